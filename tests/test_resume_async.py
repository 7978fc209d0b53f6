"""--checkpoint-every and --resume in the async scripts, which cannot resume bit for bit (an actor process, envpool's
async envs: thread timing decides what they play): a run killed hard (SIGKILL) after its second snapshot leaves no
process behind, and resumed, it restarts its processes from that snapshot and finishes the run: its step count, one
TensorBoard curve, a summary of the whole run, and the networks it resumed with the snapshot's, bit for bit."""

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import run_bookkeeping
from script_runs import ROOT, SCRIPTS, STANDIN, run_script, start_script

CARTPOLE = ["--env-id", "CartPole-v1", "--learning-rate", 2.5e-4, "--batch-size", 128, "--train-frequency", 10]
# 6,000 steps of one env, 500 before learning: 550 updates, logged every 100 and at the end
DQN = [*CARTPOLE, "--total-timesteps", 6000, "--learning-starts", 500, "--buffer-size", 10_000]
DQN += ["--checkpoint-every", 1000, "--eval-episodes", 0, "--save-model"]
# 8 rollouts of 4 envs x 32 steps on the stand-in's Cue-v5 (a game every 32 steps), 4 updates each
PPO = ["--env-id", "Cue-v5", "--num-envs", 4, "--num-steps", 32, "--num-minibatches", 2, "--update-epochs", 2]
PPO += ["--total-timesteps", 1024, "--checkpoint-every", 128, "--eval-episodes", 0, "--save-model"]
ON_STANDIN = {"PYTHONPATH": os.pathsep.join([STANDIN, ROOT])}


