"""--checkpoint-every and --resume: a run killed hard (SIGKILL) after a snapshot and resumed ends with the weights, the
returns and the TensorBoard scalars of the run never stopped, eager, the same seed, bit for bit; and what --resume
refuses, in one line."""

import glob
import json
import os
import signal
import time

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from script_runs import run_script, start_script

# DQN on CartPole: 6,000 steps, a snapshot every 1,000, an update every 10 steps from step 500
DQN = ["--total-timesteps", 6000, "--learning-starts", 500, "--eval-episodes", 0, "--save-model"]
SNAPSHOTS = [*DQN, "--checkpoint-every", 1000]


def resume(folder, workdir, flags=SNAPSHOTS, script="dqn.py"):
    """`script` --resume `folder` with `flags`: its completed process, and the summary it wrote there (None if none)."""
    _, proc = run_script(script, [*flags, "--resume", folder], workdir, check=False)
    path = os.path.join(folder, "summary.json")
    return proc, json.load(open(path)) if proc.returncode == 0 else None


def weights(folder):
    return torch.load(os.path.join(folder, "model.pt"), map_location="cpu")["q_network"]


def scalars(folder, tag):
    """(step, value) of every `tag` event in the folder's event files, in the order TensorBoard reads them."""
    events = EventAccumulator(folder, size_guidance={"scalars": 0})
    events.Reload()
    return [(event.step, event.value) for event in events.Scalars(tag)]


def killed_after_a_snapshot(workdir, snapshots=2):
    """A snapshotting run killed with SIGKILL once its folder holds `snapshots` of them (state.prev.pt for two):
    its folder."""
    proc = start_script("dqn.py", SNAPSHOTS, workdir)
    name = "state.prev.pt" if snapshots == 2 else "state.pt"
    deadline = time.monotonic() + 120
    while not glob.glob(os.path.join(workdir, "runs", "*", name)) and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    (folder,) = glob.glob(os.path.join(workdir, "runs", "*"))
    assert proc.returncode == -signal.SIGKILL and not os.path.exists(os.path.join(folder, "summary.json"))
    return folder


@pytest.fixture(scope="module")
def never_stopped(tmp_path_factory):
    summary, _ = run_script("dqn.py", SNAPSHOTS, tmp_path_factory.mktemp("never_stopped"))
    return summary


def test_a_run_killed_hard_resumes_to_the_run_never_stopped(never_stopped, workdir):
    folder = killed_after_a_snapshot(workdir)
    step = torch.load(os.path.join(folder, "state.pt"), weights_only=False)["step"]
    assert 2000 <= step < 6000
    proc, summary = resume(folder, workdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = weights(never_stopped["run_dir"])
    assert all(torch.equal(value, expected[name]) for name, value in weights(folder).items())
    for key in ("steps_done", "return_mean", "num_updates", "final_metrics", "replay_ratio_achieved"):
        assert summary[key] == never_stopped[key], key
    for tag in (
        "losses/td_loss",
        "charts/episodic_return",
    ):  # one curve: the killed run's scalars past the snapshot gone
        assert scalars(folder, tag) == scalars(never_stopped["run_dir"], tag), tag


def test_a_damaged_snapshot_resumes_from_the_one_before_and_says_so(never_stopped, workdir):
    folder = killed_after_a_snapshot(workdir)
    path = os.path.join(folder, "state.pt")
    with open(path, "r+b") as f:  # cut short, as a write the machine did not finish
        f.truncate(os.path.getsize(path) // 2)
    proc, summary = resume(folder, workdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "warning: --resume: state.pt is damaged (" in proc.stderr and "resuming from state.prev.pt" in proc.stderr
    expected = weights(never_stopped["run_dir"])
    assert all(torch.equal(value, expected[name]) for name, value in weights(folder).items())
    assert summary["return_mean"] == never_stopped["return_mean"]


def assert_refused(proc, message):
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: --") and message in lines[0], (
        proc.stderr
    )


@pytest.fixture(scope="module")
def snapshotted(tmp_path_factory):
    """A finished run's folder, with its last snapshot (step 5,000)."""
    summary, _ = run_script("dqn.py", SNAPSHOTS, tmp_path_factory.mktemp("snapshotted"))
    return summary["run_dir"]


@pytest.mark.parametrize(
    "script, flags, message",
    [
        ("dqn.py", [*SNAPSHOTS, "--env-id", "Acrobot-v1"], "is a run of dqn on CartPole-v1, not dqn on Acrobot-v1"),
        ("dqn.py", [*SNAPSHOTS, "--learning-rate", 0.001], "trained with --learning-rate 0.00025, not 0.001"),
        ("dqn.py", [*SNAPSHOTS, "--load-model", "model.pt"], "--resume continues a run, --load-model starts one"),
        ("pqn.py", ["--total-timesteps", 512], "is a run of dqn on CartPole-v1, not pqn on CartPole-v1"),
    ],
)
def test_resume_refuses_another_run_in_one_line(snapshotted, script, flags, message, workdir):
    if "--load-model" in flags:
        open(os.path.join(workdir, "model.pt"), "wb").close()
    proc, _ = resume(snapshotted, workdir, flags, script)
    assert_refused(proc, message)


def test_resume_refuses_a_folder_without_a_snapshot_a_read_only_one_and_two_damaged_ones(snapshotted, workdir):
    proc, _ = resume(str(workdir), workdir)
    assert_refused(proc, f"--resume: no state.pt in {workdir}")
    if os.geteuid() != 0:  # root writes anywhere
        os.chmod(snapshotted, 0o555)
        try:
            proc, _ = resume(snapshotted, workdir)
        finally:
            os.chmod(snapshotted, 0o755)
        assert_refused(proc, "is read-only")
    for name in ("state.pt", "state.prev.pt"):
        with open(os.path.join(snapshotted, name), "r+b") as f:
            f.truncate(100)
    proc, _ = resume(snapshotted, workdir)
    assert_refused(proc, "state.pt is damaged (")
    assert "state.prev.pt is damaged (" in proc.stderr and "nothing to resume from" in proc.stderr


def test_a_script_that_keeps_no_run_state_refuses_the_flags(workdir):
    _, proc = run_script("pqn.py", ["--total-timesteps", 512, "--checkpoint-every", 128], workdir, check=False)
    assert_refused(proc, "--checkpoint-every and --resume: this script does not keep its run's whole state")
