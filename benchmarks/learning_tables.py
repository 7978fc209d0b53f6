"""The learning benchmark's records read back: statistics over seeds, the seconds to a score, final.md (per task and
side: the final evaluation and the final training return as mean +- std, a 95% bootstrap confidence interval of the
mean and the interquartile mean, the seconds to the score, the commands), the README's learning table and a chart per
task. benchmarks/learning.py makes each record with `slim` and calls `collect`; benchmarks/collect.py --readme calls
`readme_table`.

    python benchmarks/learning_tables.py FOLDER                  final.md and the charts again from FOLDER/runs
    python benchmarks/learning_tables.py FOLDER --curves         FOLDER/curves.csv: each run's kept curve, a row a point
    python benchmarks/learning_tables.py FOLDER --slim-records   records that keep every episode (written before the
                                                                 records were slimmed) rewritten as `slim` keeps them

A record keeps, of its run's curve, what the tables take from it, computed from every episode: `episodes` (how many
points the run logged), `final_return` (the mean of the last 20 episodes) and `reached` (the task's score, and the
step and seconds at which that mean first reached it); and what the charts draw: `curve`, the mean of the last 20
episodes at up to CURVE_POINTS points (means over equal bins of steps), and `losses`, each losses/* scalar at up to
LOSS_POINTS points so.
"""

import argparse
import csv
import glob
import io
import json
import os
import pathlib

import numpy as np

import runner

# the sides, in the README table's order, each with its colour in the charts
SIDES = {
    "ours": "#4c72b0",
    "CleanRL": "#dd8452",
    "LeanRL": "#55a868",
    "CleanRL-JAX": "#c44e52",
    "LeanRL-JAX": "#8172b3",
    "FastTD3": "#937860",
    "SB3-contrib": "#da8bc3",
}
# the points a record keeps of its curve (the charts draw 100 between the seeds' ends) and of each losses/* scalar
CURVE_POINTS = 200
LOSS_POINTS = 50


def scores():
    """{task: the score its table times}, from settings.toml."""
    return {task: entry.get("score") for task, entry in runner.settings()["tasks"].items()}


def record_paths(folder):
    return sorted(glob.glob(f"{folder}/runs/*__seed*.json"))


def load_records(folder):
    """{task: {side: [record, ...]}}, ours first, each side in seed order."""
    records = {}
    for path in record_paths(folder):
        with open(path) as f:
            record = json.load(f)
        if "curve" not in record:
            raise SystemExit(f"error: {path} keeps every episode: python benchmarks/learning_tables.py {folder} "
                             "--slim-records")  # fmt: skip
        records.setdefault(record["task"], {"ours": []}).setdefault(record["side"], []).append(record)
    return {  # without the sides a task has no run of: ours where it has none
        task: {side: sorted(runs, key=lambda run: run["seed"]) for side, runs in sides.items() if runs}
        for task, sides in records.items()
    }


def ours(sides):
    """Our runs' summary (the script, its env), empty where a task has none."""
    return sides["ours"][0]["summary"] if "ours" in sides else {}


def script_of(record):
    return next(word for word in record["command"].split() if word.endswith(".py"))


def complete(runs):
    """The runs that went to the end of their budget: one stopped at its score or after --max-minutes counts for the
    seconds to the score only."""
    return [run for run in runs if "until_score" not in run]


def smoothed(returns, window=20):
    """Each episode's return as the mean of the last `window` episodes: the running mean LeanRL's scripts log, so
    every side's line is the same measure."""
    sums = np.cumsum([0, *returns], dtype=float)
    ends = np.arange(1, len(sums))
    starts = np.maximum(ends - window, 0)
    return (sums[ends] - sums[starts]) / (ends - starts)


def running_mean(curve, window=20):
    """The run's training return at each point of its full curve as the mean of the last `window` episodes: LeanRL's
    as it logged it (a curve with a `returns_kind`), the others' episode returns smoothed so."""
    return curve["returns"] if "returns_kind" in curve else smoothed(curve["returns"], window)


def final_training_return(curve, window=20):
    """The mean return of the run's last `window` training episodes, the end of its line in the chart (LeanRL: the
    last running mean of 20 it logged): what every side logs, so ours and the references compare on it."""
    means = running_mean(curve, window)
    return float(means[-1] if len(means) else "nan")


def score_reached(curve, threshold, window=20):
    """The index of the first point of the full curve at which the mean return of the last `window` episodes
    (LeanRL's: the running mean it logged) reached `threshold`; None where it never did."""
    if threshold is None:
        return None
    start = 0 if "returns_kind" in curve else window - 1  # a smoothed mean counts once all `window` are in
    means = running_mean(curve, window)
    return next((index for index in range(start, len(means)) if means[index] >= threshold), None)