def running(pid):  # an exited process not yet reaped (a zombie) does not count
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def killed_after_the_second_snapshot(script, flags, workdir, env=None):
    """`script` killed with SIGKILL once its folder holds two snapshots, its actor processes frozen (SIGSTOP) first, so
    that only the kernel can end them: an actor that looks for its learner now and then never looks again. Returns the
    run folder and the processes the run had started that outlived it by 10 s (killed then). With no `env`, a fresh
    interpreter, as a user starts it: a run the script server forks has its spawned processes forked there too."""
    if env is None:
        command = [sys.executable, os.path.join(SCRIPTS, script), *map(str, flags)]
        env = {**os.environ, "PYTHONPATH": ROOT}
        with open(os.path.join(workdir, "stderr.txt"), "w") as stderr:
            proc = subprocess.Popen(command, cwd=workdir, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
    else:
        proc = start_script(script, flags, workdir, env=env)
    deadline = time.monotonic() + 120
    while len(glob.glob(os.path.join(workdir, "runs", "*", "state*.pt"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before its second snapshot"
    started = run_bookkeeping._descendants(proc.pid)
    for pid in started:
        with open(f"/proc/{pid}/cmdline") as f:
            if "multiprocessing.spawn" in f.read():
                os.kill(pid, signal.SIGSTOP)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL  # not communicate(): a live actor holds the pipes
    deadline = time.monotonic() + 10
    while any(map(running, started)) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in started if running(pid)]
    for pid in left:  # not beside the tests that follow
        os.kill(pid, signal.SIGKILL)
    (folder,) = glob.glob(os.path.join(workdir, "runs", "*"))
    assert not os.path.exists(os.path.join(folder, "summary.json"))
    return folder, left


def the_snapshot(folder):
    """The snapshot --resume goes on from: state.pt, or state.prev.pt where the kill cut state.pt's write short."""
    path = os.path.join(folder, "state.pt")
    return torch.load(path if os.path.isfile(path) else path.replace(".pt", ".prev.pt"), weights_only=False)


def assert_resumes_with_the_snapshots_networks(script, flags, folder, snapshot, total, names, workdir, env=None):
    """A copy of the killed run resumed with nothing left to do (--total-timesteps `total`): its model.pt holds the
    networks and optimizer (`names`) the resumed run starts from; they must be the snapshot's, bit for bit."""
    copy = shutil.copytree(folder, os.path.join(workdir, "copy"))
    _, proc = run_script(script, [*flags, "--resume", copy, "--total-timesteps", total], workdir, False, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = torch.load(os.path.join(copy, "model.pt"), map_location="cpu")
    for name in names:  # an optimizer's moments and counts (its learning rate is the schedule's, set each iteration)
        got, saved = (state.get("state", state) for state in (model[name], snapshot["states"][name]))
        got, saved = (torch.utils._pytree.tree_flatten(state)[0] for state in (got, saved))
        assert len(got) == len(saved) and all(
            torch.equal(a, b) if torch.is_tensor(a) else a == b for a, b in zip(got, saved)
        ), name


def steps(folder, tag):
    events = EventAccumulator(folder, size_guidance={"scalars": 0})
    events.Reload()
    return [event.step for event in events.Scalars(tag)]


def assert_a_summary_of_the_whole_run(summary, snapshot):
    """The clock went on from the snapshot's: the steady phase began in the killed run, the seconds include its."""
    steady_seconds, steady_step = snapshot["clock"]["steady"]
    assert summary["steady_steps"] == summary["steps_done"] - steady_step
    assert summary["steady_seconds"] > steady_seconds and summary["total_seconds"] > snapshot["clock"]["total"]
    assert summary["return_mean"] is not None and summary["stopped"] is None


def resumed(script, flags, folder, workdir, env=None):
    """`script` --resume `folder`: the summary it wrote there."""
    _, proc = run_script(script, [*flags, "--resume", folder], workdir, False, env=env)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    with open(os.path.join(folder, "summary.json")) as f:
        return json.load(f)


def test_the_async_dqn_killed_hard_leaves_no_actor_and_resumes_from_its_snapshot(workdir):
    """The learner killed at once: its actor dies with it (frozen, it could not have noticed by itself). Resumed, the
    learner's networks are the snapshot's, the actor plays on from the snapshot's step (6,000 steps in all, not more),
    the learner ends at its 550th update, and each curve reads once: the killed run's events past the snapshot gone."""
    folder, left = killed_after_the_second_snapshot("dqn_atari_async.py", DQN, workdir)
    assert left == [], "the actor outlived its learner"
    snapshot = the_snapshot(folder)
    loop = snapshot["loop"]
    assert loop["inserts"] >= 2000 and loop["num_updates"] > 0 and snapshot["step"] <= loop["inserts"]
    # the learner's updates end at the snapshot's: 500 steps before learning, one update every 10 steps
    total = 500 + 10 * loop["num_updates"]
    names = ["q_network", "optimizer"]
    assert_resumes_with_the_snapshots_networks("dqn_atari_async.py", DQN, folder, snapshot, total, names, workdir)

    summary = resumed("dqn_atari_async.py", DQN, folder, workdir)
    assert summary["steps_done"] == 6000 and summary["num_updates"] == 550
    assert summary["replay_ratio_achieved"] == 550 * 128 / (6000 - 500)
    assert_a_summary_of_the_whole_run(summary, snapshot)
    logged = steps(folder, "losses/td_loss")  # every 100 updates and at the end
    assert len(logged) == 6 and logged == sorted(set(logged)) and logged[-1] == 6000
    assert logged[0] < snapshot["step"] < logged[-2]  # the killed run's first, the resumed run's last
    episodes = steps(folder, "charts/episodic_return")  # one env: a step ends one episode at most
    assert episodes == sorted(set(episodes)) and episodes[0] < snapshot["step"] < episodes[-1] <= 6000


def test_the_async_ppo_killed_hard_resumes_from_its_snapshot(workdir):
    """Resumed, the networks are the snapshot's, the rollouts go on from its iteration (8 in all, 4 updates each), the
    envs in new games; its steps: the snapshot's and at least the rollouts' since (each env's first row of a rollout
    is no step; rows past a rollout, up to num_steps of them, carry into the next), one curve."""
    folder, left = killed_after_the_second_snapshot("ppo_atari_envpool_async.py", PPO, workdir, ON_STANDIN)
    assert left == []
    snapshot = the_snapshot(folder)
    loop = snapshot["loop"]
    assert loop["iteration"] >= 2 and loop["global_step"] == snapshot["step"] >= 256
    names = ["agent", "optimizer"]
    total = loop["iteration"] * 128
    assert_resumes_with_the_snapshots_networks(
        "ppo_atari_envpool_async.py", PPO, folder, snapshot, total, names, workdir, ON_STANDIN
    )

    summary = resumed("ppo_atari_envpool_async.py", PPO, folder, workdir, ON_STANDIN)
    rollouts_since = (8 - loop["iteration"]) * 128
    assert 0 <= summary["steps_done"] - snapshot["step"] - rollouts_since <= 4 * 32
    assert summary["num_updates"] == 8 * 4
    assert_a_summary_of_the_whole_run(summary, snapshot)
    logged = steps(folder, "losses/policy_loss")  # each rollout's, the end's not again at the last one's step
    assert len(logged) == 8 and logged == sorted(set(logged)) and logged[-1] == summary["steps_done"]
    assert logged[0] < snapshot["step"] < logged[-1]
    episodes = steps(folder, "charts/episodic_return")  # two envs can end a game at the same step
    assert episodes == sorted(episodes) and episodes[0] < snapshot["step"] < episodes[-1]
