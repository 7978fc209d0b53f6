"""--checkpoint-every and --resume in dqn_atari.py and rainbow_atari.py. On ALE through gymnasium a run killed hard
(SIGKILL) after a snapshot and resumed ends with the weights, the returns and the TensorBoard scalars of the run never
stopped, bit for bit: the frame storage, Rainbow's sum tree and its noise, the target network, the envs' emulators and
generators are all kept. envpool's games cannot be saved: a resumed run starts new games there, and its storage holds
no transition across the cut."""

import glob
import json
import os

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_resume import assert_same_model, killed_after_a_snapshot, scalars

from reference_implementations import plain_n_step
from script_runs import ROOT, STANDIN, load_script, run_script, start_script

pytest.importorskip("ale_py")
pytest.importorskip("envpool")
SCRIPTS = ["dqn_atari.py", "rainbow_atari.py"]
# 2 envs x 300 steps, 100 before learning, an update of 4 transitions every 8 steps (62 updates), the target copied
# every 40 steps, the storage wrapped, a game or two ended after the last snapshot (step 400; the one before at 200)
TINY = ["--total-timesteps", 600, "--learning-starts", 100, "--buffer-size", 400, "--num-envs", 2]
TINY += ["--train-frequency", 8, "--batch-size", 4, "--target-network-frequency", 40, "--measure-burnin", 5]
TINY += ["--eval-episodes", 0, "--save-model", "--checkpoint-every", 200]


def resumed(folder, flags, script, env=None):
    """The run of `folder` resumed: its summary, and the step it went on from (killed mid-write: the one before)."""
    proc = start_script(script, [*flags, "--resume", folder], os.path.dirname(os.path.dirname(folder)), env=env)
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    summary = json.load(open(os.path.join(folder, "summary.json")))
    return {**summary, "run_dir": folder}, 200 if "resuming from state.prev.pt" in stderr else 400


