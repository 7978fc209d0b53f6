"""Checks that several test files make of a script's runs and pieces: the summary's keys, what --compile compiles,
the modes a machine runs, same seed same numbers, a checkpoint's round trip, the video of an evaluation game,
CleanRL's TensorBoard tags, learning against a random policy."""

import glob
import importlib.util
import math
import os
from functools import partial

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensordict.nn import CudaGraphModule

import run_bookkeeping
from reference_implementations import reference_gae
from script_runs import load_script, run_script, shared_run

SUMMARY_KEYS = set(run_bookkeeping.SUMMARY_KEYS)

# What --compile compiles in each script, and the graphs and graph breaks that makes: every loss is one graph (its
# backward one more, which dynamo does not count) and no piece breaks, but where an update runs an LSTM over a
# rollout: it stays out of the graphs, a break in the loss (PPO-LSTM's, two graphs; IMPALA's core sits inside
# Agent.replay, so its loss is three graphs); PPO-LSTM's policy traces its one LSTM step. A change that adds a break
# or a recompilation fails the mode tests.
COMPILED = {
    "dqn.py": (["policy", "td_loss"], 2, 0),
    "dqn_atari.py": (["policy", "td_loss"], 2, 0),
    "dqn_atari_async.py": (["td_loss"], 1, 0),
    "pqn.py": (["policy", "q_lambda_returns", "td_loss"], 3, 0),
    "pqn_atari_envpool.py": (["policy", "q_lambda_returns", "td_loss"], 3, 0),
    "rainbow_atari.py": (["policy", "rainbow_loss", "sample"], 3, 0),
    "sac_continuous_action.py": (["actor_loss", "critic_loss", "policy"], 3, 0),
    "td3_continuous_action.py": (["actor_loss", "critic_loss", "policy"], 3, 0),
    "fast_td3.py": (["actor_loss", "critic_loss", "explore"], 3, 0),
    "crossq.py": (["actor_loss", "critic_loss", "policy"], 3, 0),
    "ppo_continuous_action.py": (["gae", "policy", "ppo_loss"], 3, 0),
    "ppo_atari_envpool.py": (["gae", "policy", "ppo_loss"], 3, 0),
    "ppo_atari_envpool_async.py": (["gae", "policy", "ppo_loss"], 3, 0),
    "ppo_atari_multigpu.py": (["gae", "policy", "ppo_loss"], 3, 0),
    "ppo_atari_lstm.py": (["gae", "policy", "ppo_loss"], 4, 1),
    "impala_ray.py": (["impala_loss"], 1, 0),
    "impala_ray.py --lstm": (["impala_loss"], 3, 2),
}

# Without CUDA, --cudagraphs runs the code it would capture: of two modes that differ by it alone, one runs here (eager
# without it; compile with it, which checks its warning and its label too). The cuda tier runs all four.
SAME_ON_A_CPU = {
    "cudagraphs": "eager",
    "compile": "compile+cudagraphs",
    "async+cudagraphs": "async",
    "async+compile": "async+compile+cudagraphs",
}


def modes_here(modes):
    """The modes of `modes` a mode test runs on this machine."""
    if torch.cuda.is_available():
        return list(modes)
    return [mode for mode in modes if SAME_ON_A_CPU.get(mode) not in modes]


def assert_compiled_as_designed(summary, variant=""):
    """A run's summary says what ran compiled (nothing without --compile), in the graphs and graph breaks of
    COMPILED, and nothing compiled again after warm-up."""
    pieces, graphs, breaks = COMPILED[summary["script"] + variant]
    if not summary["compile"]:
        pieces, graphs, breaks = [], 0, 0
    assert summary["compiled_pieces"] == pieces
    assert (summary["compile_graphs"], summary["graph_breaks"], summary["graphs_after_warmup"]) == (graphs, breaks, 0)


# A script's one tiny run (its eager mode test's, which every test that only reads a tiny run shares) records its
# first evaluation game where moviepy, the [video] extra, is there to write it; its video test reads it back.
RECORD = ["--capture-video"] if importlib.util.find_spec("moviepy") else []
CARTPOLE_SCREEN, ATARI_SCREEN, PENDULUM_SCREEN = (400, 600, 3), (210, 160, 3), (500, 500, 3)


