"""Running a script the way the tests do: `python leanrl_scripts/<script> ARGS` in a scratch folder, forked by the
script server that has the imports done (tests/script_server.py: 6-7 s of imports a run on a 2-core CPU, hundreds of
runs; LEANRL_TESTS_FRESH=1 runs each in a fresh interpreter instead), its summary read back; a run on envpool's
stand-in (tests/standin); a script imported as a module to test its pieces. And the runs that several test files make:
a run refused with one error line, every script's short run, the runs under the CUDA imitation and the host-sync
probe."""

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

import torch

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


def the_one_error_line(script, args, workdir, env=None):
    """Runs `script` in `workdir`: it must exit with code 2, one line on stderr and no run folder; returns the line."""
    _, proc = run_script(script, args, workdir, check=False, timeout=120, env=env)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert not os.path.exists(os.path.join(workdir, "runs"))
    return lines[0]


# Every script's short run (test_hard_knocks, and test_track and test_videos for the one error line of what cannot
# work): its env (and the flags every run takes), a short run, the flags that make it diverge, its learning-rate flag,
# and another script whose checkpoint it must refuse. The DQN scripts read their losses (the divergence check, the
# progress line) every 100 updates: the image ones update on batches of 8.
PENDULUM_ENV = ["--env-id", "Pendulum-v1"]
BREAKOUT = ["--env-id", "Breakout-v5", "--num-envs", 4, "--num-steps", 32, "--num-minibatches", 2, "--update-epochs", 2]
OFF_POLICY = ["--total-timesteps", 400, "--learning-starts", 200, "--measure-burnin", 5, "--batch-size", 64]
SHORT_RUNS = {
    "sac_continuous_action.py": dict(
        base=PENDULUM_ENV,
        tiny=OFF_POLICY,
        diverge=["--policy-lr", 1e30, "--q-lr", 1e30],
        lr="--q-lr",
        other="td3_continuous_action.py",
    ),
    "td3_continuous_action.py": dict(
        base=PENDULUM_ENV,
        tiny=OFF_POLICY,
        diverge=["--learning-rate", 1e30],
        lr="--learning-rate",
        other="sac_continuous_action.py",
    ),
    # its critics are distributional, its replay kept per env: a td3_continuous_action.py model is another network
    "fast_td3.py": dict(
        base=[*PENDULUM_ENV, "--num-envs", 4, "--critic-hidden-dim", 64, "--actor-hidden-dim", 32],
        tiny=OFF_POLICY,
        diverge=["--critic-learning-rate", 1e30, "--actor-learning-rate", 1e30],
        lr="--critic-learning-rate",
        other="td3_continuous_action.py",
    ),
    # SAC's checkpoint holds target critics and critics without Batch Renormalization
    "crossq.py": dict(
        base=[*PENDULUM_ENV, "--critic-hidden-dim", 64],
        tiny=OFF_POLICY,
        diverge=["--learning-rate", 1e30],
        lr="--learning-rate",
        other="sac_continuous_action.py",
    ),
    "ppo_continuous_action.py": dict(
        base=PENDULUM_ENV,
        tiny=["--total-timesteps", 1024, "--num-steps", 512, "--measure-burnin", 0],
        diverge=["--learning-rate", 10],
        lr="--learning-rate",
        other="sac_continuous_action.py",
    ),
    "ppo_atari_envpool.py": dict(
        base=BREAKOUT,
        tiny=["--total-timesteps", 256, "--measure-burnin", 0],
        diverge=["--learning-rate", 1e30],
        lr="--learning-rate",
        other="ppo_atari_lstm.py",
    ),
    # a checkpoint of ppo_atari_envpool.py is this script's too (the same network): PPO-LSTM's is another's
    "ppo_atari_envpool_async.py": dict(
        base=BREAKOUT,
        tiny=["--total-timesteps", 256, "--measure-burnin", 0],
        diverge=["--learning-rate", 1e30],
        lr="--learning-rate",
        other="ppo_atari_lstm.py",
    ),
    "ppo_atari_lstm.py": dict(
        base=BREAKOUT,
        tiny=["--total-timesteps", 256, "--measure-burnin", 0],
        diverge=["--learning-rate", 1e30],
        lr="--learning-rate",
        other="ppo_atari_envpool.py",
    ),
    "dqn.py": dict(
        base=["--env-id", "CartPole-v1"],
        tiny=["--total-timesteps", 2000, "--learning-starts", 500],
        diverge=["--learning-rate", 1e30],
        lr="--learning-rate",
        other="sac_continuous_action.py",
    ),
    "dqn_atari.py": dict(
        base=["--env-id", "Breakout-v5"],
        tiny=[
            "--total-timesteps",
            400,
            "--learning-starts",
            200,
            "--buffer-size",
            400,
            "--train-frequency",
            4,
            "--batch-size",
            8,
        ],
        diverge=["--learning-rate", 1e30],
        lr="--learning-rate",
        other="ppo_atari_envpool.py",
    ),
    # DQN Atari's torso with dueling distributional heads: a dqn_atari.py model is another network
    "rainbow_atari.py": dict(
        base=["--env-id", "Breakout-v5"],
        tiny=["--total-timesteps", 400, "--learning-starts", 200, "--buffer-size", 400, "--batch-size", 8],
        diverge=["--learning-rate", 1e30],
        lr="--learning-rate",
        other="dqn_atari.py",
    ),
    # on CartPole: its actor process and rate limiter are what this script adds; a dqn.py model is another network
    "dqn_atari_async.py": dict(
        base=["--env-id", "CartPole-v1"],
        tiny=["--total-timesteps", 2000, "--learning-starts", 500, "--buffer-size", 2000],
        diverge=["--learning-rate", 1e30],
        lr="--learning-rate",
        other="dqn.py",
    ),
    "pqn.py": dict(
        base=["--env-id", "CartPole-v1"],
        tiny=["--total-timesteps", 1024, "--num-steps", 64, "--measure-burnin", 0],
        diverge=["--learning-rate", 1e30],
        lr="--learning-rate",
        other="dqn.py",
    ),
    # the same network as PPO Atari's but for the LayerNorms and the heads: its checkpoint is another's
    "pqn_atari_envpool.py": dict(
        base=BREAKOUT,
        tiny=["--total-timesteps", 256, "--measure-burnin", 0],
        diverge=["--learning-rate", 1e30],
        lr="--learning-rate",
        other="ppo_atari_envpool.py",
    ),
    "impala_ray.py": dict(
        base=["--env-id", "CartPole-v1", "--num-actors", 2, "--envs-per-actor", 4, "--batch-size", 16],
        tiny=["--total-timesteps", 3000, "--measure-burnin", 2],
        diverge=["--learning-rate", 1e30],
        lr="--learning-rate",
        other="dqn.py",
    ),
}

