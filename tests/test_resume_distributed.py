"""--checkpoint-every and --resume for the scripts of several processes, which cannot resume bit for bit (their envs'
state and their other processes' generators are not in the snapshot): a run killed with SIGKILL after its second
snapshot, then resumed with the same command, ends with exit code 0 and the whole run's steps and updates, one
TensorBoard curve (no step logged twice), a summary of the whole run (its clock and
counters went on from the snapshot); each of its processes starts from the snapshot's networks and optimizer
(tests/restore_probe records them at its first optimizer step); and no process of the killed run is left."""

import glob
import json
import os
import signal
import time

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_impala import CARTPOLE, NO_CLUSTER, REPLAY, running
from test_ppo_multigpu import TINY, assert_nothing_left_running, launch, summaries
from test_resume import scalars

import run_bookkeeping
from script_runs import ROOT, start_script

PROBE = os.path.join(ROOT, "tests", "restore_probe")


def kill_after_the_second_snapshot(proc, workdir, kill=os.kill):
    """SIGKILL, by `kill`, to the run `proc` once its folder holds two snapshots; every process it had must be gone
    within 15 s. Returns its folder and the snapshot --resume reads then."""
    deadline = time.monotonic() + 300
    while not glob.glob(os.path.join(workdir, "runs", "*", "state.prev.pt")) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        time.sleep(0.02)
    processes = [proc.pid, *run_bookkeeping._descendants(proc.pid)]
    kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 15
    while any(map(running, processes)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [pid for pid in processes if running(pid)]
    (folder,) = glob.glob(os.path.join(workdir, "runs", "*"))
    # state.pt, or the one before where the kill cut its write short (--resume then says so)
    path = next(path for name in ("state.pt", "state.prev.pt") if os.path.isfile(path := f"{folder}/{name}"))
    return folder, torch.load(path, weights_only=False), processes


def equal(got, expected):
    flat, flat_expected = (torch.utils._pytree.tree_flatten(state)[0] for state in (got, expected))
    return len(flat) == len(flat_expected) and all(
        torch.equal(torch.as_tensor(a), torch.as_tensor(b)) for a, b in zip(flat, flat_expected)
    )


def probe_folder(workdir):
    os.makedirs(folder := os.path.join(workdir, "restored"))
    return folder


def restored(workdir, snapshot, processes):
    """What each of the resumed run's `processes` that step an optimizer had at their first step (probe_folder's
    records, returned): the snapshot's network and optimizer state."""
    paths = sorted(glob.glob(os.path.join(workdir, "restored", "*.pt")))
    records = [torch.load(path, weights_only=False) for path in paths]
    assert len(records) == processes
    for record in records:
        assert equal(record["params"], list(snapshot["states"]["agent"].values())), "the network"
        assert equal(record["optimizer"], snapshot["states"]["optimizer"]["state"]), "the optimizer"
    return records


def assert_one_curve(folder, steps):
    """Every loss logged once at each of `steps`, in order: the killed run's scalars past its snapshot are gone."""
    tags = [tag for tag in EventAccumulator(folder).Reload().Tags()["scalars"] if tag.startswith("losses/")]
    assert tags
    for tag in tags:
        assert [step for step, _ in scalars(folder, tag)] == steps, tag


# the multi-process PPO: 20 iterations of 64 steps, a snapshot every 2
FLAGS = [*TINY, "--total-timesteps", 1280, "--checkpoint-every", 128]


def kill_every_group(pid, signum):
    """`signum` to the process group of `pid` and of each process it started, each a group of its own (setsid)."""
    for group in {os.getpgid(process) for process in [pid, *run_bookkeeping._descendants(pid)]}:
        os.killpg(group, signum)


@pytest.mark.slow  # one torchrun launch of two processes: 16-21 s here
def test_the_multi_process_ppo_stops_with_its_launcher_killed_hard(workdir):
    """SIGKILL to torchrun alone: its processes, each in a process group of its own, would train on unseen; Linux sends
    them a SIGTERM as it dies (PR_SET_PDEATHSIG), and they stop within seconds, the first with the summary of the
    steps done."""
    folder, snapshot, _ = kill_after_the_second_snapshot(launch(FLAGS, workdir), workdir, os.killpg)
    stopped = json.load(open(os.path.join(folder, "summary.json")))
    assert stopped["stopped"] and stopped["steps_done"] < 1280 and snapshot["step"] >= 128


@pytest.mark.slow  # two torchrun launches of two processes: 38-58 s here
def test_the_multi_process_ppo_killed_hard_resumes_from_its_last_snapshot(workdir):
    """Both processes restore the snapshot (the second reads it too); the learning rate is annealed over the whole
    run from the restored iteration."""
    # every process at once, as a lost machine: torchrun starts each in a process group of its own
    folder, snapshot, processes = kill_after_the_second_snapshot(launch(FLAGS, workdir), workdir, kill_every_group)
    assert len(processes) == 3 and snapshot["step"] >= 128  # the launcher and its two processes
    assert not os.path.exists(os.path.join(folder, "summary.json"))

    probe = {"PYTHONPATH": PROBE, "LEANRL_PROBE_RESTORED": probe_folder(workdir)}
    proc = launch([*FLAGS, "--resume", folder], workdir, env=probe)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    restored(workdir, snapshot, processes=2)
    [summary] = summaries(workdir)
    assert summary["steps_done"] == 1280 and summary["num_updates"] == 20 * 2
    assert summary["steady_steps"] == 1280 - 64 and summary["total_seconds"] > snapshot["clock"]["total"]
    assert_one_curve(folder, list(range(64, 1281, 64)))
    rates = [rate for _, rate in scalars(folder, "charts/learning_rate")]  # annealed over the whole run
    assert rates == pytest.approx([2.5e-4 * (1 - iteration / 20) for iteration in range(20)], rel=1e-6)
    assert_nothing_left_running(workdir)


@pytest.mark.slow  # two runs of Ray and its actors: 76-91 s here
def test_impala_killed_hard_resumes_from_its_last_snapshot_with_its_replay(workdir):
    """The driver killed: the script's reaper ends the local Ray it started (its actors too); the resumed run starts
    Ray and its actors again, the learner's networks, optimizer and LASER replay as the snapshot left them."""
    pytest.importorskip("ray")
    # each update: 8 fresh unrolls of 20 steps, 8 replayed; 30 updates, a snapshot every 6
    flags = [*CARTPOLE, *REPLAY, "--total-timesteps", 4800, "--checkpoint-every", 960, "--eval-episodes", 0]
    proc = start_script("impala_ray.py", flags, workdir, env=NO_CLUSTER)
    folder, snapshot, processes = kill_after_the_second_snapshot(proc, workdir)
    assert len(processes) >= 6 and snapshot["step"] >= 960  # the driver, Ray's GCS, raylet, agents, actors, reaper
    assert not os.path.exists(os.path.join(folder, "summary.json"))

    env = {**NO_CLUSTER, "PYTHONPATH": os.pathsep.join([PROBE, ROOT]), "LEANRL_PROBE_RESTORED": probe_folder(workdir)}
    proc = start_script("impala_ray.py", [*flags, "--resume", folder], workdir, env=env)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    (record,) = restored(workdir, snapshot, processes=1)  # the learner's (the actors step no optimizer)
    # the replay at the first update: the snapshot's, but for the 8 fresh unrolls just added at its cursor
    saved, replay = snapshot["states"]["replay"], record["replay"]
    fresh = (saved["cursor"] + torch.arange(8)) % 24
    kept = torch.ones(24, dtype=torch.bool)
    kept[fresh] = False
    assert saved["size"] > 0 and replay["cursor"] == (saved["cursor"] + 8) % 24
    assert replay["size"] == min(saved["size"] + 8, 24)
    for stored, expected in zip(replay["storage"], saved["storage"]):
        assert torch.equal(stored[:, kept], expected[:, kept])
    assert (replay["host_dones"][:, kept.numpy()] == saved["host_dones"][:, kept.numpy()]).all()

    summary = json.load(open(os.path.join(folder, "summary.json")))
    assert summary["steps_done"] == 4800 and summary["num_updates"] == 30
    assert summary["steady_steps"] == 4800 - 3 * 160 and summary["total_seconds"] > snapshot["clock"]["total"]
    # the resumed actors act with the restored weights, under the update count they were published at
    lags = dict(scalars(folder, "charts/policy_lag"))
    assert lags[snapshot["step"] + 160] == 0 and len(snapshot["loop"]["lags"]) == snapshot["step"] // 80
    assert_one_curve(folder, list(range(160, 4801, 160)))
