#!/usr/bin/env bash
# TD3 on HalfCheetah-v5 (CleanRL's defaults: 1 env, batch 256) in every mode. Learning starts after 5,000
# random steps here (the default 25,000 only delays the steady phase); learning curves need the defaults.
source "$(dirname "$0")/lib.sh"
case $BENCH_PROFILE in
    smoke) budget=(--env-id Pendulum-v1 --total-timesteps 300 --learning-starts 200 --batch-size 64 --measure-burnin 5) ;;
    quick) budget=(--env-id HalfCheetah-v5 --total-timesteps 6500 --learning-starts 5000) ;;
    *) budget=(--env-id HalfCheetah-v5 --total-timesteps 15000 --learning-starts 5000) ;;
esac
run_modes td3 td3_continuous_action.py "${budget[@]}" --eval-episodes 0 --seed 1