# Runs under tests/cuda_imitation.py: test_cuda_paths, and test_cuda on a GPU.
IMITATION = os.path.join(ROOT, "tests", "cuda_imitation.py")
IMITATED_ATARI = ["--total-timesteps", 512, "--num-envs", 4, "--num-steps", 32]
IMITATED_ATARI += ["--num-minibatches", 2, "--update-epochs", 1]
IMITATED_PENDULUM = ["--env-id", "Pendulum-v1", "--total-timesteps", 300, "--learning-starts", 200, "--batch-size", 32]
IMITATED_CARTPOLE = ["--env-id", "CartPole-v1", "--total-timesteps", 1000, "--learning-starts", 500]
IMITATED_CARTPOLE += ["--buffer-size", 1000]
IMITATED_PQN = ["--env-id", "CartPole-v1", "--total-timesteps", 512, "--num-steps", 32, "--num-minibatches", 2]
IMITATED_IMPALA = ["--env-id", "CartPole-v1", "--total-timesteps", 1280, "--num-actors", 1, "--envs-per-actor", 4]
IMITATED_IMPALA += ["--batch-size", 8, "--unroll-length", 8, "--replay-ratio", 0.5, "--lstm"]
# script: its flags, and its acting views by the names of the script's globals (view: learner). IMPALA's actors act with
# copies the learner sends them: it has no view, and is here for its copies.
IMITATED_RUNS = {
    "dqn.py": (IMITATED_CARTPOLE, {"q_view": "q_network"}),
    "dqn_atari.py": (
        ["--total-timesteps", 300, "--learning-starts", 200, "--buffer-size", 400, "--num-envs", 2],
        {"q_view": "q_network"},
    ),
    "rainbow_atari.py": (
        ["--total-timesteps", 300, "--learning-starts", 200, "--buffer-size", 400, "--num-envs", 2],
        {"q_view": "q_network"},
    ),
    # the actor process acts with a shared CPU copy, written after every update with --actor-sync-every 1
    "dqn_atari_async.py": (
        [*IMITATED_CARTPOLE, "--batch-size", 64, "--actor-sync-every", 1],
        {"actor.q_network": "q_network"},
    ),
    "sac_continuous_action.py": (IMITATED_PENDULUM, {"actor_view": "actor", "qnet_view": "qnet"}),
    # TD3's actor reads the first critic alone
    "td3_continuous_action.py": (IMITATED_PENDULUM, {"actor_view": "actor", "qnet_view": "qnet.members.0"}),
    "fast_td3.py": (
        [*IMITATED_PENDULUM, "--num-envs", 4, "--critic-hidden-dim", 64, "--actor-hidden-dim", 32],
        {"actor_view": "actor", "qnet_view": "qnet"},
    ),
    "crossq.py": ([*IMITATED_PENDULUM, "--critic-hidden-dim", 64], {"actor_view": "actor", "qnet_view": "qnet"}),
    "ppo_continuous_action.py": (
        ["--env-id", "Pendulum-v1", "--total-timesteps", 256, "--num-steps", 64, "--num-minibatches", 2],
        {"agent_view": "agent"},
    ),
    "ppo_atari_envpool.py": (IMITATED_ATARI, {"agent_view": "agent"}),
    "ppo_atari_envpool_async.py": (IMITATED_ATARI, {"agent_view": "agent"}),
    "ppo_atari_lstm.py": (IMITATED_ATARI, {"agent_view": "agent"}),
    "ppo_atari_lstm.py --lstm-impl loop": ([*IMITATED_ATARI, "--lstm-impl", "loop"], {"agent_view": "agent"}),
    "ppo_atari_multigpu.py": (
        ["--total-timesteps", 512, "--local-num-envs", 4, "--num-steps", 32, "--num-minibatches", 2],
        {"agent_view": "agent"},
    ),
    "pqn.py": (IMITATED_PQN, {"q_view": "q_network"}),
    "pqn_atari_envpool.py": (IMITATED_ATARI, {"q_view": "q_network"}),
    "impala_ray.py --lstm": (IMITATED_IMPALA, {}),
}
# The others send host data once per env step, right after reading the actions back (the stream is idle then), and
# in their evaluation: a blocking copy there waits for nothing.
NO_BLOCKING_COPIES = {
    "dqn.py",
    "pqn.py",
    "ppo_atari_lstm.py",
    "ppo_atari_lstm.py --lstm-impl loop",
    "impala_ray.py --lstm",
}


