"""Ours beside LeanRL's and CleanRL's scripts of the same names, for speed, on this machine (CPU or CUDA).

    python benchmarks/compare.py --leanrl CLONE --cleanrl CLONE [--reference-python PY] [--profile full|quick|smoke]
                                 [--rounds N] [--budget-minutes M] [--only sac,td3] [--results FOLDER]
    ./run.sh --compare --leanrl CLONE --cleanrl CLONE [--quick | --smoke] [...]   (the same)

The clones are plain `git clone`s of pytorch-labs/LeanRL and vwxyzjn/cleanrl; their scripts are read at the commits
pinned in benchmarks/references.py and patched at run time (the patches and commits go into every record). Every
row runs the same env, budget, seed and flags on each side: ours in its modes (eager and compile, and on CUDA
cudagraphs and compile+cudagraphs), LeanRL's plain script and its compiled one in its modes, CleanRL's script. On a
CPU each side runs at one and two threads and ours also at its default; on CUDA each runs once, the references with
one CPU thread, the setting our scripts choose there (torch's default pool fights the env's worker threads).

Runs go one at a time, in scratch folders, and alternate within a round (the first side and the first of our modes swap
each round; our modes at one thread count go side by side). Each run's result is one JSON line in FOLDER/runs.jsonl the
moment it ends; a second call skips what is recorded, so an interrupted sweep goes on where it stopped. --budget-minutes
M starts no run that its estimate (the same run's time in earlier records, else the profile's guess) says will not end
within M minutes; the plan puts each side's headline runs of every row first. FOLDER gets compare.md (medians over
rounds, ratios, the machine, versions, commits, patches, commands) and compare.png. Steady SPS: ours from its summary
(after warm-up), LeanRL's from the speed it logs (after its burn-in), CleanRL's from the wall times of its TensorBoard
SPS points, from the third point after learning starts.
"""

import argparse
import glob
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from references import check_clone, package_versions, write_reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HALF_CHEETAH = ["--env-id", "HalfCheetah-v5"]
OFF_POLICY = {
    "full": HALF_CHEETAH + ["--total-timesteps", "15000", "--learning-starts", "5000"],
    "quick": HALF_CHEETAH + ["--total-timesteps", "6000", "--learning-starts", "1000"],
    "smoke": ["--env-id", "Pendulum-v1", "--total-timesteps", "800", "--learning-starts", "200", "--batch-size", "32"],
}
# row: (our script, LeanRL's plain script, LeanRL's compiled script, CleanRL's script, {profile: flags all take})
ROWS = {
    "sac": ("sac_continuous_action.py", "sac_continuous_action", "sac_continuous_action_torchcompile",
            "sac_continuous_action", OFF_POLICY),
    "td3": ("td3_continuous_action.py", "td3_continuous_action", "td3_continuous_action_torchcompile",
            "td3_continuous_action", OFF_POLICY),
    "ppo_continuous": (
        "ppo_continuous_action.py", "ppo_continuous_action", "ppo_continuous_action_torchcompile",
        "ppo_continuous_action",
        {
            "full": HALF_CHEETAH + ["--total-timesteps", "40960"],
            "quick": HALF_CHEETAH + ["--total-timesteps", "20480"],
            "smoke": ["--env-id", "Pendulum-v1", "--total-timesteps", "2560", "--num-steps", "256"],
        },
    ),
    "dqn": ("dqn.py", "dqn", "dqn_torchcompile", "dqn", {
        "full": ["--env-id", "CartPole-v1", "--total-timesteps", "60000", "--learning-starts", "10000"],
        "quick": ["--env-id", "CartPole-v1", "--total-timesteps", "30000", "--learning-starts", "10000"],
        "smoke": ["--env-id", "CartPole-v1", "--total-timesteps", "1500", "--learning-starts", "500"],
    }),
    "ppo_atari": ("ppo_atari_envpool.py", "ppo_atari_envpool", "ppo_atari_envpool_torchcompile", "ppo_atari_envpool", {
        "full": ["--env-id", "Breakout-v5", "--total-timesteps", "81920"],
        "quick": ["--env-id", "Breakout-v5", "--total-timesteps", "20480"],
        "smoke": ["--env-id", "Breakout-v5", "--total-timesteps", "2560", "--num-envs", "4", "--num-steps", "64"],
    }),
}  # fmt: skip
TITLES = {"sac": "SAC", "td3": "TD3", "ppo_continuous": "PPO continuous", "dqn": "DQN", "ppo_atari": "PPO Atari"}
# a run's seconds before any record says better (a compiling run: twice), on a CPU and on CUDA
GUESS_SECONDS = {False: {"smoke": 30, "quick": 90, "full": 240}, True: {"smoke": 30, "quick": 60, "full": 120}}
SIDES = ("ours", "leanrl", "cleanrl")


