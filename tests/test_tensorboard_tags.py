"""Every scalar that CleanRL's script of the same name writes to TensorBoard, each script writes under the same tag, so
that a user's dashboards carry over. The lists are CleanRL's (fe8d8a0), read off its scripts' add_scalar calls;
dqn_atari_async.py is held to CleanRL's dqn_atari.py, ppo_atari_envpool_async.py to its ppo_atari_envpool.py.
IMPALA has no CleanRL counterpart."""

import glob
import os

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_continuous_scripts import tiny_run as continuous_tiny_run
from test_dqn import tiny_run as dqn_tiny_run
from test_ppo_continuous import TINY_RUN as PPO_CONTINUOUS_TINY_RUN
from test_pqn import tiny_run as pqn_tiny_run

from script_runs import run_on_standin, shared_run

EPISODES = {"charts/episodic_return", "charts/episodic_length"}
PPO = {f"losses/{name}" for name in ("policy_loss", "value_loss", "entropy", "old_approx_kl", "approx_kl", "clipfrac")}
PPO |= EPISODES | {"charts/SPS", "charts/learning_rate", "losses/explained_variance"}
DQN = EPISODES | {"charts/SPS", "losses/td_loss", "losses/q_values", "eval/episodic_return"}
PQN = EPISODES | {"charts/SPS", "losses/td_loss", "losses/q_values"}
CRITICS = {f"losses/{name}" for name in ("qf1_values", "qf2_values", "qf1_loss", "qf2_loss", "qf_loss", "actor_loss")}
CLEANRL_TAGS = {
    "sac_continuous_action.py": EPISODES | CRITICS | {"losses/alpha", "losses/alpha_loss"},
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
# Runs long enough for episodes to end and the speed to be measured (a run logs its last losses as it ends); an
# evaluation where CleanRL's script evaluates. The scripts on classic control and MuJoCo read their one tiny run
# (their eager mode test's); the image scripts play envpool's stand-in (tests/standin), whose Cue-v5 game ends after
# 32 steps of an env (a random Breakout game takes about 200).
TINY_RUNS = {
    "sac_continuous_action.py": continuous_tiny_run("sac_continuous_action.py"),
    "td3_continuous_action.py": continuous_tiny_run("td3_continuous_action.py"),
    "ppo_continuous_action.py": PPO_CONTINUOUS_TINY_RUN,
    "dqn.py": dqn_tiny_run("eager")[1],
    "pqn.py": pqn_tiny_run("pqn.py"),
}
ATARI_PPO = ["--env-id", "Cue-v5", "--total-timesteps", 512, "--num-steps", 32, "--eval-episodes", 0]
ATARI_DQN = ["--env-id", "Cue-v5", "--learning-starts", 100, "--num-envs", 4, "--measure-burnin", 5]
STANDIN_RUNS = {
    "dqn_atari.py": [*ATARI_DQN, "--total-timesteps", 260, "--buffer-size", 260, "--eval-episodes", 1],
    "dqn_atari_async.py": [*ATARI_DQN, "--total-timesteps", 260, "--buffer-size", 260, "--eval-episodes", 1],
    "ppo_atari_envpool.py": [*ATARI_PPO, "--num-envs", 8],
    "ppo_atari_envpool_async.py": [*ATARI_PPO, "--num-envs", 8],
    "ppo_atari_lstm.py": [*ATARI_PPO, "--num-envs", 8],
    "ppo_atari_multigpu.py": [*ATARI_PPO, "--local-num-envs", 8],
    "pqn_atari_envpool.py": [*ATARI_PPO, "--num-envs", 8],
    # charts/beta comes with the losses every 100 updates
    "rainbow_atari.py": [*ATARI_DQN, "--total-timesteps", 520, "--buffer-size", 520, "--eval-episodes", 0],
}


@pytest.mark.parametrize("script", sorted(CLEANRL_TAGS))
def test_every_tag_of_cleanrls_script_is_written(script, workdir):
    if script in TINY_RUNS:
        summary, _ = shared_run(script, TINY_RUNS[script])
    else:
        summary, _ = run_on_standin(script, STANDIN_RUNS[script], workdir)
    (events,) = glob.glob(os.path.join(summary["run_dir"], "events.out.tfevents.*"))
    accumulator = EventAccumulator(events, size_guidance={"scalars": 0})
    accumulator.Reload()
    assert CLEANRL_TAGS[script] - set(accumulator.Tags()["scalars"]) == set()
