"""README's commands are the ones CI runs."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci_lines = [
        line
        for line in (ROOT / ".ci/run").read_text().splitlines()
        if line and not line.startswith(("#", "set ", "cd "))
    ]
    test_command = ci_lines[-1]
    assert "pytest" in test_command
    block = readme.split("```bash", 1)[1].split("```", 1)[0].strip().splitlines()
    assert block[1] == test_command  # the second of README's two opening commands
    assert "app serve" in block[0]
