"""``python -m app ...`` and ``python scripts/X.py ...`` as fresh processes, without paying the
interpreter's imports each time: command-line runs that exit on their own, and servers.

A fresh ``python -m app`` spends 2-8 s of CPU importing torch, llguidance and the app before it
reads its first flag (``python -X importtime -c 'import app.__main__'``); a test that checks a
one-line refusal, or talks to a mock server for a second, pays that for a check of
milliseconds. Here one driver process (``python -m tests.forked_cli``, started once per session
and xdist worker by the ``forked_processes`` fixture of ``tests/conftest.py``) imports the app
once, then forks a child for every process asked of it. The child is a process of its own as
``python -m app`` would be: it runs ``app/__main__.py`` as ``__main__``
(:func:`runpy.run_module`, what ``-m`` does) or the script as ``__main__``
(:func:`runpy.run_path`), with its own PID, ``sys.argv``, working directory, environment,
standard input, output and error, and exit status. It ends as the interpreter does: its
non-daemon threads joined, ``atexit`` functions run, streams flushed; an uncaught exception
prints its traceback and exits 1, ``SystemExit`` as the interpreter treats it, an uncaught
``KeyboardInterrupt`` ends it by SIGINT. Nothing a child does reaches the driver or the next
child.

Two kinds of process:

- a *run* (:meth:`ForkedCli.run`): standard input, output and error are files, read back whole
  once it exits (refusals, short script runs), answered as :func:`subprocess.run` answers;
- a *server* (:meth:`ForkedCli.launch`, the launcher of ``scripts/harness/server.py`` during the
  suite): standard input /dev/null, output and error into the harness's log file, answered at
  once with a handle to signal and wait on (:class:`ForkedServer`).

What is shared is only what the imports left in memory, so the driver is kept fit to fork:

- it does nothing but import and fork. It holds one thread whenever it forks (it checks, and
  exits rather than fork with more). The one thread the imports start, OpenBLAS's pool
  (numpy's), is stopped by OpenBLAS's own at-fork handler the first time the driver forks and
  restarted in a child at its first BLAS call; the driver forks once at start for that, then
  checks. torch's OpenMP pool starts at the first parallel operation, which the driver never
  runs, so each child starts its own with its own settings;
- a child gets the environment it is given (the driver's own when none is). What the imports
  set in the environment (``app/__init__.py``'s defaults: ``MKL_CBWR``...) is set again in the
  child where its environment lacks it, as its own import would have. Variables read while
  importing (OpenMP's and OpenBLAS's at library load, the interpreter's, torch's...:
  :data:`IMPORT_TIME_ENV`) cannot change after the imports: a server whose environment differs
  from the driver's there is started as a real subprocess instead (:meth:`ForkedCli.forks`), as
  is any command that is not this interpreter running a module or a script (nginx, a router,
  ``python -c``, which runs another checkout's app in ``scripts/bench_prefix_cache.py``);
- a child shares the driver's hash seed (``PYTHONHASHSEED``) and numpy's global random state
  (the app draws from neither); Python's ``random`` reseeds itself in a child, and torch's
  default generator starts from the same fixed seed in any fresh process.

A test that writes to a process's standard input or reads its output while it runs (pipes)
starts a real one (``tests/batch/test_command.py``'s standard input and output, and Ctrl-C).

Protocol on the driver's standard input/output: one JSON object per line each way. In:
``{"id": n, "args": [...], "cwd": str, "env": {...} | null, "stdin": str | null, "timeout":
float}`` (a run), ``{"id": n, "args": [...], "cwd": str, "env": {...} | null, "log": str}`` (a
server), ``{"id": n, "signal": int}`` (to the process of request ``n``, unless it has exited).
Out: ``{"ready": true, "environment": {...}, "import_defaults": {...}}`` once the imports are
done (the environment as they left it, and what they set in it); ``{"id": n, "returncode":
int, "stdout": str, "stderr": str, "timed_out": bool}`` when a run exits; ``{"id": n, "pid":
int}`` when a server has started and ``{"id": n, "returncode": int}`` when it exits. When its
standard input ends (the session is over), the driver kills what is left of its children.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import runpy
import selectors
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, TextIO

REPO = Path(__file__).resolve().parents[1]

#: Prefixes of the environment variables read while the driver imports: by the interpreter, the
#: dynamic loader and glibc at start, GNU OpenMP (torch's) and OpenBLAS (numpy's) as their
#: libraries load, torch as it is imported. Not Intel OpenMP's ``KMP_*``, inductor's
#: ``TORCHINDUCTOR_*``, Hugging Face's ``HF_*``: the driver loads none of them
#: (``tests/test_forked_cli.py`` checks), and libraries the tests import set them in the
#: session's environment (lm_eval, sklearn, inductor). A server is forked only when its
#: environment agrees with the driver's on all of them.
IMPORT_TIME_ENV = (
    "PYTHON",
    "LD_",
    "MALLOC_",
    "GLIBC_TUNABLES",
    "OMP_",
    "GOMP_",
    "OPENBLAS_",
    "GOTO_",
    "MKL_",
    "TORCH_",
    "PYTORCH_",
    "CUDA_",
    # set by app/__init__.py as it is imported (read by oneDNN and ideep at their first use)
    "ONEDNN_",
    "DNNL_",
    "LRU_CACHE_CAPACITY",
)


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


def _finalize(status: int | None) -> NoReturn:
    """Ends a child as the interpreter ends after its main module: non-daemon threads joined,
    ``atexit`` functions run, streams flushed, then ``status`` (None: killed by SIGINT, an
    uncaught ``KeyboardInterrupt``). ``os._exit``: nothing of the driver's own runs."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # what Py_FinalizeEx calls first
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # a closed stream: nothing more to write
                pass
        if status is None:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        os._exit(1 if status is None else status)


