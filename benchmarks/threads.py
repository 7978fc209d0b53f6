"""How many CPU threads should torch use? Each script at 1 thread, at every usable core, and at its own choice,
on an idle machine or one kept busy by other programs (--busy K: K processes spinning on the CPU meanwhile).

    python benchmarks/threads.py [--busy K] [--rounds R] [--only ppo_atari,sac] [--profile quick] [--out FILE.md]
                                 [--dry-run]
The rows and their budgets are benchmarks/settings.toml's (every row without a tool, at the quick budget unless
--profile says otherwise), run eager. Runs alternate (1 thread, all cores, the script's choice; then the next
round), one at a time; a row reports the median SPS of the rounds. Prints a markdown table (and writes it to --out).
"""

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

import runner


def spin():
    while True:
        pass


def words(rows, name, profile, threads):
    """Row `name`'s eager run with `threads` torch threads (None: the script's own choice)."""
    return runner.our_command(rows, name, profile, *([] if threads is None else ["--torch-threads", str(threads)]))


def run(words):
    """One run in a scratch folder: (SPS, the thread count it used)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    ended, summary = runner.run_in_scratch(sys.executable, words, env)
    if ended.returncode or not summary:
        sys.exit(f"error: {' '.join(words)} failed:\n{ended.stderr[-2000:]}")
    return summary["sps"], summary["torch_threads"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", type=int, default=0, help="CPU-bound processes running beside each measured run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", default="", help="comma-separated rows of benchmarks/settings.toml")
    parser.add_argument("--out", help="also write the table to this file")
    parser.add_argument("--profile", choices=runner.PROFILES, default="quick")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args()
    rows = runner.settings()["rows"]
    scripts = [name for name in rows if "tool" not in rows[name]]
    names = args.only.split(",") if args.only else scripts
    if unknown := set(names) - set(scripts):
        parser.error(f"unknown names {sorted(unknown)}")
    cores = len(os.sched_getaffinity(0))
    if args.dry_run:
        for name, threads in [(name, threads) for name in names for threads in (1, cores, None)]:
            print(runner.record_command(sys.executable, words(rows, name, args.profile, threads)))
        return
    spinners = [mp.Process(target=spin, daemon=True) for _ in range(args.busy)]
    for process in spinners:
        process.start()
    try:
        if spinners:
            time.sleep(60)  # let the load average show the spinners
        load = os.getloadavg()[0]
        lines = []
        for name in names:
            sps = {1: [], cores: [], None: []}
            for _ in range(args.rounds):
                for threads in sps:
                    value, used = run(words(rows, name, args.profile, threads))
                    sps[threads].append(value)
                    if threads is None:
                        chosen = used
            medians = {threads: statistics.median(values) for threads, values in sps.items()}
            best = max((1, cores), key=medians.get)
            lines.append(
                f"| {name} | {medians[1]:.0f} | {medians[cores]:.0f} | {chosen} | {medians[None]:.0f} "
                f"| {medians[None] / medians[best]:.2f} |"
            )
            print(lines[-1], file=sys.stderr, flush=True)
    finally:
        for process in spinners:
            process.kill()
    busy = f"busy: {args.busy} spinning processes" if args.busy else "idle"
    title = f"{busy}, {cores} cores, load average {load:.1f} when the runs began, median of {args.rounds} rounds"
    header = f"| script | 1 thread SPS | {cores} threads SPS | its choice | its choice SPS | choice / best |"
    table = "\n".join(
        [f"#### Torch threads, {title}", "", header, "| --- | ---: | ---: | ---: | ---: | ---: |", *lines]
    )
    table += "\n"
    print(table, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
