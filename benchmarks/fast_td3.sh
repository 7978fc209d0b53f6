#!/usr/bin/env bash
# FastTD3 on HalfCheetah-v5 in every speed mode: the rows of group "fast_td3" in benchmarks/settings.toml.
exec "${PYTHON:-python}" "$(dirname "$0")/speed.py" --group "$(basename "$0" .sh)" "$@"
