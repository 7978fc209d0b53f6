"""Helpers shared by the tests: run a script as a subprocess and read its summary, or import its pieces; the two
tiers (a plain `python -m pytest` leaves the tests marked slow out, `-m slow` runs them).

The scripts' runs are forked from a server that has their imports done (tests/script_server.py): 6-7 s of imports
a run on a 2-core CPU, hundreds of runs. LEANRL_TESTS_FRESH=1 runs each in a fresh interpreter instead."""

import atexit
import glob
import importlib.util
import json
import math
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
from functools import partial

import numpy as np
import pytest
import torch
from tensordict.nn import CudaGraphModule

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

SUMMARY_KEYS = {
    "script",
    "env_id",
    "seed",
    "num_envs",
    "total_timesteps",
    "mode",
    "compile",
    "cudagraphs_requested",
    "cudagraphs_active",
    "device",
    "torch_version",
    "sps",
    "steady_steps",
    "steady_seconds",
    "warmup_seconds",
    "total_seconds",
    "return_mean",
    "eval_return_mean",
    "peak_memory_mb",
    "env_seconds",
}
# What --compile compiles in each script, and the graphs and graph breaks that makes: every loss is one graph (its
# backward one more, which dynamo does not count) and no piece breaks, but where an update runs an LSTM over a
# rollout: it stays out of the graphs, a break in the loss (PPO-LSTM's, two graphs; IMPALA's core sits inside
# Agent.replay, so its loss is three graphs); PPO-LSTM's policy traces its one LSTM step. A change that adds a break
# or a recompilation fails the mode tests.
COMPILED = {
    "dqn.py": (["policy", "td_loss"], 2, 0),
    "dqn_atari.py": (["policy", "td_loss"], 2, 0),
    "dqn_atari_async.py": (["td_loss"], 1, 0),
    "pqn.py": (["policy", "q_lambda_returns", "td_loss"], 3, 0),
    "pqn_atari_envpool.py": (["policy", "q_lambda_returns", "td_loss"], 3, 0),
    "rainbow_atari.py": (["policy", "rainbow_loss", "sample"], 3, 0),
    "sac_continuous_action.py": (["actor_loss", "critic_loss", "policy"], 3, 0),
    "td3_continuous_action.py": (["actor_loss", "critic_loss", "policy"], 3, 0),
    "ppo_continuous_action.py": (["gae", "policy", "ppo_loss"], 3, 0),
    "ppo_atari_envpool.py": (["gae", "policy", "ppo_loss"], 3, 0),
    "ppo_atari_envpool_async.py": (["gae", "policy", "ppo_loss"], 3, 0),
    "ppo_atari_multigpu.py": (["gae", "policy", "ppo_loss"], 3, 0),
    "ppo_atari_lstm.py": (["gae", "policy", "ppo_loss"], 4, 1),
    "impala_ray.py": (["impala_loss"], 1, 0),
    "impala_ray.py --lstm": (["impala_loss"], 3, 2),
}


def assert_compiled_as_designed(summary, variant=""):
    """A run's summary says what ran compiled (nothing without --compile), in the graphs and graph breaks of
    COMPILED, and nothing compiled again after warm-up."""
    pieces, graphs, breaks = COMPILED[summary["script"] + variant]
    if not summary["compile"]:
        pieces, graphs, breaks = [], 0, 0
    assert summary["compiled_pieces"] == pieces
    assert (summary["compile_graphs"], summary["graph_breaks"], summary["graphs_after_warmup"]) == (graphs, breaks, 0)


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


def start_script(script, args, cwd, env=None, new_session=False, sigint_default=False, file_size_limit=None):
    """`python leanrl_scripts/<script> ARGS` in `cwd`, its stdout and stderr piped: forked by the script server, or a
    fresh interpreter where its environment asks for one (READ_AT_START) or LEANRL_TESTS_FRESH=1 is set. Under
    `--break-learner`, tests/sabotage comes first on its PYTHONPATH."""
    path = os.path.join(SCRIPTS, script) if not os.path.isabs(script) else script
    env = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
    if os.environ.get(BREAK_LEARNER) == "1":
        env["PYTHONPATH"] = os.pathsep.join([SABOTAGE, env["PYTHONPATH"]])
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


