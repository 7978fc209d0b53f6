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
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

from references import check_clone, package_versions, write_reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HALF_CHEETAH = ["--env-id", "HalfCheetah-v5"]
OFF_POLICY = {
    "full": HALF_CHEETAH + ["--total-timesteps", "15000", "--learning-starts", "5000"],
    "quick": HALF_CHEETAH + ["--total-timesteps", "6000", "--learning-starts", "1000"],
    "smoke": ["--env-id", "Pendulum-v1", "--total-timesteps", "800", "--learning-starts", "200", "--batch-size", "32"],
}


class Row(NamedTuple):
    """A row: our script; LeanRL's plain and compiled scripts, CleanRL's ("" where it has none); the JAX scripts of
    the same algorithm, (project, name) each, (project, name, "cuda") for one that runs on CUDA only; {profile: flags
    every side takes}; the env id the references take where they name the env otherwise (CleanRL's ALE ids)."""

    ours: str
    leanrl_plain: str
    leanrl_compiled: str
    cleanrl: str
    flags: dict
    jax: tuple = ()
    reference_env: str = ""


ATARI_DQN = {  # benchmarks/dqn_atari.sh's budgets: learning starts early, the steady phase is what is timed
    "full": ["--env-id", "Breakout-v5", "--total-timesteps", "12000", "--learning-starts", "4000"],
    "quick": ["--env-id", "Breakout-v5", "--total-timesteps", "6000", "--learning-starts", "2000"],
    "smoke": ["--env-id", "Breakout-v5", "--total-timesteps", "1000", "--learning-starts", "400"],
}
ROWS = {
    "sac": Row("sac_continuous_action.py", "sac_continuous_action", "sac_continuous_action_torchcompile",
               "sac_continuous_action", OFF_POLICY),
    "td3": Row("td3_continuous_action.py", "td3_continuous_action", "td3_continuous_action_torchcompile",
               "td3_continuous_action", OFF_POLICY,
               jax=(("LeanRL", "td3_continuous_action_jax"), ("CleanRL", "td3_continuous_action_jax"))),
    "ppo_continuous": Row(
        "ppo_continuous_action.py", "ppo_continuous_action", "ppo_continuous_action_torchcompile",
        "ppo_continuous_action",
        {
            "full": HALF_CHEETAH + ["--total-timesteps", "40960"],
            "quick": HALF_CHEETAH + ["--total-timesteps", "20480"],
            "smoke": ["--env-id", "Pendulum-v1", "--total-timesteps", "2560", "--num-steps", "256"],
        },
    ),
    "dqn": Row("dqn.py", "dqn", "dqn_torchcompile", "dqn", {
        "full": ["--env-id", "CartPole-v1", "--total-timesteps", "60000", "--learning-starts", "10000"],
        "quick": ["--env-id", "CartPole-v1", "--total-timesteps", "30000", "--learning-starts", "10000"],
        "smoke": ["--env-id", "CartPole-v1", "--total-timesteps", "1500", "--learning-starts", "500"],
    }, jax=(("LeanRL", "dqn_jax"), ("CleanRL", "dqn_jax"))),
    "ppo_atari": Row(
        "ppo_atari_envpool.py", "ppo_atari_envpool", "ppo_atari_envpool_torchcompile", "ppo_atari_envpool", {
        "full": ["--env-id", "Breakout-v5", "--total-timesteps", "81920"],
        "quick": ["--env-id", "Breakout-v5", "--total-timesteps", "20480"],
        "smoke": ["--env-id", "Breakout-v5", "--total-timesteps", "2560", "--num-envs", "4", "--num-steps", "64"],
        # the scan variant on CUDA only: on 2 CPU cores its scanned update ran 11x slower than the unscanned one
        # (15 against 172 SPS at the smoke budget; each piece compiled once, as jax's compile log shows)
        }, jax=(("LeanRL", "ppo_atari_envpool_xla_jax"), ("CleanRL", "ppo_atari_envpool_xla_jax"),
                ("CleanRL", "ppo_atari_envpool_xla_jax_scan", "cuda"))),
    # no LeanRL script; CleanRL's play ALE's Breakout through gymnasium with its own wrappers, ours envpool's (its
    # default back-end), both with the DeepMind preprocessing
    "dqn_atari": Row("dqn_atari.py", "", "", "dqn_atari", {
        profile: flags + ["--buffer-size", "100000"] for profile, flags in ATARI_DQN.items()
    }, jax=(("CleanRL", "dqn_atari_jax"),), reference_env="BreakoutNoFrameskip-v4"),
}  # fmt: skip
TITLES = {
    "sac": "SAC", "td3": "TD3", "ppo_continuous": "PPO continuous", "dqn": "DQN", "ppo_atari": "PPO Atari",
    "dqn_atari": "DQN Atari",
}  # fmt: skip
# a run's seconds before any record says better (a compiling run: twice), on a CPU and on CUDA
GUESS_SECONDS = {False: {"smoke": 30, "quick": 90, "full": 240}, True: {"smoke": 30, "quick": 60, "full": 120}}
SIDES = ("ours", "leanrl", "cleanrl", "jax")
PROJECT = {"leanrl": "LeanRL", "cleanrl": "CleanRL"}
# XLA's CPU runtime takes every core; one thread: its Eigen pool switched off, the flags jax users pass for one thread
XLA_ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def plan(rows, rounds, cuda, headline_only=False):
    """The runs in order: (row, side, script, mode, threads, round). Per round: each side's headline runs of every
    row first (LeanRL's compiled script, CleanRL's, each JAX script, and ours at its default threads: on CUDA in its
    fastest mode, on a CPU in both, so that --compile is timed beside eager), then the rest (none with
    `headline_only`); within a row the sides go ours, LeanRL, CleanRL, JAX, and our modes at one thread count one
    after the other, both orders reversed every other round (runs late in a series ran slower here, so a fixed order
    would favour a mode). A JAX script's mode is "jit" (XLA compiles every jitted function at its first call)."""
    our_modes = ["eager", "compile", "cudagraphs", "compile+cudagraphs"] if cuda else ["eager", "compile"]
    leanrl_modes = ["compile", "cudagraphs", "compile+cudagraphs"] if cuda else ["compile"]
    our_threads = ["default"] if cuda else ["default", 1, 2]
    their_threads = [1] if cuda else [1, 2]
    jax_threads = [1] if cuda else ["default", 1]
    runs = []
    for round_index in range(1, rounds + 1):
        forward = round_index % 2 == 1
        tiers = ([], [])
        for row in rows:
            spec = ROWS[row]
            leanrl = [(spec.leanrl_compiled, mode, threads) for mode in leanrl_modes for threads in their_threads]
            leanrl += [(spec.leanrl_plain, "eager", threads) for threads in their_threads]
            jax = [f"{project.lower()}/{name}" for project, name, *only in spec.jax if cuda or only != ["cuda"]]
            by_side = {
                "ours": [
                    (spec.ours, mode, threads) for threads in our_threads for mode in our_modes[:: 1 if forward else -1]
                ],
                "leanrl": leanrl if spec.leanrl_compiled else [],
                "cleanrl": [(spec.cleanrl, "eager", threads) for threads in their_threads] if spec.cleanrl else [],
                "jax": [(script, "jit", threads) for script in jax for threads in jax_threads],
            }
            headline = {
                "ours": [(spec.ours, mode, "default") for mode in (our_modes[-1:] if cuda else our_modes)],
                "leanrl": [(spec.leanrl_compiled, leanrl_modes[-1], 1)],
                "cleanrl": [(spec.cleanrl, "eager", 1)],
                "jax": [(script, "jit", jax_threads[0]) for script in jax],
            }
            for side in SIDES if forward else SIDES[::-1]:
                for run in by_side[side]:
                    if run in headline[side] or not headline_only:
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


