#!/usr/bin/env bash
# PPO-LSTM on Breakout-v5, the padded one-call LSTM and the per-step loop, in every speed mode, then the update
# phase alone: the rows of group "ppo_lstm" in benchmarks/settings.toml.
exec "${PYTHON:-python}" "$(dirname "$0")/speed.py" --group "$(basename "$0" .sh)" "$@"