def plan(rows, rounds, cuda):
    """The runs in order: (row, side, script, mode, threads, round). Per round: each side's headline runs of every
    row first (LeanRL's compiled script, CleanRL's, and ours at its default threads: on CUDA in its fastest mode,
    on a CPU in both, so that --compile is timed beside eager), then the rest; within a row the sides go ours,
    LeanRL, CleanRL, and our modes at one thread count one after the other, both orders reversed every other round
    (runs late in a series ran slower here, so a fixed order would favour a mode)."""
    our_modes = ["eager", "compile", "cudagraphs", "compile+cudagraphs"] if cuda else ["eager", "compile"]
    leanrl_modes = ["compile", "cudagraphs", "compile+cudagraphs"] if cuda else ["compile"]
    our_threads = ["default"] if cuda else ["default", 1, 2]
    their_threads = [1] if cuda else [1, 2]
    runs = []
    for round_index in range(1, rounds + 1):
        forward = round_index % 2 == 1
        tiers = ([], [])
        for row in rows:
            ours, leanrl_plain, leanrl_compiled, cleanrl, _ = ROWS[row]
            by_side = {
                "ours": [
                    (ours, mode, threads) for threads in our_threads for mode in our_modes[:: 1 if forward else -1]
                ],
                "leanrl": [(leanrl_compiled, mode, threads) for mode in leanrl_modes for threads in their_threads]
                + [(leanrl_plain, "eager", threads) for threads in their_threads],
                "cleanrl": [(cleanrl, "eager", threads) for threads in their_threads],
            }
            headline = {
                "ours": [(ours, mode, "default") for mode in (our_modes[-1:] if cuda else our_modes)],
                "leanrl": [(leanrl_compiled, leanrl_modes[-1], 1)],
                "cleanrl": [(cleanrl, "eager", 1)],
            }
            for side in SIDES if forward else SIDES[::-1]:
                for run in by_side[side]:
                    tiers[run not in headline[side]].append((row, side, *run, round_index))
        runs += tiers[0] + tiers[1]
    return runs


def run_key(record):
    return tuple(record[key] for key in ("row", "side", "script", "mode", "threads", "round", "profile"))


