#!/usr/bin/env bash
# IMPALA on Breakout-v5 (Nature CNN, unrolls of 20 steps, 32 per update) with 8 envs in all, the env count of
# ppo_atari.sh: 2 actors x 4 envs in every mode; then, eager only, 1 actor x 8 envs, 4 actors x 2 envs, and
# 2 actors x 4 envs with half of each batch replayed (LASER); and 2 actors x 4 envs with the LSTM core, in every
# mode. The first updates (actor start-up, compilation) are left out of the speed figure.
source "$(dirname "$0")/lib.sh"
case $BENCH_PROFILE in
    smoke) budget=(--total-timesteps 256 --unroll-length 8 --batch-size 8 --measure-burnin 2) ;;
    quick) budget=(--total-timesteps 20480) ;;
    *) budget=(--total-timesteps 81920) ;;
esac
common=(--env-id Breakout-v5 "${budget[@]}" --eval-episodes 0 --seed 1)
run_modes impala impala_ray.py "${common[@]}" --num-actors 2 --envs-per-actor 4
MODES=eager run_modes impala_1actor impala_ray.py "${common[@]}" --num-actors 1 --envs-per-actor 8
MODES=eager run_modes impala_4actors impala_ray.py "${common[@]}" --num-actors 4 --envs-per-actor 2
MODES=eager run_modes impala_replay impala_ray.py "${common[@]}" --num-actors 2 --envs-per-actor 4 --replay-ratio 0.5
run_modes impala_lstm impala_ray.py "${common[@]}" --num-actors 2 --envs-per-actor 4 --lstm
