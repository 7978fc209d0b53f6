"""dqn_atari.py and dqn_atari_async.py on Atari: the scripts' own wrapper against a hand-built expectation on a scripted
fake emulator, the frame storage rebuilding exactly the stacks the envs returned (both back-ends and classic control,
across episode starts and wrap-around), every mode, determinism, and learning measured against a random policy in
the same test."""

import math
import os

import gymnasium as gym
import numpy as np
import pytest
import torch

from checks import (
    ATARI_SCREEN,
    RECORD,
    SUMMARY_KEYS,
    are_whole_game_scores,
    assert_a_seed_learns,
    assert_beats_random,
    assert_checkpoint_round_trip,
    assert_compiled_as_designed,
    assert_records_the_first_evaluation_game,
    assert_same_seed_same_numbers,
    learned_the_cue,
    modes_here,
    random_policy_scores,
)
from script_runs import load_script, run_on_standin, run_script, shared_run

pytest.importorskip("envpool")
pytest.importorskip("ale_py")
SCRIPT, ASYNC = "dqn_atari.py", "dqn_atari_async.py"
# 2 envs x 200 steps: 200 steps before learning, 50 updates (5 of them warm-up), one evaluation game.
TINY = [
    "--total-timesteps",
    400,
    "--learning-starts",
    200,
    "--buffer-size",
    400,
    "--num-envs",
    2,
    "--measure-burnin",
    5,
    "--eval-episodes",
    1,
]
# Without CUDA, compile+cudagraphs runs the compiled code with one warning. eager and cudagraphs run in
# test_same_seed_gives_identical_runs. async+compile: the learner compiles while the actor plays eagerly; the start-up
# must neither hang nor stall (the async script's other modes run on CartPole in tests/test_dqn.py). The gymnasium run
# records its first evaluation game, ALE's screen, for the video test.
MODES = {
    "compile": (SCRIPT, ["--compile"]),
    "compile+cudagraphs": (SCRIPT, ["--compile", "--cudagraphs"]),
    "gymnasium": (SCRIPT, ["--env-backend", "gymnasium", *RECORD]),
    "async": (ASYNC, []),
    "async+compile": (ASYNC, ["--compile"]),
}


class FakeAtari(gym.Env):
    """A scripted emulator: frame t is filled with (37 t) mod 256, rewards and lives change at given frames,
    the game ends at frame `length`; every action and reset is logged."""

    observation_space = gym.spaces.Box(0, 255, (210, 160, 3), np.uint8)
    action_space = gym.spaces.Discrete(4)

    def __init__(self, rewards=None, life_lost_at=(), length=100):
        self.rewards, self.life_lost_at, self.length = rewards or {}, life_lost_at, length
        self.ale, self.actions, self.resets = self, [], 0

    def lives(self):
        return 3 - sum(t <= self.t for t in self.life_lost_at)

    def get_action_meanings(self):
        return ["NOOP", "FIRE", "RIGHT", "LEFT"]

    def frame(self):
        return np.full((210, 160, 3), 37 * self.t % 256, dtype=np.uint8)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.t, self.resets = 0, self.resets + 1
        return self.frame(), {}

    def step(self, action):
        self.t += 1
        self.actions.append(int(action))
        return self.frame(), float(self.rewards.get(self.t, 0)), self.t >= self.length, False, {}


@pytest.mark.parametrize("script", [SCRIPT, ASYNC])
def test_episodic_life_ends_an_episode_at_a_lost_life_but_not_the_game(script):
    """Noop starts, frame skip with max-pooling and the 84x84 frames are gymnasium's AtariPreprocessing; this wrapper
    is the scripts' own: a lost life ends the learner's episode, info keeps the raw reward and the game's true end."""
    fake = FakeAtari(rewards={2: 5}, life_lost_at=(3,), length=6)
    env = load_script(script).EpisodicLife(fake)
    _, info = env.reset()
    assert info == {"reward": 0.0, "terminated": False}
    steps = [env.step(2) for _ in range(3)]
    assert [step[2] for step in steps] == [False, False, True]  # the life is lost at frame 3
    assert [step[4]["reward"] for step in steps] == [0.0, 5.0, 0.0] and not any(s[4]["terminated"] for s in steps)
    env.reset()
    assert fake.resets == 1 and fake.actions == [2, 2, 2, 0]  # a no-op step, not a reset
    steps = [env.step(2) for _ in range(2)]
    assert [step[2] for step in steps] == [False, True] and steps[-1][4]["terminated"]  # the game ends at frame 6
    env.reset()
    assert fake.resets == 2


