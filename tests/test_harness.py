"""The test harness itself: a runaway test fails in its place, named, under its per-test limit, and takes its
script's run with it; the learner can be broken from outside a script (`--break-learner`)."""

import os
import subprocess
import sys
import textwrap
import uuid

import torch

from script_runs import BREAK_LEARNER, ROOT, SABOTAGE, run_script

RUNAWAY = """
import sys
sys.path.insert(0, {tests!r})
from script_runs import run_script

def test_a_run_that_never_ends(tmp_path):
    run_script("dqn.py", ["--total-timesteps", 10_000_000, "--exp-name", {marker!r}], str(tmp_path))
"""


def test_a_runaway_test_fails_named_at_its_limit_and_its_run_is_ended(tmp_path):
    marker = f"runaway-{uuid.uuid4().hex}"
    (tmp_path / "test_runaway.py").write_text(RUNAWAY.format(tests=os.path.join(ROOT, "tests"), marker=marker))
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "--timeout", "8"]
    env = {**os.environ, "LEANRL_TESTS_FRESH": "1"}  # one fresh interpreter: no script server to start
    result = subprocess.run(
        [*command, "test_runaway.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1, result.stdout[-2000:]
    assert "FAILED test_runaway.py::test_a_run_that_never_ends - Failed: Timeout" in result.stdout
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    assert left.stdout == "", "the run outlived its test"


def test_the_sabotage_zeroes_the_gradients_of_every_optimizer_step():
    """tests/sabotage/sitecustomize.py in a fresh interpreter: an Adam step after a backward leaves the weights as
    they were, where without it they move."""
    code = textwrap.dedent(
        """
        import torch
        layer = torch.nn.Linear(3, 1)
        before = layer.weight.detach().clone()
        optimizer = torch.optim.Adam(layer.parameters(), lr=0.1)
        layer(torch.ones(2, 3)).sum().backward()
        optimizer.step()
        print(torch.equal(before, layer.weight.detach()))
        """
    )
    moved = {}
    for name, path in (("sabotaged", SABOTAGE), ("plain", "")):
        env = {**os.environ, "PYTHONPATH": path}
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        moved[name] = result.stdout.strip()
    assert moved == {"sabotaged": "True", "plain": "False"}


def test_under_break_learner_a_served_run_trains_without_moving_its_weights(workdir, monkeypatch):
    """dqn.py saved after 200 and after 400 updates from the same start: under the switch both Q-networks are the one
    it started from, without it they differ."""

    def q_networks():
        weights = []
        for steps in (1000, 1800):
            args = ["--total-timesteps", steps, "--learning-starts", 200, "--train-frequency", 4, "--eval-episodes", 0]
            summary, _ = run_script("dqn.py", [*args, "--save-model", "--seed", 3], workdir)
            weights.append(torch.load(os.path.join(summary["run_dir"], "model.pt"), weights_only=True)["q_network"])
        first, second = weights
        return all(torch.equal(first[name], second[name]) for name in first)

    assert not q_networks()
    monkeypatch.setenv(BREAK_LEARNER, "1")
    assert q_networks()
