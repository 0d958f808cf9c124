"""``python -m app batch`` as a user runs it (subprocesses): exit codes, one-line refusals
without a traceback, the summary, standard input and output streamed both ways, Ctrl-C."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from harness.wait import wait_until

from app.batch import command, runner
from app.batch.config import BatchConfig
from tests.batch.conftest import batch_line, read_output, write_input

ROOT = Path(__file__).resolve().parents[2]
PROG = "python -m app batch"


def good_input(tmp_path: Path, count: int = 3) -> Path:
    lines = [batch_line(f"r{i}", {"prompt": f"p{i}", "max_tokens": 4}) for i in range(count)]
    return write_input(tmp_path / "in.jsonl", lines)


def test_a_run_writes_every_line_and_ends_with_the_summary(tmp_path, forked_cli):
    """A process of its own, forked from one that imported the app once
    (``tests/forked_cli.py``); the tests of standard input and output, Ctrl-C and a named pipe
    start ``python -m app batch`` whole."""
    source = good_input(tmp_path)
    write_input(source, [*source.read_text().splitlines(), "not json"])
    output = str(tmp_path / "out.jsonl")
    done = forked_cli.run(
        "-m", "app", "batch", "-i", str(source), "-o", output, "--model", "mock", cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    output = read_output(tmp_path / "out.jsonl")
    assert [line["custom_id"] for line in output] == ["r0", "r1", "r2", None]
    summary = done.stderr.splitlines()[-2:]
    assert summary[0].startswith("batch: 4 requests in ")
    assert summary[0].endswith(": 3 ok, 1 failed (invalid_json: 1)")
    assert " completion tok/s, " in summary[1] and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-i", "{tmp}/missing.jsonl", "-o", "{tmp}/out.jsonl"], "cannot read {tmp}/missing.jsonl"),
        (["-i", "{tmp}", "-o", "{tmp}/out.jsonl"], "cannot read {tmp}: Is a directory"),
        (["-i", "{tmp}/in.jsonl", "-o", "{tmp}/no/dir/out.jsonl"], "cannot write {tmp}/no/dir"),
        (
            ["-i", "{tmp}/in.jsonl", "-o", "{tmp}/in.jsonl"],
            "the output {tmp}/in.jsonl is the input",
        ),
        (
            ["-i", "{tmp}/in.jsonl", "-o", "-", "--model", "no-such-model"],
            "cannot load the model 'no-such-model': no-such-model: no such file or directory",
        ),
        (["-i", "{tmp}/in.jsonl", "-o", "-", "--max-num-seqs", "0"], "--max-num-seqs: Input"),
        (
            ["-i", "{tmp}/in.jsonl", "-o", "-", "--max-num-batched-tokens", "1"],
            "--max-num-batched-tokens (1) must be at least",  # (no "Value error, ")
        ),
        (["-o", "-"], "--input: Field required"),
    ],
)
def test_a_run_that_cannot_start_is_one_line_and_exit_2(tmp_path, args, message, forked_cli):
    """Each run is a process of its own, forked from one that imported the app once
    (``tests/forked_cli.py``); the runs above and below start ``python -m app batch`` whole."""
    good_input(tmp_path)
    args = [arg.format(tmp=tmp_path) for arg in args]
    model = [] if "--model" in args else ["--model", "mock"]
    done = forked_cli.run("-m", "app", "batch", *args, *model, cwd=ROOT, timeout=60)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"{PROG}: error: {message.format(tmp=tmp_path)}"), done.stderr
    assert done.stdout == "" and not (tmp_path / "no").exists()
    assert (tmp_path / "in.jsonl").read_text().count("\n") == 3  # the input is untouched


def test_standard_input_and_output_are_streamed_both_ways(tmp_path):
    """Output lines come back while the input is still open: neither side is read whole."""
    process = subprocess.Popen(
        [sys.executable, "-m", "app", "batch", "-i", "-", "-o", "-", "--model", "mock"],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdin is not None and process.stdout is not None
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in process.stdout])
    reader.start()
    try:
        for i in range(3):
            process.stdin.write(batch_line(f"first-{i}", {"prompt": "a", "max_tokens": 3}) + "\n")
        process.stdin.flush()
        first = [json.loads(lines.get(timeout=30)) for _ in range(3)]  # stdin still open
        assert [line["custom_id"] for line in first] == ["first-0", "first-1", "first-2"]
        process.stdin.write(batch_line("last", {"prompt": "b", "max_tokens": 3}) + "\n")
        process.stdin.close()
        assert json.loads(lines.get(timeout=30))["custom_id"] == "last"
        assert process.wait(timeout=30) == 0
    finally:
        process.kill()
        reader.join()
    assert "batch: 4 requests in " in process.stderr.read()


def test_ctrl_c_stops_with_the_lines_written_so_far_in_order(tmp_path):
    lines = [
        batch_line(f"r{i}", {"prompt": f"p{i}", "max_tokens": 20, "ignore_eos": True})
        for i in range(200)
    ]
    source = write_input(tmp_path / "in.jsonl", lines)
    output = tmp_path / "out.jsonl"
    # A test run started in the background of a non-interactive shell has SIGINT ignored, and
    # an ignored signal stays ignored across exec: the run would never see the Ctrl-C (two
    # clean-clone suite runs failed so). With a handler here, the child starts with the
    # default disposition, as from a terminal.
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "app", "batch", "-i", str(source), "-o", str(output)]
            + ["--model", "mock", "--mock-step-ms", "20", "--max-num-seqs", "2", "--no-progress"],
            cwd=ROOT,
            stderr=subprocess.PIPE,
            text=True,
        )
    finally:
        signal.signal(signal.SIGINT, before)
    try:
        wait_until(
            lambda: output.exists() and output.read_text().count("\n") >= 2,
            timeout=30,
            what="two lines written",
        )
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 130
    finally:
        process.kill()
    assert process.stderr is not None
    stderr = process.stderr.read()
    assert "Traceback" not in stderr and stderr.count("\n") == 1, stderr
    assert stderr.startswith(f"{PROG}: interrupted; ")
    written = read_output(output)
    assert 2 <= len(written) < 200
    assert [line["custom_id"] for line in written] == [f"r{i}" for i in range(len(written))]
    assert f"{len(written)} lines written" in stderr


def test_a_named_pipe_is_read_once_as_it_is_written(tmp_path, forked_cli):
    """A FIFO is not a file to count ahead: one reader, the lines as the writer sends them. The
    run is a process of its own, forked from one that imported the app once
    (``tests/forked_cli.py``), waited on in a thread while this one writes."""
    fifo = tmp_path / "requests.fifo"
    os.mkfifo(fifo)
    output = tmp_path / "out.jsonl"
    args = ["-m", "app", "batch", "-i", str(fifo), "-o", str(output), "--model", "mock"]
    with ThreadPoolExecutor(max_workers=1) as waiter:
        run = waiter.submit(forked_cli.run, *args, cwd=ROOT, timeout=60)
        with fifo.open("w") as writer:  # blocks until the batch opens its end
            for i in range(5):
                writer.write(batch_line(f"r{i}", {"prompt": "p", "max_tokens": 2}) + "\n")
        done = run.result(timeout=90)
    assert done.returncode == 0, done.stderr
    assert [line["custom_id"] for line in read_output(output)] == [f"r{i}" for i in range(5)]


@pytest.mark.usefixtures("restore_logging")
def test_a_model_that_fails_to_load_is_one_line_and_keeps_the_old_results(
    tmp_path, monkeypatch, capsys
):
    def broken(config):
        raise RuntimeError("weights are\nmissing")

    monkeypatch.setattr(runner, "load_model", broken)
    source = good_input(tmp_path)
    old = tmp_path / "old.jsonl"
    old.write_text("previous results\n")
    config = BatchConfig(input=str(source), output=str(old), model="mock", progress=False)
    assert command.main(config) == 2
    assert capsys.readouterr().err == (
        f"{PROG}: error: cannot load the model 'mock': weights are missing\n"
    )
    assert old.read_text() == "previous results\n"
    fresh = tmp_path / "fresh.jsonl"
    config = BatchConfig(input=str(source), output=str(fresh), model="mock", progress=False)
    assert command.main(config) == 2
    assert not fresh.exists()


@pytest.mark.usefixtures("restore_logging")
def test_a_second_run_replaces_the_output(tmp_path, capsys):
    source = good_input(tmp_path, count=2)
    output = tmp_path / "out.jsonl"
    output.write_text("stale line\n" * 10)
    config = BatchConfig(input=str(source), output=str(output), model="mock", progress=False)
    assert command.main(config) == 0
    assert [line["custom_id"] for line in read_output(output)] == ["r0", "r1"]
    assert capsys.readouterr().err.startswith("batch: 2 requests in ")


def test_a_device_or_a_full_disk_as_the_output(tmp_path, forked_cli):
    """(found by a helper) ``-o /dev/null`` failed with a traceback (a device cannot be
    truncated); a write that fails (``/dev/full``) is one line and exit 2, not a traceback."""
    source = good_input(tmp_path)
    run = ("-m", "app", "batch", "-i", str(source), "--model", "mock")
    done = forked_cli.run(*run, "-o", "/dev/null", cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    if not Path("/dev/full").exists():
        return
    done = forked_cli.run(*run, "-o", "/dev/full", cwd=ROOT, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert f"{PROG}: error: cannot write /dev/full: No space left on device" in done.stderr
