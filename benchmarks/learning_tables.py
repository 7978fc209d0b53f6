"""The learning benchmark's records read back: statistics over seeds, the seconds to a score, final.md (per task and
side: the final evaluation and the final training return as mean +- std, a 95% bootstrap confidence interval of the
mean and the interquartile mean, the seconds to the score, the commands), the README's learning table, curves.csv
and a chart per task. benchmarks/learning.py writes the records and calls `collect`; benchmarks/collect.py
--readme calls `readme_table`.
"""

import csv
import glob
import json
import os

import numpy as np

import runner


def scores():
    """{task: the score its table times}, from settings.toml."""
    return {task: entry.get("score") for task, entry in runner.settings()["tasks"].items()}


def load_records(folder):
    """{task: {side: [record, ...]}}, ours first, each side in seed order. Records from before the references
    (no side, no process time) read as ours with the summary's figures."""
    records = {}
    for path in sorted(glob.glob(os.path.join(folder, "runs", "*__seed*.json"))):
        with open(path) as f:
            record = json.load(f)
        if "side" not in record:
            record.update(
                side="ours",
                total_seconds=record["summary"]["total_seconds"],
                steps_done=record["summary"]["steps_done"],
            )
        records.setdefault(record["task"], {}).setdefault(record["side"], []).append(record)
    return {
        task: {
            side: sorted(sides[side], key=lambda record: record["seed"])
            for side in sorted(sides, key=lambda side: side != "ours")
        }
        for task, sides in records.items()
    }


def final_training_return(record, window=20):
    """The mean return of the run's last `window` training episodes, the end of its line in the chart (LeanRL: the
    last running mean of 20 it logged): what every side logs, so ours and the references compare on it."""
    returns = record["returns"]
    if not returns:
        return float("nan")
    return float(returns[-1]) if "returns_kind" in record else float(smoothed(returns, window)[-1])


def seconds_to_score(record, threshold, window=20):
    """Seconds from the run's command to its first training episode at which the mean return of the last `window`
    episodes (LeanRL's: the running mean it logged) reached `threshold`, warm-up and compilation included; None where
    it never did, or where the record's times do not count from the command (records from before they did)."""
    if threshold is None or record.get("seconds_from") != "command":
        return None
    logged = "returns_kind" in record
    means = record["returns"] if logged else smoothed(record["returns"], window)
    for index, (mean, seconds) in enumerate(zip(means, record["seconds"])):
        if mean >= threshold and (logged or index + 1 >= window):
            return float(seconds)
    return None


def complete(runs):
    """The runs that went to the end of their budget: one stopped at its score or after --max-minutes counts for the
    seconds to the score only."""
    return [run for run in runs if "until_score" not in run]


def time_to_score(task, runs, spread=True):
    """The seconds to the task's score over the seeds, as a table cell: the median, the lowest and highest (with
    `spread`), how many seeds reached it and how many were stopped before it. Per seed: its complete run where that is
    timed from the command, else its run stopped at the score."""
    timed = {}
    for run in sorted(runs, key=lambda run: "until_score" not in run):  # a seed's complete run goes in last
        if run.get("seconds_from") == "command":
            timed[run["seed"]] = run
    if not timed:
        return "not timed"
    seconds = [(run, seconds_to_score(run, scores().get(task))) for run in timed.values()]
    reached = sorted(t for _, t in seconds if t is not None)
    cut = [run["max_minutes"] for run, t in seconds if t is None and (run.get("stopped") or "").startswith("after")]
    count = f"{len(reached)}/{len(timed)}" + (
        f"; {len(cut)} stopped at {' or '.join(f'{minutes:g}' for minutes in sorted(set(cut)))} min" if cut else ""
    )
    if not reached:
        return f"not reached ({count})"
    lowest_highest = f" [{reached[0]:.0f}, {reached[-1]:.0f}]" if spread and len(reached) > 1 else ""
    return f"{np.median(reached):.0f}{lowest_highest} ({count})"


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