def steady_sps(points, learning_starts):
    """Steps per second between the third logged point after learning starts and the last, by the points' wall
    times: what a script logs as it goes, less its random steps and the first updates (a JIT compilation, a
    compiled graph's first call); None with fewer than two such points."""
    points = [(step, wall) for step, wall in points if step > learning_starts][2:]
    if len(points) < 2 or points[-1][1] <= points[0][1]:
        return None
    return (points[-1][0] - points[0][0]) / (points[-1][1] - points[0][1])


def cleanrl_steady_sps(workdir, learning_starts):
    """CleanRL's steady SPS, by the wall times of its TensorBoard SPS points (its own SPS figure counts from the
    start, random steps and all)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = glob.glob(os.path.join(workdir, "runs", "*"))
    if not runs:
        return None
    events = EventAccumulator(runs[0], size_guidance={"scalars": 0})
    events.Reload()
    if "charts/SPS" not in events.Tags()["scalars"]:
        return None
    return steady_sps([(p.step, p.wall_time) for p in events.Scalars("charts/SPS")], learning_starts)


def leanrl_steady_sps(workdir, learning_starts=None):
    """The last speed LeanRL's script logged: steps per second since its burn-in. Its JAX scripts start that clock
    before their first update, and so count its JIT compilation: for them (`learning_starts` given), the wall times
    of the logged points as for CleanRL's, and the logged speed only where too few points came after learning
    started (its PPO logs every tenth iteration, and its burn-in of three iterations leaves compilation out)."""
    path = os.path.join(workdir, "wandb_log.jsonl")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        rows = [row for row in map(json.loads, f) if "speed" in row]
    timed = steady_sps([(row["step"], row["seconds"]) for row in rows], learning_starts or 0)
    if learning_starts is not None and timed:
        return timed
    return rows[-1]["speed"] if rows else None


def run_one(args, clones, row, side, script, mode, threads, limit):
    """One run in a scratch folder; its record (sps None with the reason when it gave none)."""
    flags = list(ROWS[row].flags[args.profile])
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    env["MUJOCO_GL"] = "disable"  # no run renders, and an inherited MUJOCO_GL=egl without EGL fails at import
    record = {}
    with tempfile.TemporaryDirectory() as workdir:
        if side == "ours":
            command = [args.python, os.path.join(ROOT, "leanrl_scripts", script), *flags, "--eval-episodes", "0"]
            command += [] if threads == "default" else ["--torch-threads", str(threads)]
        else:
            project = script.split("/")[0] if side == "jax" else side  # JAX scripts: leanrl/..., cleanrl/...
            path, record = write_reference(PROJECT[project], script.split("/")[-1], clones[project], workdir)
            record["script_path"] = record.pop("script")
            if ROWS[row].reference_env:
                flags[flags.index("--env-id") + 1] = ROWS[row].reference_env
            command = [args.jax_python if side == "jax" else args.reference_python, path, *flags]
            if threads != "default":
                env["OMP_NUM_THREADS"] = str(threads)
            if side == "jax" and threads == 1:
                env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + XLA_ONE_THREAD).strip()
        command += ["--compile"] * ("compile" in mode) + ["--cudagraphs"] * ("cudagraphs" in mode) + ["--seed", "1"]
        settings = [f"{name}={shlex.quote(env[name])}" for name in ("OMP_NUM_THREADS", "XLA_FLAGS") if name in env]
        words = [os.path.relpath(c, workdir) if c.startswith(workdir) else c for c in command]
        record["command"] = " ".join(settings * (side != "ours") + words)
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
        else:
            starts = int(flags[flags.index("--learning-starts") + 1]) if "--learning-starts" in flags else 0
            if project == "leanrl":
                record["sps"] = leanrl_steady_sps(workdir, starts if side == "jax" else None)
            else:
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


def jax_threads_words(jax_records):
    """What the page says of the JAX scripts' threads: the settings its records hold (a --headline sweep on a CPU
    runs only XLA's default)."""
    one_thread = (
        f'one thread is `XLA_FLAGS="{XLA_ONE_THREAD}"` with `OMP_NUM_THREADS=1` for the torch that CleanRL\'s JAX '
        "scripts log and buffer with"
    )
    settings = {r["threads"] for r in jax_records}
    if settings == {"default"}:
        return f"They ran at XLA's default threads only (its pool takes every core); {one_thread}: not run here."
    if settings == {1}:
        return f"They ran at one thread only; {one_thread}."
    return f"They ran at XLA's default threads (its pool takes every core) and at one thread; {one_thread}."


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
    commands = [r for r in records if r["row"] == row and "--env-id" in r["command"]]
    ours = [r for r in commands if r["side"] == "ours"]
    words = (ours or commands)[0]["command"].split() if commands else []
    return words[words.index("--env-id") + 1] if words else "its default env"


