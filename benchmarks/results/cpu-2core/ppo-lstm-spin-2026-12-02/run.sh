#!/usr/bin/env bash
# From the repository root: PPO-LSTM beside 5 CPU-bound processes, its default spin and GOMP_SPINCOUNT=0 in turn,
# three rounds; prints each run's SPS and the spin count its summary records.
set -u
for i in 1 2 3 4 5; do python -c "while True: pass" & done
trap 'kill $(jobs -p)' EXIT
run=(python leanrl_scripts/ppo_atari_lstm.py --env-id Breakout-v5 --total-timesteps 4096 --num-envs 8 --eval-episodes 0 --seed 1)
for round in 1 2 3; do
    for spin in default 0; do
        if [ "$spin" = default ]; then line=$("${run[@]}" 2>/dev/null | tail -1); else line=$(GOMP_SPINCOUNT=0 "${run[@]}" 2>/dev/null | tail -1); fi
        echo "round $round, spin $spin: $(echo "${line#SPEED }" | python -c 'import json,sys; s=json.load(sys.stdin); print(round(s["sps"], 1), "SPS, gomp_spincount", s["gomp_spincount"])')"
    done
done
