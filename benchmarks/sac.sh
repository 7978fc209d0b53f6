#!/usr/bin/env bash
# SAC on HalfCheetah-v5 in every speed mode: the rows of group "sac" in benchmarks/settings.toml.
exec "${PYTHON:-python}" "$(dirname "$0")/speed.py" --group "$(basename "$0" .sh)" "$@"
