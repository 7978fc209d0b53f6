# Sourced by benchmarks/<algo>.sh: run one script in every speed mode with the same seed and budget.
# BENCH_PROFILE picks the budget (full | quick | smoke); RESULTS_DIR is where the summaries go.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python}
BENCH_PROFILE=${BENCH_PROFILE:-full}
machine_tag() {
    "$PYTHON" -c "import os, re, torch; name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f'cpu-{os.cpu_count()}core'; print(re.sub('[^A-Za-z0-9]+', '-', name).strip('-').lower())"
}
RESULTS_DIR=${RESULTS_DIR:-$ROOT/benchmarks/results/$(machine_tag)}
mkdir -p "$RESULTS_DIR"

# run_modes NAME SCRIPT ARGS...: one run per mode, its summary saved as RESULTS_DIR/NAME__MODE.json,
# then the env-only ceiling as RESULTS_DIR/NAME__env_only.json. MODES="eager" (say) runs fewer modes.
# LAUNCHER="-m torch.distributed.run --nproc-per-node 2 ..." starts the script through that module (env_only.py
# reads its --nproc-per-node: every process's envs, stepped together).
run_modes() {
    local name=$1 script=$2; shift 2
    local launcher=(${LAUNCHER:-})
    local workdir; workdir=$(mktemp -d)
    for mode in ${MODES:-eager compile cudagraphs compile+cudagraphs}; do
        local flags=()
        [[ $mode == *compile* ]] && flags+=(--compile)
        [[ $mode == *cudagraphs* ]] && flags+=(--cudagraphs)
        echo "== $name $mode: ${launcher[*]:+${launcher[*]} }$script $* ${flags[*]}" >&2
        (cd "$workdir" && "$PYTHON" "${launcher[@]}" "$ROOT/leanrl_scripts/$script" "$@" "${flags[@]}") > "$workdir/out.log"
        grep '^SPEED ' "$workdir/out.log" | tail -n 1 | cut -c7- > "$RESULTS_DIR/${name}__${mode}.json"
    done
    local env_steps=20000  # a smoke run checks the plumbing, not the ceiling: 20,000 Atari steps cost 10-15 s
    [ "$BENCH_PROFILE" = smoke ] && env_steps=2000
    "$PYTHON" "$ROOT/benchmarks/env_only.py" "$ROOT/leanrl_scripts/$script" "$@" "${launcher[@]}" --steps "$env_steps" \
        > "$RESULTS_DIR/${name}__env_only.json"
    rm -rf "$workdir"
}
