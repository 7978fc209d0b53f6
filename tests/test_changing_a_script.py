"""docs/changing_a_script.md's worked changes stay true: each diff applies to its script as it stands, copied with the
module into a folder of its own as a user copies them, and the changed copy runs eagerly and compiled, the change
seen in what it wrote."""

import math
import os
import re
import shutil
import subprocess

import pytest
import torch

from script_runs import ROOT, SCRIPTS, run_script

PAGE = os.path.join(ROOT, "docs", "changing_a_script.md")
PENDULUM = ["--env-id", "Pendulum-v1"]


def worked_changes():
    """{script: its diff}, in the page's order."""
    with open(PAGE) as f:
        diffs = re.findall(r"```diff\n(.*?)```", f.read(), re.S)
    return {re.search(r"^--- a/leanrl_scripts/(\S+)$", diff, re.M).group(1): diff for diff in diffs}


def kl_penalty_is_logged(summary):
    return math.isfinite(summary["final_metrics"]["kl_penalty"]) and summary["final_metrics"]["kl_penalty"] >= 0


def target_network_is_kept(summary):
    checkpoint = torch.load(os.path.join(summary["run_dir"], "model.pt"), weights_only=True)
    return checkpoint["target_network"].keys() == checkpoint["q_network"].keys()


def critics_have_layer_norms(summary):
    checkpoint = torch.load(os.path.join(summary["run_dir"], "model.pt"), weights_only=True)
    norms = [name for name in checkpoint["qnet"] if name.endswith("net.1.weight") or name.endswith("net.4.weight")]
    return len(norms) == 4 and all(checkpoint["qnet"][name].shape == (256,) for name in norms)


# Per changed script: a tiny run of it, and what its run shows of the change
RUNS = {
    "sac_continuous_action.py": (
        [*PENDULUM, "--total-timesteps", 400, "--learning-starts", 200, "--batch-size", 64, "--save-model"],
        critics_have_layer_norms,
    ),
    "ppo_continuous_action.py": (
        [*PENDULUM, "--total-timesteps", 1024, "--num-steps", 512, "--measure-burnin", 0],
        kl_penalty_is_logged,
    ),
    "dqn.py": (
        ["--total-timesteps", 1500, "--learning-starts", 500, "--measure-burnin", 5, "--save-model"],
        target_network_is_kept,
    ),
}


def test_every_worked_change_is_run_here():
    assert sorted(worked_changes()) == sorted(RUNS)


def changed_copy(script, folder):
    """The script and the module copied into folder/leanrl_scripts, the page's diff applied; the copy's path."""
    copies = os.path.join(folder, "leanrl_scripts")
    os.makedirs(copies)
    for name in (script, "run_bookkeeping.py"):
        shutil.copy(os.path.join(SCRIPTS, name), copies)
    applied = subprocess.run(
        ["patch", "-p1", "--fuzz=0", "--no-backup-if-mismatch"],
        input=worked_changes()[script],
        cwd=folder,
        capture_output=True,
        text=True,
    )
    assert applied.returncode == 0, applied.stdout + applied.stderr
    return os.path.join(copies, script)


@pytest.mark.parametrize(
    "script, compiled",
    [
        pytest.param(script, compiled, marks=[pytest.mark.slow] if compiled else [])
        for script in RUNS
        for compiled in (False, True)
    ],
)
def test_a_worked_change_applies_and_its_copy_runs(script, compiled, workdir):
    copy = changed_copy(script, workdir)
    args, shows_the_change = RUNS[script]
    summary, _ = run_script(copy, [*args, *(["--compile"] if compiled else []), "--eval-episodes", 1], workdir)
    assert shows_the_change(summary)
    assert summary["compile"] == compiled and summary["eval_returns"]
