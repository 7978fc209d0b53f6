"""Every script in every speed mode, with the same seed and budget: each row of settings.toml run once per mode, its
summary kept as FOLDER/NAME__MODE.json, then its env-only ceiling (benchmarks/env_only.py) as NAME__env_only.json;
a row with a `tool` keeps that program's output as its `output`. With --group, only the rows of that group (an
algorithm's table: ./run.sh --group G); without, every row (./run.sh); benchmarks/collect.py makes the tables of FOLDER.

    python benchmarks/speed.py [--group G] [--profile full|quick|smoke] [--modes "eager compile"] [--results FOLDER]
                               [--dry-run]
The profile, the modes and the folder default to $BENCH_PROFILE, $MODES and $RESULTS_DIR (run.sh sets them), else
full, all four and benchmarks/results/<machine-tag>. Our scripts run with $PYTHON where it is set.
"""

import argparse
import json
import os
import sys

import runner


def commands(rows, names, profile, modes, env_only_steps):
    """(the file it writes, the command relative to the repository) of every run, in order."""
    runs = []
    for name in names:
        if "tool" in rows[name]:
            runs.append((rows[name]["output"], [rows[name]["tool"], *runner.flags(rows, name, profile)]))
            continue
        for mode in [mode for mode in modes if mode in rows[name].get("modes", runner.MODES)]:
            runs.append((f"{name}__{mode}.json", runner.our_command(rows, name, profile, *runner.mode_flags(mode))))
        # env_only.py takes the script first, then its env flags and torchrun's --nproc-per-node among the others
        launcher = rows[name].get("launcher", [])
        words = runner.our_command(rows, name, profile)[len(launcher) :]
        env_only = ["benchmarks/env_only.py", *words, *launcher, "--steps", str(env_only_steps)]
        runs.append((f"{name}__env_only.json", env_only))
    return runs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", help="only the rows of this group in settings.toml (default: every row)")
    parser.add_argument("--profile", choices=runner.PROFILES, default=os.environ.get("BENCH_PROFILE", "full"))
    parser.add_argument("--modes", default=os.environ.get("MODES", " ".join(runner.MODES)))
    parser.add_argument("--results", default=os.environ.get("RESULTS_DIR"))
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args()
    table = runner.settings()
    groups = list(dict.fromkeys(row["group"] for row in table["rows"].values()))
    if args.group not in (None, *groups):
        parser.exit(2, f"error: no group '{args.group}' in settings.toml (its groups: {', '.join(groups)})\n")
    names = [name for name, row in table["rows"].items() if args.group in (None, row["group"])]
    python = os.environ.get("PYTHON", sys.executable)
    folder = None if args.dry_run else runner.results_folder(args.results)
    for output, words in commands(
        table["rows"], names, args.profile, args.modes.split(), table["env_only_steps"][args.profile]
    ):
        print(
            f"{runner.record_command(python, words)} > {output}",
            file=sys.stdout if args.dry_run else sys.stderr,
            flush=True,
        )
        if args.dry_run:
            continue
        ended, summary = runner.run_in_scratch(python, words)
        ours = output.endswith(".json") and "__" in output and not output.endswith("__env_only.json")  # a mode's run
        if ended.returncode or (ours and not summary):
            sys.exit(f"error: {' '.join(words)} failed (exit code {ended.returncode}):\n{ended.stderr[-2000:]}")
        with open(os.path.join(folder, output), "w") as f:
            f.write(json.dumps(summary) + "\n" if ours else ended.stdout)


if __name__ == "__main__":
    main()
