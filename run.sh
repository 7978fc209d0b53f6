#!/usr/bin/env bash
# Reproduce every speed table: every row in every mode (benchmarks/speed.py; one algorithm's rows with --group),
# then the collector; or, with --learning, the learning curves over seeds (benchmarks/learning.py); or, with
# --compare, ours beside LeanRL's and CleanRL's scripts (benchmarks/compare.py); or, with --tune, a hyperparameter
# sweep (benchmarks/tune.py). Every one of them reads its settings from benchmarks/settings.toml.
set -euo pipefail
usage() {
    cat <<'TEXT'
usage: ./run.sh [--group NAME] [--quick | --smoke] [--results FOLDER]
       ./run.sh --learning [--seeds N] [--cleanrl CLONE] [--leanrl CLONE] [--fasttd3 CLONE] [--sb3-contrib CLONE]
               [--reference-python PY] [--jax-python PY] [--until-score] [--max-minutes M] [--quick | --smoke] [--results FOLDER]
       ./run.sh --compare --leanrl CLONE --cleanrl CLONE [--fasttd3 CLONE] [--sb3-contrib CLONE]
               [--reference-python PY] [--jax-python PY] [--rounds N] [--budget-minutes M] [--run-timeout S] [--sides LIST] [--only LIST] [--headline]
               [--quick | --smoke] [--results FOLDER]
       any of them with --dry-run: print the commands it would run, run nothing
       ./run.sh --tune STUDY [--space FILE] [--trials N] [--workers N] [--storage URL] [...]
               (benchmarks/tune.py --help: a study of settings.toml or FILE, in Optuna; docs/tuning.md)
Runs every script in every speed mode (benchmarks/speed.py), then writes the tables and the chart; with
--learning, runs each script's learning task over seeds instead (benchmarks/learning.py) and writes the
curves, the table of final returns and a chart per task into FOLDER/learning.
  (no option)        full budgets: hours on a CPU
  --quick            short budgets: a few minutes per script on a CPU
  --smoke            tiny budgets, into a temporary folder unless --results names one
  --results FOLDER   where the run summaries, speed.md and speed.png go
                     (default: benchmarks/results/<machine-tag>/)
  --group NAME       only the rows of group NAME in benchmarks/settings.toml, one algorithm's (sac, dqn_atari,
                     ...; an unknown NAME is refused with the list), then the tables of FOLDER
  --learning         the learning benchmark (full budgets: CleanRL's, days on a CPU; --quick: hours)
  --seeds N          with --learning: seeds 1..N of each task (default 3)
  --cleanrl CLONE    with --learning: also run CleanRL's scripts (a clone of vwxyzjn/cleanrl) on the same
  --leanrl CLONE     tasks and seeds, LeanRL's (pytorch-labs/LeanRL) for SAC, TD3 and PPO continuous
  --fasttd3 CLONE    with --learning and --compare: FastTD3's own train.py (a clone of younggyoseo/FastTD3)
                     beside fast_td3.py
  --sb3-contrib CLONE with --learning and --compare: SB3-contrib's CrossQ beside crossq.py (a clone of
                     Stable-Baselines-Team/stable-baselines3-contrib; stable-baselines3 in the reference Python)
  --reference-python PY   the Python that runs them (LeanRL's need torchrl; see benchmarks/learning.py)
  --until-score      with --learning: stop each run at its task's score (for the seconds to it only)
  --max-minutes M    with --learning: stop a run after M minutes (recorded as not reaching the score)
  --jax-python PY    with --learning and --compare: the Python that runs both projects' JAX scripts too
                     (requirements/requirements-jax.txt; --compare's default: the reference Python)
  --compare          ours beside LeanRL's and CleanRL's scripts of the same names, every mode, same flags,
                     alternating, one JSON line per run in FOLDER/compare/runs.jsonl; a second call goes on
                     where the first stopped; then FOLDER/compare/compare.md and compare.png
  --rounds N         with --compare: rounds of every run, medians over them (default 3; with --smoke 1, each
                     side's headline runs only)
  --budget-minutes M with --compare: start no run that would not end within M minutes
  --run-timeout S    with --compare: stop a run after S seconds (it is recorded as stopped)
  --sides LIST       with --compare: only these sides, from ours,leanrl,cleanrl,jax,fasttd3,sb3_contrib
                     (default: all)
  --only LIST        with --compare: only these rows of benchmarks/settings.toml (default: every row that
                     names a reference script)
  --headline         with --compare: only each side's headline runs (ours at its default threads, each
                     reference in its fastest mode)
  --dry-run          print the commands the call would run (their settings: benchmarks/settings.toml)
  -h, --help         this text
  MODES="eager compile" ./run.sh ...   only those modes (default: all four)
TEXT
}
refuse() { echo "error: $1" >&2; usage >&2; exit 2; }
if [ "${1:-}" = --tune ]; then  # every word after it is the tuner's; its paths from where it is called
    shift
    exec "${PYTHON:-python}" "$(dirname "$0")/benchmarks/tune.py" "$@"
fi
export BENCH_PROFILE=full
learning=0 compare=0 seeds=3 seeds_given=0 references=() compare_args=() learning_args=() dry_run=() group=()
while [ $# -gt 0 ]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --quick) BENCH_PROFILE=quick ;;
        --smoke) BENCH_PROFILE=smoke ;;
        --results) [ $# -ge 2 ] || refuse "--results needs a folder"; export RESULTS_DIR=$(realpath -m -- "$2"); shift ;;
        --learning) learning=1 ;;
        --dry-run) dry_run=(--dry-run) ;;
        --compare) compare=1 ;;
        --group) [[ $# -ge 2 && $2 != -* ]] || refuse "--group needs a group of benchmarks/settings.toml, such as sac"
            group=(--group "$2"); shift ;;
        --rounds|--budget-minutes|--run-timeout)
            [[ $# -ge 2 && $2 =~ ^[0-9]+([.][0-9]+)?$ && ! $2 =~ ^0*([.]0*)?$ ]] || refuse "$1 needs a positive number"
            compare_args+=("$1" "$2"); shift ;;
        --sides|--only) [[ $# -ge 2 && $2 =~ ^[a-z0-9_,]+$ ]] || refuse "$1 needs a list such as ${1/--only/dqn,td3}"
            compare_args+=("$1" "$2"); shift ;;
        --headline) compare_args+=("$1") ;;
        --until-score) learning_args+=("$1") ;;
        --max-minutes)
            [[ $# -ge 2 && $2 =~ ^[0-9]+([.][0-9]+)?$ && ! $2 =~ ^0*([.]0*)?$ ]] || refuse "$1 needs a positive number"
            learning_args+=("$1" "$2"); shift ;;
        --cleanrl|--leanrl|--fasttd3|--sb3-contrib|--reference-python|--jax-python)
            [ $# -ge 2 ] || refuse "$1 needs a value"; references+=("$1" "$2"); shift ;;
        --seeds) [[ $# -ge 2 && $2 =~ ^[1-9][0-9]*$ ]] || refuse "--seeds needs a whole number, 1 or more"; seeds=$2 seeds_given=1; shift ;;
        *) refuse "unknown argument '$1' (a results folder is named with --results FOLDER)" ;;
    esac
    shift
done
if [ "$seeds_given" = 1 ] && [ "$learning" = 0 ]; then refuse "--seeds counts the seeds of --learning"; fi
if [ "$learning" = 1 ] && [ "$compare" = 1 ]; then refuse "--learning and --compare are two runs: one at a time"; fi
if [ ${#references[@]} -gt 0 ] && [ "$learning" = 0 ] && [ "$compare" = 0 ]; then
    refuse "${references[0]} is an option of --learning and --compare"
fi
if [ ${#compare_args[@]} -gt 0 ] && [ "$compare" = 0 ]; then refuse "${compare_args[0]} is an option of --compare"; fi
if [ ${#learning_args[@]} -gt 0 ] && [ "$learning" = 0 ]; then refuse "${learning_args[0]} is an option of --learning"; fi
if [ ${#group[@]} -gt 0 ] && [ $((learning + compare)) -gt 0 ]; then refuse "--group is an option of the speed runs"; fi
cd "$(dirname "$0")"
if [ "$BENCH_PROFILE" = smoke ] && [ -z "${RESULTS_DIR:-}" ] && [ ${#dry_run[@]} = 0 ]; then
    export RESULTS_DIR=$(mktemp -d)
fi
export PYTHON=${PYTHON:-python}
if [ "$compare" = 1 ]; then
    exec "$PYTHON" benchmarks/compare.py --profile "$BENCH_PROFILE" ${RESULTS_DIR:+--results "$RESULTS_DIR/compare"} \
        ${references[@]+"${references[@]}"} ${compare_args[@]+"${compare_args[@]}"} ${dry_run[@]+"${dry_run[@]}"}
fi
if [ "$learning" = 1 ]; then
    exec "$PYTHON" benchmarks/learning.py --profile "$BENCH_PROFILE" --seeds "$seeds" \
        ${RESULTS_DIR:+--results "$RESULTS_DIR/learning"} ${references[@]+"${references[@]}"} \
        ${learning_args[@]+"${learning_args[@]}"} ${dry_run[@]+"${dry_run[@]}"}
fi
# speed.py refuses an unknown group itself, in one line that names the known ones (exit 2)
"$PYTHON" benchmarks/speed.py ${group[@]+"${group[@]}"} ${dry_run[@]+"${dry_run[@]}"}
if [ ${#dry_run[@]} = 0 ]; then "$PYTHON" benchmarks/collect.py ${RESULTS_DIR:+"$RESULTS_DIR"}; fi
