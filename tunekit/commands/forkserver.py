"""Run command lines as child processes: fresh interpreters, or forks of one server that imported the stack once.

A child process keeps each command apart: a crash, a CUDA fault or a SIGKILL takes down that
command, not its caller. How the child starts (`start_method`):

- "fresh": `python -m tunekit.commands.main ...`, a new interpreter. Every child pays the import of
  torch, transformers, peft, bitsandbytes and hydra, most of a short command's time on a small CPU
  (benchmarks/history/test-suite-2026-11-25.md).
- "forkserver": a `Server`, one process started fresh with the caller's environment, imports that
  stack once (PRELOAD) and computes nothing (no tensor, so no OpenMP pool or CUDA context exists to
  be copied); each command is a fork of it that runs `<module>.main(argv)` with its own working
  directory, environment, stdin, stdout and stderr, and exits with the status the interpreter
  would give it (SystemExit as Python maps it, an int that main returns as `sys.exit(main(argv))`
  would; an uncaught exception prints its traceback, 1).

On a machine with a GPU the children start fresh: importing that stack may initialise the CUDA
driver (bitsandbytes probes for it), and CUDA does not survive a fork. Where no GPU is visible,
nothing in the server can hold CUDA state, and forking is safe.

`tunekit doctor` runs each command of its checks through a `Launcher`; the test suite runs every
CLI test through a `Server` (tests/_cli_forker.py). The server answers one JSON line per request
line on its stdin, and ends when its stdin closes:

    {"op": "start", "module", "argv", "cwd", "env", "out", "err", "stdin", "user"} -> {"pid"}
    {"op": "poll", "pid"}             -> {"code": the exit status, null while it runs;
                                          "maxrss_kib": the child's peak RSS, once it has ended}
    {"op": "signal", "pid", "signum"} -> {"sent": false once the child has ended}
    {"op": "call", "target": "module:function", "args"} -> {}   (caches the children then inherit)
    anything that fails               -> {"error": "..."}
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

CLI = "tunekit.commands.main"
# What the server imports or calls ("module:function"), in order, before its first fork: what
# `tunekit train`, `export` and `doctor` import on their way, then warm_cli.
PRELOAD = ["torch", "transformers", "peft", "accelerate", "bitsandbytes", "hydra", CLI, "tunekit.commands.compose",
           "tunekit.commands.train", "tunekit.commands.export", "tunekit.train.loop", "tunekit.config",
           "tunekit.data", "tunekit.methods", "tunekit.model", "tunekit.model.folder", "tunekit.infer.decode",
           "tunekit.methods.lora.backend", "tunekit.commands.forkserver:warm_cli"]
# The server is started by this line (no working directory on sys.path, as the console script has none).
_SERVE = ("import sys; sys.path[:1] = [] if sys.path[:1] == [''] else sys.path[:1]; "
          "from tunekit.commands.forkserver import serve; serve(sys.argv[1:])")


def start_method(cuda_devices: int) -> str:
    """"fresh" where a GPU is visible (CUDA state does not survive a fork), else "forkserver"."""
    return "fresh" if cuda_devices > 0 else "forkserver"


def exit_status(e: SystemExit) -> int:
    """The status the interpreter gives a SystemExit: None -> 0, an int as is, anything else
    (a message) is printed to stderr -> 1."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


# ------------------------------------------------------------------ the server process
def warm_cli() -> None:
    """What every `tunekit` child would otherwise set up for itself, done once in the server: the
    loss curve's plotting library, the default model's tokenizer where it is converted (a child's
    first load of it takes this one: tunekit.model.loader.preload_tokenizer), transformers' table
    of checkpoint renamings (built at a process's first from_pretrained). Each is a speed-up only:
    whatever a library lacks is skipped."""
    import matplotlib

    matplotlib.use("Agg")  # as tunekit.train.tracking sets it
    import matplotlib.pyplot  # noqa: F401

    from tunekit.model.default import converted_default_dir
    from tunekit.model.loader import preload_tokenizer

    if (folder := converted_default_dir()) is not None:
        preload_tokenizer(str(folder))
    try:
        importlib.import_module("transformers.conversion_mapping").get_checkpoint_conversion_mapping("llama")
    except (ImportError, AttributeError):
        pass
    _no_torch_library_teardown_at_exit()