def _child(
    request: dict, fds: tuple[int, int, int], import_defaults: Mapping[str, str]
) -> NoReturn:
    """In the forked child: ``fds`` become 0-2, the request's environment and working
    directory are set, the module or script runs as ``__main__``, the child exits."""
    status: int | None = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds) - {0, 1, 2}:
            os.close(fd)
        # fresh streams on the new fds (the driver's own hold its buffers and its reply channel)
        sys.stdin = sys.__stdin__ = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = sys.__stdout__ = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = sys.__stderr__ = open(  # noqa: SIM115
            2, "w", buffering=1, closefd=False, errors="backslashreplace"
        )
        if request.get("env") is not None:
            os.environ.clear()
            os.environ.update(request["env"])
        for name, value in import_defaults.items():
            os.environ.setdefault(name, value)
        os.chdir(request["cwd"])
        args = request["args"]
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
    except KeyboardInterrupt:
        traceback.print_exc()
        status = None
    except BaseException:
        traceback.print_exc()
        status = 1
    finally:
        _finalize(status)


@dataclass(slots=True)
class _Child:
    """A process the driver forked and has not reaped yet."""

    request: dict
    pid: int
    pidfd: int  # readable once the process has exited
    deadline: float | None = None  # a run's: killed after it
    timed_out: bool = False