def seconds_to_score(curve, threshold, window=20):
    """Seconds from the run's command to the first point of its full curve at the score (score_reached), warm-up and
    compilation included; None where it never got there, or where the curve's times do not count from the command
    (records from before they did)."""
    index = score_reached(curve, threshold, window)
    return None if index is None or curve.get("seconds_from") != "command" else float(curve["seconds"][index])


def binned(steps, columns, points):
    """`steps` and the `columns` beside them as their means over `points` equal bins of steps, the empty ones left
    out; as they are where there are no more than `points`."""
    steps = np.asarray(steps, dtype=float)
    columns = [np.asarray(column, dtype=float) for column in columns]
    if len(steps) <= points:
        return [steps, *columns]
    edges = np.linspace(steps[0], steps[-1], points + 1)[1:-1]
    bins = np.searchsorted(edges, steps, side="right")
    counts = np.bincount(bins, minlength=points)
    return [np.bincount(bins, column, points)[counts > 0] / counts[counts > 0] for column in [steps, *columns]]


def short(values, digits=4):
    """`values` to `digits` significant digits, as the kept curves and losses hold them."""
    return [float(f"{value:.{digits}g}") for value in values]


def slim(record, score):
    """The record as it is kept: the run's full curve (`steps`, `seconds`, `returns`, every point it logged) replaced
    by the figures the tables take from it (`episodes`: how many points it had, its training episodes or the means
    logged in their place; `final_return`; `reached`: the score `score` and the step and seconds of score_reached)
    and the curve the charts draw (the mean of the last 20 episodes) and the losses, each at up to CURVE_POINTS and
    LOSS_POINTS points (means over equal bins of steps)."""
    kept = {key: value for key, value in record.items() if key not in ("steps", "seconds", "returns", "losses")}
    index = score_reached(record, score)
    at_score = (None, None) if index is None else (record["steps"][index], float(record["seconds"][index]))
    steps, seconds, means = binned(record["steps"], [record["seconds"], running_mean(record)], CURVE_POINTS)
    losses = {}
    for tag, series in record.get("losses", {}).items():
        loss_steps, values = binned([step for step, _ in series], [[value for _, value in series]], LOSS_POINTS)
        losses[tag] = [[round(step), value] for step, value in zip(loss_steps.tolist(), short(values))]
    return {
        **kept,
        "episodes": len(record["returns"]),
        "final_return": final_training_return(record),
        "reached": dict(zip(("score", "step", "seconds"), (score, *at_score))),
        "curve": {"steps": np.rint(steps).astype(int).tolist(), "seconds": short(seconds, 6), "returns": short(means)},
        "losses": losses,
    }


def slim_records(folder):
    """Rewrites FOLDER/runs' records that keep every episode as `slim` keeps them, the task's score from
    settings.toml; records from before the references (no side, no process time) as ours with the summary's
    figures."""
    for path in record_paths(folder):
        with open(path) as f:
            record = json.load(f)
        if "curve" in record:
            continue
        if "side" not in record:
            summary = record["summary"]
            record.update(side="ours", total_seconds=summary["total_seconds"], steps_done=summary["steps_done"])
        with open(path + ".tmp", "w") as f:
            json.dump(slim(record, scores().get(record["task"])), f)
        os.replace(path + ".tmp", path)
        print(f"{path}: {record['task']} {record['side']} seed {record['seed']}, slimmed")


def time_to_score(task, runs, spread=True):
    """The seconds to the task's score over the seeds, as a table cell: the median, the lowest and highest (with
    `spread`), how many seeds reached it and how many were stopped before it. Per seed: its complete run where that is
    timed from the command, else its run stopped at the score."""
    timed = {  # a seed's complete run goes in last
        run["seed"]: run
        for run in sorted(runs, key=lambda run: "until_score" not in run)
        if run.get("seconds_from") == "command"
    }
    if not timed:
        return "not timed"
    score, reached, cut = scores().get(task), [], []
    for run in timed.values():
        if run["reached"]["score"] != score:
            raise SystemExit(f"error: {task} {run['side']} seed {run['seed']}: its record times the score "
                             f"{run['reached']['score']}, settings.toml's is {score}")  # fmt: skip
        if (seconds := run["reached"]["seconds"]) is not None:
            reached.append(seconds)
        elif str(run.get("stopped")).startswith("after"):
            cut.append(run["max_minutes"])
    reached.sort()
    count = f"{len(reached)}/{len(timed)}"
    if cut:
        count += f"; {len(cut)} stopped at {' or '.join(f'{minutes:g}' for minutes in sorted(set(cut)))} min"
    if not reached:
        return f"not reached ({count})"
    lowest_highest = f" [{reached[0]:.0f}, {reached[-1]:.0f}]" if spread and len(reached) > 1 else ""
    return f"{np.median(reached):.0f}{lowest_highest} ({count})"