def _no_torch_library_teardown_at_exit() -> None:
    """torch keeps a weakref.finalize per operator library (hundreds once bitsandbytes and triton
    are imported) that deregisters the library's operators at interpreter exit: most of a child's
    exit time, spent tidying a process that ends right after. Those finalizers
    (torch.library._del_library) no longer run at exit; every other exit function does (wandb,
    logging, tempfile's finalizers), as in the console script."""
    import weakref

    import torch.library

    del_library = getattr(torch.library, "_del_library", None)  # private: a later torch may drop it
    if del_library is None:
        return
    for finalizer in list(weakref.finalize._registry):  # noqa: SLF001 - no public way to list finalizers
        info = finalizer.peek()
        if info is not None and info[1] is del_library:
            finalizer.atexit = False


def _load(entry: str, args: list | None = None) -> None:
    module, _, function = entry.partition(":")
    loaded = importlib.import_module(module)
    if function:
        getattr(loaded, function)(*(args or []))


def serve(argv: list[str]) -> None:
    """The server's body: argv[0] is the JSON list of what to preload (PRELOAD's form). An entry that
    fails is skipped, as multiprocessing's forkserver skips a preload it cannot import: a child that
    needs it then fails on its own, with its own traceback."""
    from tunekit.device.threads import openmp_env

    # The channel keeps stdin and stdout; fd 1 becomes stderr, so that what an import prints cannot
    # land in an answer, and fd 0 /dev/null.
    channel_in, channel_out = os.fdopen(os.dup(0), "r"), os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    # What `tunekit.commands.main.main` sets before torch loads (libgomp reads it at that import)
    os.environ.update(openmp_env(os.environ, torch_loaded="torch" in sys.modules))
    for entry in json.loads(argv[0]):
        try:
            _load(entry)
        except Exception:  # noqa: BLE001 - a speed-up only: a child that needs it fails there, saying why
            pass
    logging.root.handlers.clear()  # whatever an import configured: each child's own logging set-up applies
    channels = (channel_in.fileno(), channel_out.fileno())
    ended: dict[int, int | None] = {}  # pid -> exit status (None while it runs)
    for line in channel_in:
        request = json.loads(line)
        try:
            answer = _answer(request, ended, channels)
        except Exception as e:  # noqa: BLE001 - the client gets it, the server serves on
            answer = {"error": f"{type(e).__name__}: {e}"}
        channel_out.write(json.dumps(answer) + "\n")
        channel_out.flush()
    os._exit(0)  # nothing to tidy: the server computed nothing


def _answer(request: dict, ended: dict, channels: tuple[int, int]) -> dict:
    op = request["op"]
    if op == "start":
        pid = os.fork()
        if pid == 0:
            _child(request, channels)  # never returns
        ended[pid] = None
        return {"pid": pid}
    if op == "poll":
        pid = request["pid"]
        if ended[pid] is None:
            done, status, usage = os.wait4(pid, os.WNOHANG)
            if done:
                ended[pid] = (os.waitstatus_to_exitcode(status), usage.ru_maxrss)
        code, maxrss = ended[pid] or (None, None)
        return {"code": code, "maxrss_kib": maxrss}
    if op == "signal":
        # Only a child not yet reaped: its pid cannot have been reused (a zombie takes the signal harmlessly)
        running = ended[request["pid"]] is None
        if running:
            os.kill(request["pid"], request["signum"])
        return {"sent": running}
    if op == "call":
        _load(request["target"], request.get("args"))
        logging.root.handlers.clear()  # as after the preload
        return {}
    raise ValueError(f"unknown op {op!r}")