class _Driver:
    """The driver's one thread: requests on fd 0, children's exits on their pidfds, replies
    on fd 1."""

    def __init__(self, replies: TextIO, import_defaults: Mapping[str, str], scratch: Path) -> None:
        self.replies = replies
        self.import_defaults = import_defaults
        self.scratch = scratch  # a run's standard input, output and error
        self.selector = selectors.DefaultSelector()
        self.selector.register(0, selectors.EVENT_READ)
        self.children: dict[int, _Child] = {}  # request id -> child
        self.partial_line = b""

    def serve(self) -> None:
        """Until standard input ends: answer requests, reap children, kill late runs."""
        open_ = True
        while open_ or self.children:
            if not open_:  # the session is over: nothing left may outlive it
                for child in self.children.values():
                    os.kill(child.pid, signal.SIGKILL)
            for key, _ in self.selector.select(self._timeout()):
                if key.fd == 0:
                    open_ = self._read_requests()
                else:
                    self._reap(key.data)
            now = time.monotonic()
            for child in self.children.values():
                if child.deadline is not None and now > child.deadline and not child.timed_out:
                    os.kill(child.pid, signal.SIGKILL)
                    child.timed_out = True

    def _timeout(self) -> float | None:
        children = self.children.values()
        deadlines = [c.deadline for c in children if c.deadline is not None and not c.timed_out]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _read_requests(self) -> bool:
        data = os.read(0, 1 << 16)
        if not data:
            self.selector.unregister(0)
            return False
        *lines, self.partial_line = (self.partial_line + data).split(b"\n")
        for line in lines:
            request = json.loads(line)
            if "signal" in request:
                child = self.children.get(request["id"])
                if child is not None:  # not reaped yet: the pid is still this child's
                    os.kill(child.pid, request["signal"])
            else:
                self._start(request)
        return True

    def _start(self, request: dict) -> None:
        if "log" in request:  # a server
            log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            fds = (os.open(os.devnull, os.O_RDONLY), log, log)
        else:  # a run
            stdin, stdout, stderr = self._run_files(request["id"])
            stdin.write_text(request.get("stdin") or "")
            fds = (
                os.open(stdin, os.O_RDONLY),
                os.open(stdout, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644),
                os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644),
            )
        pid = self._fork(request, fds)
        for fd in set(fds):
            os.close(fd)
        child = _Child(request, pid, os.pidfd_open(pid))
        if "timeout" in request:
            child.deadline = time.monotonic() + float(request["timeout"])
        self.children[request["id"]] = child
        self.selector.register(child.pidfd, selectors.EVENT_READ, request["id"])
        if "log" in request:
            self._reply({"id": request["id"], "pid": pid})

    def _fork(self, request: dict, fds: tuple[int, int, int]) -> int:
        threads = len(os.listdir("/proc/self/task"))
        if threads != 1 or threading.active_count() != 1:
            sys.exit(f"forked-cli driver: {threads} threads, would not fork")
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self.selector.close()  # the driver's epoll and its children's pidfds
            for child in self.children.values():
                os.close(child.pidfd)
            _child(request, fds, self.import_defaults)
        return pid

    def _reap(self, request_id: int) -> None:
        child = self.children.pop(request_id)
        self.selector.unregister(child.pidfd)
        os.close(child.pidfd)
        _, wait_status = os.waitpid(child.pid, 0)
        reply: dict = {"id": request_id, "returncode": os.waitstatus_to_exitcode(wait_status)}
        if "log" not in child.request:
            paths = self._run_files(request_id)
            reply["stdout"] = paths[1].read_text(errors="replace")
            reply["stderr"] = paths[2].read_text(errors="replace")
            reply["timed_out"] = child.timed_out
            for path in paths:
                path.unlink()
        self._reply(reply)

    def _run_files(self, request_id: int) -> tuple[Path, Path, Path]:
        return tuple(self.scratch / f"{request_id}.{n}" for n in ("stdin", "stdout", "stderr"))

    def _reply(self, message: dict) -> None:
        self.replies.write(json.dumps(message) + "\n")
        self.replies.flush()


