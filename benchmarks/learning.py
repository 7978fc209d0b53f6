"""Learning curves over seeds: each script on its benchmark task, N seeds, one run at a time, and what they logged
collected into curves, a table of final returns and a chart per task.

    python benchmarks/learning.py [--profile quick|full|smoke] [--seeds N] [--only sac_pendulum,dqn_cartpole]
                                  [--results FOLDER]
    ./run.sh --learning [--quick | --smoke] [--seeds N] [--results FOLDER]    (the same, FOLDER/learning)

Each run writes FOLDER/runs/<task>__seed<k>.json (the summary and the training returns from TensorBoard, with the
seconds since the run's writer opened); a run whose file exists is not run again, so an interrupted profile goes on
where it stopped. Then FOLDER gets curves.csv (every episode of every run), final.md (per task: the final evaluation
over seeds as mean +- std, a 95% bootstrap confidence interval of the mean and the interquartile mean) and
<task>.png (the training return against steps and against seconds: the mean over seeds as a line, the lowest and the
highest seed as a band). Profiles: quick fits a 2-core CPU (hours with PPO Atari), full is CleanRL's budgets,
smoke checks the files in about a minute.
"""

import argparse
import csv
import glob
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROFILES = ("smoke", "quick", "full")
IMPALA_CARTPOLE = ["--env-id", "CartPole-v1", "--num-actors", 2, "--envs-per-actor", 4, "--batch-size", 16,
                   "--learning-rate", 3e-4]  # docs/impala.md's CartPole settings, those of its learning test
# task: (script, {profile: flags}); a task missing from a profile does not run in it. quick: tasks a 2-core CPU learns
# in minutes a seed (PPO Atari: 1M steps, about half an hour); full: CleanRL's benchmark budgets and envs.
TASKS = {
    "sac_pendulum": ("sac_continuous_action.py", {
        "smoke": ["--env-id", "Pendulum-v1", "--total-timesteps", 400, "--learning-starts", 200, "--batch-size", 32],
        "quick": ["--env-id", "Pendulum-v1", "--total-timesteps", 15_000, "--learning-starts", 1000]}),
    "td3_pendulum": ("td3_continuous_action.py", {
        "smoke": ["--env-id", "Pendulum-v1", "--total-timesteps", 400, "--learning-starts", 200, "--batch-size", 32],
        "quick": ["--env-id", "Pendulum-v1", "--total-timesteps", 15_000, "--learning-starts", 1000]}),
    "sac_halfcheetah": ("sac_continuous_action.py", {"full": ["--env-id", "HalfCheetah-v5", "--total-timesteps", 10**6]}),
    "td3_halfcheetah": ("td3_continuous_action.py", {"full": ["--env-id", "HalfCheetah-v5", "--total-timesteps", 10**6]}),
    "ppo_continuous_hopper": ("ppo_continuous_action.py", {
        "smoke": ["--env-id", "Pendulum-v1", "--total-timesteps", 1024, "--num-steps", 512],
        "quick": ["--env-id", "Hopper-v5", "--total-timesteps", 200_000],
        "full": ["--env-id", "Hopper-v5", "--total-timesteps", 10**6]}),
    "dqn_cartpole": ("dqn.py", {
        "smoke": ["--total-timesteps", 2000, "--learning-starts", 500],
        "quick": ["--total-timesteps", 500_000], "full": ["--total-timesteps", 500_000]}),
    "ppo_atari_breakout": ("ppo_atari_envpool.py", {
        "smoke": ["--total-timesteps", 512, "--num-envs", 4, "--num-steps", 32, "--num-minibatches", 2],
        "quick": ["--total-timesteps", 10**6], "full": ["--total-timesteps", 10**7]}),
    "impala_cartpole": ("impala_ray.py", {
        "smoke": IMPALA_CARTPOLE + ["--total-timesteps", 3000],
        "quick": IMPALA_CARTPOLE + ["--total-timesteps", 10**6]}),
}
EVAL_EPISODES = {"smoke": 2, "quick": 10, "full": 10}