def _own_resource_tracker() -> None:
    """Let this child start its own multiprocessing resource tracker, as a fresh process does: with
    an inherited one, a semaphore of a child killed with SIGKILL (tqdm makes one for its progress
    bars) would be reported as leaked by the server's tracker instead of in the child's own log.
    (CPython keeps the tracker's pipe in a private attribute; where it differs, nothing changes.)"""
    from multiprocessing import resource_tracker

    tracker = getattr(resource_tracker, "_resource_tracker", None)
    if tracker is not None and getattr(tracker, "_fd", None) is not None and hasattr(tracker, "_pid"):
        try:
            os.close(tracker._fd)
        except OSError:  # closed already (a server forked from its caller closes what it inherited)
            pass
        tracker._fd, tracker._pid = None, None


def _child(request: dict, channels: tuple[int, int]) -> None:
    """A forked child: `<module>.main(argv)` as `python -m <module> argv` would run it."""
    code = 1
    try:
        try:
            for fd in channels:
                os.close(fd)
            stdin = os.open(request.get("stdin") or os.devnull, os.O_RDONLY)
            os.dup2(stdin, 0)
            os.close(stdin)
            for fd, path in ((1, request["out"]), (2, request["err"])):
                target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                os.dup2(target, fd)
                os.close(target)
            sys.stdin = open(0, "r", closefd=False)
            sys.stdout = open(1, "w", closefd=False, buffering=1)
            sys.stderr = open(2, "w", closefd=False, buffering=1)
            os.chdir(request["cwd"])
            os.environ.clear()
            os.environ.update(request["env"])
            module = request["module"]
            if module == CLI:  # what its main() sets before torch loads, had torch not been loaded yet
                from tunekit.device.threads import openmp_env

                os.environ.update(openmp_env(os.environ, torch_loaded=False))
            if os.environ.get("PYTHONFAULTHANDLER"):  # read at interpreter start, which a fork skips
                import faulthandler

                faulthandler.enable()
            _own_resource_tracker()
            spec = importlib.util.find_spec(module)
            sys.argv = [spec.origin if spec and spec.origin else module, *request["argv"]]  # as `python -m`
            main = importlib.import_module(module).main
            if request.get("user"):  # as subprocess.Popen(user=...): the caller must be root. Last, once
                import pwd  # the files the child needs to start are open and imported as the caller

                user = pwd.getpwnam(request["user"])
                os.setgroups([])
                os.setgid(user.pw_gid)
                os.setuid(user.pw_uid)
        except BaseException:  # noqa: BLE001 - a child that could not start: say why, exit 1
            traceback.print_exc()
            return
        try:
            returned = main(list(request["argv"]))
            code = returned if isinstance(returned, int) else 0  # as `sys.exit(main(argv))` would
        except SystemExit as e:
            code = exit_status(e)
        except BaseException:  # noqa: BLE001 - print it and exit 1, as `python -m` would
            traceback.print_exc()
            code = 1
    finally:
        try:
            atexit._run_exitfuncs()  # what the interpreter runs at exit (wandb, logging handlers)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


# ------------------------------------------------------------------ the caller's side
class Child:
    """One running command, started fresh: pid, poll() -> exit status or None, send_signal(),
    kill() (SIGKILL), wait() -> exit status."""

    def __init__(self, proc: subprocess.Popen):
        self._proc = proc
        self.pid = proc.pid

    def poll(self) -> int | None:
        return self._proc.poll()

    def send_signal(self, signum: int) -> None:
        if self._proc.poll() is None:
            self._proc.send_signal(signum)

    def kill(self) -> None:
        self.send_signal(9)

    def wait(self, timeout: float | None = None) -> int:
        """Exit status; on timeout the child is killed (SIGKILL) and -9 returned."""
        try:
            return self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            return self._proc.wait()


