"""Turn a folder of run summaries into speed tables (markdown) and a bar chart (PNG).

    python benchmarks/collect.py [FOLDER]    (default: benchmarks/results/<machine-tag>)
    python benchmarks/collect.py --readme     (the README's comparison tables, from the results files)
reads NAME__MODE.json (the summaries that benchmarks/speed.py saved), NAME__env_only.json, and
reference.json when there is one ({NAME: {"LeanRL --compile": SPS, ...}}: the reference scripts measured on the
same kind of machine, with where each figure was measured), writes speed.md and speed.png into that folder, and
prints the markdown.

With --readme it rewrites each block of README.md between `<!-- compare:TAG -->` and `<!-- /compare:TAG -->` from
benchmarks/results/TAG/compare/runs.jsonl (`./run.sh --compare`'s records; a TAG of MACHINE/FOLDER reads
benchmarks/results/MACHINE/FOLDER/runs.jsonl, a sweep given its own --results), and each block between
`<!-- learning:TAG -->` and `<!-- /learning:TAG -->` from benchmarks/results/TAG/learning/runs, so that the
README's speed and learning tables are the results files' numbers; tests/test_benchmarks.py fails when they differ.
"""

import glob
import json
import math
import os
import pathlib
import re
import sys

import compare
import learning_tables
import runner

ROOT = runner.ROOT
LEARNING_BLOCK = re.compile(r"(<!-- learning:([\w.-]+) -->\n)(.*?)(<!-- /learning:\2 -->)", re.S)
README_BLOCK = re.compile(r"(<!-- compare:([\w.-]+(?:/[\w.-]+)?) -->\n)(.*?)(<!-- /compare:\2 -->)", re.S)

# the modes in their order, each with its colour in every panel and its label there
MODES = {
    "eager": ("#888888", "eager"),
    "compile": ("#4c72b0", "compile"),
    "cudagraphs": ("#55a868", "graphs"),
    "compile+cudagraphs": ("#c44e52", "comp.+\ngraphs"),
}
HEADER = (
    "| mode | SPS | vs eager | return | env-only SPS | learner-bound SPS | SPS / lower ceiling | warm-up s "
    "| env time / env-only time |"
)
# the columns some scripts add to their table: {a key of their summaries: (the headers, a run's cells)}
EXTRA_COLUMNS = {
    # the LSTM script: what its padding costs
    "padded_steps": (
        "padded / real steps | peak memory MB",
        lambda run: f"{run['padded_steps'] / run['real_steps']:.2f} | {run['peak_memory_mb']:.0f}",
    ),
    # DQN: gradient samples per inserted transition
    "replay_ratio_target": (
        "replay ratio achieved / target",
        lambda run: f"{run['replay_ratio_achieved']:.2f} / {run['replay_ratio_target']:.2f}",
    ),
    # IMPALA: the actors' own ceiling, and how stale the data was
    "actor_sps": (
        "actors x envs | replayed | actor SPS | policy lag mean / max",
        lambda run: (
            f"{run['num_actors']} x {run['envs_per_actor']} | {run['replay_ratio']:.2f} "
            f"| {fmt(run['actor_sps'])} | {fmt(run['policy_lag_mean'], '.1f')} / {fmt(run['policy_lag_max'])}"
        ),
    ),
}
ALONGSIDE = "ours, alongside"  # reference.json may give ours as measured beside the references, runs alternating


def load(folder):
    """{name: {mode: summary}}, with the env-only measurement under the mode "env_only"."""
    results = {}
    for file in sorted(glob.glob("*__*.json", root_dir=folder)):
        name, mode = file.removesuffix(".json").split("__", 1)
        if text := pathlib.Path(f"{folder}/{file}").read_text().strip():
            results.setdefault(name, {})[mode] = json.loads(text)
    return results


def read_json(path):
    """The JSON in a file, None where there is no such file."""
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)


def fmt(value, spec=".0f"):
    return "n/a" if value is None else format(value, spec)


def graphs_inactive(run):
    return run["cudagraphs_requested"] and not run["cudagraphs_active"]


