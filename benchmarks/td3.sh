#!/usr/bin/env bash
# TD3 on HalfCheetah-v5 in every speed mode: the rows of group "td3" in benchmarks/settings.toml.
exec "${PYTHON:-python}" "$(dirname "$0")/speed.py" --group "$(basename "$0" .sh)" "$@"
