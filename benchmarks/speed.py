"""Every script in every speed mode, with the same seed and budget: each row of settings.toml run once per mode, its
summary kept as FOLDER/NAME__MODE.json, then its env-only ceiling (benchmarks/env_only.py) as NAME__env_only.json;
a row with a `tool` keeps that program's output as its `output`. Each benchmarks/<group>.sh runs its group's rows,
./run.sh every group; benchmarks/collect.py makes the tables of FOLDER.

    python benchmarks/speed.py [--group G] [--profile full|quick|smoke] [--modes "eager compile"] [--results FOLDER]
                               [--dry-run]
The profile, the modes and the folder default to $BENCH_PROFILE, $MODES and $RESULTS_DIR (run.sh sets them), else
full, all four and benchmarks/results/<machine-tag>. Our scripts run with $PYTHON where it is set.
"""

import argparse
import json
import os
import sys
import tempfile

import runner


def commands(rows, names, profile, modes, env_only_steps):
    """(the file it writes, the command relative to the repository) of every run, in order."""
    runs = []
    for name in names:
        row, flags = rows[name], runner.flags(rows, name, profile)
        if "tool" in row:
            runs.append((row["output"], [row["tool"], *flags]))
            continue
        script, launcher = f"leanrl_scripts/{row['script']}", row.get("launcher", [])
        for mode in [mode for mode in modes if mode in row.get("modes", runner.MODES)]:
            command = [*launcher, script, *flags, "--eval-episodes", "0", "--seed", "1", *runner.mode_flags(mode)]
            runs.append((f"{name}__{mode}.json", command))
        # env_only.py reads the script's env flags and torchrun's --nproc-per-node from the same words
        command = ["benchmarks/env_only.py", script, *flags, *launcher, "--steps", str(env_only_steps)]
        runs.append((f"{name}__env_only.json", command))
    return runs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", help="only the rows of benchmarks/GROUP.sh")
    parser.add_argument("--profile", choices=runner.PROFILES, default=os.environ.get("BENCH_PROFILE", "full"))
    parser.add_argument("--modes", default=os.environ.get("MODES", " ".join(runner.MODES)))
    parser.add_argument("--results", default=os.environ.get("RESULTS_DIR"))
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args()
    table = runner.settings()
    rows = table["rows"]
    names = [name for name in rows if args.group in (None, rows[name]["group"])]
    if not names:
        parser.error(f"no rows in group {args.group}")
    python = os.environ.get("PYTHON", sys.executable)
    runs = commands(rows, names, args.profile, args.modes.split(), table["env_only_steps"][args.profile])
    if args.dry_run:
        for output, command in runs:
            print(f"{runner.record_command(python, command)} > {output}")
        return
    folder = runner.results_folder(args.results)
    for output, command in runs:
        print(f"== {output}: {' '.join(command)}", file=sys.stderr, flush=True)
        absolute = [os.path.join(runner.ROOT, word) if word.endswith(".py") else word for word in command]
        with tempfile.TemporaryDirectory() as workdir:  # the runs' own folders (runs/, videos) go with it
            ended = runner.run([python, *absolute], workdir)
        ours = "__" in output and not output.endswith("__env_only.json")  # a mode's run: its summary is kept
        summary = runner.summary(ended.stdout) if ours else None
        if ended.returncode or (ours and summary is None):
            sys.exit(f"error: {' '.join(command)} failed (exit code {ended.returncode}):\n{ended.stderr[-2000:]}")
        with open(os.path.join(folder, output), "w") as f:
            f.write(json.dumps(summary) + "\n" if ours else ended.stdout)


if __name__ == "__main__":
    main()
