#!/usr/bin/env bash
# PPO-LSTM on Atari (envpool Breakout-v5, CleanRL's defaults: 8 envs x 128 steps, 4 minibatches of 2 env rows,
# 4 epochs): the padded one-call LSTM, then the per-step loop, in every mode. The first iteration
# (compilation, graph capture) is left out of the speed figure.
source "$(dirname "$0")/lib.sh"
case $BENCH_PROFILE in
    smoke) budget=(--total-timesteps 256 --num-envs 4 --num-steps 32 --num-minibatches 2 --update-epochs 2) ;;
    quick) budget=(--total-timesteps 8192 --num-envs 8) ;;
    *) budget=(--total-timesteps 30720 --num-envs 8) ;;
esac
run_modes ppo_lstm ppo_atari_lstm.py --env-id Breakout-v5 "${budget[@]}" --eval-episodes 0 --seed 1 --lstm-impl padded
run_modes ppo_lstm_loop ppo_atari_lstm.py --env-id Breakout-v5 "${budget[@]}" --eval-episodes 0 --seed 1 --lstm-impl loop
# The update phase alone, one minibatch of 2 env rows x 128 steps: CNN only (the floor), padded, loop.
"$PYTHON" "$ROOT/benchmarks/lstm_update.py" $([[ $BENCH_PROFILE == smoke ]] && echo --repeats 2) > "$RESULTS_DIR/lstm_update.json"
