"""Ours beside LeanRL's and CleanRL's scripts of the same names, for speed, on this machine (CPU or CUDA).

    python benchmarks/compare.py --leanrl CLONE --cleanrl CLONE [--reference-python PY] [--jax-python PY]
                                 [--profile full|quick|smoke] [--rounds N] [--budget-minutes M] [--run-timeout S]
                                 [--sides ours,leanrl] [--only sac,td3] [--headline] [--results FOLDER] [--dry-run]
    ./run.sh --compare --leanrl CLONE --cleanrl CLONE [--quick | --smoke] [...]   (the same)

The rows are those of benchmarks/settings.toml that name a reference script; every side of a row runs its env,
budget, seed and flags: ours in its modes (eager and compile, and on CUDA cudagraphs and compile+cudagraphs),
LeanRL's plain script and its compiled one in its modes, CleanRL's script, the projects' JAX scripts. The
references are read from the clones at the commits in benchmarks/references.py and patched at run time. On a CPU
each side runs at one and two threads and ours also at its default; on CUDA each runs once, the references with one
CPU thread, the setting our scripts choose there (torch's default pool fights the env's worker threads).

Runs go one at a time, in scratch folders, and alternate within a round (the first side and the first of our modes
swap each round). Each run's result is one JSON line in FOLDER/runs.jsonl the moment it ends; a second call skips
what is recorded. --budget-minutes M starts no run that its estimate (the same run's time in earlier records, else
the profile's guess) says will not end within M minutes; each side's headline runs of every row go first. FOLDER
gets compare.md (medians over rounds, ratios, the machine, versions, commits, patches) and compare.png. Steady SPS:
ours from its summary (after warm-up), LeanRL's from the speed it logs (after its burn-in), CleanRL's and the JAX
scripts' from the wall times of their logged points, from the third after learning starts.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import runner
from references import check_clones, fasttd3_flags, option, package_versions, script_path, write_reference

# a run's seconds before any record says better (a compiling run: twice), on a CPU and on CUDA
GUESS_SECONDS = {False: {"smoke": 30, "quick": 90, "full": 240}, True: {"smoke": 30, "quick": 60, "full": 120}}
SIDES = ("ours", "leanrl", "cleanrl", "jax", "fasttd3", "sb3_contrib")
PROJECT = {"leanrl": "LeanRL", "cleanrl": "CleanRL", "fasttd3": "FastTD3", "sb3_contrib": "SB3-contrib"}
# the sides whose runs are left out without their clone, where the others' clones are needed
OPTIONAL = ("fasttd3", "sb3_contrib")
NAMES = {"ours": "ours", "jax": "JAX", **PROJECT}
# XLA's CPU runtime takes every core; one thread: its Eigen pool switched off, the flags jax users pass for one thread
XLA_ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
KEY = ("row", "side", "script", "mode", "threads", "round", "profile")


def compared(rows):
    """The names of settings.toml's rows that have a reference script."""
    return [name for name, row in rows.items() if set(SIDES[1:]) & set(row)]


def plan(rows, names, rounds, cuda, headline_only=False):
    """The runs in order: (row, side, script, mode, threads, round). Per round: each side's headline runs of every
    row first (LeanRL's compiled script, CleanRL's, each JAX script, and ours at its default threads: on CUDA in its
    fastest mode, on a CPU in both, so that --compile is timed beside eager), then the rest (none with
    `headline_only`); within a row the sides go ours, LeanRL, CleanRL, JAX, and our modes at one thread count one
    after the other, both orders reversed every other round (runs late in a series ran slower here, so a fixed order
    would favour a mode). A JAX script's mode is "jit" (XLA compiles every jitted function at its first call)."""
    our_modes = list(runner.MODES) if cuda else ["eager", "compile"]
    leanrl_modes = our_modes[1:] if cuda else ["compile"]
    our_threads, their_threads, jax_threads = (
        (["default"], [1], [1]) if cuda else (["default", 1, 2], [1, 2], ["default", 1])
    )
    runs = []
    for round_index in range(1, rounds + 1):
        forward = round_index % 2 == 1
        tiers = ([], [])
        for name in names:
            row = rows[name]
            plain, compiled = row.get("leanrl", ["", ""])
            jax = [f"{project.lower()}/{script}" for project, script, *only in row.get("jax", []) if cuda or not only]
            modes = our_modes if forward else our_modes[::-1]
            by_side = {
                "ours": [(row["script"], mode, threads) for threads in our_threads for mode in modes],
                "leanrl": [(compiled, mode, threads) for mode in leanrl_modes for threads in their_threads]
                + [(plain, "eager", threads) for threads in their_threads],
                "cleanrl": [(row.get("cleanrl"), "eager", threads) for threads in their_threads],
                "jax": [(script, "jit", threads) for script in jax for threads in jax_threads],
                # FastTD3's train.py: eager, and compiled its own way (on CUDA its CUDA graphs too)
                "fasttd3": [
                    (row.get("fasttd3"), mode, threads) for mode in ("eager", "compile") for threads in their_threads
                ],
                # SB3-contrib's class: eager, as it has no compiled mode
                "sb3_contrib": [(row.get("sb3_contrib"), "eager", threads) for threads in their_threads],
            }
            headline = [("ours", row["script"], mode, "default") for mode in (our_modes[-1:] if cuda else our_modes)]
            headline += [("leanrl", compiled, leanrl_modes[-1], 1), ("cleanrl", row.get("cleanrl"), "eager", 1)]
            headline += [("jax", script, "jit", jax_threads[0]) for script in jax]
            headline += [("fasttd3", row.get("fasttd3"), "compile" if cuda else "eager", 1)]
            headline += [("sb3_contrib", row.get("sb3_contrib"), "eager", 1)]
            for side in SIDES if forward else SIDES[::-1]:
                for run in by_side[side]:
                    tier = (side, *run) not in headline
                    if run[0] and not (tier and headline_only):
                        tiers[tier].append((name, side, *run, round_index))
        runs += tiers[0] + tiers[1]
    return runs


