"""Helpers shared by the tests: run a script as a subprocess and read its summary, or import its pieces."""

import glob
import importlib.util
import json
import os
import subprocess
import sys
from functools import partial

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "leanrl_scripts")
# One inductor cache for the whole session (and its subprocesses): each graph is compiled once.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(ROOT, ".torchinductor-cache"))

SUMMARY_KEYS = {
    "script", "env_id", "seed", "num_envs", "total_timesteps", "mode", "compile", "cudagraphs_requested",
    "cudagraphs_active", "device", "torch_version", "sps", "steady_steps", "steady_seconds", "warmup_seconds",
    "total_seconds", "return_mean", "eval_return_mean", "peak_memory_mb", "env_seconds",
}


def run_script(script, args, cwd, check=True, timeout=900):
    """Run leanrl_scripts/<script> in `cwd`; return (summary or None, completed process)."""
    before = set(glob.glob(os.path.join(cwd, "runs", "*")))
    env = {**os.environ, "PYTHONPATH": ROOT}  # lets gymnasium import test envs given as "tests.module:EnvId"
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, script), *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, env=env)
    if not check:
        return None, proc
    assert proc.returncode == 0, f"{script} {args} failed:\n{proc.stderr[-3000:]}"
    (run_dir,) = set(glob.glob(os.path.join(cwd, "runs", "*"))) - before
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    speed_lines = [line for line in proc.stdout.splitlines() if line.startswith("SPEED ")]
    assert speed_lines and speed_lines[-1] == proc.stdout.rstrip().splitlines()[-1], "SPEED must be the last line"
    assert json.loads(speed_lines[-1][len("SPEED "):]) == summary
    summary["run_dir"] = run_dir
    return summary, proc


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
    gae = module.speed_up(partial(module.gae, gamma=0.99, gae_lambda=0.95), compiled, False)
    advantages, returns = gae(rewards, values, dones, next_value, next_done)
    expected_advantages, expected_returns = reference_gae(rewards, values, dones, next_value, next_done, 0.99, 0.95)
    torch.testing.assert_close(advantages, expected_advantages, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(returns, expected_returns, atol=2e-5, rtol=1e-5)


def done_patterns(num_steps, batch, generator):
    """The cases the LSTM scripts' padding must get right, one (T, B) float pattern each (PPO-LSTM's dones[t]: obs t
    starts an episode; IMPALA's: step t ends one)."""
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
    loaded, _ = run_script(script, ["--total-timesteps", 0, "--eval-episodes", 0, "--load-model", checkpoint,
                                    "--save-model"], workdir)
    first, second = (torch.load(os.path.join(run["run_dir"], "model.pt"), weights_only=True) for run in (trained, loaded))
    assert first[weights].keys() == second[weights].keys()
    assert all(torch.equal(first[weights][name], second[weights][name]) for name in first[weights])
    _, proc = run_script(script, ["--env-id", "Pong-v5", "--total-timesteps", 0, "--load-model", checkpoint],
                         workdir, check=False, timeout=120)
    assert proc.returncode == 2 and "Pong-v5 has num_actions 6" in proc.stderr