def losses_and_returns(folder):
    tags = EventAccumulator(folder).Reload().Tags()["scalars"]
    return [tag for tag in tags if tag.startswith("losses/") or tag == "charts/episodic_return"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_run_on_ale_killed_hard_resumes_to_the_run_never_stopped(script, workdir):
    flags = [*TINY, "--env-backend", "gymnasium"]
    expected, _ = run_script(script, flags, workdir)
    os.makedirs(os.path.join(workdir, "killed"))
    folder = killed_after_a_snapshot(os.path.join(workdir, "killed"), script, flags)
    got, _ = resumed(folder, flags, script)
    assert_same_model(folder, expected["run_dir"])
    for key in ("steps_done", "return_mean", "num_updates", "final_metrics"):
        assert got[key] == expected[key], key
    for tag in losses_and_returns(expected["run_dir"]):  # one curve: the killed run's scalars past its snapshot gone
        assert scalars(folder, tag) == scalars(expected["run_dir"], tag), tag


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_run_on_envpool_resumes_with_new_games_on_one_curve(script, workdir):
    """On envpool's stand-in (games of 32 steps): the games in play at the snapshot are cut off, their returns never
    recorded; the resumed run plays new ones to the run's last step and update, its returns on the killed run's curve
    from the snapshot on."""
    flags, env = [*TINY, "--env-id", "Cue-v5"], {"PYTHONPATH": os.pathsep.join([STANDIN, ROOT])}
    folder = killed_after_a_snapshot(workdir, script, flags, env)
    before = scalars(folder, "charts/episodic_return")
    got, resumed_from = resumed(folder, flags, script, env)
    assert got["steps_done"] == 600 and got["num_updates"] == 62
    returns = scalars(folder, "charts/episodic_return")
    assert returns[: returns.index(next(p for p in returns if p[0] > resumed_from))] == [
        point for point in before if point[0] <= resumed_from
    ]
    steps = [step for step, _ in returns]
    assert steps == sorted(steps) and steps[-1] > resumed_from + 64  # one curve, new games ended after the resume
    assert [step for step, _ in scalars(folder, "losses/td_loss")] == [600]
    # a game is 2 lives of 16 steps and the reset step between them (and the one before it, but for the first game
    # of a run or a resume): none carries the steps of a game cut off
    assert {length for _, length in scalars(folder, "charts/episodic_length")} == {33, 34}


def played_across_a_cut(script, cut=150, steps=300):
    """Random play of envpool's Breakout (2 envs) into the script's storage (300 rows a lane: no wrap), cut at `cut`
    as a resumed run cuts it: new envs of another seed, new games, rb.new_games. Returns the storage and, per lane,
    the plain stream of what the agent saw, with the cut as a truncation after step cut - 2: the row of step cut - 1
    lost its next observation, a reset step's row."""
    module = load_script(script)
    rb = module.FrameReplay(600, 2, torch.device("cpu"), *([3, 0.9] if script == "rainbow_atari.py" else []))
    envs, rng = module.make_envs("Breakout-v5", 2, 3, "envpool"), np.random.default_rng(3)
    obs, _ = envs.reset()
    stream = [dict(obs=[], rewards=[], terminations=[], ends=[]) for _ in range(2)]
    for step in range(steps):
        if step == cut:
            envs = module.make_envs("Breakout-v5", 2, 3 + cut, "envpool")
            obs, _ = envs.reset()
            rb.new_games(step)
        actions = rng.integers(0, 4, size=2, dtype=np.int32)
        next_obs, rewards, terminations, truncations, infos = envs.step(actions)
        reset = terminations | truncations
        rb.add(step, obs, actions, rewards, terminations, reset, infos["terminated"].astype(bool) | truncations)
        for lane in range(2):
            for key, value in dict(obs=obs, rewards=rewards, terminations=terminations, ends=reset).items():
                stream[lane][key].append(value[lane])
        obs = next_obs
    for lane in range(2):
        stream[lane]["ends"][cut - 2], stream[lane]["ends"][cut - 1] = True, False
    return rb, stream


def test_frame_storage_holds_no_transition_across_the_cut_of_a_resumed_envpool_run():
    """Every stored row that is a transition gives back the stacks the agent saw before and after its step; the row
    before the cut is none, the first row after it starts a stack."""
    rb, stream = played_across_a_cut("dqn_atari.py")
    rows = torch.arange(298)
    for lane in range(2):
        valid = [t == 0 or not stream[lane]["ends"][t - 1] for t in range(298)]
        assert rb.valid[:298, lane].tolist() == valid and not valid[149] and valid[150]
        obs, next_obs = rb.stacks(rows[valid], torch.full((sum(valid),), lane))
        assert np.array_equal(obs.numpy(), np.stack([stream[lane]["obs"][t] for t in range(298) if valid[t]]))
        assert np.array_equal(next_obs.numpy(), np.stack([stream[lane]["obs"][t + 1] for t in range(298) if valid[t]]))


def test_rainbow_storage_ends_its_n_step_returns_at_the_cut_of_a_resumed_envpool_run():
    """Exactly the transitions with their 3 steps stored have a priority, the row before the cut none; each one's
    obs, n-step return, bootstrap discount and obs are the plain loop's, which treats the cut as a truncation."""
    rb, stream = played_across_a_cut("rainbow_atari.py")
    rows = len(rb.frames)
    leaves = rb.tree.leaves.view(-1)[: rows * 2].view(rows, 2)
    for lane in range(2):
        expected = [t for t in range(297) if t == 0 or not stream[lane]["ends"][t - 1]]
        assert [t for t in range(300) if leaves[t, lane] > 0] == expected and 149 not in expected
        t = torch.tensor(expected)
        obs, _, returns, discounts, next_obs = rb.transitions(t, torch.full_like(t, lane))
        for k, step in enumerate(expected):
            total, discount, bootstrap = plain_n_step(stream[lane], step, 3, 0.9)
            assert returns[k].item() == pytest.approx(total, abs=1e-6) and discounts[k].item() == pytest.approx(
                discount, abs=1e-6
            )
            assert np.array_equal(obs[k].numpy(), stream[lane]["obs"][step])
            assert np.array_equal(next_obs[k].numpy(), bootstrap), step


def test_a_snapshot_that_cannot_be_written_is_one_error_line_and_leaves_no_partial_file(workdir):
    """A full disk (a file size limit under the snapshot's size): one line, exit code 1, neither state.pt nor its
    temporary file."""
    flags, env = [*TINY, "--env-id", "Cue-v5"], {"PYTHONPATH": os.pathsep.join([STANDIN, ROOT])}
    proc = start_script("dqn_atari.py", flags, workdir, env=env, file_size_limit=500_000)
    _, stderr = proc.communicate(timeout=300)
    (folder,) = glob.glob(os.path.join(workdir, "runs", "*"))
    state = os.path.join(os.path.relpath(folder, workdir), "state.pt")
    assert proc.returncode == 1 and [line for line in stderr.splitlines() if line.strip()][-1:] == [
        f"error: could not write {state}: File too large"
    ], stderr[-3000:]
    assert "Traceback" not in stderr and not [name for name in os.listdir(folder) if name.startswith("state")]
