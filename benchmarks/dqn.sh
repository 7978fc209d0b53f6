#!/usr/bin/env bash
# DQN on CartPole-v1, synchronous (dqn.py) and with the actor process (dqn_atari_async.py), in every speed mode:
# the rows of group "dqn" in benchmarks/settings.toml.
exec "${PYTHON:-python}" "$(dirname "$0")/speed.py" --group "$(basename "$0" .sh)" "$@"