def assert_records_the_first_evaluation_game(summary, screen):
    """--capture-video: one mp4 of the first evaluation game in the run folder, read back frame by frame, of the
    env's screen, its frames moving. On CartPole one frame a step after the reset's (a step scores 1), on Atari a
    whole game: five balls of Breakout, not one life."""
    if not RECORD:
        pytest.skip("moviepy, the [video] extra, is not installed")
    imageio = pytest.importorskip("imageio.v2")  # moviepy's own reader and writer
    videos = glob.glob(os.path.join(summary["run_dir"], "videos", "*.mp4"))
    assert len(videos) == 1, videos
    with imageio.get_reader(videos[0]) as reader:
        first, frames, moved = None, 0, False
        for frame in reader:
            first = frame if first is None else first
            moved |= bool((frame != first).any())
            frames += 1
    assert first.shape == screen and moved
    if screen == CARTPOLE_SCREEN:
        # a game held to the 500-step limit reads back one frame short: imageio's reader gives 500 frames of the 501
        # that gymnasium's RecordVideo writes (seen with RecordVideo alone, no script)
        assert frames == summary["eval_returns"][0] + 1 - (summary["eval_returns"][0] == 500)
    elif screen == ATARI_SCREEN:
        assert frames >= 100  # 117-357 frames here
    else:  # Pendulum: its 200 steps and the reset
        assert frames >= 200


# Every scalar that CleanRL's script of the same name writes to TensorBoard, each script writes under the same tag, so
# that a user's dashboards carry over. The lists are CleanRL's (fe8d8a0), read off its scripts' add_scalar calls;
# dqn_atari_async.py is held to CleanRL's dqn_atari.py, ppo_atari_envpool_async.py to its ppo_atari_envpool.py.
# IMPALA has no CleanRL counterpart, FastTD3 logs its own names (test_fast_td3).
EPISODES = {"charts/episodic_return", "charts/episodic_length"}
PPO = {f"losses/{name}" for name in ("policy_loss", "value_loss", "entropy", "old_approx_kl", "approx_kl", "clipfrac")}
PPO |= EPISODES | {"charts/SPS", "charts/learning_rate", "losses/explained_variance"}
DQN = EPISODES | {"charts/SPS", "losses/td_loss", "losses/q_values", "eval/episodic_return"}
PQN = EPISODES | {"charts/SPS", "losses/td_loss", "losses/q_values"}
CRITICS = {f"losses/{name}" for name in ("qf1_values", "qf2_values", "qf1_loss", "qf2_loss", "qf_loss", "actor_loss")}
CLEANRL_TAGS = {
    "sac_continuous_action.py": EPISODES | CRITICS | {"losses/alpha", "losses/alpha_loss"},
    "crossq.py": EPISODES | CRITICS | {"losses/alpha", "losses/alpha_loss"},  # CleanRL's SAC's
    "td3_continuous_action.py": EPISODES | CRITICS | {"eval/episodic_return"},
    "ppo_continuous_action.py": PPO | {"eval/episodic_return"},
    "dqn.py": DQN,
    "dqn_atari.py": DQN,
    "dqn_atari_async.py": DQN,
    "ppo_atari_envpool.py": PPO | {"charts/avg_episodic_return"},
    "ppo_atari_envpool_async.py": PPO | {"charts/avg_episodic_return"},
    "ppo_atari_lstm.py": PPO,
    "ppo_atari_multigpu.py": PPO,
    "pqn.py": PQN,
    "pqn_atari_envpool.py": PQN | {"charts/avg_episodic_return"},
    "rainbow_atari.py": EPISODES | {"charts/SPS", "charts/beta", "losses/td_loss", "losses/q_values"},
}


def assert_writes_cleanrls_tags(summary):
    """A run long enough for episodes to end and the speed to be measured (a run logs its last losses as it ends),
    with an evaluation where CleanRL's script evaluates, wrote every tag of CleanRL's script of the same name."""
    (events,) = glob.glob(os.path.join(summary["run_dir"], "events.out.tfevents.*"))
    accumulator = EventAccumulator(events, size_guidance={"scalars": 0})
    accumulator.Reload()
    assert CLEANRL_TAGS[summary["script"]] - set(accumulator.Tags()["scalars"]) == set()


# What one whole game can score. Breakout: whole points, 1, 4 or 7 a brick, at most 864 (two walls of 108 bricks, 432
# points each). CartPole: a point a step, from 8 steps (a cart pushed one way all along drops its pole in 8 to 10) to
# the 500-step limit. Pendulum: 200 steps of a reward from -(pi^2 + 0.1 * 8^2 + 0.001 * 2^2) = -16.27 (upside down, at
# full speed and torque) to 0 (upright and still), not whole.
GAME_SCORES = {"Breakout-v5": (0, 864), "CartPole-v1": (8, 500)}
PENDULUM_RETURNS = (-200 * (math.pi**2 + 0.1 * 8**2 + 0.001 * 2**2), 0.0)


def are_whole_game_scores(scores, env_id):
    """Each of `scores` is what one whole game of `env_id` can score (GAME_SCORES): whole points, within its range."""
    low, high = GAME_SCORES[env_id]
    return all(low <= score <= high and score == int(score) for score in scores)


