"""Starts the scripts for the tests without paying their imports each time.

A script's imports (torch, tensordict with torch._dynamo, gymnasium, TensorBoard, envpool) take 6-7 s of CPU on a
2-core machine, and the tests start the scripts hundreds of times: most of the suite's time went there. This server
imports them once and does what a process's first torch.compile sets up (warm_up_compile); for each run it forks,
and the child runs the script as `python script.py ARGS` would: its own argv, working directory, environment,
session if asked, the test's pipes as stdin, stdout and stderr, a sitecustomize module that the test's PYTHONPATH
entries hold, the script run as __main__, then the interpreter's exit (non-daemon threads joined, atexit functions
run, the exit code of SystemExit, SIGINT re-raised after a KeyboardInterrupt). PYTHONPATH entries a test puts before
the server's come first on sys.path, and the modules they shadow are dropped from the server's imports (a test hides
an extra that way). What a fork cannot give is what the interpreter and libgomp read once at start-up:
script_runs.start_script runs a fresh interpreter when a test's environment differs from the server's there (the OpenMP
and thread variables, PYTHONPATH otherwise), and LEANRL_TESTS_FRESH=1 makes every run a fresh interpreter. A process
that a served run starts with multiprocessing's spawn (the async DQN's actor) is forked here too, through
tests/served_python.py.

    python tests/script_server.py SOCKET    (tests/script_runs.py starts it; one JSON request per connection)
"""

import atexit
import ctypes
import fcntl
import importlib
import json
import multiprocessing
import os
import resource
import runpy
import selectors
import shlex
import signal
import socket
import sys
import threading
from functools import partial

# Read once by libgomp when torch loads it: the CNN scripts set it before their imports, and sleeping idle threads
# are also what a 2-core machine running tests wants from the MLP scripts.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import gymnasium  # noqa: E402,F401
import numpy  # noqa: E402,F401
import tensordict.nn  # noqa: E402,F401
import torch  # noqa: E402,F401
import torch.utils.tensorboard  # noqa: E402,F401
import tqdm  # noqa: E402,F401
import tyro  # noqa: E402,F401

try:
    import envpool  # noqa: F401
except ModuleNotFoundError:
    pass


def warm_up_compile():
    """A process's first torch.compile pays, once, inductor's imports and its probes of the C++ compiler (its version,
    a child Python that loads a kernel to check the vector ISA, g++ -E of torch's headers to key the precompiled
    header): 5-6 s here, even with every graph in the cache. One small compile here pays them before the forks. With
    one compile thread, as no worker pool may be forked along; the runs' compiles find the setting restored."""
    import torch._inductor.config

    threads, torch._inductor.config.compile_threads = torch._inductor.config.compile_threads, 1
    try:
        torch.compile(lambda x: x.mul(2).sin().sum())(torch.randn(8))
    except Exception:  # no C++ compiler, say: each compiled run then fails on its own, the others still run
        pass
    torch._inductor.config.compile_threads = threads
    torch._dynamo.reset()


warm_up_compile()
MAX_FDS = 64  # stdin, stdout, stderr, and a spawned child's inherited descriptors
SPAWN_PYTHON = []  # the interpreter multiprocessing's spawn runs in a served run: served_python.py, through sh


def run_child(request, fds):
    """In the forked child: become `python script args`, or `python -c CODE` for a process that a served run
    spawned (its descriptors at their numbers), and never return."""
    if request["new_session"]:
        os.setsid()
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1024) for fd in fds]  # clear of the numbers they go to
    for fd in fds:
        os.close(fd)
    watch = moved.pop() if "code" in request else None
    for target, fd in zip([0, 1, 2, *request.get("fd_numbers", [])], moved):
        os.dup2(fd, target)
        os.close(fd)
    if request["sigint_default"]:  # what a fresh interpreter does when SIGINT is not ignored as it starts
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if request.get("sigint_ignored"):  # ignored as it started, as a fresh interpreter keeps it
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if request["file_size_limit"] is not None:  # a full disk: a write past the limit fails with EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (request["file_size_limit"],) * 2)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if watch is not None:  # the spawner's child is served_python.py: when it ends (SIGKILL too), this process ends
        threading.Thread(target=lambda: os.read(watch, 1) or os.kill(os.getpid(), signal.SIGKILL), daemon=True).start()
        sys.argv = ["-c", *request["args"]]
        run = partial(exec, compile(request["code"], "<string>", "exec"), {"__name__": "__main__"})
    else:
        script = request["script"]
        sys.argv = [script, *request["args"]]
        sys.path[0] = os.path.dirname(script)  # what `python script.py` puts first, then PYTHONPATH's entries
        multiprocessing.set_executable(SPAWN_PYTHON[0])  # a process it spawns is forked here too
        run = partial(runpy.run_path, script, run_name="__main__")
    for folder in reversed(request["path_first"]):  # a test's own, before the server's: modules it hides or adds
        sys.path.insert(1, folder)
        shadowed = {name.removesuffix(".py") for name in os.listdir(folder)}
        for name in [name for name in sys.modules if name.split(".")[0] in shadowed]:
            del sys.modules[name]  # imported by the server: the run imports the test's module instead
        if "sitecustomize" in shadowed:  # what a fresh interpreter imports as it starts
            importlib.import_module("sitecustomize")
    code = 0
    try:
        run()
    except SystemExit as exit:
        if exit.code is None or isinstance(exit.code, int):
            code = exit.code or 0
        else:
            print(exit.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        code = -signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # the interpreter's own exit: non-daemon threads, then atexit, then the streams
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    ctypes.CDLL(None).fflush(None)  # what C libraries left in their stdio buffers, as exit() would write it
    if code == -signal.SIGINT:  # as Python does after an uncaught KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def write_spawn_python(path):
    """multiprocessing's spawn execs its interpreter with the child's descriptors: this runs served_python.py
    instead, which has the child forked here (the real interpreter where the environment asks for one)."""
    served_python = os.path.join(os.path.dirname(os.path.abspath(__file__)), "served_python.py")
    read_at_start = {name: os.environ.get(name) for name in os.environ["LEANRL_READ_AT_START"].split()}  # as set here
    settings = {
        "LEANRL_REAL_PYTHON": sys.executable,
        "LEANRL_SCRIPT_SERVER": path,
        "LEANRL_SERVER_READ_AT_START": json.dumps(read_at_start),
    }
    wrapper = os.path.join(os.path.dirname(path), "spawn_python")
    with open(wrapper, "w") as f:
        f.write("#!/bin/sh\nexec env " + " ".join(f"{k}={shlex.quote(v)}" for k, v in settings.items()))
        f.write(f' {shlex.quote(sys.executable)} {shlex.quote(served_python)} "$@"\n')
    os.chmod(wrapper, 0o755)
    SPAWN_PYTHON.append(wrapper)


def serve(path):
    write_spawn_python(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    waiting = {}  # child pid -> the connection its exit status goes to
    print("ready", flush=True)
    while True:
        for _ in selector.select(timeout=0.05):
            connection, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(connection, 1 << 20, MAX_FDS)
            request = json.loads(message)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                selector.close()
                listener.close()
                connection.close()
                run_child(request, fds)
            for fd in fds:
                os.close(fd)
            connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            waiting[pid] = connection
        for pid, connection in list(waiting.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                try:
                    connection.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                except OSError:  # the test went away without waiting
                    pass
                connection.close()
                del waiting[pid]


if __name__ == "__main__":
    serve(sys.argv[1])
