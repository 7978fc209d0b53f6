"""How many CPU threads should torch use? Each script at 1 thread, at every usable core, and at its own choice,
on an idle machine or one kept busy by other programs (--busy K: K processes spinning on the CPU meanwhile).

    python benchmarks/threads.py [--busy K] [--rounds R] [--only ppo_atari,sac] [--out FILE.md]
Runs alternate (1 thread, all cores, the script's choice; then the next round), one at a time; a row reports the
median SPS of the rounds. Prints a markdown table (and writes it to --out).
"""

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ATARI = ["--env-id", "Breakout-v5", "--eval-episodes", "0"]
# name: (script, flags, flags that shorten the busy runs, where each step costs about three times as long)
CONFIGS = {
    "sac": (
        "sac_continuous_action.py",
        [
            "--env-id",
            "HalfCheetah-v5",
            "--total-timesteps",
            "6000",
            "--learning-starts",
            "5000",
            "--eval-episodes",
            "0",
        ],
        ["--total-timesteps", "5400"],
    ),
    "td3": (
        "td3_continuous_action.py",
        [
            "--env-id",
            "HalfCheetah-v5",
            "--total-timesteps",
            "6000",
            "--learning-starts",
            "5000",
            "--eval-episodes",
            "0",
        ],
        ["--total-timesteps", "5400"],
    ),
    "ppo_continuous": (
        "ppo_continuous_action.py",
        ["--env-id", "HalfCheetah-v5", "--total-timesteps", "20480", "--eval-episodes", "0"],
        ["--total-timesteps", "8192"],
    ),
    "dqn": (
        "dqn.py",
        ["--env-id", "CartPole-v1", "--total-timesteps", "25000", "--eval-episodes", "0"],
        ["--total-timesteps", "15000"],
    ),
    "ppo_atari": ("ppo_atari_envpool.py", ATARI + ["--total-timesteps", "10240"], ["--total-timesteps", "4096"]),
    "ppo_atari_async": (
        "ppo_atari_envpool_async.py",
        ATARI + ["--total-timesteps", "10240"],
        ["--total-timesteps", "4096"],
    ),
    "ppo_lstm": ("ppo_atari_lstm.py", ATARI + ["--total-timesteps", "8192"], ["--total-timesteps", "4096"]),
    "dqn_atari": (
        "dqn_atari.py",
        ATARI + ["--total-timesteps", "3000", "--learning-starts", "1000", "--buffer-size", "5000"],
        ["--total-timesteps", "1800"],
    ),
    "dqn_atari_async": (
        "dqn_atari_async.py",
        ATARI + ["--total-timesteps", "3000", "--learning-starts", "1000", "--buffer-size", "5000"],
        ["--total-timesteps", "1800"],
    ),
    "impala": (
        "impala_ray.py",
        ATARI + ["--total-timesteps", "20480", "--num-actors", "2", "--envs-per-actor", "4"],
        ["--total-timesteps", "8192"],
    ),
}


def spin():
    while True:
        pass


def run(script, flags, threads):
    """One run in a scratch folder: (SPS, the thread count it used). threads=None: the script's own choice."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    extra = [] if threads is None else ["--torch-threads", str(threads)]
    with tempfile.TemporaryDirectory() as workdir:
        proc = subprocess.run(
            [sys.executable, os.path.join(ROOT, "leanrl_scripts", script), *flags, *extra],
            cwd=workdir,
            capture_output=True,
            text=True,
            env=env,
        )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("SPEED ")]
    if proc.returncode or not lines:
        raise SystemExit(f"error: {script} {' '.join(flags + extra)} failed:\n{proc.stderr[-2000:]}")
    summary = json.loads(lines[-1][len("SPEED ") :])
    return summary["sps"], summary["torch_threads"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", type=int, default=0, help="CPU-bound processes running beside each measured run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", default="", help="comma-separated names from: " + ", ".join(CONFIGS))
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(CONFIGS)
    if unknown := set(names) - set(CONFIGS):
        parser.error(f"unknown names {sorted(unknown)}")
    cores = len(os.sched_getaffinity(0))
    spinners = [mp.Process(target=spin, daemon=True) for _ in range(args.busy)]
    for process in spinners:
        process.start()
    try:
        if spinners:
            time.sleep(60)  # let the load average show the spinners
        load = os.getloadavg()[0]
        rows = []
        for name in names:
            script, flags, busy_flags = CONFIGS[name]
            flags = flags + (busy_flags if args.busy else [])  # later flags win in tyro
            sps = {1: [], cores: [], None: []}
            for _ in range(args.rounds):
                for threads in sps:
                    value, used = run(script, flags, threads)
                    sps[threads].append(value)
                    if threads is None:
                        chosen = used
            medians = {threads: statistics.median(values) for threads, values in sps.items()}
            best = max((1, cores), key=medians.get)
            rows.append(
                f"| {name} | {medians[1]:.0f} | {medians[cores]:.0f} | {chosen} | {medians[None]:.0f} "
                f"| {medians[None] / medians[best]:.2f} |"
            )
            print(rows[-1], file=sys.stderr, flush=True)
    finally:
        for process in spinners:
            process.kill()
    title = (
        f"{'busy: ' + str(args.busy) + ' spinning processes' if args.busy else 'idle'}, {cores} cores, "
        f"load average {load:.1f} when the runs began, median of {args.rounds} rounds"
    )
    table = (
        "\n".join(
            [
                f"#### Torch threads, {title}",
                "",
                f"| script | 1 thread SPS | {cores} threads SPS | its choice | its choice SPS | choice / best |",
                "| --- | ---: | ---: | ---: | ---: | ---: |",
                *rows,
            ]
        )
        + "\n"
    )
    print(table, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