def best_settings(records):
    """The table of each row's best setting per side and the ratios (compare.md's first, the README's), and
    {(row, side): SPS}. The JAX column is the faster of the two projects' JAX scripts, named."""
    table = medians(records)
    jax = any(key[1] == "jax" for key in table)
    lines = ["| script | ours: best | LeanRL: best | CleanRL: best |" + " JAX: best |" * jax]
    lines[0] += " ours / LeanRL | ours / CleanRL |" + " ours / JAX |" * jax
    lines.append("| --- " * (4 + jax) + "| ---: " * (2 + jax) + "|")
    best = {}
    for row in [row for row in ROWS if any(key[0] == row for key in table)]:
        cells = []
        for side in SIDES[: 3 + jax]:
            found = [(sps, key) for key, (sps, _) in table.items() if key[0] == row and key[1] == side]
            sps, key = max(found, key=lambda item: item[0]) if found else (None, None)
            best[row, side] = sps
            tried = any((r["row"], r["side"]) == (row, side) for r in records)
            setting = f"{PROJECT[key[2].split('/')[0]]}'s {key[2].split('/')[1]}" if side == "jax" and key else None
            setting = setting or (key and key[3])
            cells.append(f"{sps:.0f} ({setting}, {thread_words(key[4])})" if found else "no SPS" if tried else "-")
        ratios = [
            f"{best[row, 'ours'] / best[row, side]:.2f}x" if best[row, "ours"] and best[row, side] else "-"
            for side in SIDES[1 : 3 + jax]
        ]
        lines.append(f"| {TITLES.get(row, row)}, {env_of(records, row)} | " + " | ".join(cells + ratios) + " |")
    return lines, best


