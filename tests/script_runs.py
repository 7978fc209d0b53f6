"""Running a script the way the tests do: `python leanrl_scripts/<script> ARGS` in a scratch folder, forked by the
script server that has the imports done (tests/script_server.py: 6-7 s of imports a run on a 2-core CPU, hundreds of
runs; LEANRL_TESTS_FRESH=1 runs each in a fresh interpreter instead), its summary read back; a run on envpool's
stand-in (tests/standin); a script imported as a module to test its pieces."""

import atexit
import fcntl
import glob
import hashlib
import importlib.util
import json
import os
import resource
import select
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "leanrl_scripts")
sys.path.insert(0, SCRIPTS)  # the run bookkeeping module, which the scripts import from beside them
MODULE = "run_bookkeeping.py"
ALL_SCRIPTS = sorted(name for name in os.listdir(SCRIPTS) if name.endswith(".py") and name != MODULE)

# One inductor cache for the whole session (and its subprocesses): each graph is compiled once.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(ROOT, ".torchinductor-cache"))

STANDIN = os.path.join(ROOT, "tests", "standin")  # envpool's stand-in with its small Atari-shaped tasks
SABOTAGE = os.path.join(ROOT, "tests", "sabotage")  # zeroes every optimizer step's gradients
BREAK_LEARNER = "LEANRL_TESTS_BREAK_LEARNER"

# What an interpreter reads once as it starts (sys.path, OpenMP and torch's threads): a run whose environment differs
# from the script server's there gets a fresh interpreter (tests/script_server.py).
READ_AT_START = (
    "PYTHONPATH",
    "PYTHONHASHSEED",
    "OMP_NUM_THREADS",
    "OMP_WAIT_POLICY",
    "GOMP_SPINCOUNT",
    "MKL_NUM_THREADS",
    "LD_PRELOAD",
)


class ScriptServer:
    """The process that forks the scripts' runs with their imports done (tests/script_server.py); one a session."""

    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="leanrl-tests-")
        self.address = os.path.join(self.folder, "socket")
        self.env = {**os.environ, "PYTHONPATH": ROOT}
        self.process = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "tests", "script_server.py"), self.address],
            env={**self.env, "LEANRL_READ_AT_START": " ".join(READ_AT_START)},
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        assert self.process.stdout.readline() == "ready\n", "the script server did not start"
        atexit.register(self.close)

    def path_first(self, env):
        """The folders `env`'s PYTHONPATH puts before the server's own (None: it does not end with the server's)."""
        entries, own = env.get("PYTHONPATH", "").split(os.pathsep), self.env["PYTHONPATH"].split(os.pathsep)
        return entries[: len(entries) - len(own)] if entries[len(entries) - len(own) :] == own else None

    def serves(self, env):
        same = all(env.get(name) == self.env.get(name) for name in READ_AT_START if name != "PYTHONPATH")
        return same and self.path_first(env) is not None

    def start(self, request, fds):
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(self.address)
        socket.send_fds(connection, [json.dumps(request).encode()], fds)
        return connection

    def close(self):
        self.process.kill()
        self.process.wait()
        for name in os.listdir(self.folder):
            os.remove(os.path.join(self.folder, name))
        os.rmdir(self.folder)


SERVER = []  # started by the first run that can use it


class ServedScript:
    """A run the server forked, with what the tests use of subprocess.Popen: pid, stdout and stderr (text),
    poll, wait, send_signal, kill, communicate, returncode (negative: the signal that ended it)."""

    def __init__(self, server, request):
        pipes = [os.pipe() for _ in range(2)]
        with open(os.devnull) as devnull:
            self.connection = server.start(request, [devnull.fileno(), pipes[0][1], pipes[1][1]])
        for _, write_end in pipes:
            os.close(write_end)
        self.stdout, self.stderr = (os.fdopen(read_end, "r") for read_end, _ in pipes)
        self.args, self.received, self.returncode = [request["script"], *request["args"]], b"", None
        self.pid = self.message(None)["pid"]

    def message(self, timeout):
        """The server's next line: the pid, then the exit code."""
        while b"\n" not in self.received:
            if not select.select([self.connection], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            chunk = self.connection.recv(4096)
            assert chunk, "the script server went away"
            self.received += chunk
        line, self.received = self.received.split(b"\n", 1)
        return json.loads(line)

    def wait(self, timeout=None):
        if self.returncode is None:
            self.returncode = self.message(timeout)["returncode"]
            self.connection.close()
        return self.returncode

    def poll(self):
        try:
            return self.wait(timeout=0.001)
        except subprocess.TimeoutExpired:
            return None

    def send_signal(self, signum):
        if self.returncode is None:
            os.kill(self.pid, signum)

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout=None):
        """Both streams to their end, then the exit code; on a timeout the run is killed, as subprocess.run does."""
        deadline = None if timeout is None else time.monotonic() + timeout
        selector, output = selectors.DefaultSelector(), {}
        for stream in (self.stdout, self.stderr):
            if not stream.closed:
                selector.register(stream.fileno(), selectors.EVENT_READ, stream)
                output[stream] = []
        while selector.get_map():
            left = None if deadline is None else deadline - time.monotonic()
            ready = selector.select(timeout=left) if left is None or left > 0 else []
            if not ready:
                self.kill()
                raise subprocess.TimeoutExpired(self.args, timeout)
            for key, _ in ready:
                chunk = os.read(key.fd, 1 << 16)
                if chunk:
                    output[key.data].append(chunk)
                else:
                    selector.unregister(key.fd)
                    key.data.close()
        self.wait(None if deadline is None else max(0.1, deadline - time.monotonic()))
        return tuple(b"".join(output.get(stream, [])).decode() for stream in (self.stdout, self.stderr))


