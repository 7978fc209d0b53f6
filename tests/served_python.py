#!/usr/bin/env python3
"""`$PYTHON` for run.sh in the tests: `served_python.py FILE.py ARGS` runs FILE.py through the script server
(tests/script_server.py: imports done, forked), with this process's working directory, environment and standard
streams, and exits as the run did; anything else, or an environment that differs from the server's where an
interpreter reads it at start, execs the real interpreter. run.sh's smoke runs start about forty Python programs,
each 6-7 s of imports on a 2-core machine. script_runs.served_python_env() gives the variables it reads.

It is also the interpreter that multiprocessing's spawn starts in a served run (the async DQN's actor: 6-9 s of
imports a run): `served_python.py -c CODE --multiprocessing-fork` has the child forked by the server with this
process's descriptors at their numbers, and the child ends when this process does, even by SIGKILL; the run sees
this process as its child (its pid, its exit, the signals it is sent)."""

import json
import os
import signal
import socket
import sys


def is_open(fd):
    try:
        os.fstat(fd)
        return True
    except OSError:  # the descriptor that listed them, closed since
        return False


args = sys.argv[1:]
inherited = [fd for fd in sorted(map(int, os.listdir("/proc/self/fd"))) if fd > 2 and is_open(fd)]
real_python = os.environ["LEANRL_REAL_PYTHON"]
read_at_start = json.loads(os.environ["LEANRL_SERVER_READ_AT_START"])  # the server's values of those variables
# multiprocessing's spawn: [interpreter flags] -c "... spawn_main(...)" --multiprocessing-fork
code_at = args.index("-c") + 1 if "-c" in args[:-1] else None
spawned = code_at is not None and "spawn_main" in args[code_at] and args[-1] == "--multiprocessing-fork"
if not (args and (args[0].endswith(".py") or spawned)) or any(os.environ.get(k) != v for k, v in read_at_start.items()):
    os.execv(real_python, [real_python, *args])

request = {
    "cwd": os.getcwd(),
    "env": dict(os.environ),
    "path_first": [],
    "new_session": False,
    "sigint_default": False,
    "file_size_limit": None,
}
fds = [0, 1, 2]
if spawned:
    for name in ("LEANRL_REAL_PYTHON", "LEANRL_SCRIPT_SERVER", "LEANRL_SERVER_READ_AT_START"):  # the wrapper's
        request["env"].pop(name)
    watch, watched = os.pipe()  # its end is the child's sign that this process is gone
    request.update(
        code=args[code_at],
        args=args[code_at + 1 :],
        fd_numbers=inherited,
        sigint_ignored=signal.getsignal(signal.SIGINT) is signal.SIG_IGN,
    )
    fds += [*inherited, watch]
else:
    request.update(script=os.path.abspath(args[0]), args=args[1:])
connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
connection.connect(os.environ["LEANRL_SCRIPT_SERVER"])
socket.send_fds(connection, [json.dumps(request).encode()], fds)
for fd in fds[3:]:
    os.close(fd)
with connection.makefile() as replies:
    pid = json.loads(replies.readline())["pid"]
    for signum in (signal.SIGINT, signal.SIGTERM):  # passed on, as to a process of one's own
        signal.signal(signum, lambda signum, _: os.kill(pid, signum))
    returncode = json.loads(replies.readline())["returncode"]
if returncode < 0:
    signal.signal(-returncode, signal.SIG_DFL)
    os.kill(os.getpid(), -returncode)
sys.exit(returncode)