def interquartile_mean(values):
    """rliable's IQM (scipy's trim_mean at 25%): the mean after dropping a quarter of the values, rounded down, at
    each end; with fewer than four seeds it is the mean."""
    cut = len(values) // 4
    return float(np.sort(values)[cut : len(values) - cut].mean())


def bootstrap_interval(values, resamples=10_000, seed=0):
    """95% percentile bootstrap confidence interval of the mean over seeds."""
    means = np.random.default_rng(seed).choice(values, (resamples, len(values))).mean(1)
    return tuple(np.percentile(means, (2.5, 97.5)).tolist())


def mean_std_interval(values):
    low, high = bootstrap_interval(values)
    return f"{np.mean(values):.1f} +- {np.std(values):.1f} | [{low:.1f}, {high:.1f}] | {interquartile_mean(values):.1f}"


def minutes(runs):
    """The median minutes a run."""
    return np.median([run["total_seconds"] for run in runs]) / 60


def stop_words(record):
    """How a run stopped early was told to stop, in words of learning.py's flags; None for a complete run."""
    if "until_score" in record:
        limits = (["at the score"] if record["until_score"] else []) + (
            [f"after {record['max_minutes']:g} minutes"] if record["max_minutes"] else []
        )
        return "stopped " + " or ".join(limits)


def final_table(records):
    """Per task and side: the final evaluation (ours; the references have none) and the final training return, each
    as mean +- std over seeds, a 95% bootstrap interval of the mean and the IQM, of its complete runs (of the runs
    stopped at the score or a time limit, where a side has only those: where they stood)."""
    table = (
        "| task | side: script, env | steps | seeds | final eval return, mean +- std | 95% CI of the mean | IQM | "
        "final training return (last 20 episodes), mean +- std | 95% CI of the mean | IQM | "
        "score | seconds to the score: median [lowest, highest] (seeds that reached it) | minutes a run (median) |\n"
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n"
    )
    commands = ""
    for task, sides in records.items():
        for side, runs in sides.items():
            whole = complete(runs)
            shown = whole or runs
            first = shown[0]
            evaluation = "none | | "  # the references have none
            if side == "ours" and whole:
                evaluation = mean_std_interval([run["summary"]["eval_return_mean"] for run in shown])
            label = side if whole else f"{side} (stopped runs: where they stood)"
            script = first["summary"]["script"] if side == "ours" else os.path.basename(script_of(first))
            env_id = ours(sides).get("env_id", "its default env")
            training = mean_std_interval([run["final_return"] for run in shown])
            table += f"| {task} | {label}: {script}, {env_id} | {first['steps_done']} | {len(shown)} | {evaluation} "
            table += (
                f"| {training} | {scores().get(task, '-')} | {time_to_score(task, runs)} | {minutes(shown):.1f} |\n"
            )
            where = ""
            if side != "ours":
                where = f" ({first['repository']} at {first['commit'][:8]}, patched as its record says)"
            for kind in (whole, [run for run in runs if "until_score" in run]):
                if kind:
                    stops = f", {stop_words(kind[0])}" if "until_score" in kind[0] else ""
                    python = "" if kind[0]["command"].startswith("python") else "python "  # earlier records: none
                    seeds = ", ".join(str(run["seed"]) for run in kind)
                    commands += (
                        f"- {task}, {side}{stops}: `{python}{kind[0]['command']} --seed S`{where}, S = {seeds}\n"
                    )
    return f"{table}\nCommands:\n{commands}"


def readme_table(folder):
    """The README's learning table from FOLDER/runs: per task, the score and each side's seconds to it (median over
    seeds, timed from the command), its final training return and its minutes a run, then our final evaluation."""
    records = load_records(folder)
    return (
        "| task | steps | seeds | score | seconds to the score, median (seeds that reached it) | training return, last "
        "20 episodes | minutes a run | ours: final evaluation |\n"
        "| --- | ---: | ---: | ---: | --- | --- | --- | ---: |\n"
    ) + "".join(readme_row(task, records[task]) for task in scores() if task in records)