def test_fire_reset_presses_fire_then_2():
    fake = FakeAtari()
    env = load_script(SCRIPT).FireReset(fake)
    obs, _ = env.reset()
    assert fake.actions == [1, 2] and obs[0, 0, 0] == 37 * 2


def test_clip_reward_keeps_the_sign():  # the script clips with gymnasium's TransformReward
    env = gym.wrappers.TransformReward(FakeAtari(rewards={1: 5, 2: -3}), np.sign)
    env.reset()
    assert [env.step(0)[1] for _ in range(3)] == [1.0, -1.0, 0.0]


def test_frame_stack_repeats_the_first_frame_then_shifts():  # the script stacks with gymnasium's wrapper
    env = gym.wrappers.FrameStackObservation(FakeAtari(), 4, padding_type="reset")
    obs, _ = env.reset()
    assert obs.shape == (4, 210, 160, 3) and (obs == 0).all()
    env.step(0)
    obs, *_ = env.step(0)
    assert [plane[0, 0, 0] for plane in obs] == [0, 0, 37, 74]


# script, env id, back-end, and the storage for 2 envs of 300 rows (the async one's with 10 extra rows)
STORAGES = {
    "envpool": (SCRIPT, "Breakout-v5", "envpool", lambda module: module.FrameReplay(600, 2, torch.device("cpu"))),
    "gymnasium": (SCRIPT, "Breakout-v5", "gymnasium", lambda module: module.FrameReplay(600, 2, torch.device("cpu"))),
    "async-envpool": (
        ASYNC,
        "Breakout-v5",
        "envpool",
        lambda module: module.FrameReplay(600, 2, (4, 84, 84), torch.uint8, 10),
    ),
    "async-cartpole": (
        ASYNC,
        "CartPole-v1",
        "envpool",  # flat observations: a stack of one
        lambda module: module.FrameReplay(600, 2, (1, 4), torch.float32, 10),
    ),
}


@pytest.mark.parametrize("case", STORAGES)
def test_storage_rebuilds_the_stacks_the_env_returned(case):
    """Random play into a storage of 300 rows per env for 700 steps (a random Breakout game lasts about 200 steps, a
    CartPole episode about 20): every valid row still stored must give back the observation before and after its
    step, including rows at and after episode starts, and the step after any episode's end (a lost life included:
    envpool then plays its reset, whatever the action) is no transition. envpool keeps its frame stack across a lost
    life, gymnasium's restarts it (see the scripts' make_envs)."""
    script, env_id, backend, storage = STORAGES[case]
    module = load_script(script)
    envs = module.make_envs(env_id, 2, 3, backend)
    rb, rng = storage(module), np.random.default_rng(3)
    num_actions = int(getattr(envs, "single_action_space", envs.action_space).n)
    obs, _ = envs.reset()
    seen, ended = [obs], []
    for step in range(700):
        actions = rng.integers(0, num_actions, size=2, dtype=np.int32)
        obs, rewards, terminations, truncations, infos = envs.step(actions)
        game_over = np.asarray(infos.get("terminated", terminations), dtype=bool) | truncations
        reset = terminations | truncations
        rb.add(step, seen[-1], actions, rewards, terminations, reset, game_over if backend == "envpool" else reset)
        seen.append(obs)
        ended.append(reset)
    steps, rows = 700, len(rb.frames)
    assert rows < steps  # the storage wrapped around
    stored = torch.arange(steps - 1 - rb.buffer_rows, steps - 1)  # every row that has a next frame
    checked = 0
    for lane in range(2):
        valid = rb.valid[stored % rows, lane]
        obs, next_obs = rb.stacks(stored[valid] % rows, torch.full((int(valid.sum()),), lane))
        expected = torch.from_numpy(np.stack([seen[t][lane] for t in stored[valid]]))
        expected_next = torch.from_numpy(np.stack([seen[t + 1][lane] for t in stored[valid]]))
        assert torch.equal(obs, expected) and torch.equal(next_obs, expected_next)
        checked += int(valid.sum())
        assert (~valid).sum() >= 1 and rb.first[stored % rows, lane].sum() >= 1  # reset steps, new stacks
        # the step after an episode's end resets the env (envpool's ignores its action): never a transition
        after_an_end = torch.tensor([bool(ended[t - 1][lane]) for t in stored])
        assert after_an_end.any() and not (valid & after_an_end).any()
    assert checked > 550
    batch = rb.sample(steps, 64)
    assert batch[0].shape == (64, *seen[0].shape[1:]) and batch[3].shape == (64, *seen[0].shape[1:])
    envs.close()


