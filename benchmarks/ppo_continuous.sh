#!/usr/bin/env bash
# PPO continuous on HalfCheetah-v5 in every speed mode: the rows of group "ppo_continuous" in
# benchmarks/settings.toml.
exec "${PYTHON:-python}" "$(dirname "$0")/speed.py" --group "$(basename "$0" .sh)" "$@"