def load_runs(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def estimate(records, row, side, mode, profile, cuda):
    """Seconds the run will take: the median of the same row, side and mode's earlier runs, else a guess."""
    same = [r for r in records if (r["row"], r["side"], r["mode"], r["profile"]) == (row, side, mode, profile)]
    seconds = [r["seconds"] for r in same]
    return statistics.median(seconds) if seconds else GUESS_SECONDS[cuda][profile] * (2 if "compile" in mode else 1)


def cleanrl_steady_sps(workdir, learning_starts):
    """Steps per second between CleanRL's third TensorBoard SPS point after learning starts and its last, by the
    points' wall times (its own SPS figure counts from the start, random steps and all)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = glob.glob(os.path.join(workdir, "runs", "*"))
    if not runs:
        return None
    events = EventAccumulator(runs[0], size_guidance={"scalars": 0})
    events.Reload()
    if "charts/SPS" not in events.Tags()["scalars"]:
        return None
    points = [p for p in events.Scalars("charts/SPS") if p.step > learning_starts][2:]
    if len(points) < 2 or points[-1].wall_time <= points[0].wall_time:
        return None
    return (points[-1].step - points[0].step) / (points[-1].wall_time - points[0].wall_time)


def leanrl_steady_sps(workdir):
    """The last speed LeanRL's script logged: steps per second since its burn-in."""
    path = os.path.join(workdir, "wandb_log.jsonl")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        speeds = [row["speed"] for row in map(json.loads, f) if "speed" in row]
    return speeds[-1] if speeds else None


def run_one(args, clones, row, side, script, mode, threads, limit):
    """One run in a scratch folder; its record (sps None with the reason when it gave none)."""
    flags = list(ROWS[row][4][args.profile])
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    env["MUJOCO_GL"] = "disable"  # no run renders, and an inherited MUJOCO_GL=egl without EGL fails at import
    record = {}
    with tempfile.TemporaryDirectory() as workdir:
        if side == "ours":
            command = [args.python, os.path.join(ROOT, "leanrl_scripts", script), *flags, "--eval-episodes", "0"]
            command += [] if threads == "default" else ["--torch-threads", str(threads)]
        else:
            name = "LeanRL" if side == "leanrl" else "CleanRL"
            path, record = write_reference(name, script, clones[side], workdir)
            record["script_path"] = record.pop("script")
            command = [args.reference_python, path, *flags]
            env["OMP_NUM_THREADS"] = str(threads)
        command += ["--compile"] * ("compile" in mode) + ["--cudagraphs"] * ("cudagraphs" in mode) + ["--seed", "1"]
        record["command"] = " ".join(os.path.relpath(c, workdir) if c.startswith(workdir) else c for c in command)
        started = time.time()
        # its own process group, so that a stopped run (the cap, Ctrl-C) takes its compile workers with it
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        proc = subprocess.Popen(command, cwd=workdir, env=env, text=True, start_new_session=True, **pipes)
        try:
            stdout, stderr = proc.communicate(timeout=limit)
        except BaseException as stop:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            if not isinstance(stop, subprocess.TimeoutExpired):
                raise
            return {**record, "sps": None, "seconds": time.time() - started, "error": f"stopped after {limit:.0f} s"}
        record["seconds"] = time.time() - started
        if side == "ours":
            speed = [line for line in stdout.splitlines() if line.startswith("SPEED ")]
            summary = json.loads(speed[-1][len("SPEED ") :]) if speed else {}
            record.update(sps=summary.get("sps"), warmup_seconds=summary.get("warmup_seconds"))
            record.update(torch_threads=summary.get("torch_threads"), device=summary.get("device"))
        elif side == "leanrl":
            record["sps"] = leanrl_steady_sps(workdir)
        else:
            starts = int(flags[flags.index("--learning-starts") + 1]) if "--learning-starts" in flags else 0
            record["sps"] = cleanrl_steady_sps(workdir, starts)
        if proc.returncode:
            tail = [line for line in stderr.strip().splitlines() if "Warning" not in line][-2:]
            record.update(sps=None, error=f"exit code {proc.returncode}: " + " / ".join(tail)[-600:])
        elif record["sps"] is None:
            record["error"] = "it ended without a steady SPS: a budget too short for its burn-in"
    return record


def machine():
    """The machine a table was measured on, in words."""
    import torch

    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    words = f"{cpu}, {os.cpu_count()} cores"
    if torch.cuda.is_available():
        try:
            driver = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
            ).stdout.strip()
        except OSError:
            driver = ""
        words += f", {torch.cuda.get_device_name(0)} (driver {driver or 'unknown'})"
    return words


def medians(records):
    """{(row, side, script, mode, threads): (median SPS, rounds)} of the runs that gave one."""
    groups = {}
    for r in records:
        if r.get("sps"):
            groups.setdefault((r["row"], r["side"], r["script"], r["mode"], r["threads"]), []).append(r["sps"])
    return {key: (statistics.median(values), len(values)) for key, values in groups.items()}


def thread_words(threads):
    return {"default": "its default threads", 1: "1 thread"}.get(threads, f"{threads} threads")


def each(records, key, length=None):
    """The records' distinct values of `key`, in one phrase."""
    return "; ".join(sorted({str(r[key])[:length] for r in records})) or "none"


