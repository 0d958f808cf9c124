"""``python -m app ...`` and ``python scripts/X.py ...`` as fresh processes, without paying the
interpreter's imports each time.

A fresh ``python -m app`` spends ~8 s of CPU importing torch, llguidance and the app before it
reads its first flag (``python -X importtime -c 'import app.__main__'``); a test that checks a
one-line refusal pays that for a check of milliseconds. Here one driver process
(``python -m tests.forked_cli``, started once per session by the ``forked_cli`` fixture of
``tests/conftest.py``) imports the app once, then forks a child for every run. The child is a
process of its own as ``python -m app`` would be: it runs ``app/__main__.py`` as ``__main__``
(:func:`runpy.run_module`, what ``-m`` does) or the script as ``__main__``
(:func:`runpy.run_path`), with its own ``sys.argv``, working directory, standard input, output
and error (files, read back whole), and exit status (an uncaught exception prints its traceback
and exits 1, ``SystemExit`` as the interpreter treats it). Nothing a run does reaches the driver
or the next run.

What is shared is only what the imports left in memory, so this is for runs that exit on their
own (refusals, short script runs); a test that signals a process or streams through its pipes
starts a real one.

Protocol on the driver's standard input/output: one JSON object per line each way,
``{"args": [...], "cwd": str, "stdin": str | null, "timeout": float}`` in, and
``{"returncode": int, "stdout": str, "stderr": str, "timed_out": bool}`` out.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _exit_status(exit_: SystemExit) -> int:
    """The status the interpreter exits with for an uncaught ``SystemExit`` (printing a code
    that is neither None nor an int to stderr, as it does)."""
    code = exit_.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _child(args: list[str], cwd: str, stdin_path: str, out_path: str, err_path: str) -> None:
    """In the forked child: point fds 0-2 at the run's files, run, exit with the status."""
    status = 1
    try:
        for fd, path, flags in (
            (0, stdin_path, os.O_RDONLY),
            (1, out_path, os.O_WRONLY | os.O_TRUNC),
            (2, err_path, os.O_WRONLY | os.O_TRUNC),
        ):
            opened = os.open(path, flags)
            os.dup2(opened, fd)
            os.close(opened)
        # fresh streams on the new fds (the driver's own hold its buffers and its reply channel)
        sys.stdin = sys.__stdin__ = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = sys.__stdout__ = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = sys.__stderr__ = open(  # noqa: SIM115
            2, "w", buffering=1, closefd=False, errors="backslashreplace"
        )
        os.chdir(cwd)
        if args[0] == "-m":
            sys.argv = ["-m", *args[2:]]  # runpy puts the module's path in argv[0]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            script = str(Path(args[0]).resolve())
            sys.argv = [args[0], *args[1:]]
            sys.path[0] = str(Path(script).parent)
            runpy.run_path(script, run_name="__main__")
        status = 0
    except SystemExit as exit_:
        status = _exit_status(exit_)
    except BaseException:
        traceback.print_exc()
        status = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # a closed stream: nothing more to write
                pass
        os._exit(status)


def _run(request: dict, scratch: Path) -> dict:
    stdin_path = scratch / "stdin"
    stdin_path.write_text(request.get("stdin") or "")
    out_path, err_path = scratch / "stdout", scratch / "stderr"
    out_path.write_bytes(b"")
    err_path.write_bytes(b"")
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _child(request["args"], request["cwd"], str(stdin_path), str(out_path), str(err_path))
    deadline = time.monotonic() + float(request["timeout"])
    timed_out = False
    while True:
        done, wait_status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            _, wait_status = os.waitpid(pid, 0)
            timed_out = True
            break
        time.sleep(0.01)  # polling the child's exit: the condition we wait for
    return {
        "returncode": os.waitstatus_to_exitcode(wait_status),
        "stdout": out_path.read_text(errors="replace"),
        "stderr": err_path.read_text(errors="replace"),
        "timed_out": timed_out,
    }


def _serve() -> None:
    """The driver: import the app, say ready, then one forked run per request line."""
    import app.__main__  # noqa: F401  (the imports every run shares)

    # ``-m app`` executes app/__main__.py afresh as ``__main__`` (runpy warns when the module is
    # already imported): keep what it imports, not the module
    del sys.modules["app.__main__"]

    replies = sys.stdout
    # fd 1 is the reply channel: anything else the driver or a library prints goes to stderr
    sys.stdout = sys.stderr
    replies.write('{"ready": true}\n')
    replies.flush()
    with tempfile.TemporaryDirectory(prefix="forked-cli-") as scratch:
        for line in sys.stdin:
            reply = _run(json.loads(line), Path(scratch))
            replies.write(json.dumps(reply) + "\n")
            replies.flush()


@dataclass(slots=True)
class ForkedCli:
    """A driver process (``python -m tests.forked_cli``) and a lock for its one conversation.

    :meth:`run` has :func:`subprocess.run`'s answer: a :class:`subprocess.CompletedProcess`
    with text ``stdout``/``stderr``, or :class:`subprocess.TimeoutExpired` after ``timeout``
    seconds (the child is killed)."""

    process: subprocess.Popen = field(init=False)
    lock: threading.Lock = field(default_factory=threading.Lock)
    ready: bool = False

    def __post_init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.forked_cli"],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def _wait_ready(self) -> None:
        """The driver's first line says its imports are done (the first run waits for it)."""
        line = self.process.stdout.readline()
        if json.loads(line or "{}").get("ready") is not True:
            status = self.process.poll()
            raise AssertionError(f"the forked-cli driver did not start (exit {status})")
        self.ready = True

    def run(
        self,
        *args: str,
        cwd: Path = REPO,
        stdin: str | None = None,
        timeout: float = 120.0,
    ) -> subprocess.CompletedProcess:
        """``python *args`` (``-m app serve ...``, ``scripts/X.py ...``) as a forked child."""
        request = {"args": list(args), "cwd": str(cwd), "stdin": stdin, "timeout": timeout}
        with self.lock:
            if not self.ready:
                self._wait_ready()
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            line = self.process.stdout.readline()
        if not line:
            raise AssertionError(f"the forked-cli driver exited ({self.process.poll()})")
        reply = json.loads(line)
        command = [sys.executable, *args]
        if reply["timed_out"]:
            raise subprocess.TimeoutExpired(command, timeout, reply["stdout"], reply["stderr"])
        return subprocess.CompletedProcess(
            command, reply["returncode"], reply["stdout"], reply["stderr"]
        )

    def close(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


if __name__ == "__main__":
    _serve()