def sabotaged_if_asked(env):
    """A run's environment, with tests/sabotage first on its PYTHONPATH under `--break-learner`."""
    if os.environ.get(BREAK_LEARNER) != "1":
        return env
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [SABOTAGE, env.get("PYTHONPATH")]))}


def start_script(script, args, cwd, env=None, new_session=False, sigint_default=False, file_size_limit=None):
    """`python leanrl_scripts/<script> ARGS` in `cwd`, its stdout and stderr piped: forked by the script server, or a
    fresh interpreter where its environment asks for one (READ_AT_START) or LEANRL_TESTS_FRESH=1 is set. Under
    `--break-learner`, tests/sabotage comes first on its PYTHONPATH."""
    path = os.path.join(SCRIPTS, script) if not os.path.isabs(script) else script
    env = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
    env = sabotaged_if_asked(env)
    if os.environ.get("LEANRL_TESTS_FRESH") != "1":
        if not SERVER:
            SERVER.append(ScriptServer())
        if SERVER[0].serves(env):
            request = {
                "script": path,
                "args": list(map(str, args)),
                "cwd": str(cwd),
                "env": env,
                "path_first": SERVER[0].path_first(env),
                "new_session": new_session,
                "sigint_default": sigint_default,
                "file_size_limit": file_size_limit,
            }
            return ServedScript(SERVER[0], request)

    def before_exec():
        if sigint_default:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        if file_size_limit is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    return subprocess.Popen(
        [sys.executable, path, *map(str, args)],
        cwd=cwd,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        start_new_session=new_session,
        preexec_fn=before_exec,
    )


def served_python_env():
    """The environment for run.sh whose `$PYTHON` sends each script's run to the script server
    (tests/served_python.py); the real interpreter under LEANRL_TESTS_FRESH=1."""
    if os.environ.get("LEANRL_TESTS_FRESH") == "1":
        return {**os.environ, "PYTHON": sys.executable}
    if not SERVER:
        SERVER.append(ScriptServer())
    server_env = SERVER[0].env
    return {
        **os.environ,
        "PYTHONPATH": server_env["PYTHONPATH"],
        "PYTHON": os.path.join(ROOT, "tests", "served_python.py"),
        "LEANRL_REAL_PYTHON": sys.executable,
        "LEANRL_SCRIPT_SERVER": SERVER[0].address,
        "LEANRL_SERVER_READ_AT_START": json.dumps({k: server_env.get(k) for k in READ_AT_START}),
    }


def run_script(script, args, cwd, check=True, timeout=900, env=None):
    """Run leanrl_scripts/<script> in `cwd`; return (summary or None, completed process)."""
    before = set(glob.glob(os.path.join(cwd, "runs", "*")))
    proc = start_script(script, args, cwd, env=env)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except BaseException:  # its own timeout, the test's limit (pytest-timeout), Ctrl-C: the run goes too
        proc.kill()
        proc.communicate()
        raise
    proc = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    if not check:
        return None, proc
    assert proc.returncode == 0, f"{script} {args} failed:\n{proc.stderr[-3000:]}"
    (run_dir,) = set(glob.glob(os.path.join(cwd, "runs", "*"))) - before
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    speed_lines = [line for line in proc.stdout.splitlines() if line.startswith("SPEED ")]
    assert speed_lines and speed_lines[-1] == proc.stdout.rstrip().splitlines()[-1], "SPEED must be the last line"
    assert json.loads(speed_lines[-1][len("SPEED ") :]) == summary
    summary["run_dir"] = run_dir
    return summary, proc


# The runs that several tests read and none changes (a tiny run's summary, checkpoint and video) are made once a
# session, in a folder that the session's xdist workers share (tests/conftest.py names it).
SHARED_RUNS = "LEANRL_TESTS_SHARED_RUNS"


def shared_run(script, args, env=None):
    """run_script's (summary, completed process) of `script ARGS`, made by the first test of the session that asks
    for it; a test asking while another worker makes it waits for it. Its run folder is read-only by agreement: a
    test that changes what a run wrote makes a run of its own."""
    key = json.dumps([script, list(map(str, args)), env or {}])
    cwd = os.path.join(os.environ[SHARED_RUNS], hashlib.sha1(key.encode()).hexdigest()[:16])
    with open(cwd + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = os.path.join(cwd, "record.json")
        if not os.path.exists(record):
            os.makedirs(cwd, exist_ok=True)
            summary, proc = run_script(script, args, cwd, env=env)
            with open(record + ".tmp", "w") as f:
                json.dump({"summary": summary, "args": proc.args, "stdout": proc.stdout, "stderr": proc.stderr}, f)
            os.replace(record + ".tmp", record)
        with open(record) as f:
            made = json.load(f)
    return made["summary"], subprocess.CompletedProcess(made["args"], 0, made["stdout"], made["stderr"])


def run_on_standin(script, args, cwd):
    """run_script with envpool's stand-in (tests/standin/envpool.py) first on the run's PYTHONPATH: the script's own
    env code makes its tasks (Cue-v5, Recall-v5) as it makes an Atari game."""
    return run_script(script, args, cwd, env={"PYTHONPATH": os.pathsep.join([STANDIN, ROOT])})


def load_script(script):
    """Import a script as a module (its __main__ block does not run) to test its pieces."""
    name = "leanrl_" + script[: -len(".py")]
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(SCRIPTS, script))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # torch.compile resolves the functions' globals through sys.modules
        environ = dict(os.environ)
        spec.loader.exec_module(module)
        os.environ.clear()  # what a script sets at import (OMP_WAIT_POLICY) stays out of the later test runs
        os.environ.update(environ)
    return sys.modules[name]