def write_tables(folder, records):
    """compare.md and compare.png from the records: per row each side's best setting and the ratios, then every
    setting's median."""
    table = medians(records)
    rows = [row for row in ROWS if any(key[0] == row for key in table)]
    ours = [r for r in records if r["side"] == "ours"]
    theirs = [r for r in records if r["side"] in ("leanrl", "cleanrl")]
    jax = [r for r in records if r["side"] == "jax"]
    lines = [f"# Ours beside LeanRL and CleanRL{', and their JAX scripts' * bool(jax)}: {each(records, 'machine')}", ""]
    lines.append(
        f"Measured {each(records, 'date')}, {each(records, 'profile')} budgets, one run at a time. Ours at "
        f"{each(ours, 'commit', 8)} with {each(ours, 'packages')}"
        + (f"; the references with {each(theirs, 'packages')}" if theirs else "")
        + (f"; the JAX scripts with {each(jax, 'packages')}" if jax else "")
        + ". Made by `python benchmarks/compare.py` (`./run.sh --compare`); every run's command, SPS and time is a "
        "line of runs.jsonl beside this page."
    )
    if jax:
        lines += [
            "",
            "The JAX scripts' steady SPS, like CleanRL's, comes from the wall times of the points they log, from the "
            "third after learning starts: their JIT compilation (at each jitted function's first call) falls "
            "before it. LeanRL's JAX scripts log to the wandb stand-in, which keeps each point's time. "
            + jax_threads_words(jax),
        ]
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
        heights = [best.get((row, side)) or 0 for row in rows]
        ax.bar([j + (i - 1.5) * 0.2 for j in range(len(rows))], heights, width=0.2, label=side)
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
    parser.add_argument(
        "--jax-python",
        help="the Python that runs the JAX scripts (requirements/requirements-jax.txt; default: --reference-python); "
        "without jax, flax and optax there, the JAX scripts are left out",
    )
    parser.add_argument("--profile", choices=("smoke", "quick", "full"), default="full")
    parser.add_argument("--rounds", type=int, help="default: 3, and 1 with --profile smoke")
    parser.add_argument("--budget-minutes", type=float, default=None)
    parser.add_argument("--run-timeout", type=float, default=None, help="seconds after which a run is stopped")
    parser.add_argument("--only", default="", help="comma-separated rows from: " + ", ".join(ROWS))
    parser.add_argument("--sides", default=",".join(SIDES), help="comma-separated sides from: " + ", ".join(SIDES))
    parser.add_argument(
        "--headline", action="store_true", help="only each side's headline runs (as --profile smoke does)"
    )
    parser.add_argument("--results", help="default: benchmarks/results/<machine-tag>/compare")
    parser.add_argument("--collect", action="store_true", help="only write the tables from FOLDER/runs.jsonl")
    args = parser.parse_args()
    rows = args.only.split(",") if args.only else list(ROWS)
    if unknown := [row for row in rows if row not in ROWS]:
        parser.error(f"unknown rows {', '.join(unknown)}")
    args.sides = args.sides.split(",")
    if unknown := [side for side in args.sides if side not in SIDES]:
        parser.error(f"unknown sides {', '.join(unknown)}")
    args.rounds = args.rounds or (1 if args.profile == "smoke" else 3)
    args.jax_python = args.jax_python or args.reference_python
    for name in ("reference_python", "jax_python"):  # the runs start in scratch folders: a relative path from here
        if os.sep in getattr(args, name):
            setattr(args, name, os.path.abspath(getattr(args, name)))
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
    jax = {"packages": package_versions(args.jax_python)}
    runs = [
        run
        for run in plan(rows, args.rounds, cuda, headline_only=args.headline or args.profile == "smoke")
        if run[1] in args.sides
    ]
    if any(run[1] == "jax" for run in runs) and (missing := missing_jax(args.jax_python)):
        print(f"note: {args.jax_python} lacks {missing}: the JAX scripts are left out "
              "(requirements/requirements-jax.txt, --jax-python)", flush=True)  # fmt: skip
        runs = [run for run in runs if run[1] != "jax"]
    started = time.time()
    for row, side, script, mode, threads, round_index in runs:
        key = (row, side, script, mode, threads, round_index, args.profile)
        if key in done:
            continue
        left = None if args.budget_minutes is None else args.budget_minutes * 60 - (time.time() - started)
        if left is not None and estimate(records, row, side, mode, args.profile, cuda) > left:
            print(f"{row} {side} {script} {mode} round {round_index}: left for a later call", flush=True)
            continue
        limits = [limit for limit in (left, args.run_timeout) if limit is not None]
        record = {**dict(zip(("row", "side", "script", "mode", "threads", "round", "profile"), key)), **shared}
        record.update(ours if side == "ours" else jax if side == "jax" else references)
        record.update(run_one(args, clones, row, side, script, mode, threads, min(limits) if limits else None))
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
        records.append(record)
        done.add(key)
        sps = f"{record['sps']:.1f} SPS" if record["sps"] else record["error"]
        print(f"{row} {side} {script} {mode} {threads} threads round {round_index}: {sps}", flush=True)


def missing_jax(python):
    """The JAX packages `python` cannot import, in words ("" when it has them all)."""
    check = "import importlib.util as u; print(' '.join(m for m in ('jax', 'flax', 'optax') if not u.find_spec(m)))"
    return subprocess.run([python, "-c", check], capture_output=True, text=True).stdout.strip().replace(" ", ", ")


def machine_tag():
    """The results' folder name (benchmarks/lib.sh): the GPU's name, else cpu-<cores>core."""
    import re

    import torch

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu-{os.cpu_count()}core"
    return re.sub("[^A-Za-z0-9]+", "-", name).strip("-").lower()


if __name__ == "__main__":
    main()