def table(name, runs, references):
    """A benchmark's table, a row per mode, then the reference scripts' speed where reference.json gives it."""
    env_only = runs.get("env_only", {}).get("env_only_sps")
    modes = [m for m in MODES if m in runs] + sorted(set(runs) - set(MODES) - {"env_only"})
    first = runs[modes[0]]
    eager_sps = runs.get("eager", {}).get("sps")
    threads = f", {first['torch_threads']} torch threads" if "torch_threads" in first else ""
    envs = first["num_envs"]
    if first.get("world_size", 1) > 1:  # torchrun's processes (ppo_atari_multigpu.py); torch threads are each one's
        envs = f"{first['world_size']} processes x {first['local_num_envs']}"
    extra = [columns for key, columns in EXTRA_COLUMNS.items() if key in first]
    header = HEADER + "".join(f" {headers} |" for headers, _ in extra)
    text = (
        f"### {name}: {first['script']} on {first['env_id']} ({envs} env, {first['device']}, "
        f"torch {first['torch_version']}{threads}, {first['total_timesteps']} steps)\n\n"
        f"{header}\n| --- |{' ---: |' * (header.count('|') - 2)}\n"
    )
    for mode in modes:
        run = runs[mode]
        steps = run["steady_steps"]
        # the learner's busy time; with the envs in actor processes, all but its waits for them
        learner_seconds = (
            run["steady_seconds"]
            - run["learner_wait_seconds" if run.get("async_actor") or "actor_sps" in first else "env_seconds"]
        )
        learner_bound = steps / learner_seconds if steps and learner_seconds > 0 else None
        ceiling = min(filter(None, (env_only, learner_bound, run.get("actor_sps"))), default=None)
        # the last column: the env's time in the run against the env-only time of as many steps (above 1, the loop
        # slows the env)
        text += (
            f"| {mode}{' (graphs inactive: no CUDA)' if graphs_inactive(run) else ''} | {fmt(run['sps'])} "
            f"| {fmt(run['sps'] / eager_sps, '.2f') + 'x' if run['sps'] and eager_sps else 'n/a'} "
            f"| {fmt(run['return_mean'], '.1f')} | {fmt(env_only)} | {fmt(learner_bound)} "
            f"| {fmt(run['sps'] / ceiling if run['sps'] and ceiling else None, '.2f')} "
            f"| {fmt(run['warmup_seconds'], '.1f')} "
            f"| {fmt(run['env_seconds'] * env_only / steps if env_only and steps else None, '.2f')} |"
            f"{''.join(f' {cells(run)} |' for _, cells in extra)}\n"
        )
    if name in references:
        text += f"\n{reference_line(references[name])}\n"
    return text


def reference_line(references):
    """The reference scripts' speed beside ours, the comparison the tables exist for. Not divided into the table's
    runs: they were measured apart from them; the ratio is to ours measured alongside them, where given."""
    scripts = ", ".join(f"{label} {sps:.0f} SPS" for label, sps in references.items() if label != ALONGSIDE)
    alongside = ""
    if ALONGSIDE in references:
        alongside = f" (ours measured alongside, alternating runs: {references[ALONGSIDE]:.0f} SPS)"
    return f"Reference scripts on this kind of machine: {scripts}{alongside}."


def update_phase(phase):
    """PPO-LSTM's update phase, timed by benchmarks/lstm_update.py (lstm_update.json), as a table."""
    return (
        f"\n### PPO-LSTM update phase: one minibatch ({phase['env_rows']} env rows x {phase['num_steps']} steps, "
        f"{phase['episode_starts']} episode starts, "
        f"padded/real steps {phase['padded_steps'] / phase['real_steps']:.1f})\n\n"
        "| CNN only ms | padded ms | loop ms | padded / CNN only | loop / padded |\n"
        "| ---: | ---: | ---: | ---: | ---: |\n"
        f"| {phase['cnn_only']:.1f} | {phase['padded']:.1f} | {phase['loop']:.1f} "
        f"| {phase['padded'] / phase['cnn_only']:.2f} | {phase['loop'] / phase['padded']:.2f} |\n"
    )


