#!/usr/bin/env bash
# Reproduce every speed table: each benchmarks/<algo>.sh in every mode, then the collector.
set -euo pipefail
usage() {
    cat <<'TEXT'
usage: ./run.sh [--quick | --smoke] [--results FOLDER]
Runs every script in every speed mode (benchmarks/<algo>.sh), then writes the tables and the chart.
  (no option)        full budgets: hours on a CPU
  --quick            short budgets: a few minutes per script on a CPU
  --smoke            tiny budgets, into a temporary folder unless --results names one
  --results FOLDER   where the run summaries, speed.md and speed.png go
                     (default: benchmarks/results/<machine-tag>/)
  -h, --help         this text
  MODES="eager compile" ./run.sh ...   only those modes (default: all four)
TEXT
}
refuse() { echo "error: $1" >&2; usage >&2; exit 2; }
export BENCH_PROFILE=full
while [ $# -gt 0 ]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --quick) BENCH_PROFILE=quick ;;
        --smoke) BENCH_PROFILE=smoke ;;
        --results) [ $# -ge 2 ] || refuse "--results needs a folder"; export RESULTS_DIR=$(realpath -m -- "$2"); shift ;;
        *) refuse "unknown argument '$1' (a results folder is named with --results FOLDER)" ;;
    esac
    shift
done
cd "$(dirname "$0")"
if [ "$BENCH_PROFILE" = smoke ] && [ -z "${RESULTS_DIR:-}" ]; then export RESULTS_DIR=$(mktemp -d); fi
source benchmarks/lib.sh  # picks the machine's results folder unless one was given
export RESULTS_DIR PYTHON
for bench in benchmarks/*.sh; do
    if [ "$(basename "$bench")" != lib.sh ]; then bash "$bench"; fi
done
"$PYTHON" benchmarks/collect.py "$RESULTS_DIR"
