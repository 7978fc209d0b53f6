#!/usr/bin/env bash
# DQN on CartPole-v1 (CleanRL's defaults: 1 env, batch 128, an update every 10 steps, 10,000 steps before
# learning), synchronous (dqn.py) and with the actor process (dqn_atari_async.py, given the same settings: its
# defaults are CleanRL's dqn_atari's), in every mode. The budget covers the steady phase only; learning curves need
# the default --total-timesteps 500000.
source "$(dirname "$0")/lib.sh"
case $BENCH_PROFILE in
    smoke) budget=(--total-timesteps 1000 --learning-starts 500 --buffer-size 1000 --measure-burnin 5) ;;
    quick) budget=(--total-timesteps 25000) ;;
    *) budget=(--total-timesteps 60000) ;;
esac
cartpole=(--learning-rate 2.5e-4 --buffer-size 10000 --batch-size 128 --train-frequency 10 --target-network-frequency 500
          --end-e 0.05 --exploration-fraction 0.5 --learning-starts 10000)
run_modes dqn dqn.py --env-id CartPole-v1 "${budget[@]}" --eval-episodes 0 --seed 1
run_modes dqn_async dqn_atari_async.py --env-id CartPole-v1 "${cartpole[@]}" "${budget[@]}" --eval-episodes 0 --seed 1