class ForkedChild(Child):
    """One running command, a fork of `server`."""

    def __init__(self, server: Server, pid: int):
        self._server, self.pid, self._code = server, pid, None
        self.maxrss_kib = None  # its peak resident set (getrusage's ru_maxrss), once it has ended

    def poll(self) -> int | None:
        if self._code is None:
            answer = self._server.ask({"op": "poll", "pid": self.pid})
            self._code, self.maxrss_kib = answer["code"], answer.get("maxrss_kib")
        return self._code

    def send_signal(self, signum: int) -> None:
        self._server.ask({"op": "signal", "pid": self.pid, "signum": int(signum)})

    def wait(self, timeout: float | None = None) -> int:
        deadline, pause = None if timeout is None else time.monotonic() + timeout, 0.002
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                self.kill()
                deadline = None
            time.sleep(pause)
            pause = min(2 * pause, 0.05)  # a short command's end seen at once, a long one's cheaply
        return code


class _ServerFork:
    """The handle of a server forked from the caller: what Server uses of a subprocess.Popen."""

    def __init__(self, pid: int, stdin, stdout):
        self.pid, self.stdin, self.stdout, self._code = pid, stdin, stdout, None

    def poll(self) -> int | None:
        if self._code is None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self._code = os.waitstatus_to_exitcode(status)
        return self._code

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(["fork server"], timeout)
            time.sleep(0.01)
        return self._code

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, 9)


def _forget_the_callers_exit_work() -> None:
    """In a server forked from its caller: the caller's exit functions and finalizers (the removal of
    its temporary folders, the closing of its own servers) are the caller's, and each child runs the
    exit functions it finds (`_child`), so they are dropped here, before any child is forked."""
    atexit._clear()  # noqa: SLF001 - CPython's; there is no public way to drop every exit function
    import weakref

    for finalizer in list(weakref.finalize._registry):  # noqa: SLF001 - as in _no_torch_library_teardown_at_exit
        finalizer.atexit = False


def _fork_server(env: dict, preload: list[str]) -> _ServerFork:
    """A server forked from the calling process: it starts with everything the caller imported, and
    none of its exit work."""
    requests_r, requests_w = os.pipe()
    answers_r, answers_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            _forget_the_callers_exit_work()
            _own_resource_tracker()  # the caller's tracker pipe goes with the descriptors closed below
            os.dup2(requests_r, 0)
            os.dup2(answers_w, 1)
            # Every other descriptor the caller had open (pipes to its other servers and children
            # among them) is closed here: held open by this server, such a pipe would never end
            os.closerange(3, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 65536)
            os.environ.clear()
            os.environ.update(env)
            serve([json.dumps(preload)])
        finally:
            os._exit(1)  # serve() ends the process itself; this only on an error before it could
    os.close(requests_r)
    os.close(answers_w)
    return _ServerFork(pid, os.fdopen(requests_w, "w"), os.fdopen(answers_r, "r"))