def chart(results, references, path):
    """One panel per benchmark, three to a row so that the grid reads at about 900 pixels wide: our modes, then
    the reference scripts measured on the same kind of machine, hatched, then ours measured alongside, light grey."""
    if not (plt := runner.pyplot()):
        return
    columns = min(3, len(results))
    rows = math.ceil(len(results) / 3)
    # every text but the titles and the axis label at 6 points; room above the bars for their labels
    with plt.rc_context({"font.size": 6, "axes.ymargin": 0.15}):
        fig = plt.figure(figsize=(7.5, 2.4 * rows))
        inactive = False
        for index, (name, runs) in enumerate(results.items()):
            ax = fig.add_subplot(rows, columns, index + 1)
            modes = [m for m in MODES if m in runs]
            inactive = inactive or any(graphs_inactive(runs[m]) for m in modes)
            bars = [
                (f"{MODES[m][1]}{'*' if graphs_inactive(runs[m]) else ''}", runs[m]["sps"] or 0, MODES[m][0], "")
                for m in modes
            ]
            bars += [
                (
                    label.replace(" ", "\n", 1),
                    sps,
                    "#dddddd" if label == ALONGSIDE else "white",
                    "" if label == ALONGSIDE else "///",
                )
                for label, sps in references.get(name, {}).items()
            ]
            labels, values, colors, hatches = zip(*bars)
            ax.bar_label(
                ax.bar(labels, values, color=colors, edgecolor="black", linewidth=0.5, hatch=hatches), fmt="%.0f"
            )
            if len(bars) > 4:  # five labels side by side already run into each other
                plt.setp(ax.get_xticklabels(), rotation=40, ha="right")
            ax.set_title(f"{name}: {runs[modes[0]]['env_id']}, {runs[modes[0]]['device']}", fontsize=7)
        fig.axes[0].set_ylabel("env steps / s", fontsize=7)
        fig.text(
            0.01,
            0.003,
            "hatched: reference scripts, same kind of machine; light grey: ours measured alongside them"
            f"{'; *: CUDA graphs requested, inactive without CUDA' if inactive else ''}",
        )
        fig.tight_layout(rect=(0, 0.02, 1, 1))
        fig.savefig(path, dpi=120)
    plt.close(fig)


def main(folder):
    results = {name: runs for name, runs in load(folder).items() if set(runs) - {"env_only"}}
    if not results:
        print(f"error: no NAME__MODE.json summaries in {folder}", file=sys.stderr)
        return 2
    references = read_json(f"{folder}/reference.json") or {}
    markdown = "\n".join(table(name, runs, references) for name, runs in results.items())
    if phase := read_json(f"{folder}/lstm_update.json"):  # written by ./run.sh --group ppo_lstm
        markdown += update_phase(phase)
    if profile := os.environ.get("BENCH_PROFILE"):  # set by run.sh: say which command made these numbers
        command = "./run.sh" if profile == "full" else f"./run.sh --{profile}"
        markdown = f"Made by `{command}` (budgets in benchmarks/settings.toml).\n\n{markdown}"
    pathlib.Path(f"{folder}/speed.md").write_text(markdown)
    chart(results, references, f"{folder}/speed.png")
    print(markdown, end="")
    return 0


def readme_block(tag):
    """The README's comparison table of the machine whose results are in benchmarks/results/TAG/compare."""
    folder = f"benchmarks/results/{tag if '/' in tag else tag + '/compare'}"
    records = compare.load_runs(f"{ROOT}/{folder}/runs.jsonl")
    counts = {count for _, count in compare.medians(records).values()} or {0}
    runs = f"{min(counts)}" if len(counts) == 1 else f"{min(counts)}-{max(counts)}"
    spread = "one run per setting" if max(counts) == 1 else f"the median of each setting's {runs} runs"
    return (
        f"{compare.each(records, 'machine')}; {compare.each(records, 'date')}; steady SPS, {spread}, alternating, "
        f"each side at its best mode and threads ([every run, the versions and the patches]({folder}/compare.md)):\n\n"
        + "".join(f"{line}\n" for line in compare.best_settings(records)[0])
    )


def learning_block(tag):
    """The README's learning table of the machine whose runs are in benchmarks/results/TAG/learning/runs."""
    return learning_tables.readme_table(f"{ROOT}/benchmarks/results/{tag}/learning")


def update_readme(path=None):
    path = pathlib.Path(path or f"{ROOT}/README.md")
    text = README_BLOCK.sub(lambda m: f"{m[1]}{readme_block(m[2])}{m[4]}", path.read_text())
    path.write_text(LEARNING_BLOCK.sub(lambda m: f"{m[1]}{learning_block(m[2])}{m[4]}", text))


if __name__ == "__main__":
    match sys.argv[1:]:
        case ["--readme"]:
            sys.exit(update_readme())
        case []:
            sys.exit(main(runner.results_folder(None)))
        case [folder] if folder not in ("-h", "--help"):
            sys.exit(main(folder))
    print("usage: python benchmarks/collect.py [RESULTS_FOLDER] | --readme", file=sys.stderr)
    sys.exit(2)
