"""--checkpoint-every and --resume: a run killed hard (SIGKILL) after a snapshot and resumed ends with the weights, the
returns and the TensorBoard scalars of the run never stopped, eager, the same seed, bit for bit; and what --resume
refuses, in one line."""

import glob
import json
import os
import shutil
import signal
import time

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from script_runs import ROOT, SCRIPTS, run_script, start_script

# Each script with its run state kept: a run of a few snapshots, an update at every step from early on
CONTINUOUS = ["--env-id", "Pendulum-v1", "--total-timesteps", 2000, "--learning-starts", 500, "--batch-size", 64]
RUNS = {
    "dqn.py": ["--total-timesteps", 6000, "--learning-starts", 500, "--checkpoint-every", 1000],
    "sac_continuous_action.py": [*CONTINUOUS, "--checkpoint-every", 500],
    "td3_continuous_action.py": [*CONTINUOUS, "--checkpoint-every", 500],
    # Batch Renormalization's running statistics and step counts, buffers of the snapshot's networks
    "crossq.py": [*CONTINUOUS, "--critic-hidden-dim", 64, "--checkpoint-every", 500],
    "ppo_continuous_action.py": ["--env-id", "Pendulum-v1", "--total-timesteps", 4096, "--num-steps", 256]
    + ["--checkpoint-every", 1024],
    # MuJoCo's physics and generator, which gymnasium's pickling of its envs leaves out; Hopper's falls end episodes
    "td3_continuous_action.py on Hopper-v5": ["--env-id", "Hopper-v5", *CONTINUOUS[2:], "--checkpoint-every", 500],
}
RUNS = {script: [*flags, "--eval-episodes", 0, "--save-model"] for script, flags in RUNS.items()}
SNAPSHOTS = RUNS["dqn.py"]


def resume(folder, workdir, flags=SNAPSHOTS, script="dqn.py"):
    """`script` --resume `folder` with `flags`: its completed process, and the summary it wrote there (None if none)."""
    _, proc = run_script(script, [*flags, "--resume", folder], workdir, check=False)
    path = os.path.join(folder, "summary.json")
    return proc, json.load(open(path)) if proc.returncode == 0 else None


def assert_same_model(folder, expected_folder):
    """model.pt's every network and optimizer state equal, bit for bit."""
    got, expected = (torch.load(os.path.join(f, "model.pt"), map_location="cpu") for f in (folder, expected_folder))
    assert got.keys() == expected.keys()
    for name in (name for name in expected if name != "args"):
        flat, flat_expected = (torch.utils._pytree.tree_flatten(state)[0] for state in (got[name], expected[name]))
        assert len(flat) == len(flat_expected) and all(
            torch.equal(a, b) if torch.is_tensor(a) else a == b for a, b in zip(flat, flat_expected)
        ), name


def scalars(folder, tag):
    """(step, value) of every `tag` event in the folder's event files, in the order TensorBoard reads them."""
    events = EventAccumulator(folder, size_guidance={"scalars": 0})
    events.Reload()
    return [(event.step, event.value) for event in events.Scalars(tag)]


def killed_after_a_snapshot(workdir, run="dqn.py", flags=None, env=None):
    """A run of RUNS (or of `flags`) killed with SIGKILL once its folder holds two snapshots: its folder."""
    proc = start_script(run.split()[0], RUNS[run] if flags is None else flags, workdir, env=env)
    deadline = time.monotonic() + 300
    while not glob.glob(os.path.join(workdir, "runs", "*", "state.prev.pt")) and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    (folder,) = glob.glob(os.path.join(workdir, "runs", "*"))
    assert proc.returncode == -signal.SIGKILL and not os.path.exists(os.path.join(folder, "summary.json"))
    return folder


@pytest.fixture(scope="module")
def never_stopped(tmp_path_factory):
    """Each script's run of RUNS to its end, made when a test first asks for it."""
    runs = {}

    def run(name):
        if name not in runs:
            runs[name] = run_script(name.split()[0], RUNS[name], tmp_path_factory.mktemp("never_stopped"))[0]
        return runs[name]

    return run