def imitated_run(script, args, workdir, views=None, check=True):
    """`script` run under the imitation; returns its log and the completed process."""
    log = os.path.join(workdir, "imitation.json")
    env = {"CUDA_IMITATION_LOG": log, "CUDA_IMITATION_VIEWS": ",".join(f"{v}={k}" for v, k in (views or {}).items())}
    _, proc = run_script(IMITATION, [os.path.join(SCRIPTS, script), *args], workdir, check=False, env=env)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    with open(log) as f:
        return json.load(f), proc


# The scripts whose loop keeps tensors or acting views across a resume, resumed under the imitation: test_cuda_paths,
# and test_cuda on a GPU
RESUMED_RUNS = ["dqn.py", "sac_continuous_action.py", "crossq.py", "fast_td3.py", "ppo_continuous_action.py", "pqn.py"]
RESUMED_RUNS += ["ppo_atari_lstm.py"]


def resumed_imitated_run(run, workdir, resumed_flags=()):
    """IMITATED_RUNS's `run` with snapshots, then resumed under the imitation (with `resumed_flags`) to twice its
    steps: its views followed the learner, it wrote its model and a later snapshot."""
    flags, views = IMITATED_RUNS[run]
    total = flags[flags.index("--total-timesteps") + 1]
    first, _ = run_script(run, [*flags, "--checkpoint-every", total // 4, "--eval-episodes", 0], workdir)
    state = os.path.join(first["run_dir"], "state.pt")
    resumed_at = torch.load(state, weights_only=False)["step"]
    flags = [*flags, "--checkpoint-every", total // 4, "--resume", first["run_dir"], "--save-model", *resumed_flags]
    flags[flags.index("--total-timesteps") + 1] = 2 * total
    log, _ = imitated_run(run, [*flags, "--eval-episodes", 1], workdir, views)
    for view in views:
        assert log["views"][view]["equal"] and log["views"][view]["learner_changed"], log["views"][view]
    summary = json.load(open(os.path.join(first["run_dir"], "summary.json")))
    assert summary["steps_done"] >= 2 * total - 256 and os.path.isfile(os.path.join(first["run_dir"], "model.pt"))
    assert torch.load(state, weights_only=False)["step"] > resumed_at


# Runs under tests/host_sync_probe.py: test_host_syncs, and test_cuda on a GPU. Per script: its flags and the pieces
# that must not sync.
PROBE = os.path.join(ROOT, "tests", "host_sync_probe.py")
PROBED_ATARI = ["--total-timesteps", 256, "--num-envs", 4, "--num-steps", 32]
PROBED_ATARI += ["--num-minibatches", 2, "--update-epochs", 1]
PROBED_RUNS = {
    "sac_continuous_action.py": (
        ["--env-id", "Pendulum-v1", "--total-timesteps", 300, "--learning-starts", 200, "--batch-size", 32],
        {"policy", "critic_loss", "actor_loss", "update_critics", "update_actor"},
    ),
    "td3_continuous_action.py": (
        ["--env-id", "Pendulum-v1", "--total-timesteps", 300, "--learning-starts", 200, "--batch-size", 32],
        {"policy", "critic_loss", "actor_loss", "update_critics", "update_actor"},
    ),
    "crossq.py": (
        ["--env-id", "Pendulum-v1", "--total-timesteps", 300, "--learning-starts", 200, "--batch-size", 32]
        + ["--critic-hidden-dim", 64],
        {"policy", "critic_loss", "actor_loss", "update_critics", "update_actor"},
    ),
    "fast_td3.py": (
        ["--env-id", "Pendulum-v1", "--num-envs", 4, "--total-timesteps", 300, "--learning-starts", 200]
        + ["--batch-size", 32, "--critic-hidden-dim", 64, "--actor-hidden-dim", 32],
        {"explore", "critic_loss", "actor_loss", "update_critics", "update_actor"},
    ),
    "ppo_continuous_action.py": (
        [
            "--env-id",
            "Pendulum-v1",
            "--total-timesteps",
            128,
            "--num-steps",
            64,
            "--num-minibatches",
            2,
            "--update-epochs",
            1,
        ],
        {"policy", "gae", "ppo_loss", "update"},
    ),
    "ppo_atari_envpool.py": (PROBED_ATARI, {"policy", "gae", "ppo_loss", "update"}),
    "ppo_atari_envpool_async.py": (PROBED_ATARI, {"policy", "gae", "ppo_loss", "update"}),
    "ppo_atari_lstm.py": (PROBED_ATARI, {"policy", "gae", "ppo_loss", "update"}),
    "pqn.py": (
        ["--total-timesteps", 256, "--num-steps", 32, "--num-minibatches", 2, "--update-epochs", 1],
        {"policy", "q_lambda_returns", "td_loss", "update"},
    ),
    "pqn_atari_envpool.py": (PROBED_ATARI, {"policy", "q_lambda_returns", "td_loss", "update"}),
    "dqn.py": (
        ["--total-timesteps", 700, "--learning-starts", 500, "--buffer-size", 1000],
        {"policy", "td_loss", "update"},
    ),
    "dqn_atari.py": (
        ["--total-timesteps", 300, "--learning-starts", 200, "--buffer-size", 400, "--num-envs", 2, "--start-e", 0.5],
        {"policy", "td_loss", "update"},
    ),
    "rainbow_atari.py": (
        ["--total-timesteps", 300, "--learning-starts", 200, "--buffer-size", 400, "--num-envs", 2],
        {"policy", "rainbow_loss", "sample", "update"},
    ),
    # the learner compiles its loss only: the actor process acts eagerly
    "dqn_atari_async.py": (
        [
            "--env-id",
            "CartPole-v1",
            "--total-timesteps",
            700,
            "--learning-starts",
            500,
            "--buffer-size",
            1000,
            "--batch-size",
            64,
        ],
        {"td_loss", "update"},
    ),
    "impala_ray.py": (
        [
            "--env-id",
            "CartPole-v1",
            "--total-timesteps",
            640,
            "--num-actors",
            1,
            "--envs-per-actor",
            4,
            "--batch-size",
            8,
            "--unroll-length",
            8,
            "--replay-ratio",
            0.5,
        ],
        {"impala_loss", "update"},
    ),
}