def check_summary(summary, proc, mode):
    assert SUMMARY_KEYS <= summary.keys()
    is_async = mode.startswith("async")
    assert summary["compile"] == ("compile" in mode) and summary.get("async_actor", False) == is_async
    if "OMP_NUM_THREADS" not in os.environ:  # the learner's threads: every usable core, less the actor's
        assert summary["torch_threads"] == max(1, load_script(SCRIPT).usable_cores() - is_async)
    assert summary["env_backend"] == ("gymnasium" if mode == "gymnasium" else "envpool")
    assert summary["cudagraphs_requested"] == ("cudagraphs" in mode) and summary["cudagraphs_active"] is False
    assert summary["num_updates"] == 50 and summary["steps_done"] == 400
    assert summary["replay_ratio_target"] == 8.0 and summary["replay_ratio_achieved"] == 8.0
    assert_compiled_as_designed(summary)  # the async actor acts eagerly: the learner's loss alone is compiled
    assert summary["sps"] == pytest.approx(summary["steady_steps"] / summary["steady_seconds"])
    assert len(summary["eval_returns"]) == 1 and are_whole_game_scores(summary["eval_returns"], "Breakout-v5")
    assert math.isfinite(summary["final_metrics"]["td_loss"])
    assert sum("--cudagraphs needs CUDA" in line for line in proc.stderr.splitlines()) == ("cudagraphs" in mode)


@pytest.mark.parametrize("mode", modes_here(MODES))
def test_every_mode_writes_a_valid_summary(mode, workdir):
    script, flags = MODES[mode]
    check_summary(*shared_run(script, [*TINY, *flags, "--save-model"]), mode)


def test_capture_video_records_the_first_evaluation_game():
    script, flags = MODES["gymnasium"]
    assert_records_the_first_evaluation_game(shared_run(script, [*TINY, *flags, "--save-model"])[0], ATARI_SCREEN)


def test_same_seed_gives_identical_runs(workdir):
    """Eager, then --cudagraphs, which without CUDA runs the same code eagerly: the same numbers."""
    first, second = assert_same_seed_same_numbers(
        SCRIPT, [*TINY, "--save-model"], workdir, ["eval_returns", "final_metrics"], second_flags=["--cudagraphs"]
    )
    check_summary(*first, "eager")
    check_summary(*second, "cudagraphs")


@pytest.mark.learning
@pytest.mark.parametrize("script", [SCRIPT, ASYNC])
def test_learns_the_cue_task(script, workdir):
    """Cue-v5 (tests/standin/envpool.py) through the script's envpool code (the async one's actor process too): 3,000
    steps of 4 envs, 500 before learning, epsilon annealed over 900, an update every 8 steps at lr 5e-4, the target
    copied every 250 steps; about 45 s. A random policy scores 8 a game, a learned one about 30."""
    args = ["--env-id", "Cue-v5", "--total-timesteps", 3000, "--learning-starts", 500, "--buffer-size", 3000]
    args += ["--num-envs", 4, "--exploration-fraction", 0.3, "--train-frequency", 8, "--learning-rate", 5e-4]
    args += ["--target-network-frequency", 250, "--eval-episodes", 10]
    assert_a_seed_learns(lambda seed: run_on_standin(script, [*args, "--seed", seed], workdir)[0], learned_the_cue)


@pytest.mark.benchmark
@pytest.mark.learning
def test_learns_ms_pacman_above_a_random_policy(workdir):
    """About 4 minutes on a 2-core CPU: 40,000 steps (4 envs), 4,000 before learning, epsilon annealed over
    10,000, CleanRL's update every 4 steps and target copy every 1,000 steps, lr 2.5e-4. Seeds 1 and 2
    evaluated 532 and 554 (20 games at epsilon 0.05), a random policy 248; on an AMD EPYC seed 1 evaluated 453,
    median 340 against the random policy's 235, a trained game ahead of a random one in 90% of pairs. MsPacman's
    pellets reward every few steps; Breakout at this budget learned with seed 1 (3.8 against 1.0) but not with
    seed 2."""
    args = [
        "--env-id",
        "MsPacman-v5",
        "--total-timesteps",
        40_000,
        "--learning-starts",
        4000,
        "--buffer-size",
        40_000,
        "--num-envs",
        4,
        "--exploration-fraction",
        0.25,
        "--learning-rate",
        2.5e-4,
        "--eval-episodes",
        20,
        "--seed",
        1,
    ]
    summary, _ = run_script(SCRIPT, args, workdir)
    random_scores = random_policy_scores(SCRIPT, "MsPacman-v5", 30, seed=1)
    trained = np.array(summary["eval_returns"])
    assert_beats_random(trained, random_scores, factor=1.5)


def test_a_checkpoint_loads_back_to_the_same_weights(workdir):
    assert_checkpoint_round_trip(SCRIPT, [*TINY, "--save-model"], "q_network", workdir)