def train_returns(run_dir):
    """(steps, seconds since the writer opened, returns) of every training episode the run logged to TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    events.Reload()
    if "charts/episodic_return" not in events.Tags()["scalars"]:
        return [], [], []
    start = events.FirstEventTimestamp()
    rows = events.Scalars("charts/episodic_return")
    return [row.step for row in rows], [row.wall_time - start for row in rows], [row.value for row in rows]


def run_task(task, seed, profile, folder, python):
    """One run of `task` with `seed` in a scratch folder; its record in FOLDER/runs/<task>__seed<seed>.json."""
    script, budgets = TASKS[task]
    record_path = os.path.join(folder, "runs", f"{task}__seed{seed}.json")
    if os.path.exists(record_path):
        print(f"{task} seed {seed}: done before ({record_path})", flush=True)
        return
    flags = [*map(str, budgets[profile]), "--eval-episodes", str(EVAL_EPISODES[profile])]
    command = [python, os.path.join(ROOT, "leanrl_scripts", script), *flags, "--seed", str(seed)]
    with tempfile.TemporaryDirectory() as workdir:
        proc = subprocess.run(command, cwd=workdir, stdout=subprocess.PIPE, text=True)
        speed = [line for line in proc.stdout.splitlines() if line.startswith("SPEED ")]
        if proc.returncode or not speed:
            raise SystemExit(f"error: {task} seed {seed} failed (exit code {proc.returncode}): {' '.join(command)}")
        summary = json.loads(speed[-1][len("SPEED "):])
        steps, seconds, returns = train_returns(glob.glob(os.path.join(workdir, "runs", "*"))[0])
    record = {"task": task, "seed": seed, "profile": profile, "command": " ".join([f"leanrl_scripts/{script}", *flags]),
              "summary": summary,
              "steps": steps, "seconds": seconds, "returns": returns}
    os.makedirs(os.path.dirname(record_path), exist_ok=True)
    with open(record_path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(record_path + ".tmp", record_path)
    print(f"{task} seed {seed}: eval return {summary['eval_return_mean']}, {summary['sps']:.0f} SPS", flush=True)


def load_records(folder):
    """{task: [record, ...]} in seed order."""
    records = {}
    for path in sorted(glob.glob(os.path.join(folder, "runs", "*__seed*.json"))):
        with open(path) as f:
            record = json.load(f)
        records.setdefault(record["task"], []).append(record)
    return {task: sorted(runs, key=lambda record: record["seed"]) for task, runs in records.items()}


def interquartile_mean(values):
    """rliable's IQM (scipy's trim_mean at 25%): the mean after dropping a quarter of the values, rounded down, at
    each end; with fewer than four seeds it is the mean."""
    values, cut = np.sort(np.asarray(values, dtype=float)), len(values) // 4
    return float(values[cut : len(values) - cut].mean())


def bootstrap_interval(values, resamples=10_000, seed=0):
    """95% percentile bootstrap confidence interval of the mean over seeds."""
    values = np.asarray(values, dtype=float)
    means = np.random.default_rng(seed).choice(values, (resamples, len(values))).mean(1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def final_table(records):
    lines = ["| task | script, env | steps | seeds | final eval return, mean +- std | 95% CI of the mean | IQM | "
             "minutes a run (median) |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for task, runs in records.items():
        finals = [run["summary"]["eval_return_mean"] for run in runs]
        low, high = bootstrap_interval(finals)
        first = runs[0]["summary"]
        minutes = np.median([run["summary"]["total_seconds"] for run in runs]) / 60
        lines.append(f"| {task} | {first['script']}, {first['env_id']} | {first['steps_done']} | {len(runs)} | "
                     f"{np.mean(finals):.1f} +- {np.std(finals):.1f} | [{low:.1f}, {high:.1f}] | "
                     f"{interquartile_mean(finals):.1f} | {minutes:.1f} |")
    commands = [f"- {task}: `python {runs[0]['command']} --seed S`, S = {', '.join(str(run['seed']) for run in runs)}"
                for task, runs in records.items()]
    return "\n".join(lines + ["", "Commands:", *commands]) + "\n"


def smoothed(returns, window=10):
    """Each episode's return as the mean of the last `window` episodes, the usual reading of a noisy curve."""
    sums = np.cumsum(np.insert(np.asarray(returns, dtype=float), 0, 0))
    counts = np.minimum(np.arange(1, len(returns) + 1), window)
    return (sums[1:] - sums[np.arange(1, len(returns) + 1) - counts]) / counts