def readme_row(task, sides):
    """A task's row of the README's learning table, its sides in the order of SIDES."""
    sides = {side: sides[side] for side in sorted(sides, key=list(SIDES).index)}
    # a side with runs stopped at the score only: no final return, no whole run
    whole = {side: complete(runs) for side, runs in sides.items() if complete(runs)}
    evaluation = [run["summary"]["eval_return_mean"] for run in whole.get("ours", [])]
    steps = max(run["steps_done"] for runs in sides.values() for run in complete(runs) or runs)
    seeds = max(len({run["seed"] for run in runs}) for runs in sides.values())
    times = " · ".join(f"{side} {time_to_score(task, runs, spread=False)}" for side, runs in sides.items())
    finals = " · ".join(f"{side} {np.mean([run['final_return'] for run in runs]):.1f}" for side, runs in whole.items())
    run_minutes = " · ".join(f"{side} {minutes(runs):.1f}" for side, runs in whole.items())
    row = f"| {task} ({ours(sides).get('env_id', '')}) | {steps:,} | {seeds} | {scores().get(task, '-')} | {times} "
    evaluated = f"{np.mean(evaluation):.1f} +- {np.std(evaluation):.1f}" if evaluation else "-"  # runs stopped early
    return row + f"| {finals or '-'} | {run_minutes or '-'} | {evaluated} |\n"


def chart(task, sides, path):
    """Two panels: the training return against steps and against seconds; per side, over seeds, a line for the mean
    and a band from the lowest to the highest seed, on the range every seed covers. Each line is the mean return of
    the last 20 episodes: episode returns smoothed so, LeanRL's as it logged it."""
    if not (plt := runner.pyplot()):
        return
    import PIL.Image  # matplotlib's own dependency

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for axis, key, label in zip(axes, ("steps", "seconds"), ("env steps", "seconds")):
        for side, runs in sides.items():
            # a side's runs stopped at the score: their curves to where they were
            drawn = [run["curve"] for run in complete(runs) or runs if run["curve"]["returns"]]
            if drawn:
                grid = np.linspace(max(run[key][0] for run in drawn), min(run[key][-1] for run in drawn), 100)
                values = np.stack([np.interp(grid, run[key], run["returns"]) for run in drawn])
                color = SIDES.get(side, "#8c8c8c")
                axis.fill_between(grid, values.min(0), values.max(0), alpha=0.2, color=color, linewidth=0)
                axis.plot(
                    grid, values.mean(0), color=color, label=f"{side}, {len(drawn)} seed{'s' if len(drawn) > 1 else ''}"
                )
        axis.set(xlabel=label, ylabel="training return (last 20 episodes)")
        axis.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"{task}: {ours(sides).get('script', '')} on {ours(sides).get('env_id', '')}", fontsize=10)
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=100)
    plt.close(fig)
    # a palette of 256 colours: a third of the bytes, as each rerun adds its charts to git
    PIL.Image.open(image).convert("RGB").quantize(256).save(path, optimize=True)


def curve_rows(records):
    """curves.csv: a row per point of each run's kept curve, its return the mean of the last 20 episodes (LeanRL's:
    what it logged) over the point's bin of steps."""
    yield "task side script seed step seconds return kind run".split()
    for task, sides in records.items():
        for side, runs in sides.items():
            for run in runs:
                about = [task, side, script_of(run), run["seed"]]
                kind = [run.get("returns_kind", "mean of the last 20 episodes"), stop_words(run) or "complete"]
                curve = run["curve"]
                for step, seconds, value in zip(curve["steps"], curve["seconds"], curve["returns"]):
                    yield [*about, step, seconds, value, *kind]


def collect(folder):
    """final.md and a chart per task from FOLDER/runs; the table printed."""
    records = load_records(folder)
    table = final_table(records)
    pathlib.Path(f"{folder}/final.md").write_text(table)
    for task, sides in records.items():
        chart(task, sides, f"{folder}/{task}.png")
    print(table, end="")


def main():
    parser = argparse.ArgumentParser(description="final.md and a chart per task from FOLDER/runs")
    parser.add_argument("folder", help="a learning results folder, e.g. benchmarks/results/cpu-2core/learning")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--curves", action="store_true", help="write FOLDER/curves.csv instead (not kept in git)")
    only.add_argument("--slim-records", action="store_true", help="rewrite the records that keep every episode")
    args = parser.parse_args()
    if args.slim_records:
        slim_records(args.folder)
    elif args.curves:
        with open(f"{args.folder}/curves.csv", "w", newline="") as f:
            csv.writer(f).writerows(curve_rows(load_records(args.folder)))
    else:
        collect(args.folder)


if __name__ == "__main__":
    main()
