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
import re
import sys

import compare
import learning_tables
import runner

ROOT = runner.ROOT
LEARNING_BLOCK = re.compile(r"(<!-- learning:([\w.-]+) -->\n)(.*?)(<!-- /learning:\2 -->)", re.S)
README_BLOCK = re.compile(r"(<!-- compare:([\w.-]+(?:/[\w.-]+)?) -->\n)(.*?)(<!-- /compare:\2 -->)", re.S)

MODES = ["eager", "compile", "cudagraphs", "compile+cudagraphs"]
MODE_COLORS = dict(zip(MODES, ["#888888", "#4c72b0", "#55a868", "#c44e52"]))  # a mode's colour in every panel


def load(folder):
    """{name: {mode: summary}}, with the env-only measurement under the mode "env_only"."""
    results = {}
    for path in sorted(glob.glob(os.path.join(folder, "*__*.json"))):
        name, mode = os.path.basename(path)[: -len(".json")].split("__", 1)
        with open(path) as f:
            text = f.read().strip()
        if text:
            results.setdefault(name, {})[mode] = json.loads(text)
    return results


def fmt(value, spec=".0f"):
    return "n/a" if value is None else format(value, spec)


def table(name, runs):
    env_only = runs.get("env_only", {}).get("env_only_sps")
    modes = [m for m in MODES if m in runs] + sorted(set(runs) - set(MODES) - {"env_only"})
    first = runs[modes[0]]
    eager_sps = runs.get("eager", {}).get("sps")
    threads = f", {first['torch_threads']} torch threads" if "torch_threads" in first else ""
    envs = f"{first['num_envs']} env"
    if first.get("world_size", 1) > 1:  # torchrun's processes (ppo_atari_multigpu.py); torch threads are each one's
        envs = f"{first['world_size']} processes x {first['local_num_envs']} env"
    lines = [
        f"### {name}: {first['script']} on {first['env_id']} ({envs}, {first['device']}, "
        f"torch {first['torch_version']}{threads}, {first['total_timesteps']} steps)",
        "",
        "| mode | SPS | vs eager | return | env-only SPS | learner-bound SPS | SPS / lower ceiling | warm-up s "
        "| env time / env-only time |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    padding = "padded_steps" in first  # the LSTM script: what its padding costs
    if padding:
        lines[-2] += " padded / real steps | peak memory MB |"
        lines[-1] += " ---: | ---: |"
    replay = "replay_ratio_target" in first  # DQN: gradient samples per inserted transition
    if replay:
        lines[-2] += " replay ratio achieved / target |"
        lines[-1] += " ---: |"
    actors = "actor_sps" in first  # IMPALA: the actors' own ceiling, and how stale the data was
    if actors:
        lines[-2] += " actors x envs | replayed | actor SPS | policy lag mean / max |"
        lines[-1] += " ---: | ---: | ---: | ---: |"
    for mode in modes:
        run = runs[mode]
        sps = run["sps"]
        learner_seconds = run["steady_seconds"] - run["env_seconds"]
        if run.get("async_actor") or actors:  # the envs run in actor processes: the learner's bound is its busy time
            learner_seconds = run["steady_seconds"] - run["learner_wait_seconds"]
        learner_bound = run["steady_steps"] / learner_seconds if run["steady_steps"] and learner_seconds > 0 else None
        ceiling = min((c for c in (env_only, learner_bound, run.get("actor_sps")) if c), default=None)
        label = mode + (
            " (graphs inactive: no CUDA)" if run["cudagraphs_requested"] and not run["cudagraphs_active"] else ""
        )
        # the env's time in the run against the env-only time of as many steps: above 1, the loop slows the env
        env_ratio = run["env_seconds"] * env_only / run["steady_steps"] if env_only and run["steady_steps"] else None
        lines.append(
            f"| {label} | {fmt(sps)} | {fmt(sps / eager_sps, '.2f') + 'x' if sps and eager_sps else 'n/a'} "
            f"| {fmt(run['return_mean'], '.1f')} | {fmt(env_only)} | {fmt(learner_bound)} "
            f"| {fmt(sps / ceiling if sps and ceiling else None, '.2f')} | {fmt(run['warmup_seconds'], '.1f')} "
            f"| {fmt(env_ratio, '.2f')} |"
            + (f" {run['padded_steps'] / run['real_steps']:.2f} | {run['peak_memory_mb']:.0f} |" if padding else "")
            + (f" {run['replay_ratio_achieved']:.2f} / {run['replay_ratio_target']:.2f} |" if replay else "")
            + (
                f" {run['num_actors']} x {run['envs_per_actor']} | {run['replay_ratio']:.2f} | {fmt(run['actor_sps'])} "
                f"| {fmt(run['policy_lag_mean'], '.1f')} / {fmt(run['policy_lag_max'])} |"
                if actors
                else ""
            )
        )
    return "\n".join(lines)


ALONGSIDE = "ours, alongside"  # reference.json may give ours as measured beside the references, runs alternating


def reference_line(references):
    """The reference scripts' speed beside ours, the comparison the tables exist for. Not divided into the table's
    runs: they were measured apart from them; the ratio is to ours measured alongside them, where given."""
    scripts = {label: sps for label, sps in references.items() if label != ALONGSIDE}
    line = "Reference scripts on this kind of machine: " + ", ".join(
        f"{label} {sps:.0f} SPS" for label, sps in scripts.items()
    )
    if ALONGSIDE in references:
        line += f" (ours measured alongside, alternating runs: {references[ALONGSIDE]:.0f} SPS)"
    return line + "."


def chart(results, references, path):
    """One panel per benchmark, three to a row so that the grid reads at about 900 pixels wide: our modes, then
    the reference scripts measured on the same kind of machine, hatched, then ours measured alongside, light grey."""
    if not (plt := runner.pyplot()):
        return
    columns = min(3, len(results))
    rows = math.ceil(len(results) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(7.5, 2.4 * rows), squeeze=False)
    short = {"eager": "eager", "compile": "compile", "cudagraphs": "graphs", "compile+cudagraphs": "comp.+\ngraphs"}
    inactive = False
    for ax, (name, runs) in zip(axes.flat, results.items()):
        modes = [m for m in MODES if m in runs]
        labels = [
            short[m] + ("*" if runs[m]["cudagraphs_requested"] and not runs[m]["cudagraphs_active"] else "")
            for m in modes
        ]
        inactive = inactive or any(label.endswith("*") for label in labels)
        refs = references.get(name, {})
        values = [runs[m]["sps"] or 0 for m in modes] + list(refs.values())
        ours_there = [label == ALONGSIDE for label in refs]
        colors = [MODE_COLORS[m] for m in modes] + ["#dddddd" if o else "white" for o in ours_there]
        bars = ax.bar(
            range(len(values)),
            values,
            color=colors,
            edgecolor="black",
            linewidth=0.5,
            hatch=[""] * len(modes) + ["" if o else "///" for o in ours_there],
        )
        ax.bar_label(bars, fmt="%.0f", fontsize=6)
        crowded = len(values) > 4  # five labels side by side already run into each other
        ax.set_xticks(
            range(len(values)),
            labels + [label.replace(" ", "\n", 1) for label in refs],
            fontsize=6,
            rotation=40 if crowded else 0,
            ha="right" if crowded else "center",
        )
        ax.set_title(f"{name}: {runs[modes[0]]['env_id']}, {runs[modes[0]]['device']}", fontsize=7)
        ax.tick_params(axis="y", labelsize=6)
        ax.margins(y=0.15)
    for ax in axes.flat[len(results) :]:
        ax.axis("off")
    axes[0][0].set_ylabel("env steps / s", fontsize=7)
    footnote = "hatched: reference scripts, same kind of machine; light grey: ours measured alongside them"
    fig.text(
        0.01, 0.003, footnote + ("; *: CUDA graphs requested, inactive without CUDA" if inactive else ""), fontsize=6
    )
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(folder):
    results = {name: runs for name, runs in load(folder).items() if set(runs) - {"env_only"}}
    if not results:
        print(f"error: no NAME__MODE.json summaries in {folder}", file=sys.stderr)
        return 2
    references = {}
    if os.path.exists(os.path.join(folder, "reference.json")):
        with open(os.path.join(folder, "reference.json")) as f:
            references = {name: sps for name, sps in json.load(f).items() if name in results}
    markdown = (
        "\n\n".join(
            table(name, runs) + (f"\n\n{reference_line(references[name])}" if name in references else "")
            for name, runs in results.items()
        )
        + "\n"
    )
    update_path = os.path.join(folder, "lstm_update.json")  # written by benchmarks/ppo_lstm.sh
    if os.path.exists(update_path):
        with open(update_path) as f:
            phase = json.load(f)
        markdown += (
            f"\n### PPO-LSTM update phase: one minibatch ({phase['env_rows']} env rows x {phase['num_steps']} steps, "
            f"{phase['episode_starts']} episode starts, "
            f"padded/real steps {phase['padded_steps'] / phase['real_steps']:.1f})\n\n"
            "| CNN only ms | padded ms | loop ms | padded / CNN only | loop / padded |\n"
            "| ---: | ---: | ---: | ---: | ---: |\n"
            f"| {phase['cnn_only']:.1f} | {phase['padded']:.1f} | {phase['loop']:.1f} "
            f"| {phase['padded'] / phase['cnn_only']:.2f} | {phase['loop'] / phase['padded']:.2f} |\n"
        )
    profile = os.environ.get("BENCH_PROFILE")  # set by run.sh: say which command made these numbers
    if profile:
        command = "./run.sh" if profile == "full" else f"./run.sh --{profile}"
        markdown = f"Made by `{command}` (budgets in benchmarks/settings.toml).\n\n" + markdown
    with open(os.path.join(folder, "speed.md"), "w") as f:
        f.write(markdown)
    chart(results, references, os.path.join(folder, "speed.png"))
    print(markdown, end="")
    return 0


def readme_block(tag):
    """The README's comparison table of the machine whose results are in benchmarks/results/TAG/compare."""
    folder = os.path.join("benchmarks", "results", tag if "/" in tag else os.path.join(tag, "compare"))
    records = compare.load_runs(os.path.join(ROOT, folder, "runs.jsonl"))
    counts = sorted({count for _, count in compare.medians(records).values()}) or [0]
    runs = f"{counts[0]}" if counts[0] == counts[-1] else f"{counts[0]}-{counts[-1]}"
    lines = [
        f"{compare.each(records, 'machine')}; {compare.each(records, 'date')}; steady SPS, "
        + ("one run per setting" if counts[-1] == 1 else f"the median of each setting's {runs} runs")
        + ", alternating, each side at its best mode and threads "
        f"([every run, the versions and the patches]({folder}/compare.md)):",
        "",
        *compare.best_settings(records)[0],
    ]
    return "\n".join(lines) + "\n"


def learning_block(tag):
    """The README's learning table of the machine whose runs are in benchmarks/results/TAG/learning/runs."""
    folder = os.path.join("benchmarks", "results", tag, "learning")
    return "\n".join(learning_tables.readme_table(os.path.join(ROOT, folder))) + "\n"


def update_readme(path=None):
    path = path or os.path.join(ROOT, "README.md")
    with open(path) as f:
        text = f.read()
    text = README_BLOCK.sub(lambda m: m.group(1) + readme_block(m.group(2)) + m.group(4), text)
    text = LEARNING_BLOCK.sub(lambda m: m.group(1) + learning_block(m.group(2)) + m.group(4), text)
    with open(path, "w") as f:
        f.write(text)


if __name__ == "__main__":
    if sys.argv[1:] == ["--readme"]:
        sys.exit(update_readme())
    if len(sys.argv) > 2 or sys.argv[1:2] in (["-h"], ["--help"]):
        print("usage: python benchmarks/collect.py [RESULTS_FOLDER] | --readme", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1] if sys.argv[1:] else runner.results_folder(None)))
