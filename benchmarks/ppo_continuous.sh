#!/usr/bin/env bash
# PPO (continuous) on HalfCheetah-v5 with CleanRL's defaults (1 env x 2048 steps, 32 minibatches, 10 epochs)
# in every mode. The first iteration (compilation, graph capture) is left out of the speed figure.
source "$(dirname "$0")/lib.sh"
case $BENCH_PROFILE in
    smoke) budget=(--env-id Pendulum-v1 --total-timesteps 256 --num-steps 64 --num-minibatches 4 --update-epochs 2) ;;
    quick) budget=(--env-id HalfCheetah-v5 --total-timesteps 8192) ;;
    *) budget=(--env-id HalfCheetah-v5 --total-timesteps 40960) ;;
esac
run_modes ppo_continuous ppo_continuous_action.py "${budget[@]}" --eval-episodes 0 --seed 1