def chart(task, runs, path):
    """Two panels: the smoothed training return against steps and against seconds; over seeds, a line for the mean
    and a band from the lowest to the highest, on the range every seed covers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for axis, key, label in ((axes[0], "steps", "env steps"), (axes[1], "seconds", "seconds")):
        curves = [(np.asarray(run[key], dtype=float), smoothed(run["returns"])) for run in runs if len(run["returns"])]
        if not curves:
            continue
        grid = np.linspace(max(x[0] for x, _ in curves), min(x[-1] for x, _ in curves), 100)
        values = np.stack([np.interp(grid, x, y) for x, y in curves])
        axis.fill_between(grid, values.min(0), values.max(0), alpha=0.25, color="#4c72b0", linewidth=0)
        axis.plot(grid, values.mean(0), color="#4c72b0", label=f"ours, {len(curves)} seeds")
        axis.set_xlabel(label)
        axis.set_ylabel("episodic return")
        axis.legend(loc="lower right", fontsize=8)
    summary = runs[0]["summary"]
    fig.suptitle(f"{task}: {summary['script']} on {summary['env_id']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def collect(folder):
    records = load_records(folder)
    with open(os.path.join(folder, "curves.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["task", "script", "env_id", "seed", "step", "seconds", "return"])
        for task, runs in records.items():
            for run in runs:
                for step, seconds, value in zip(run["steps"], run["seconds"], run["returns"]):
                    writer.writerow([task, run["summary"]["script"], run["summary"]["env_id"], run["seed"], step,
                                     f"{seconds:.3f}", value])
    table = final_table(records)
    with open(os.path.join(folder, "final.md"), "w") as f:
        f.write(table)
    try:
        for task, runs in records.items():
            chart(task, runs, os.path.join(folder, f"{task}.png"))
    except ModuleNotFoundError:
        print("note: matplotlib is not installed (pip install '.[dev]'): no charts", file=sys.stderr)
    print(table, end="")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=PROFILES, default="full")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 1..N of each task")
    parser.add_argument("--only", default="", help="comma-separated tasks from: " + ", ".join(TASKS))
    parser.add_argument("--results", help="default: benchmarks/results/<machine-tag>/learning")
    args = parser.parse_args()
    tasks = args.only.split(",") if args.only else [task for task in TASKS if args.profile in TASKS[task][1]]
    if unknown := [task for task in tasks if task not in TASKS or args.profile not in TASKS[task][1]]:
        parser.error(f"no {args.profile} budget for {', '.join(unknown)}")
    if args.seeds < 1:
        parser.error("--seeds must be 1 or more")
    folder = args.results or os.path.join(ROOT, "benchmarks", "results", machine_tag(), "learning")
    os.makedirs(folder, exist_ok=True)
    for task in tasks:
        for seed in range(1, args.seeds + 1):
            run_task(task, seed, args.profile, folder, sys.executable)
    collect(folder)


def machine_tag():
    """The speed tables' folder name (benchmarks/lib.sh): the GPU's name, else cpu-<cores>core."""
    import re

    import torch

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu-{os.cpu_count()}core"
    return re.sub("[^A-Za-z0-9]+", "-", name).strip("-").lower()


if __name__ == "__main__":
    main()
