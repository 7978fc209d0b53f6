#!/usr/bin/env bash
# PPO on Breakout-v5, synchronous (ppo_atari_envpool.py) and in two halves (ppo_atari_envpool_async.py), in
# every speed mode, then the env ceiling of this machine: the rows of group "ppo_atari" in benchmarks/settings.toml.
exec "${PYTHON:-python}" "$(dirname "$0")/speed.py" --group "$(basename "$0" .sh)" "$@"