def _serve() -> None:
    """The driver: import the app, fork once (libraries' at-fork handlers stop their pools),
    check it holds one thread, say ready, then fork a child per request."""
    environment = dict(os.environ)
    import app.__main__  # noqa: F401  (the imports every child shares)
    import app.api.server  # noqa: F401  (imported by `serve` once its flags are parsed)
    import app.models.loading  # noqa: F401

    # ``-m app`` executes app/__main__.py afresh as ``__main__`` (runpy warns when the module is
    # already imported): keep what it imports, not the module
    del sys.modules["app.__main__"]
    import_defaults = {k: v for k, v in os.environ.items() if environment.get(k) != v}

    probe = os.fork()
    if probe == 0:
        os._exit(0)
    os.waitpid(probe, 0)
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1 or threading.active_count() != 1:
        sys.exit(f"forked-cli driver: {threads} threads after the imports, will not fork")

    replies = sys.stdout
    # fd 1 is the reply channel: anything else the driver or a library prints goes to stderr
    sys.stdout = sys.stderr
    ready = {"ready": True, "environment": dict(os.environ), "import_defaults": import_defaults}
    replies.write(json.dumps(ready) + "\n")
    replies.flush()
    scratch = Path(tempfile.mkdtemp(prefix="forked-cli-"))
    try:
        _Driver(replies, import_defaults, scratch).serve()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _runs_python(argv: Sequence[str]) -> bool:
    """``argv`` is this interpreter running a module (``-m``) or a script file."""
    if len(argv) < 2 or argv[0] != sys.executable:
        return False
    if argv[1] == "-m":
        return len(argv) > 2
    return argv[1].endswith(".py") and Path(argv[1]).is_file()


class FreshProcessWarning(UserWarning):
    """A server that could have been forked was started as a fresh process: its environment
    differs from the driver's on a variable read at import (the session pays its imports)."""


