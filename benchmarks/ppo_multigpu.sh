#!/usr/bin/env bash
# PPO Atari as two torchrun processes of 4 envs in every speed mode: the rows of group "ppo_multigpu" in
# benchmarks/settings.toml.
exec "${PYTHON:-python}" "$(dirname "$0")/speed.py" --group "$(basename "$0" .sh)" "$@"