class Server:
    """A fork server: a process started now with `env` as its environment (what is read at import,
    thread counts and TRITON_INTERPRET, is read there once for every child) that imports `preload`
    (PRELOAD by default) while the caller goes on, then forks one child per start().
    Ends with close(), or when the caller's process ends.

    from_here=True forks the server from the caller instead of starting a fresh interpreter: it
    starts with the caller's imports (free where the caller is itself a fork of a server, as the GPU
    check's doctor stage is). Only on a machine without a GPU, from a caller that has computed
    nothing yet (no thread pool to copy) and that imported triton, if at all, with the
    TRITON_INTERPRET setting of `env`."""

    def __init__(self, env: dict, preload: list[str] | None = None, from_here: bool = False):
        self.env, self.preload = dict(env), list(PRELOAD if preload is None else preload)
        self._lock, self._asked, self.forked_here = threading.Lock(), False, from_here
        if from_here:
            self._proc = _fork_server(self.env, self.preload)
        else:
            self._proc = subprocess.Popen([sys.executable, "-c", _SERVE, json.dumps(self.preload)], env=self.env,
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def alive(self) -> bool:
        return self._proc.poll() is None

    def ask(self, request: dict) -> dict:
        """One request, its answer (RuntimeError for an error or a server that has ended)."""
        with self._lock:
            self._asked = True
            try:
                self._proc.stdin.write(json.dumps(request) + "\n")
                self._proc.stdin.flush()
                line = self._proc.stdout.readline()
            except (BrokenPipeError, ValueError):  # ValueError: closed already
                line = ""
        if not line:
            raise RuntimeError(f"the fork server has ended (exit status {self._proc.wait()}); its stderr says why")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"fork server: {answer['error']}")
        return answer

    def call(self, target: str, *args) -> None:
        """`module:function(*args)` in the server (JSON arguments), before the children it then forks:
        caches they inherit. It must compute no tensor (no thread pool may exist at a fork)."""
        self.ask({"op": "call", "target": target, "args": list(args)})

    def start(self, module: str, argv: list[str], out: Path, err: Path, env: dict | None = None,
              cwd: Path | None = None, stdin: Path | None = None, user: str | None = None) -> ForkedChild:
        """`python -m <module> argv` as a fork: `env` its whole environment (the server's by default),
        `cwd` the caller's by default, stdin read from the file `stdin` (none by default), stdout and
        stderr appended to `out` and `err` (may be the same file; both exist once this returns),
        running as `user` where given (as subprocess.Popen's user=; the caller must be root)."""
        for path in (out, err):
            open(path, "ab").close()
        pid = self.ask({"op": "start", "module": module, "argv": list(argv), "cwd": str(cwd or os.getcwd()),
                        "env": dict(self.env if env is None else env), "out": str(out), "err": str(err),
                        "stdin": str(stdin) if stdin else None, "user": user})["pid"]
        return ForkedChild(self, pid)

    def close(self) -> None:
        """End the server; children still running go on by themselves. One never asked anything (a
        caller that failed before its first child) is killed, maybe mid-import: it holds nothing."""
        with self._lock:
            # A server forked from its caller is killed too: any process the caller forks after it
            # holds its request pipe open, so closing our end is no end of input to it (it computed
            # nothing and holds nothing to tidy; its running children go on by themselves)
            if not self._asked or self.forked_here:
                self._proc.kill()
            if not self._proc.stdin.closed:
                self._proc.stdin.close()  # a server waiting for requests ends at once
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc.stdout.close()


class Launcher:
    """Starts `python -m <module> args` (a module with `main(argv)`; tunekit's CLI unless told) with
    `env` as the child's whole environment and the caller's working directory, by `method` (see
    above); `preload` is what a fork server imports once, `from_here` as Server's. close() ends its
    server."""

    def __init__(self, env: dict, method: str, module: str = CLI, preload: list[str] | None = None,
                 from_here: bool = False):
        if method not in ("fresh", "forkserver"):
            raise ValueError(f"start method {method!r}: choose fresh or forkserver")
        self.env, self.method, self.module = dict(env), method, module
        self.server = Server(self.env, preload, from_here) if method == "forkserver" else None

    def command(self, args: list[str]) -> list[str]:
        """The equivalent shell command (for logs)."""
        return [sys.executable, "-m", self.module, *args]

    def start(self, args: list[str], out: Path, err: Path) -> Child:
        """Start the command, its stdout appended to `out` and stderr to `err` (may be the same file)."""
        if self.server is not None:
            return self.server.start(self.module, args, out, err)
        with open(out, "ab") as o, open(err, "ab") as e:
            return Child(subprocess.Popen(self.command(args), env=self.env, stdout=o, stderr=e,
                                          stdin=subprocess.DEVNULL))

    def run(self, args: list[str], out: Path, err: Path, timeout: float | None = None) -> int:
        """Run to completion; the exit status (-9 where the timeout killed it)."""
        return self.start(args, out, err).wait(timeout)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