def run_key(record):
    return tuple(record[key] for key in KEY)


def load_runs(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def steady_sps(points, learning_starts):
    """Steps per second between the third logged point after learning starts and the last, by the points' wall
    times: what a script logs as it goes, less its random steps and the first updates (a JIT compilation, a
    compiled graph's first call); None with fewer than two such points."""
    points = [point for point in points if point[0] > learning_starts][2:]
    if len(points) < 2 or points[-1][1] <= points[0][1]:
        return None
    return (points[-1][0] - points[0][0]) / (points[-1][1] - points[0][1])


def reference_sps(workdir, jax, learning_starts):
    """A reference's steady SPS. CleanRL's scripts: by the wall times of their TensorBoard SPS points (their own
    figure counts from the start, random steps and all). LeanRL's: the last speed they logged, steps per second
    since their burn-in; their JAX scripts start that clock before the first update, and so count its JIT
    compilation: for them, the wall times of the logged points as for CleanRL's, and the logged speed only where too
    few points came after learning started (their PPO logs every tenth iteration, and its burn-in of three
    iterations leaves compilation out)."""
    logged = runner.Logs(workdir).read()
    if "wandb/speed" not in logged:
        return steady_sps(logged.get("charts/SPS", []), learning_starts)
    return jax and steady_sps(logged["wandb/speed"], learning_starts) or logged["wandb/speed"][-1][2]


def command(args, rows, run):
    """(the Python, the words after it: the script as the repository or its clone names it and its flags, the
    environment's settings) of one of `plan`'s runs."""
    name, side, script, mode, threads = run[:5]
    if side == "ours":
        extra = ["--torch-threads", str(threads)] * (threads != "default") + runner.mode_flags(mode)
        return args.python, runner.our_command(rows, name, args.profile, *extra), {}
    flags, settings = runner.flags(rows, name, args.profile), {}
    if "reference_env" in rows[name]:
        flags[flags.index("--env-id") + 1] = rows[name]["reference_env"]
    if threads != "default":
        settings["OMP_NUM_THREADS"] = str(threads)
    if side == "jax" and threads == 1:
        settings["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {XLA_ONE_THREAD}".strip()
    python = args.jax_python if side == "jax" else args.reference_python
    script = script_path(PROJECT[script.split("/")[0] if side == "jax" else side], script.split("/")[-1])
    if side == "fasttd3":  # the same settings under its names
        import torch

        return python, [script, *fasttd3_flags(flags, torch.cuda.is_available(), mode), "--seed", "1"], settings
    return python, [script, *flags, *runner.mode_flags(mode), "--seed", "1"], settings


def run_one(args, clones, rows, run, limit):
    """One run in a scratch folder; its record (sps None with the reason when it gave none)."""
    python, words, settings = command(args, rows, run)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    env.update(settings, MUJOCO_GL="disable")  # no run renders; an inherited MUJOCO_GL=egl without EGL fails
    record = {"command": runner.record_command(python, words, settings), "packages": package_versions(python)}
    starts = int(words[words.index("--learning-starts") + 1]) if "--learning-starts" in words else 0
    with tempfile.TemporaryDirectory() as workdir:
        if run[1] == "ours":
            ended = runner.run([python, os.path.join(runner.ROOT, words[0]), *words[1:]], workdir, env, limit)
            summary = runner.summary(ended.stdout) or {}
            record.update({key: summary.get(key) for key in ("sps", "warmup_seconds", "torch_threads", "device")})
        else:
            project = PROJECT[words[0].split("/")[0] if run[1] == "jax" else run[1]]
            path, found = write_reference(project, os.path.basename(words[0])[:-3], clones[option(project)], workdir)
            record.update(found, script_path=found.pop("script"))
            ended = runner.run([python, path, *words[1:]], workdir, env, limit)
            record["sps"] = reference_sps(workdir, run[1] == "jax", starts)
    record["seconds"] = ended.seconds
    tail = [line for line in ended.stderr.strip().splitlines() if "Warning" not in line][-2:]
    if ended.stopped or ended.returncode or not record["sps"]:
        record["sps"] = None
        record["error"] = (
            f"stopped {ended.stopped}" if ended.stopped
            else f"exit code {ended.returncode}: " + " / ".join(tail)[-600:] if ended.returncode
            else "it ended without a steady SPS: a budget too short for its burn-in"
        )  # fmt: skip
    return record


def machine():
    """The machine a table was measured on, in words."""
    import torch

    with open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    words = f"{names[0] if names else platform.machine()}, {os.cpu_count()} cores"
    if torch.cuda.is_available():
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        driver = subprocess.run(query, capture_output=True, text=True).stdout.strip() or "unknown"
        words += f", {torch.cuda.get_device_name(0)} (driver {driver})"
    return words


def medians(records):
    """{(row, side, script, mode, threads): (median SPS, rounds)} of the runs that gave one."""
    groups = {}
    for r in records:
        if r.get("sps"):
            groups.setdefault(run_key(r)[:5], []).append(r["sps"])
    return {key: (statistics.median(values), len(values)) for key, values in groups.items()}


def each(records, key, length=None):
    """The records' distinct values of `key`, in one phrase."""
    return "; ".join(sorted({str(r[key])[:length] for r in records})) or "none"


def env_of(records, row):
    """The env id the row's runs took, from their commands (ours first)."""
    commands = sorted((r["side"] != "ours", r["command"].split()) for r in records if r["row"] == row)
    words = next((words for _, words in commands if "--env-id" in words), None)
    return words[words.index("--env-id") + 1] if words else "its default env"


def best_settings(records):
    """The table of each row's best setting per side and the ratios (compare.md's first, the README's), and
    {(row, side): SPS}. The JAX column is the faster of the two projects' JAX scripts, named."""
    table, rows = medians(records), runner.settings()["rows"]
    # the JAX and FastTD3 columns where they have a figure
    shown = [side for side in SIDES if side in SIDES[:3] or any(key[1] == side for key in table)]
    lines = ["| script | " + "".join(f"{NAMES[side]}: best | " for side in shown)]
    lines[0] += "".join(f"ours / {NAMES[side]} | " for side in shown[1:])
    lines[0] = lines[0].rstrip()
    lines.append("| --- " * (1 + len(shown)) + "| ---: " * (len(shown) - 1) + "|")
    best = {}
    for row in [row for row in compared(rows) if any(key[0] == row for key in table)]:
        cells = []
        for side in shown:
            found = [(sps, key) for key, (sps, _) in table.items() if key[:2] == (row, side)]
            sps, key = max(found, key=lambda item: item[0]) if found else (None, None)
            best[row, side] = sps
            setting = key and (f"{PROJECT[key[2].split('/')[0]]}'s {key[2].split('/')[1]}" if side == "jax" else key[3])
            threads = key and {"default": "its default threads", 1: "1 thread"}.get(key[4], f"{key[4]} threads")
            tried = any((r["row"], r["side"]) == (row, side) for r in records)
            cells.append(f"{sps:.0f} ({setting}, {threads})" if found else "no SPS" if tried else "-")
        for side in shown[1:]:
            cells.append(
                f"{best[row, 'ours'] / best[row, side]:.2f}x" if best[row, "ours"] and best[row, side] else "-"
            )
        lines.append(f"| {rows[row].get('title', row)}, {env_of(records, row)} | " + " | ".join(cells) + " |")
    return lines, best


def write_tables(folder, records):
    """compare.md and compare.png from the records: per row each side's best setting and the ratios, then every
    setting's median, the runs that gave no SPS and the references' patches."""
    table, order = medians(records), compared(runner.settings()["rows"])
    ours, jax = [r for r in records if r["side"] == "ours"], [r for r in records if r["side"] == "jax"]
    theirs = [r for r in records if r["side"] in PROJECT]
    packages = f"Ours at {each(ours, 'commit', 8)} with {each(ours, 'packages')}"
    packages += f"; the references with {each(theirs, 'packages')}" * bool(theirs)
    packages += f"; the JAX scripts with {each(jax, 'packages')}" * bool(jax)
    lines = [
        f"# Ours beside LeanRL and CleanRL{', and their JAX scripts' * bool(jax)}"
        + "".join(f", and {PROJECT[side]}" for side in OPTIONAL if any(r["side"] == side for r in records))
        + f": {each(records, 'machine')}",
        "",
        f"Measured {each(records, 'date')}, {each(records, 'profile')} budgets, one run at a time. {packages}. Made "
        "by `python benchmarks/compare.py` (`./run.sh --compare`); every run's command, SPS and time is a line of "
        "runs.jsonl beside this page.",
    ]
    if jax:
        one_thread = (
            f'one thread is `XLA_FLAGS="{XLA_ONE_THREAD}"` with `OMP_NUM_THREADS=1` for the torch that CleanRL\'s JAX '
            "scripts log and buffer with"
        )
        # the settings the records hold: a --headline sweep on a CPU runs only XLA's default
        settings = {r["threads"] for r in jax}
        ran = f"at XLA's default threads (its pool takes every core) and at one thread; {one_thread}"
        if settings == {"default"}:
            ran = f"at XLA's default threads only (its pool takes every core); {one_thread}: not run here"
        elif settings == {1}:
            ran = f"at one thread only; {one_thread}"
        lines += [
            "",
            "The JAX scripts' steady SPS, like CleanRL's, comes from the wall times of the points they log, from the "
            "third after learning starts: their JIT compilation (at each jitted function's first call) falls before "
            f"it. LeanRL's JAX scripts log to the wandb stand-in, which keeps each point's time. They ran {ran}.",
        ]
    best_lines, best = best_settings(records)
    lines += ["", *best_lines, "", "Every setting, median SPS over the rounds that gave one:", ""]
    lines += [
        "| row | side | script | mode | threads | SPS | rounds | warm-up s (ours) |",
        "| --- " * 5 + "| ---: " * 3 + "|",
    ]
    for key in sorted(table, key=lambda k: (order.index(k[0]), SIDES.index(k[1]), k[2], k[3], str(k[4]))):
        warmups = [r["warmup_seconds"] for r in records if r.get("warmup_seconds") and key == run_key(r)[:5]]
        warmup = f"{statistics.median(warmups):.1f}" if warmups else ""
        lines.append("| " + " | ".join(map(str, key)) + f" | {table[key][0]:.0f} | {table[key][1]} | {warmup} |")
    if failed := [r for r in records if not r.get("sps")]:
        lines += ["", "Runs that gave no SPS (the reason is the run's last line on stderr):", ""]
        lines += [f"- {' '.join(map(str, run_key(r)[:4]))} {r['threads']} threads, round {r['round']}: {r['error']}"
                  for r in failed]  # fmt: skip
    patches = {f"{r['repository']} {r['script_path']} at {r['commit'][:8]}": r.get("patches", []) for r in theirs + jax}
    lines += ["", "Reference scripts and their run-time patches:", ""]
    lines += [f"- {script}: " + "; ".join(reasons) for script, reasons in sorted(patches.items())]
    with open(os.path.join(folder, "compare.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    if plt := runner.pyplot():
        rows = [row for row in order if any(key[0] == row for key in table)]
        fig, ax = plt.subplots(figsize=(1.6 * max(len(rows), 2) + 2, 3.5))
        for i, side in enumerate(SIDES):
            heights = [best.get((row, side)) or 0 for row in rows]
            ax.bar([j + (i - len(SIDES) / 2) * 0.14 for j in range(len(rows))], heights, width=0.14, label=side)
        ax.set_xticks(range(len(rows)), rows)
        ax.set(ylabel="steady SPS, best setting", yscale="log")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(folder, "compare.png"), dpi=100)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    runner.add_arguments(parser)
    parser.add_argument("--rounds", type=int, help="default: 3, and 1 with --profile smoke")
    parser.add_argument("--budget-minutes", type=float, help="start no run that would end after M minutes")
    parser.add_argument("--run-timeout", type=float, help="seconds after which a run is stopped")
    parser.add_argument("--sides", default=",".join(SIDES), help="comma-separated sides from: " + ", ".join(SIDES))
    parser.add_argument("--headline", action="store_true", help="only each side's headline runs (as smoke does)")
    parser.add_argument("--collect", action="store_true", help="only write the tables from FOLDER/runs.jsonl")
    args = parser.parse_args()
    rows = runner.settings()["rows"]
    names = args.only.split(",") if args.only else compared(rows)
    if unknown := [n for n in names if n not in compared(rows)] + [s for s in args.sides.split(",") if s not in SIDES]:
        parser.error(f"unknown rows or sides: {', '.join(unknown)} (rows: {', '.join(compared(rows))})")
    args.rounds = args.rounds or (1 if args.profile == "smoke" else 3)
    if args.rounds < 1 or (args.budget_minutes or 1) <= 0:
        parser.error("--rounds and --budget-minutes must be positive")
    args.python = os.environ.get("PYTHON", sys.executable)
    sides = args.sides.split(",")
    # the projects whose scripts the runs read; FastTD3's and SB3-contrib's runs are left out without their clones
    needed = {PROJECT[side] for side in sides if side in PROJECT for name in names if side in rows[name]}
    needed |= {project for name in names for project, *_ in rows[name].get("jax", [])} if "jax" in sides else set()
    optional = {PROJECT[side] for side in OPTIONAL}
    clones = check_clones(parser, args, () if args.collect or args.dry_run else needed - optional)
    args.jax_python = args.jax_python or args.reference_python
    import torch

    cuda = torch.cuda.is_available()
    runs = plan(rows, names, args.rounds, cuda, args.headline or args.profile == "smoke")
    runs = [run for run in runs if run[1] in sides]
    if not args.dry_run:  # FastTD3's and SB3-contrib's runs need their clones (--fasttd3, --sb3-contrib)
        runs = [run for run in runs if run[1] not in OPTIONAL or run[1] in clones]
    if args.dry_run:
        for run in runs:
            print(runner.record_command(*command(args, rows, run)))
        return
    folder = runner.results_folder(args.results, "compare")
    records = load_runs(os.path.join(folder, "runs.jsonl"))
    if not args.collect:
        sweep(args, rows, runs, clones, os.path.join(folder, "runs.jsonl"), records, cuda)
    write_tables(folder, records)
    with open(os.path.join(folder, "compare.md")) as f:
        print(f.read(), end="")


def sweep(args, rows, runs, clones, path, records, cuda):
    """Runs what `runs` holds and `records` lacks, appending each run's record to `path` as it ends."""
    done = {run_key(r) for r in records}
    commit = subprocess.run(["git", "-C", runner.ROOT, "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    # a reference's record takes its own commit from run_one
    shared = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "device": "cuda" if cuda else "cpu"}
    shared["commit"] = commit.strip() or "unknown"
    if any(run[1] == "jax" for run in runs) and (missing := missing_jax(args.jax_python)):
        print(f"note: {args.jax_python} lacks {missing}: the JAX scripts are left out "
              "(requirements/requirements-jax.txt, --jax-python)", flush=True)  # fmt: skip
        runs = [run for run in runs if run[1] != "jax"]
    started = time.time()
    for run in [run for run in runs if (*run, args.profile) not in done]:
        name, side, script, mode, threads, round_index = run
        left = None if args.budget_minutes is None else args.budget_minutes * 60 - (time.time() - started)
        same = [
            r["seconds"]
            for r in records
            if (r["row"], r["side"], r["mode"], r["profile"]) == (name, side, mode, args.profile)
        ]
        guess = GUESS_SECONDS[cuda][args.profile] * (2 if "compile" in mode else 1)
        if left is not None and (statistics.median(same) if same else guess) > left:
            print(f"{name} {side} {script} {mode} round {round_index}: left for a later call", flush=True)
            continue
        limit = min([limit for limit in (left, args.run_timeout) if limit is not None], default=None)
        record = {**dict(zip(KEY, (*run, args.profile))), **shared, **run_one(args, clones, rows, run, limit)}
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
        records.append(record)
        sps = f"{record['sps']:.1f} SPS" if record["sps"] else record["error"]
        print(f"{name} {side} {script} {mode} {threads} threads round {round_index}: {sps}", flush=True)


def missing_jax(python):
    """The JAX packages `python` cannot import, in words ("" when it has them all)."""
    check = "import importlib.util as u; print(', '.join(m for m in ('jax', 'flax', 'optax') if not u.find_spec(m)))"
    return subprocess.run([python, "-c", check], capture_output=True, text=True).stdout.strip()


if __name__ == "__main__":
    main()