def is_a_pendulum_return(value):
    """`value` (one episode's return, or a mean of them) lies in the range of a Pendulum episode's return."""
    low, high = PENDULUM_RETURNS
    return low <= value <= high


CUE_RANDOM_SCORE = 8.0  # a random policy's game on Cue-v5: 32 steps, one action of 4 scores (test_standin_envpool)


def learned_the_cue(summary):
    """On Cue-v5, the last 20 training games and the evaluation games each score at least twice a random policy."""
    threshold = 2 * CUE_RANDOM_SCORE
    return summary["return_mean"] >= threshold and summary["eval_return_mean"] >= threshold


def assert_a_seed_learns(run_seed, learned, seeds=(1, 2, 3)):
    """Runs seed after seed, `run_seed(seed)` giving a run's summary, until `learned(summary)` holds. A run's numbers
    are a CPU's: an AMD EPYC and an Intel Xeon round floats apart, and a seed that learns on one can fall short on
    the other; a broken learner falls short with every seed. Fails with each seed's scores when none learns."""
    scores = []
    for seed in seeds:
        summary = run_seed(seed)
        if learned(summary):
            return summary
        scores.append(f"seed {seed}: training {summary['return_mean']}, evaluation {summary['eval_returns']}")
    raise AssertionError("; ".join(scores))


# A piece's equivalence test runs each of these against eager on the same device: (compile, cudagraphs, device). The
# CUDA cases are the cuda tier's (without CUDA a graph passes the call through: eager against eager, which proves
# nothing); the compiled one on a CPU is the fast tier's.
SPEED_FLAGS = {
    "compile": (True, False, "cpu"),
    "compile-cuda": (True, False, "cuda"),
    "cudagraphs": (False, True, "cuda"),
    "compile+cudagraphs": (True, True, "cuda"),
}
CUDA_TIER = (pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))
GRAPH_WARMUP = 2
# Calls of a sped-up piece in an equivalence test: the warm-up ones, the call that captures the graph, two replays
SPED_UP_CALLS = GRAPH_WARMUP + 3


def speed_flag_params(names=SPEED_FLAGS):
    """`pytest.param`s of SPEED_FLAGS, the CUDA ones in the cuda tier."""
    return [
        pytest.param(SPEED_FLAGS[name], id=name, marks=CUDA_TIER if SPEED_FLAGS[name][2] == "cuda" else ())
        for name in names
    ]


def speed_flags_here():
    """`flags` parameters of an equivalence test: (compile, cudagraphs, device), named."""
    return pytest.mark.parametrize("flags", speed_flag_params())


def speed_up(fn, compile, cudagraphs):
    """A piece wrapped as the scripts wrap theirs: torch.compile, then a CUDA graph after its warm-up calls (fewer
    than the scripts' 5, so that a test reaches the capture and the replays in a few calls)."""
    fn = torch.compile(fn) if compile else fn
    return CudaGraphModule(fn, warmup=GRAPH_WARMUP) if cudagraphs else fn


def assert_same_seed_same_numbers(script, args, workdir, keys, second_flags=()):
    """Two runs of `script` with the same seed, the second with `second_flags` (flags that must not change the
    numbers, such as --cudagraphs without CUDA), give equal values under `keys`. Returns both runs. The first is the
    session's shared run of `args` (the eager mode test's, where the arguments are the same); the second records no
    video (RECORD), which changes none of the numbers and costs seconds on CartPole and Pendulum."""
    first = shared_run(script, args)
    second = run_script(script, [*[arg for arg in args if arg not in RECORD], *second_flags], workdir)
    for key in keys:
        assert first[0][key] == second[0][key], key
    return first, second