@pytest.mark.parametrize("run", RUNS)
def test_a_run_killed_hard_resumes_to_the_run_never_stopped(run, never_stopped, workdir):
    if "Hopper" in run:
        pytest.importorskip("mujoco")
    folder = killed_after_a_snapshot(workdir, run)
    every = RUNS[run][RUNS[run].index("--checkpoint-every") + 1]
    (last,) = [
        os.path.join(folder, name) for name in ("state.pt", "state.prev.pt") if os.path.isfile(f"{folder}/{name}")
    ][:1]
    assert torch.load(last, weights_only=False)["step"] >= every  # killed mid-write: the one before, and a line
    proc, summary = resume(folder, workdir, RUNS[run], run.split()[0])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("resuming from state.prev.pt" in proc.stderr) == last.endswith("prev.pt"), proc.stderr
    expected = never_stopped(run)
    assert_same_model(folder, expected["run_dir"])
    for key in ("steps_done", "return_mean", "num_updates", "final_metrics"):
        assert summary[key] == expected[key], key
    # one curve: the killed run's scalars past its snapshot are gone
    tags = EventAccumulator(expected["run_dir"]).Reload().Tags()["scalars"]
    for tag in ["charts/episodic_return", *(tag for tag in tags if tag.startswith("losses/"))]:
        assert scalars(folder, tag) == scalars(expected["run_dir"], tag), tag


def test_a_damaged_snapshot_resumes_from_the_one_before_and_says_so(never_stopped, workdir):
    folder = killed_after_a_snapshot(workdir)
    path = os.path.join(folder, "state.pt")
    if not os.path.exists(path):  # killed while writing it
        shutil.copy(os.path.join(folder, "state.prev.pt"), path)
    with open(path, "r+b") as f:  # cut short, as a write the machine did not finish
        f.truncate(os.path.getsize(path) // 2)
    proc, summary = resume(folder, workdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "warning: --resume: state.pt is damaged (" in proc.stderr and "resuming from state.prev.pt" in proc.stderr
    assert_same_model(folder, never_stopped("dqn.py")["run_dir"])
    assert summary["return_mean"] == never_stopped("dqn.py")["return_mean"]


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
    script = os.path.join(workdir, "keeps_no_run_state.py")  # a script that never calls run.resumable
    with open(script, "w") as f:
        f.write("import tyro\nfrom run_bookkeeping import Run, RunArgs\n\nRun(tyro.cli(RunArgs)).start()\n")
    env = {"PYTHONPATH": os.pathsep.join([SCRIPTS, ROOT])}
    _, proc = run_script(script, ["--total-timesteps", 512, "--checkpoint-every", 128], workdir, check=False, env=env)
    assert_refused(proc, "--checkpoint-every and --resume: this script does not keep its run's whole state")


def test_a_sigterm_writes_a_snapshot_at_the_step_it_stops_and_the_resumed_run_is_the_run_never_stopped(workdir):
    """A preemption notice: the run stops at its next safe point with a snapshot of that step, between two periodic
    ones, so the resumed run loses no step."""
    flags = ["--total-timesteps", 20_000, "--learning-starts", 500, "--eval-episodes", 0, "--save-model"]
    flags += ["--checkpoint-every", 1_000_000]
    for side in ("never_stopped", "stopped"):
        os.makedirs(os.path.join(workdir, side))
    expected, _ = run_script("dqn.py", flags, os.path.join(workdir, "never_stopped"))
    proc = start_script("dqn.py", flags, os.path.join(workdir, "stopped"))
    deadline = time.monotonic() + 120
    while not glob.glob(os.path.join(workdir, "stopped", "runs", "*", "events.*")) and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    proc.communicate()
    (folder,) = glob.glob(os.path.join(workdir, "stopped", "runs", "*"))
    assert proc.returncode == 128 + signal.SIGTERM
    stopped_at = torch.load(os.path.join(folder, "state.pt"), weights_only=False)["step"]
    assert 0 < stopped_at < 20_000 and json.load(open(os.path.join(folder, "summary.json")))["steps_done"] >= stopped_at
    proc, summary = resume(folder, workdir, flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_model(folder, expected["run_dir"])
    assert summary["return_mean"] == expected["return_mean"] and summary["steps_done"] == 20_000


def test_checkpoint_minutes_writes_snapshots_by_the_clock(workdir):
    """--checkpoint-minutes alone (here 30 ms): snapshots as the run goes, the last near its end."""
    flags = ["--total-timesteps", 6000, "--learning-starts", 500, "--eval-episodes", 0, "--checkpoint-minutes", 0.0005]
    summary, _ = run_script("dqn.py", flags, workdir)
    steps = [
        torch.load(os.path.join(summary["run_dir"], name), weights_only=False)["step"]
        for name in ("state.prev.pt", "state.pt")
    ]
    assert 0 < steps[0] < steps[1] <= 6000 and steps[1] >= 3000, steps
