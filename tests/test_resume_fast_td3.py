"""fast_td3.py's --checkpoint-every and --resume: a run killed hard (SIGKILL) after its second snapshot and resumed ends
with the weights, the optimizers, the normaliser, the counters, the returns and the TensorBoard scalars of the run never
stopped, eager, the same seed, bit for bit."""

import glob
import os
import signal
import time

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_resume import assert_same_model, resume, scalars

from script_runs import run_script, start_script

SCRIPT = "fast_td3.py"
# 2 Pendulum envs, 300 steps each: the snapshots at steps 100 (before the first update) and 200 (50 steps of the envs
# of updates later), the end of each env's first episode after them
FLAGS = ["--env-id", "Pendulum-v1", "--num-envs", 2, "--total-timesteps", 600, "--learning-starts", 100]
FLAGS += ["--batch-size", 64, "--critic-hidden-dim", 64, "--actor-hidden-dim", 32, "--measure-burnin", 5]
FLAGS += ["--checkpoint-every", 100, "--eval-episodes", 0, "--save-model"]


def killed_after_its_second_snapshot(workdir):
    """A run of FLAGS killed with SIGKILL once its folder holds two snapshots: its folder."""
    proc = start_script(SCRIPT, FLAGS, workdir)
    deadline = time.monotonic() + 300
    while not glob.glob(os.path.join(workdir, "runs", "*", "state.prev.pt")) and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    (folder,) = glob.glob(os.path.join(workdir, "runs", "*"))
    assert proc.returncode == -signal.SIGKILL and not os.path.exists(os.path.join(folder, "summary.json"))
    return folder


def test_a_run_killed_hard_resumes_to_the_run_never_stopped(workdir):
    for side in ("never_stopped", "killed"):
        os.makedirs(os.path.join(workdir, side))
    expected, _ = run_script(SCRIPT, FLAGS, os.path.join(workdir, "never_stopped"))
    folder = killed_after_its_second_snapshot(os.path.join(workdir, "killed"))
    last = next(
        os.path.join(folder, name) for name in ("state.pt", "state.prev.pt") if os.path.isfile(f"{folder}/{name}")
    )
    assert torch.load(last, weights_only=False)["step"] >= 100  # killed mid-write: the one before, and a line
    proc, summary = resume(folder, workdir, FLAGS, SCRIPT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("resuming from state.prev.pt" in proc.stderr) == last.endswith("prev.pt"), proc.stderr
    assert_same_model(folder, expected["run_dir"])
    for key in ("steps_done", "return_mean", "critic_updates", "actor_updates", "final_metrics"):
        assert summary[key] == expected[key], key
    # one curve: the killed run's scalars past its snapshot are gone
    tags = EventAccumulator(expected["run_dir"]).Reload().Tags()["scalars"]
    assert {"losses/qf_loss", "losses/actor_loss"} <= set(tags)
    for tag in ["charts/episodic_return", *(tag for tag in tags if tag.startswith("losses/"))]:
        assert scalars(folder, tag) == scalars(expected["run_dir"], tag), tag