def env_of(records, row):
    """The env id the row's runs took, from their commands."""
    words = next((r["command"].split() for r in records if r["row"] == row and "--env-id" in r["command"]), [])
    return words[words.index("--env-id") + 1] if words else "its default env"


def best_settings(records):
    """The table of each row's best setting per side and the ratios (compare.md's first, the README's), and
    {(row, side): SPS}."""
    table = medians(records)
    lines = ["| script | ours: best | LeanRL: best | CleanRL: best | ours / LeanRL | ours / CleanRL |"]
    lines.append("| --- | --- | --- | --- | ---: | ---: |")
    best = {}
    for row in [row for row in ROWS if any(key[0] == row for key in table)]:
        cells = []
        for side in SIDES:
            found = [(sps, key) for key, (sps, _) in table.items() if key[0] == row and key[1] == side]
            sps, key = max(found, key=lambda item: item[0]) if found else (None, None)
            best[row, side] = sps
            tried = any((r["row"], r["side"]) == (row, side) for r in records)
            cells.append(f"{sps:.0f} ({key[3]}, {thread_words(key[4])})" if found else "no SPS" if tried else "-")
        ratios = [
            f"{best[row, 'ours'] / best[row, side]:.2f}x" if best[row, "ours"] and best[row, side] else "-"
            for side in ("leanrl", "cleanrl")
        ]
        lines.append(f"| {TITLES.get(row, row)}, {env_of(records, row)} | " + " | ".join(cells + ratios) + " |")
    return lines, best


def write_tables(folder, records):
    """compare.md and compare.png from the records: per row each side's best setting and the ratios, then every
    setting's median."""
    table = medians(records)
    rows = [row for row in ROWS if any(key[0] == row for key in table)]
    ours = [r for r in records if r["side"] == "ours"]
    theirs = [r for r in records if r["side"] != "ours"]
    lines = [f"# Ours beside LeanRL and CleanRL: {each(records, 'machine')}", ""]
    lines.append(
        f"Measured {each(records, 'date')}, {each(records, 'profile')} budgets, one run at a time. Ours at "
        f"{each(ours, 'commit', 8)} with {each(ours, 'packages')}; the references with {each(theirs, 'packages')}. "
        "Made by `python benchmarks/compare.py` (`./run.sh --compare`); every run's command, SPS and time is a line "
        "of runs.jsonl beside this page."
    )
    best_lines, best = best_settings(records)
    lines += [""] + best_lines
    lines += ["", "Every setting, median SPS over the rounds that gave one:", ""]
    lines += ["| row | side | script | mode | threads | SPS | rounds | warm-up s (ours) |"]
    lines += ["| --- " * 5 + "| ---: " * 3 + "|"]
    for key in sorted(table, key=lambda k: (list(ROWS).index(k[0]), SIDES.index(k[1]), k[2], k[3], str(k[4]))):
        warmups = [r["warmup_seconds"] for r in records if r.get("warmup_seconds") and key == run_key(r)[:5]]
        warmup = f"{statistics.median(warmups):.1f}" if warmups else ""
        lines.append("| " + " | ".join(map(str, key)) + f" | {table[key][0]:.0f} | {table[key][1]} | {warmup} |")
    failed = [r for r in records if not r.get("sps")]
    if failed:
        lines += ["", "Runs that gave no SPS (the reason is the run's last line on stderr):", ""]
        lines += [
            f"- {r['row']} {r['side']} {r['script']} {r['mode']} {r['threads']} threads, round {r['round']}: "
            f"{r['error']}"
            for r in failed
        ]
    patches = {}
    for r in records:
        if r["side"] != "ours":
            patches.setdefault(f"{r['repository']} {r['script_path']} at {r['commit'][:8]}", r.get("patches", []))
    lines += ["", "Reference scripts and their run-time patches:", ""]
    for script, reasons in sorted(patches.items()):
        lines.append(f"- {script}: " + "; ".join(reasons))
    with open(os.path.join(folder, "compare.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError:
        return
    fig, ax = plt.subplots(figsize=(1.6 * max(len(rows), 2) + 2, 3.5))
    for i, side in enumerate(SIDES):
        heights = [best[row, side] or 0 for row in rows]
        ax.bar([j + (i - 1) * 0.27 for j in range(len(rows))], heights, width=0.27, label=side)
    ax.set_xticks(range(len(rows)), rows)
    ax.set_ylabel("steady SPS, best setting")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "compare.png"), dpi=100)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leanrl", metavar="CLONE", help="a clone of pytorch-labs/LeanRL")
    parser.add_argument("--cleanrl", metavar="CLONE", help="a clone of vwxyzjn/cleanrl")
    parser.add_argument("--reference-python", default=sys.executable, help="the Python that runs the references")
    parser.add_argument("--profile", choices=("smoke", "quick", "full"), default="full")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget-minutes", type=float, default=None)
    parser.add_argument("--run-timeout", type=float, default=None, help="seconds after which a run is stopped")
    parser.add_argument("--only", default="", help="comma-separated rows from: " + ", ".join(ROWS))
    parser.add_argument("--results", help="default: benchmarks/results/<machine-tag>/compare")
    parser.add_argument("--collect", action="store_true", help="only write the tables from FOLDER/runs.jsonl")
    args = parser.parse_args()
    rows = args.only.split(",") if args.only else list(ROWS)
    if unknown := [row for row in rows if row not in ROWS]:
        parser.error(f"unknown rows {', '.join(unknown)}")
    if args.rounds < 1 or (args.budget_minutes is not None and args.budget_minutes <= 0):
        parser.error("--rounds and --budget-minutes must be positive")
    clones = {"leanrl": args.leanrl, "cleanrl": args.cleanrl}
    for side, name in (("leanrl", "LeanRL"), ("cleanrl", "CleanRL")):
        if not args.collect and not clones[side]:
            parser.error(f"--{side} CLONE is needed: a clone of {name}'s repository")
        if not args.collect and (problem := check_clone(name, clones[side])):
            parser.error(problem)
    folder = args.results or os.path.join(ROOT, "benchmarks", "results", machine_tag(), "compare")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "runs.jsonl")
    records = load_runs(path)
    if not args.collect:
        sweep(args, rows, clones, path, records)
    write_tables(folder, records)
    print(open(os.path.join(folder, "compare.md")).read(), end="")


