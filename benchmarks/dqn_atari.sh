#!/usr/bin/env bash
# DQN on Breakout-v5, synchronous (dqn_atari.py) and with the actor process (dqn_atari_async.py), in every
# speed mode: the rows of group "dqn_atari" in benchmarks/settings.toml.
exec "${PYTHON:-python}" "$(dirname "$0")/speed.py" --group "$(basename "$0" .sh)" "$@"