def run_on_standin(script, args, cwd):
    """run_script with envpool's stand-in (tests/standin/envpool.py) first on the run's PYTHONPATH: the script's own
    env code makes its tasks (Cue-v5, Recall-v5) as it makes an Atari game."""
    return run_script(script, args, cwd, env={"PYTHONPATH": os.pathsep.join([STANDIN, ROOT])})


CUE_RANDOM_SCORE = 8.0  # a random policy's game on Cue-v5: 32 steps, one action of 4 scores (test_standin_envpool)


def assert_learns_the_cue(summary):
    """On Cue-v5, the last 20 training games and the evaluation games each score at least twice a random policy."""
    assert summary["return_mean"] >= 2 * CUE_RANDOM_SCORE, summary["return_mean"]
    assert summary["eval_return_mean"] >= 2 * CUE_RANDOM_SCORE, summary["eval_returns"]


def speed_up(fn, compile, cudagraphs):
    """A piece wrapped as the scripts wrap theirs: torch.compile, then a CUDA graph after 5 warm-up calls (without
    CUDA, CudaGraphModule passes the call through, which still checks the piece's calling convention)."""
    fn = torch.compile(fn) if compile else fn
    return CudaGraphModule(fn, warmup=5) if cudagraphs else fn


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


@pytest.fixture
def workdir(tmp_path):
    return str(tmp_path)


def assert_same_seed_same_numbers(script, args, workdir, keys, second_flags=()):
    """Two runs of `script` with the same seed, the second with `second_flags` (flags that must not change the
    numbers, such as --cudagraphs without CUDA), give equal values under `keys`. Returns both runs."""
    first = run_script(script, args, workdir)
    second = run_script(script, [*args, *second_flags], workdir)
    for key in keys:
        assert first[0][key] == second[0][key], key
    return first, second


def reference_gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda):
    """CleanRL's reverse loop."""
    advantages, last = torch.zeros_like(rewards), 0
    for t in reversed(range(len(rewards))):
        if t == len(rewards) - 1:
            next_nonterminal, next_values = 1.0 - next_done, next_value
        else:
            next_nonterminal, next_values = 1.0 - dones[t + 1], values[t + 1]
        delta = rewards[t] + gamma * next_values * next_nonterminal - values[t]
        advantages[t] = last = delta + gamma * gae_lambda * next_nonterminal * last
    return advantages, advantages + values


