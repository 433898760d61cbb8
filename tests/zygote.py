"""Child processes that start without importing torch again: forked from a forkserver that imported it once.

A test that needs its own process (an address-space cap, a SIGKILL, a crash that must not take the
test run with it) used to start ``sys.executable`` and spend ~2-3 s of its two cores importing torch
and ckptio. :func:`run` and :class:`Child` take the same ``argv`` (``[sys.executable, script, ...]``,
``[sys.executable, "-m", module, ...]`` or ``[sys.executable, "-c", code, ...]``) and run it in a
process forked from multiprocessing's forkserver instead: a fresh single-threaded interpreter that
has imported :data:`PRELOAD`, started once per test process. The child takes the caller's
environment and working directory as they are at the call, runs the program as ``__main__``, and
ends the way an interpreter does (non-daemon threads joined, ``atexit`` handlers run), with its exit
status (or the signal that killed it, negative, as ``subprocess`` reports it).

Not for tests about a fresh interpreter itself (what ``import ckptio`` imports, start-up time): those
start ``sys.executable``.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp", "ckptio"]


def context():
    """The forkserver context, with :data:`PRELOAD` imported in the server."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _main(argv: list[str], env: dict, cwd: str, stdin: str | None, out: str, err: str | None) -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C is KeyboardInterrupt, as in a fresh interpreter
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    fd = os.open(stdin or os.devnull, os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    for target, path in ((1, out), (2, err or out)):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = open(0, closefd=False)
    code = 0
    try:
        if argv[1] == "-m":
            sys.argv = [argv[2], *argv[3:]]
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        elif argv[1] == "-c":
            sys.argv = ["-c", *argv[3:]]
            exec(compile(argv[2], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            sys.argv = argv[1:]
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[1])))
            runpy.run_path(argv[1], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as an interpreter would
        traceback.print_exc()
        code = 1
    try:  # what an interpreter does at its end, before the teardown a forked child skips
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        code = code or 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - closed by the program
            pass
    os._exit(code)


class Child:
    """A :class:`subprocess.Popen`-like handle (``poll``, ``wait``, ``communicate``, ``kill``, ``pid``,
    ``returncode``) on ``argv`` run in a forked child. Output goes to files read back by ``communicate``
    (``stderr=subprocess.STDOUT`` merges both); ``input`` is the child's stdin, as text."""

    def __init__(
        self,
        argv: list[str],
        *,
        env: dict | None = None,
        cwd: str | os.PathLike | None = None,
        input: str | None = None,
        stderr: int | None = None,
    ) -> None:
        self.args = argv
        self._dir = tempfile.mkdtemp(prefix="zygote-")
        self._out = os.path.join(self._dir, "out")
        self._err = None if stderr == subprocess.STDOUT else os.path.join(self._dir, "err")
        for p in (self._out, self._err):
            if p:
                open(p, "w").close()
        stdin = None
        if input is not None:
            stdin = os.path.join(self._dir, "in")
            with open(stdin, "w") as f:
                f.write(input)
        self._proc = context().Process(
            target=_main,
            args=(
                list(argv),
                dict(os.environ if env is None else env),
                os.fspath(cwd or os.getcwd()),
                stdin,
                self._out,
                self._err,
            ),
            daemon=False,
        )
        self._proc.start()
        self.pid = self._proc.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not self._proc.is_alive():
            self._proc.join()
            self.returncode = self._proc.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            self._proc.kill()
            self.wait()

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        with open(self._out, errors="replace") as f:
            out = f.read()
        err = ""
        if self._err:
            with open(self._err, errors="replace") as f:
                err = f.read()
        for p in os.listdir(self._dir):
            os.unlink(os.path.join(self._dir, p))
        os.rmdir(self._dir)
        return out, err


def run(
    argv: list[str],
    *,
    timeout: float | None = None,
    env: dict | None = None,
    cwd: str | os.PathLike | None = None,
    input: str | None = None,
    check: bool = False,
    stderr: int | None = None,
    capture_output: bool = True,
    text: bool = True,
) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, text=True, ...)`` in a forked child; a timeout kills it
    and raises :class:`subprocess.TimeoutExpired`, as ``subprocess.run`` does. Output is always captured
    as text (``capture_output``/``text`` are accepted for a like-for-like call)."""
    assert capture_output and text, "zygote.run captures text output only"
    child = Child(argv, env=env, cwd=cwd, input=input, stderr=stderr)
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        out, err = child.communicate(None if deadline is None else max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        child.kill()
        raise
    done = subprocess.CompletedProcess(argv, child.returncode, out, err)
    if check:
        done.check_returncode()
    return done
