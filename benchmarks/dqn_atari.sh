#!/usr/bin/env bash
# DQN on Breakout-v5 with envpool (CleanRL's dqn_atari settings: 1 env, batch 32, an update every 4 steps),
# synchronous (dqn_atari.py) and with the actor process (dqn_atari_async.py), in every mode. learning_starts is cut
# from 80,000 to keep the run short; the speed of the steady phase does not depend on it.
source "$(dirname "$0")/lib.sh"
case $BENCH_PROFILE in
    smoke) budget=(--total-timesteps 400 --learning-starts 200 --buffer-size 400 --num-envs 2 --measure-burnin 5) ;;
    quick) budget=(--total-timesteps 6000 --learning-starts 2000 --buffer-size 100000) ;;
    *) budget=(--total-timesteps 12000 --learning-starts 4000 --buffer-size 100000) ;;
esac
run_modes dqn_atari dqn_atari.py --env-id Breakout-v5 "${budget[@]}" --eval-episodes 0 --seed 1
run_modes dqn_atari_async dqn_atari_async.py --env-id Breakout-v5 "${budget[@]}" --eval-episodes 0 --seed 1