def sweep(args, rows, clones, path, records):
    """Runs what the plan holds and `records` lacks, appending each run's record to `path` as it ends."""
    import torch

    cuda = torch.cuda.is_available()
    args.python = os.environ.get("PYTHON", sys.executable)
    done = {run_key(r) for r in records}
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    shared = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "device": "cuda" if cuda else "cpu"}
    ours = {"commit": commit.strip() or "unknown", "packages": package_versions(args.python)}
    references = {"packages": package_versions(args.reference_python)}
    started = time.time()
    for row, side, script, mode, threads, round_index in plan(rows, args.rounds, cuda):
        key = (row, side, script, mode, threads, round_index, args.profile)
        if key in done:
            continue
        left = None if args.budget_minutes is None else args.budget_minutes * 60 - (time.time() - started)
        if left is not None and estimate(records, row, side, mode, args.profile, cuda) > left:
            print(f"{row} {side} {script} {mode} round {round_index}: left for a later call", flush=True)
            continue
        limits = [limit for limit in (left, args.run_timeout) if limit is not None]
        record = {**dict(zip(("row", "side", "script", "mode", "threads", "round", "profile"), key)), **shared}
        record.update(ours if side == "ours" else references)
        record.update(run_one(args, clones, row, side, script, mode, threads, min(limits) if limits else None))
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
        records.append(record)
        done.add(key)
        sps = f"{record['sps']:.1f} SPS" if record["sps"] else record["error"]
        print(f"{row} {side} {script} {mode} {threads} threads round {round_index}: {sps}", flush=True)


def machine_tag():
    """The results' folder name (benchmarks/lib.sh): the GPU's name, else cpu-<cores>core."""
    import re

    import torch

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu-{os.cpu_count()}core"
    return re.sub("[^A-Za-z0-9]+", "-", name).strip("-").lower()


if __name__ == "__main__":
    main()