class ForkedServer:
    """A server the driver forked (:class:`harness.server.ServerProcess`): its exit status
    comes from the driver, which is its parent and reaps it; a signal goes through the driver,
    which sends it only while the process has not been reaped (its PID cannot be another's)."""

    def __init__(self, driver: ForkedCli, request_id: int, pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._driver = driver
        self._request_id = request_id
        self._exited = threading.Event()

    def exited(self, returncode: int) -> None:
        """The driver reaped it (called by the driver's reader thread)."""
        self.returncode = returncode
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Its exit status; :class:`subprocess.TimeoutExpired` after ``timeout`` seconds."""
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            self._driver.send({"id": self._request_id, "signal": int(sig)})

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkedCli:
    """The client of a driver process (``python -m tests.forked_cli``), started by
    :meth:`start` or the first process asked of it.

    :meth:`run` has :func:`subprocess.run`'s answer; :meth:`launch` is a launcher of
    ``scripts/harness/server.py`` (:func:`harness.server.set_launcher`). Both may be called
    from any thread, at once: a thread of this process reads the driver's replies."""

    def __init__(self) -> None:
        self._environment = dict(os.environ)  # the driver's, before any test changes this one
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()  # starting the driver, writing to it, the tables below
        self._ids = itertools.count()
        self._replies: dict[int, tuple[Future, list[str]]] = {}  # request id -> awaited reply
        self._ready: Future = Future()
        self._reader: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        """The driver's PID (the parent of every forked child); None before :meth:`start`."""
        return None if self._process is None else self._process.pid

    def start(self) -> None:
        """Starts the driver (its imports run while this process goes on); once only."""
        with self._lock:
            if self._process is not None:
                return
            self._process = subprocess.Popen(
                [sys.executable, "-m", "tests.forked_cli"],
                cwd=REPO,
                env=self._environment,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            self._reader = threading.Thread(
                target=self._read_replies, name="forked-cli-replies", daemon=True
            )
            self._reader.start()

    def run(
        self,
        *args: str,
        cwd: Path = REPO,
        stdin: str | None = None,
        timeout: float = 120.0,
    ) -> subprocess.CompletedProcess:
        """``python *args`` (``-m app serve ...``, ``scripts/X.py ...``) as a forked child, in
        the driver's environment; :class:`subprocess.TimeoutExpired` after ``timeout`` seconds
        (the child is killed)."""
        request = {"args": list(args), "cwd": str(cwd), "stdin": stdin, "timeout": timeout}
        reply = self._ask(request, [sys.executable, *args]).result()
        command = [sys.executable, *args]
        if reply["timed_out"]:
            raise subprocess.TimeoutExpired(command, timeout, reply["stdout"], reply["stderr"])
        return subprocess.CompletedProcess(
            command, reply["returncode"], reply["stdout"], reply["stderr"]
        )

    def forks(self, argv: Sequence[str], env: Mapping[str, str]) -> bool:
        """Whether ``argv`` can be a forked child: this interpreter running a module (``-m``)
        or a script, in an environment that agrees with the driver's, as its imports left it,
        on the variables read at import (:data:`IMPORT_TIME_ENV`). The child's environment is
        ``env`` with what the imports set where ``env`` lacks it (waits for the imports)."""
        return _runs_python(argv) and not self.differences_at_import(env)

    def differences_at_import(self, env: Mapping[str, str]) -> list[str]:
        """The variables of :data:`IMPORT_TIME_ENV` on which a child's environment (``env``
        with what the imports set where it lacks it) differs from the driver's as its imports
        left it (waits for the imports)."""
        self.start()
        ready = self._ready.result()
        imported, child = ready["environment"], {**ready["import_defaults"], **env}
        return sorted(
            name
            for name in {*child, *imported}
            if name.startswith(IMPORT_TIME_ENV) and child.get(name) != imported.get(name)
        )

    def launch(
        self, argv: Sequence[str], *, cwd: Path, env: Mapping[str, str], log_path: Path
    ) -> ForkedServer | subprocess.Popen:
        """The harness's launcher: a forked child when :meth:`forks` allows it, else a real
        subprocess (:func:`harness.server.popen`), with a :class:`FreshProcessWarning` when
        only the environment stood in the way."""
        from harness.server import popen  # scripts/ is on the path of pytest, not the driver's

        if not _runs_python(argv):
            return popen(argv, cwd=cwd, env=env, log_path=log_path)
        differing = self.differences_at_import(env)
        if differing:
            warnings.warn(
                f"{shlex.join(argv[1:4])}... started as a fresh process: its environment "
                f"differs from the forked-cli driver's on {', '.join(differing)} (read at import)",
                FreshProcessWarning,
                stacklevel=2,
            )
            return popen(argv, cwd=cwd, env=env, log_path=log_path)
        request = {"args": list(argv[1:]), "cwd": str(cwd), "env": dict(env)}
        request["log"] = str(log_path)
        return self._ask(request, list(argv)).result()

    def send(self, message: dict) -> None:
        """Writes one request line to the driver."""
        with self._lock:
            self._write(message)

    def close(self) -> None:
        """Ends the driver (it kills any child left) and waits for it."""
        with self._lock:
            process = self._process
        if process is None:
            return
        process.stdin.close()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        self._reader.join()

    def _ask(self, request: dict, args: list[str]) -> Future:
        """Sends ``request`` under a new id; the future holds its reply (a run's) or its
        :class:`ForkedServer` (a server's), once the driver's imports are done."""
        self.start()
        self._ready.result()
        reply: Future = Future()
        with self._lock:
            request["id"] = next(self._ids)
            self._replies[request["id"]] = (reply, args)
            self._write(request)
        return reply

    def _write(self, message: dict) -> None:
        if self._process.poll() is not None:
            raise AssertionError(f"the forked-cli driver exited ({self._process.returncode})")
        self._process.stdin.write(json.dumps(message) + "\n")
        self._process.stdin.flush()

    def _read_replies(self) -> None:
        """The reader thread: each reply to its request's future, each exit to its server."""
        servers: dict[int, ForkedServer] = {}  # request id -> a server not reaped yet
        for line in self._process.stdout:
            message = json.loads(line)
            if message.get("ready"):
                self._ready.set_result(message)
                continue
            request_id = message["id"]
            if request_id in servers:
                servers.pop(request_id).exited(message["returncode"])
                continue
            with self._lock:
                reply, args = self._replies.pop(request_id)
            if "pid" in message:
                servers[request_id] = ForkedServer(self, request_id, message["pid"], args)
                reply.set_result(servers[request_id])
            else:
                reply.set_result(message)
        status = self._process.wait()
        failure = AssertionError(f"the forked-cli driver exited ({status})")
        if not self._ready.done():
            self._ready.set_exception(failure)
        with self._lock:
            for reply, _ in self._replies.values():
                reply.set_exception(failure)
            self._replies.clear()


if __name__ == "__main__":
    _serve()
