"""--checkpoint-every and --resume on PQN and on the envpool scripts. pqn.py's gymnasium envs are kept in its
snapshot: killed with SIGKILL after a snapshot and resumed, it ends bit for bit as the run never stopped. Envpool's
games cannot be saved mid-episode: a resumed ppo_atari_envpool.py, pqn_atari_envpool.py or ppo_atari_lstm.py plays new
games from its snapshot on (seeded with the run's seed plus the step, the LSTM's state zero as at a game's start). It
goes on from the snapshot's networks, optimizer, counters and schedules, on one curve, but cannot end with the weights
of the run never stopped: on these tiny runs of the stand-in's Cue-v5 (tests/standin/envpool.py) they were 0.01%
(pqn_atari_envpool.py), 0.31% (ppo_atari_lstm.py) and 0.69% (ppo_atari_envpool.py) apart (the difference's L2 norm
over the weights'), 27-100% of what the steps after the snapshot moved them; the test prints both figures."""

import glob
import json
import os
import shutil
import signal
import time

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_resume import assert_same_model, scalars

from script_runs import ROOT, STANDIN, run_script, start_script

ON_STANDIN = {"PYTHONPATH": os.pathsep.join([STANDIN, ROOT])}
CUE = ["--env-id", "Cue-v5", "--num-envs", 4, "--num-minibatches", 2, "--update-epochs", 1, "--num-steps", 32]
CUE += ["--total-timesteps", 1024, "--checkpoint-every", 256]
# Each run: a few snapshots, a second one before half the run; with its env (None: gymnasium's)
RUNS = {
    "pqn.py": (["--total-timesteps", 8192, "--checkpoint-every", 1024], None),
    "ppo_atari_envpool.py": (CUE, ON_STANDIN),
    "pqn_atari_envpool.py": (CUE, ON_STANDIN),
    "ppo_atari_lstm.py": ([*CUE, "--num-steps", 16, "--total-timesteps", 512, "--checkpoint-every", 128], ON_STANDIN),
}
RUNS = {script: ([*flags, "--eval-episodes", 0, "--save-model"], env) for script, (flags, env) in RUNS.items()}
ENVPOOL_SCRIPTS = [script for script in RUNS if script != "pqn.py"]


def resume(script, folder, workdir, flags=None):
    """`script` --resume `folder` (with RUNS' flags unless `flags`): its summary."""
    given, env = RUNS[script]
    _, proc = run_script(script, [*(flags or given), "--resume", folder], workdir, check=False, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.load(open(os.path.join(folder, "summary.json")))


def killed_after_a_snapshot(script, workdir):
    """A run of `script` killed with SIGKILL once its folder holds two snapshots: its folder and the snapshot that
    --resume reads (state.pt; state.prev.pt if the kill cut state.pt's write short)."""
    flags, env = RUNS[script]
    proc = start_script(script, flags, workdir, env=env)
    deadline = time.monotonic() + 300
    while not glob.glob(os.path.join(workdir, "runs", "*", "state.prev.pt")) and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    (folder,) = glob.glob(os.path.join(workdir, "runs", "*"))
    assert proc.returncode == -signal.SIGKILL and not os.path.exists(os.path.join(folder, "summary.json"))
    (path,) = [path for path in (f"{folder}/state.pt", f"{folder}/state.prev.pt") if os.path.isfile(path)][:1]
    return folder, torch.load(path, weights_only=False)


@pytest.fixture(scope="module")
def never_stopped(tmp_path_factory):
    """Each script's run of RUNS to its end, made when a test first asks for it."""
    runs = {}

    def run(script):
        if script not in runs:
            flags, env = RUNS[script]
            runs[script] = run_script(script, flags, tmp_path_factory.mktemp("never_stopped"), env=env)[0]
        return runs[script]

    return run


def loss_tags(folder):
    return [tag for tag in EventAccumulator(folder).Reload().Tags()["scalars"] if tag.startswith("losses/")]


def test_pqn_killed_hard_resumes_to_the_run_never_stopped(never_stopped, workdir):
    folder, _ = killed_after_a_snapshot("pqn.py", workdir)
    summary, expected = resume("pqn.py", folder, workdir), never_stopped("pqn.py")
    assert_same_model(folder, expected["run_dir"])
    for key in ("steps_done", "return_mean", "num_updates", "final_metrics"):
        assert summary[key] == expected[key], key
    for tag in ["charts/episodic_return", "charts/epsilon", "charts/learning_rate", *loss_tags(expected["run_dir"])]:
        assert scalars(folder, tag) == scalars(expected["run_dir"], tag), tag


def up_to(step, events):
    return [event for event in events if event[0] <= step]


def flat_weights(folder, name):
    return torch.cat([p.flatten() for p in torch.load(os.path.join(folder, "model.pt"))[name].values()])


@pytest.mark.parametrize("script", ENVPOOL_SCRIPTS)
def test_an_envpool_run_killed_hard_resumes_on_new_games_on_one_curve(script, never_stopped, workdir):
    folder, snapshot = killed_after_a_snapshot(script, workdir)
    step, expected = snapshot["step"], never_stopped(script)
    # resumed up to the snapshot's own step, a copy of the run saves the networks and the optimizer it restored
    at_snapshot = shutil.copytree(folder, os.path.join(workdir, "at_snapshot"))
    resume(script, at_snapshot, workdir, [*RUNS[script][0], "--total-timesteps", step])
    restored = torch.load(os.path.join(at_snapshot, "model.pt"))
    names = restored.keys() & snapshot["states"].keys()  # the networks and the optimizer
    assert len(names) == 2
    for name in names:  # an optimizer's settings are the script's (its learning rate): its state compared
        states = (restored[name], snapshot["states"][name])
        flat, flat_saved = (torch.utils._pytree.tree_flatten(state.get("state", state))[0] for state in states)
        assert all(torch.equal(a, b) if torch.is_tensor(a) else a == b for a, b in zip(flat, flat_saved, strict=True))

    summary = resume(script, folder, workdir)
    counters = ("steps_done", "num_updates", "steady_steps", "real_steps")
    assert [summary.get(key) for key in counters] == [expected.get(key) for key in counters]
    assert summary["total_seconds"] > snapshot["clock"]["total"]  # the clock goes on from the snapshot's
    # one curve: each step once, up to the snapshot the run never stopped's; the learning rate's schedule kept
    for tag in loss_tags(expected["run_dir"]):
        got, theirs = scalars(folder, tag), scalars(expected["run_dir"], tag)
        assert [s for s, _ in got] == [s for s, _ in theirs] and up_to(step, got) == up_to(step, theirs), tag
    assert scalars(folder, "charts/learning_rate") == scalars(expected["run_dir"], "charts/learning_rate")
    episodes, theirs = scalars(folder, "charts/episodic_return"), scalars(expected["run_dir"], "charts/episodic_return")
    assert [s for s, _ in episodes] == sorted(s for s, _ in episodes) and episodes[-1][0] > step
    assert up_to(step, episodes) == up_to(step, theirs)

    # new games after the resume: other weights than the run never stopped's, as far as the steps after it moved them
    name = next(iter(snapshot["states"]))
    final, final_expected = flat_weights(folder, name), flat_weights(expected["run_dir"], name)
    at_resume = torch.cat([p.flatten() for p in snapshot["states"][name].values()])
    distance, moved = (final - final_expected).norm(), (final_expected - at_resume).norm()
    apart = distance / final_expected.norm()
    print(f"{script} resumed at {step}: final weights {apart:.2%} apart, {distance / moved:.0%} of the move")
    assert 0 < apart < 0.05 and distance < 2 * moved
