#!/usr/bin/env bash
# PQN on CartPole-v1 (pqn.py) and on envpool's Breakout-v5 (pqn_atari_envpool.py), in every speed mode: the rows of
# group "pqn" in benchmarks/settings.toml.
exec "${PYTHON:-python}" "$(dirname "$0")/speed.py" --group "$(basename "$0" .sh)" "$@"