def mean_std_interval(values):
    low, high = bootstrap_interval(values)
    return f"{np.mean(values):.1f} +- {np.std(values):.1f} | [{low:.1f}, {high:.1f}] | {interquartile_mean(values):.1f}"


def final_table(records):
    """Per task and side: the final evaluation (ours; the references have none) and the final training return, each
    as mean +- std over seeds, a 95% bootstrap interval of the mean and the IQM, of its complete runs (of the runs
    stopped at the score or a time limit, where a side has only those: where they stood)."""
    lines = [
        "| task | side: script, env | steps | seeds | final eval return, mean +- std | 95% CI of the mean | IQM | "
        "final training return (last 20 episodes), mean +- std | 95% CI of the mean | IQM | "
        "score | seconds to the score: median [lowest, highest] (seeds that reached it) | minutes a run (median) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    commands = []
    for task, sides in records.items():
        env_id = sides["ours"][0]["summary"]["env_id"] if "ours" in sides else "its default env"
        for side, runs in sides.items():
            shown = complete(runs) or runs
            first = shown[0]
            script = first["summary"]["script"] if side == "ours" else os.path.basename(next(w for w in first["command"].split() if w.endswith(".py")))
            evaluation = (
                mean_std_interval([run["summary"]["eval_return_mean"] for run in shown])
                if side == "ours" and complete(runs)
                else "none | | "
            )
            training = mean_std_interval([final_training_return(run) for run in shown])
            minutes = np.median([run["total_seconds"] for run in shown]) / 60
            label = side if complete(runs) else f"{side} (stopped runs: where they stood)"
            lines.append(
                f"| {task} | {label}: {script}, {env_id} | {first['steps_done']} | {len(shown)} | {evaluation} | "
                f"{training} | {scores().get(task, '-')} | {time_to_score(task, runs)} | {minutes:.1f} |"
            )
            where = (
                ""
                if side == "ours"
                else f" ({first['repository']} at {first['commit'][:8]}, patched as its record says)"
            )
            for kind in (complete(runs), [run for run in runs if "until_score" in run]):
                if kind:
                    stops = "" if "until_score" not in kind[0] else ", " + stop_words(kind[0])
                    python = "" if kind[0]["command"].startswith("python") else "python "  # earlier records
                    commands.append(
                        f"- {task}, {side}{stops}: `{python}{kind[0]['command']} --seed S`{where}, "
                        f"S = {', '.join(str(run['seed']) for run in kind)}"
                    )
    return "\n".join(lines + ["", "Commands:", *commands]) + "\n"


def stop_words(record):
    """How a run stopped early was told to stop: learning.py's flags in words."""
    limits = (["at the score"] if record["until_score"] else []) + (
        [f"after {record['max_minutes']:g} minutes"] if record["max_minutes"] else []
    )
    return "stopped " + " or ".join(limits)


SIDE_ORDER = ("ours", "CleanRL", "LeanRL", "CleanRL-JAX", "LeanRL-JAX")


def readme_table(folder):
    """The README's learning table from FOLDER/runs: per task, the score and each side's seconds to it (median over
    seeds, timed from the command), its final training return and its minutes a run, then our final evaluation."""
    records = load_records(folder)
    lines = [
        "| task | steps | seeds | score | seconds to the score, median (seeds that reached it) | training return, last "
        "20 episodes | minutes a run | ours: final evaluation |",
        "| --- | ---: | ---: | ---: | --- | --- | --- | ---: |",
    ]
    for task in [task for task in scores() if task in records]:
        sides = sorted(records[task].items(), key=lambda item: SIDE_ORDER.index(item[0]))
        times, finals, minutes = [], [], []
        for side, runs in sides:
            times.append(f"{side} {time_to_score(task, runs, spread=False)}")
            if complete(runs):  # a side with runs stopped at the score only: no final return, no whole run
                finals.append(f"{side} {np.mean([final_training_return(run) for run in complete(runs)]):.1f}")
                minutes.append(f"{side} {np.median([run['total_seconds'] for run in complete(runs)]) / 60:.1f}")
        ours = complete(records[task].get("ours", []))
        evaluation = [run["summary"]["eval_return_mean"] for run in ours]
        steps = max(run["steps_done"] for _, runs in sides for run in complete(runs) or runs)
        env_id = records[task]["ours"][0]["summary"]["env_id"] if "ours" in records[task] else ""
        seeds = max(len({run["seed"] for run in runs}) for _, runs in sides)
        lines.append(
            f"| {task} ({env_id}) | {steps:,} | {seeds} | {scores().get(task, '-')} | "
            + " · ".join(times)
            + " | "
            + " · ".join(finals)
            + " | "
            + " · ".join(minutes)
            + f" | {np.mean(evaluation):.1f} +- {np.std(evaluation):.1f} |"
        )
    return lines


def smoothed(returns, window=20):
    """Each episode's return as the mean of the last `window` episodes: the running mean LeanRL's scripts log, so
    every side's line is the same measure."""
    sums = np.cumsum(np.insert(np.asarray(returns, dtype=float), 0, 0))
    counts = np.minimum(np.arange(1, len(returns) + 1), window)
    return (sums[1:] - sums[np.arange(1, len(returns) + 1) - counts]) / counts


COLORS = {
    "ours": "#4c72b0",
    "CleanRL": "#dd8452",
    "LeanRL": "#55a868",
    "CleanRL-JAX": "#c44e52",
    "LeanRL-JAX": "#8172b3",
}


def chart(task, sides, path):
    """Two panels: the training return against steps and against seconds; per side, over seeds, a line for the mean
    and a band from the lowest to the highest seed, on the range every seed covers. Each line is the mean return of
    the last 20 episodes: episode returns smoothed so, LeanRL's as it logged it."""
    if not (plt := runner.pyplot()):
        return
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for axis, key, label in ((axes[0], "steps", "env steps"), (axes[1], "seconds", "seconds")):
        for side, runs in sides.items():
            curves = [
                (
                    np.asarray(run[key], dtype=float),
                    np.asarray(run["returns"], dtype=float) if "returns_kind" in run else smoothed(run["returns"]),
                )
                for run in complete(runs) or runs  # a side's runs stopped at the score: their curves to where they were
                if len(run["returns"])
            ]
            if not curves:
                continue
            grid = np.linspace(max(x[0] for x, _ in curves), min(x[-1] for x, _ in curves), 100)
            values = np.stack([np.interp(grid, x, y) for x, y in curves])
            color = COLORS.get(side, "#8c8c8c")
            axis.fill_between(grid, values.min(0), values.max(0), alpha=0.2, color=color, linewidth=0)
            plural = "s" if len(curves) > 1 else ""
            axis.plot(grid, values.mean(0), color=color, label=f"{side}, {len(curves)} seed{plural}")
        axis.set_xlabel(label)
        axis.set_ylabel("training return (last 20 episodes)")
        axis.legend(loc="lower right", fontsize=8)
    ours = sides.get("ours", [{}])[0].get("summary", {})
    fig.suptitle(f"{task}: {ours.get('script', '')} on {ours.get('env_id', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def collect(folder):
    records = load_records(folder)
    with open(os.path.join(folder, "curves.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["task", "side", "script", "seed", "step", "seconds", "return", "kind", "run"])
        for task, sides in records.items():
            for side, runs in sides.items():
                for run in runs:
                    script = next(word for word in run["command"].split() if word.endswith(".py"))
                    kind = run.get("returns_kind", "episode")
                    ended = stop_words(run) if "until_score" in run else "complete"
                    for step, seconds, value in zip(run["steps"], run["seconds"], run["returns"]):
                        writer.writerow([task, side, script, run["seed"], step, f"{seconds:.3f}", value, kind, ended])
    table = final_table(records)
    with open(os.path.join(folder, "final.md"), "w") as f:
        f.write(table)
    for task, sides in records.items():
        chart(task, sides, os.path.join(folder, f"{task}.png"))
    print(table, end="")
