#!/usr/bin/env python3
"""`$PYTHON` for run.sh in the tests: `served_python.py FILE.py ARGS` runs FILE.py through the script server
(tests/script_server.py: imports done, forked), with this process's working directory, environment and standard
streams, and exits as the run did; anything else, or an environment that differs from the server's where an
interpreter reads it at start, execs the real interpreter. run.sh's smoke runs start about forty Python programs,
each 6-7 s of imports on a 2-core machine. conftest.served_python_env() gives the variables it reads."""

import json
import os
import signal
import socket
import sys

args = sys.argv[1:]
real_python = os.environ["LEANRL_REAL_PYTHON"]
read_at_start = json.loads(os.environ["LEANRL_SERVER_READ_AT_START"])  # the server's values of those variables
if not args or not args[0].endswith(".py") or any(os.environ.get(k) != v for k, v in read_at_start.items()):
    os.execv(real_python, [real_python, *args])

request = {
    "script": os.path.abspath(args[0]),
    "args": args[1:],
    "cwd": os.getcwd(),
    "env": dict(os.environ),
    "path_first": [],
    "new_session": False,
    "sigint_default": False,
    "file_size_limit": None,
}
connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
connection.connect(os.environ["LEANRL_SCRIPT_SERVER"])
socket.send_fds(connection, [json.dumps(request).encode()], [0, 1, 2])
with connection.makefile() as replies:
    pid = json.loads(replies.readline())["pid"]
    for signum in (signal.SIGINT, signal.SIGTERM):  # passed on, as to a process of one's own
        signal.signal(signum, lambda signum, _: os.kill(pid, signum))
    returncode = json.loads(replies.readline())["returncode"]
if returncode < 0:
    signal.signal(-returncode, signal.SIG_DFL)
    os.kill(os.getpid(), -returncode)
sys.exit(returncode)
