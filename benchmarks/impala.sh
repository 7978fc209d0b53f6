#!/usr/bin/env bash
# IMPALA on Breakout-v5 at 2 actors x 4 envs in every speed mode, other actor counts, replay and the LSTM core:
# the rows of group "impala" in benchmarks/settings.toml.
exec "${PYTHON:-python}" "$(dirname "$0")/speed.py" --group "$(basename "$0" .sh)" "$@"