def assert_gae_equals_the_reverse_loop(script, steps, envs, compiled, seed, rewards_sign=False):
    """The script's gae (compiled or not) against the reverse loop, with an episode end into the first and into
    the last observation."""
    module = load_script(script)
    g = torch.Generator().manual_seed(seed)
    rewards, values = torch.randn(steps, envs, generator=g), torch.randn(steps, envs, generator=g)
    if rewards_sign:  # clipped rewards, as on Atari
        rewards = rewards.sign()
    dones = (torch.rand(steps, envs, generator=g) < 0.05).float()
    dones[0, 0] = dones[-1, -1] = 1.0
    next_value, next_done = torch.randn(envs, generator=g), torch.tensor([1.0] + [0.0] * (envs - 1))
    gae = speed_up(partial(module.gae, gamma=0.99, gae_lambda=0.95), compiled, False)
    advantages, returns = gae(rewards, values, dones, next_value, next_done)
    expected_advantages, expected_returns = reference_gae(rewards, values, dones, next_value, next_done, 0.99, 0.95)
    torch.testing.assert_close(advantages, expected_advantages, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(returns, expected_returns, atol=2e-5, rtol=1e-5)


def done_patterns(num_steps, batch, generator):
    """The cases the LSTM scripts' padding must get right, one (T, B) float pattern each (PPO-LSTM's starts[t]: obs t
    starts an episode; IMPALA's dones[t]: step t ends one)."""
    none = torch.zeros(num_steps, batch)
    first = none.clone()
    first[0] = 1.0  # PPO-LSTM: every env starts an episode at t=0, no stored state is used
    last = none.clone()
    last[-1] = 1.0
    every = torch.ones(num_steps, batch)
    many_short = none.clone()
    many_short[::3, 0] = 1.0  # env 0: episodes of three steps; the others: one long segment
    random = (torch.rand(num_steps, batch, generator=generator) < 0.1).float()
    return {"none": none, "t0": first, "last": last, "every": every, "many_short": many_short, "random": random}


def loss_and_gradients(loss_fn, agent, *inputs):
    """The loss and metrics of `loss_fn(*inputs)` and the gradients it gives `agent`'s parameters."""
    agent.zero_grad()
    loss, metrics = loss_fn(*inputs)
    loss.backward()
    return loss.detach(), metrics, {name: p.grad.clone() for name, p in agent.named_parameters()}


def assert_same_loss_and_gradients(result, expected):
    """Two `loss_and_gradients` results agree: loss, every metric, every parameter's gradient."""
    (loss, metrics, grads), (expected_loss, expected_metrics, expected_grads) = result, expected
    torch.testing.assert_close(loss, expected_loss, atol=1e-5, rtol=1e-5)
    for name in expected_metrics:
        torch.testing.assert_close(metrics[name], expected_metrics[name], atol=1e-5, rtol=1e-5)
    for name in expected_grads:
        torch.testing.assert_close(grads[name], expected_grads[name], atol=1e-5, rtol=1e-4)


def assert_checkpoint_round_trip(script, train_args, weights, workdir):
    """Trained (the session's shared run of `train_args`, which saves its model), loaded with no steps to play and
    saved again: the same `weights` state dict (no evaluation game: each costs seconds on Atari); the checkpoint
    refused, exit code 2, on a game with other actions."""
    trained, _ = shared_run(script, train_args)
    checkpoint = os.path.join(trained["run_dir"], "model.pt")
    loaded, _ = run_script(
        script, ["--total-timesteps", 0, "--eval-episodes", 0, "--load-model", checkpoint, "--save-model"], workdir
    )
    first, second = (
        torch.load(os.path.join(run["run_dir"], "model.pt"), weights_only=True) for run in (trained, loaded)
    )
    assert first[weights].keys() == second[weights].keys()
    assert all(torch.equal(first[weights][name], second[weights][name]) for name in first[weights])
    _, proc = run_script(
        script,
        ["--env-id", "Pong-v5", "--total-timesteps", 0, "--load-model", checkpoint],
        workdir,
        check=False,
        timeout=120,
    )
    assert proc.returncode == 2 and "Pong-v5 has num_actions 6" in proc.stderr


def random_policy_scores(script, env_id, games, seed, **settings):
    """True scores of `games` whole games with uniformly random actions, on the script's own envpool envs
    (`make_envs(env_id, games, seed=seed, **settings)`, one game an env): envpool's info holds the unclipped reward
    and the game's end, which a lost life does not end where the envs end an episode there."""
    envs = load_script(script).make_envs(env_id, games, seed=seed, **settings)
    envs.reset()
    rng = np.random.default_rng(seed)
    scores, finished = np.zeros(games), np.zeros(games, dtype=bool)
    while not finished.all():
        _, _, _, truncations, infos = envs.step(rng.integers(envs.action_space.n, size=games, dtype=np.int32))
        scores += infos["reward"] * ~finished
        finished |= infos["terminated"].astype(bool) | truncations
    return scores


def assert_beats_random(trained, random_scores, factor):
    """Games of a trained agent against games of a random policy: the mean at least `factor` times the random mean,
    and a rank test, as scores of single games have long tails (one 1,920 among MsPacman games of 300-400 made a
    test on the means fail with a mean 1.8x the random one). A trained game must beat a random game in enough
    pairs (ties count half) to lie 3 standard deviations above the one half that no learning gives (Mann-Whitney's
    U, normal approximation without the tie correction, which only makes it stricter)."""
    trained, random_scores = np.asarray(trained, dtype=float), np.asarray(random_scores, dtype=float)
    assert trained.mean() >= factor * random_scores.mean(), (trained, random_scores.mean())
    differences = trained[:, None] - random_scores[None, :]
    wins = ((differences > 0) + 0.5 * (differences == 0)).sum()
    pairs, games = differences.size, len(trained) + len(random_scores)
    z = (wins - pairs / 2) / math.sqrt(pairs * (games + 1) / 12)
    assert z >= 3, (z, trained, random_scores)
