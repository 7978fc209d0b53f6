"""envpool's stand-in (tests/standin/envpool.py), which the image scripts' CI learning tests run on, held to what
the scripts meet of real envpool's Breakout-v5: spaces, shapes and dtypes, info keys, the episode's end at a lost
life and at the game's end, the reset step after it, async send/recv. Each check runs both envs through the same
function, so the stand-in cannot drift from the real contract unnoticed."""

import importlib.util
import os

import numpy as np
import pytest

from script_runs import STANDIN

envpool = pytest.importorskip("envpool")
spec = importlib.util.spec_from_file_location("standin_envpool", os.path.join(STANDIN, "envpool.py"))
standin = importlib.util.module_from_spec(spec)
spec.loader.exec_module(standin)

SIDES = {"real": (envpool, "Breakout-v5"), "standin": (standin, "Cue-v5")}


def make(side, task=None, **settings):
    module, game = SIDES[side]
    settings = {"num_envs": 2, "num_threads": 1, "seed": 1, **settings}
    return module.make(task or game, env_type="gymnasium", **settings)


def layout(value):
    """What the scripts rely on of a returned value: its type, and an array's dtype and shape."""
    if isinstance(value, dict):
        return {key: layout(item) for key, item in value.items() if key != "players"}
    if isinstance(value, tuple):
        return tuple(layout(item) for item in value)
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.shape)
    return type(value).__name__


@pytest.mark.parametrize("task", standin.TASKS)
def test_the_tasks_are_listed_and_have_an_atari_spec_as_envpool_gives_one(task):
    assert task in standin.list_all_envs()
    assert type(standin.make_spec(task)).__name__ == type(envpool.make_spec("Breakout-v5")).__name__ == "AtariEnvSpec"


@pytest.mark.parametrize("settings", [{}, {"stack_num": 1}, {"episodic_life": False, "reward_clip": False}])
def test_spaces_and_what_reset_and_step_return_are_laid_out_as_breakouts(settings):
    results = {}
    for side in SIDES:
        envs = make(side, **settings)
        results[side] = (
            repr(envs.observation_space),
            repr(envs.action_space),
            layout(envs.reset()),
            layout(envs.step(np.zeros(2, np.int32))),
        )
        envs.close()
    assert results["standin"] == results["real"]
    assert "ram" in results["real"][3][4] and "terminated" in results["real"][3][4]


def episode_ends(side, episodic_life):
    """Steps one env with random actions until its game ends; at each episode's end, the step after it: (lives,
    info["terminated"], its reward, terminated, truncated, the frame stack kept, elapsed_step)."""
    envs = make(side, num_envs=1, episodic_life=episodic_life, reward_clip=episodic_life)
    obs, _ = envs.reset()
    rng, seen = np.random.default_rng(0), []
    for _ in range(5000):
        obs, _, terminated, truncated, info = envs.step(rng.integers(0, 4, 1).astype(np.int32))
        if terminated[0] or truncated[0]:
            after, reward, *ends, after_info = envs.step(np.array([1], np.int32))
            kept = np.array_equal(after[0, :-1], obs[0, 1:])
            game_over = bool(info["terminated"][0])
            seen.append((game_over, float(reward[0]), bool(ends[0][0]), bool(ends[1][0]), kept))
            seen.append(("elapsed_step after", int(after_info["elapsed_step"][0]) == 0, game_over))
            if game_over:
                break
            obs = after
    envs.close()
    return seen


@pytest.mark.parametrize("episodic_life", [True, False])
def test_episodes_end_at_each_lost_life_and_the_reset_step_follows_as_on_breakout(episodic_life):
    real, ours = episode_ends("real", episodic_life), episode_ends("standin", episodic_life)
    # Breakout has 5 lives, the stand-in's games 2: each life's end but the last, then the game's, look alike
    assert ours[-2:] == real[-2:] and set(ours[:-2]) == set(real[:-2])
    assert real[-2] == (True, 0.0, False, False, False)  # the game's end: the reset step scores 0, a new stack
    if episodic_life:
        assert real[0] == (False, 0.0, False, False, True)  # a lost life: the stack goes on


def test_async_send_and_recv_hand_out_batches_of_envs_by_id_as_breakout():
    results = {}
    for side in SIDES:
        envs = make(side, num_envs=4, batch_size=2)
        envs.async_reset()
        ids, layouts = [], []
        for _ in range(6):
            result = envs.recv()
            ids.append(sorted(result[4]["env_id"].tolist()))
            layouts.append(layout(result))
            envs.send(np.zeros(2, np.int32), result[4]["env_id"])
        envs.close()
        results[side] = layouts, sorted({i for batch in ids for i in batch})
    assert results["standin"] == results["real"]
    assert results["real"][1] == [0, 1, 2, 3] and results["real"][0][0][0][2] == (2, 4, 84, 84)


def play(task, choose, games=1, num_envs=64):
    """The true score of `games` games (no episodic life, a reset step after each) in each of `num_envs` envs,
    actions from choose(envs, obs); with the frame stacks seen at Recall-v5's questions."""
    envs = make("standin", task, num_envs=num_envs, seed=3, episodic_life=False, reward_clip=False)
    obs, _ = envs.reset()
    steps = standin.LIVES[task] * (standin.RECALL_DELAY + 1 if task == "Recall-v5" else standin.LIFE_STEPS) + 1
    total, asked = 0.0, []
    for _ in range(games * steps):
        obs, _, _, _, info = envs.step(choose(envs, obs))
        total += info["reward"].sum()
        asked += [stack for stack in obs if np.array_equal(stack[-1], standin.QUESTION)]
    return total / num_envs / games, asked


@pytest.mark.parametrize("task", standin.TASKS)
def test_a_random_policy_scores_a_quarter_of_what_the_cue_scores(task):
    """What the learning tests' thresholds stand on: the cue's action scores every point (32 a game on Cue-v5, one
    a game on Recall-v5), a random policy a quarter of that; at Recall-v5's question no frame of the stack shows
    the cue, so a frame stack cannot answer it."""
    rng = np.random.default_rng(0)
    cued, asked = play(task, lambda envs, obs: envs.cue.copy())
    random, _ = play(task, lambda envs, obs: rng.integers(0, 4, len(obs)), games=20)
    best = standin.LIVES[task] * (standin.LIFE_STEPS if task == "Cue-v5" else 1)
    assert cued == best and 0.22 * best < random < 0.28 * best
    if task == "Recall-v5":
        shown = [
            frame for stack in asked for frame in stack if any(np.array_equal(frame, cue) for cue in standin.FRAMES)
        ]
        assert asked and not shown
