"""Every scalar that CleanRL's script of the same name writes to TensorBoard, each image script writes under the same
tag (checks.CLEANRL_TAGS), on envpool's stand-in. The scripts on classic control and MuJoCo are checked in their own
tests, on their one tiny run (checks.assert_writes_cleanrls_tags)."""

import pytest

from checks import assert_writes_cleanrls_tags
from script_runs import run_on_standin

# Runs long enough for episodes to end and the speed to be measured, an evaluation where CleanRL's script evaluates:
# on envpool's stand-in (tests/standin), whose Cue-v5 game ends after 32 steps of an env (a random Breakout game takes
# about 200).
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


@pytest.mark.parametrize("script", sorted(STANDIN_RUNS))
def test_every_tag_of_cleanrls_script_is_written(script, workdir):
    summary, _ = run_on_standin(script, STANDIN_RUNS[script], workdir)
    assert_writes_cleanrls_tags(summary)
