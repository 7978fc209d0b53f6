#!/usr/bin/env bash
# Rainbow on Breakout-v5 (rainbow_atari.py) in every
# speed mode: the rows of group "rainbow" in benchmarks/settings.toml.
exec "${PYTHON:-python}" "$(dirname "$0")/speed.py" --group "$(basename "$0" .sh)" "$@"
