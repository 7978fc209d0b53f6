#!/usr/bin/env bash
# PPO Atari on two processes under torchrun (ppo_atari_multigpu.py, envpool Breakout-v5), 4 envs each: the 8 envs of
# benchmarks/ppo_atari.sh, with the same budgets, in every mode, so the two tables read side by side. On one GPU the
# two processes share it (gloo); the env-only ceiling steps both processes' envs together.
source "$(dirname "$0")/lib.sh"
case $BENCH_PROFILE in
    smoke) budget=(--total-timesteps 256 --local-num-envs 2 --num-steps 32 --num-minibatches 2 --update-epochs 2) ;;
    quick) budget=(--total-timesteps 8192 --local-num-envs 4) ;;
    *) budget=(--total-timesteps 40960 --local-num-envs 4) ;;
esac
LAUNCHER="-m torch.distributed.run --standalone --nproc-per-node 2" \
    run_modes ppo_multigpu ppo_atari_multigpu.py --env-id Breakout-v5 "${budget[@]}" --eval-episodes 0 --seed 1