def assert_gae_equals_the_reverse_loop(script, steps, envs, compiled, seed, rewards_sign=False):
    """The script's gae (compiled or not) against the reverse loop, with an episode end into the first and into
    the last observation."""
    module = load_script(script)
    g = torch.Generator().manual_seed(seed)
    rewards, values = torch.randn(steps, envs, generator=g), torch.randn(steps, envs, generator=g)
    if rewards_sign:  # clipped rewards, as on Atari
        rewards = rewards.sign()
    dones = (torch.rand(steps, envs, generator=g) < 0.05).float()
    dones[0, 0] = dones[-1, -1] = 1.0
    next_value, next_done = torch.randn(envs, generator=g), torch.tensor([1.0] + [0.0] * (envs - 1))
    gae = speed_up(partial(module.gae, gamma=0.99, gae_lambda=0.95), compiled, False)
    advantages, returns = gae(rewards, values, dones, next_value, next_done)
    expected_advantages, expected_returns = reference_gae(rewards, values, dones, next_value, next_done, 0.99, 0.95)
    torch.testing.assert_close(advantages, expected_advantages, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(returns, expected_returns, atol=2e-5, rtol=1e-5)


def done_patterns(num_steps, batch, generator):
    """The cases the LSTM scripts' padding must get right, one (T, B) float pattern each (PPO-LSTM's starts[t]: obs t
    starts an episode; IMPALA's dones[t]: step t ends one)."""
    none = torch.zeros(num_steps, batch)
    first = none.clone()
    first[0] = 1.0  # PPO-LSTM: every env starts an episode at t=0, no stored state is used
    last = none.clone()
    last[-1] = 1.0
    every = torch.ones(num_steps, batch)
    many_short = none.clone()
    many_short[::3, 0] = 1.0  # env 0: episodes of three steps; the others: one long segment
    random = (torch.rand(num_steps, batch, generator=generator) < 0.1).float()
    return {"none": none, "t0": first, "last": last, "every": every, "many_short": many_short, "random": random}


def loss_and_gradients(loss_fn, agent, *inputs):
    """The loss and metrics of `loss_fn(*inputs)` and the gradients it gives `agent`'s parameters."""
    agent.zero_grad()
    loss, metrics = loss_fn(*inputs)
    loss.backward()
    return loss.detach(), metrics, {name: p.grad.clone() for name, p in agent.named_parameters()}


def assert_same_loss_and_gradients(result, expected):
    """Two `loss_and_gradients` results agree: loss, every metric, every parameter's gradient."""
    (loss, metrics, grads), (expected_loss, expected_metrics, expected_grads) = result, expected
    torch.testing.assert_close(loss, expected_loss, atol=1e-5, rtol=1e-5)
    for name in expected_metrics:
        torch.testing.assert_close(metrics[name], expected_metrics[name], atol=1e-5, rtol=1e-5)
    for name in expected_grads:
        torch.testing.assert_close(grads[name], expected_grads[name], atol=1e-5, rtol=1e-4)


def assert_checkpoint_round_trip(script, train_args, weights, workdir):
    """Trained, saved, loaded with no steps to play and saved again: the same `weights` state dict (no evaluation
    game: each costs tens of seconds on Atari); the checkpoint refused, exit code 2, on a game with other actions."""
    trained, _ = run_script(script, [*train_args, "--save-model", "--eval-episodes", 0], workdir)
    checkpoint = os.path.join(trained["run_dir"], "model.pt")
    loaded, _ = run_script(
        script, ["--total-timesteps", 0, "--eval-episodes", 0, "--load-model", checkpoint, "--save-model"], workdir
    )
    first, second = (
        torch.load(os.path.join(run["run_dir"], "model.pt"), weights_only=True) for run in (trained, loaded)
    )
    assert first[weights].keys() == second[weights].keys()
    assert all(torch.equal(first[weights][name], second[weights][name]) for name in first[weights])
    _, proc = run_script(
        script,
        ["--env-id", "Pong-v5", "--total-timesteps", 0, "--load-model", checkpoint],
        workdir,
        check=False,
        timeout=120,
    )
    assert proc.returncode == 2 and "Pong-v5 has num_actions 6" in proc.stderr


def assert_beats_random(trained, random_scores, factor):
    """Games of a trained agent against games of a random policy: the mean at least `factor` times the random mean,
    and a rank test, as scores of single games have long tails (one 1,920 among MsPacman games of 300-400 made a
    test on the means fail with a mean 1.8x the random one). A trained game must beat a random game in enough
    pairs (ties count half) to lie 3 standard deviations above the one half that no learning gives (Mann-Whitney's
    U, normal approximation without the tie correction, which only makes it stricter)."""
    trained, random_scores = np.asarray(trained, dtype=float), np.asarray(random_scores, dtype=float)
    assert trained.mean() >= factor * random_scores.mean(), (trained, random_scores.mean())
    differences = trained[:, None] - random_scores[None, :]
    wins = ((differences > 0) + 0.5 * (differences == 0)).sum()
    pairs, games = differences.size, len(trained) + len(random_scores)
    z = (wins - pairs / 2) / math.sqrt(pairs * (games + 1) / 12)
    assert z >= 3, (z, trained, random_scores)


SLOW_LEFT_OUT = pytest.StashKey[int]()
# Per test, past which it fails in its place (pytest-timeout; the fast tier's limit is pyproject.toml's): the slow
# tier's longest take 2-5 minutes here, the real games up to 11.
SLOW_TEST_LIMIT, BENCHMARK_TEST_LIMIT = 900, 1800


def pytest_addoption(parser):
    parser.addoption(
        "--break-learner",
        action="store_true",
        help="run every script with its gradients zeroed (tests/sabotage): each learning test must then fail",
    )


def pytest_configure(config):
    if config.getoption("--break-learner"):  # read by start_script, in xdist's workers too
        os.environ[BREAK_LEARNER] = "1"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """pyproject.toml's `-n auto`: the fast tier in two worker processes. Most of its tests wait on one script's
    run, which keeps one core busy (tiny budgets, one torch thread), so a second worker uses the core that would
    idle. Tests picked by marker (`-m slow`) or named by node id run in this process: the learning tests keep the
    cores busy on their own (two workers on a 2-core CPU made each run 1.4-2.7x slower, the slow tier no
    faster), and one test needs no workers. `-n N` sets another count, `-n 0` runs in this process."""
    return 0 if config.option.markexpr or any("::" in arg for arg in config.args) else 2


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Tests go to whichever worker is free, but those that start Ray (IMPALA's, and run.sh's runs of every script)
    run one after the other on one worker, first: a `ray.init()` joins the cluster that another test's `ray start`
    made, and a local Ray instance takes the cores for seconds as it starts. xdist's own `--dist loadgroup` does
    this by a marker, but renames the tests to do it, which pytest 9.2 no longer lets it."""
    from xdist.scheduler import LoadScopeScheduling

    class RayTestsTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid):  # a scope is a unit of work that one worker runs, largest first
            return "ray" if "impala" in nodeid or "test_run_sh_" in nodeid else nodeid

    return RayTestsTogether(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Three tiers: `python -m pytest` leaves out the tests marked slow (the learning tests among them) and those
    marked benchmark (the real games), `-m slow` runs only the slow ones, `-m benchmark` only the real games; a test
    named by its node id runs whatever its tier."""
    for item in items:
        if item.get_closest_marker("learning") and not item.get_closest_marker("benchmark"):
            item.add_marker(pytest.mark.slow)
        for tier, seconds in (("benchmark", BENCHMARK_TEST_LIMIT), ("slow", SLOW_TEST_LIMIT)):
            if item.get_closest_marker(tier) and not item.get_closest_marker("timeout"):
                item.add_marker(pytest.mark.timeout(seconds))
    if config.option.markexpr or any("::" in arg for arg in config.args):
        return
    slow = [item for item in items if item.get_closest_marker("slow") or item.get_closest_marker("benchmark")]
    if slow:
        items[:] = [item for item in items if item not in slow]
        config.hook.pytest_deselected(items=slow)
        config.stash[SLOW_LEFT_OUT] = len(slow)
        if hasattr(config, "workeroutput"):  # an xdist worker: the count goes to the main process
            config.workeroutput["slow_left_out"] = len(slow)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist's main process, as a worker ends: every worker collected the same tests."""
    if "slow_left_out" in getattr(node, "workeroutput", {}):
        node.config.stash[SLOW_LEFT_OUT] = node.workeroutput["slow_left_out"]


def pytest_terminal_summary(terminalreporter, config):
    if config.stash.get(SLOW_LEFT_OUT, 0):
        terminalreporter.write_line(
            f"{config.stash[SLOW_LEFT_OUT]} slow and benchmark tests left out: python -m pytest -m slow runs the "
            "slow ones (CI runs both tiers), -m benchmark the real games"
        )
