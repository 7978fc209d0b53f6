#!/usr/bin/env bash
# PPO on Atari (envpool Breakout-v5) with CleanRL's defaults (8 envs x 128 steps, 4 minibatches, 4 epochs) in
# every mode, then the same with ppo_atari_envpool_async.py (one half of the envs steps while the network acts for
# the other). The first iteration (compilation, graph capture) is left out of the speed figure.
source "$(dirname "$0")/lib.sh"
case $BENCH_PROFILE in
    smoke) budget=(--total-timesteps 256 --num-envs 4 --num-steps 32 --num-minibatches 2 --update-epochs 2) ;;
    quick) budget=(--total-timesteps 8192 --num-envs 8) ;;
    *) budget=(--total-timesteps 40960 --num-envs 8) ;;
esac
run_modes ppo_atari ppo_atari_envpool.py --env-id Breakout-v5 "${budget[@]}" --eval-episodes 0 --seed 1
run_modes ppo_atari_async ppo_atari_envpool_async.py --env-id Breakout-v5 "${budget[@]}" --eval-episodes 0 --seed 1
# What bounds the envs on this machine: the script's envpool set-up against envpool's own at 8, 16 and 32 envs
"$PYTHON" "$ROOT/benchmarks/env_ceiling.py" $([[ $BENCH_PROFILE == smoke ]] && echo --steps 256 --envs 8) > "$RESULTS_DIR/env_ceiling.jsonl"
