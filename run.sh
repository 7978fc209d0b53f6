#!/usr/bin/env bash
# Reproduce every speed table: each benchmarks/<algo>.sh in every mode, then the collector.
#   ./run.sh [FOLDER]          full budgets, results in FOLDER (default benchmarks/results/<machine-tag>/)
#   ./run.sh --quick [FOLDER]  short budgets (a few minutes per script on a CPU)
#   ./run.sh --smoke [FOLDER]  tiny budgets into a temporary folder (CI runs it with MODES="eager compile+cudagraphs")
#   MODES="eager compile" ./run.sh ...  only those modes (default: all four)
set -euo pipefail
cd "$(dirname "$0")"
export BENCH_PROFILE=full
case "${1:-}" in
    --quick) BENCH_PROFILE=quick; shift ;;
    --smoke) BENCH_PROFILE=smoke; shift; export RESULTS_DIR=${1:-$(mktemp -d)} ;;
    --*) echo "error: unknown option $1 (use --quick or --smoke)" >&2; exit 2 ;;
esac
if [ -n "${1:-}" ]; then export RESULTS_DIR=$1; fi
source benchmarks/lib.sh  # picks the machine's results folder unless one was given
export RESULTS_DIR PYTHON
for bench in benchmarks/*.sh; do
    if [ "$(basename "$bench")" != lib.sh ]; then bash "$bench"; fi
done
"$PYTHON" benchmarks/collect.py "$RESULTS_DIR"
