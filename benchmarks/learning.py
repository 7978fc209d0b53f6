"""Learning curves over seeds: each script on its task of benchmarks/settings.toml, N seeds, one run at a time, each
run's curve kept as a record; benchmarks/learning_tables.py makes the table and the charts of them.

    python benchmarks/learning.py [--profile quick|full|smoke] [--seeds N] [--only sac_pendulum,dqn_cartpole]
                                  [--results FOLDER] [--cleanrl CLONE] [--leanrl CLONE] [--reference-python PY]
                                  [--jax-python PY] [--until-score] [--max-minutes M] [--dry-run]
    ./run.sh --learning [--quick | --smoke] [--seeds N] [--results FOLDER] [...]    (the same, FOLDER/learning)

Each run writes FOLDER/runs/<task>[__<side>]__seed<k>.json: the summary, the command (relative to the repository
or the reference clone, the Python by its version), and of the training returns it logged to TensorBoard (with the
seconds since the command) and its losses/* scalars what learning_tables.slim keeps: the figures the tables take
from every episode and the curves downsampled, tens of kB a run; a run whose file exists is not run again, so an
interrupted profile goes on where it stopped. `python benchmarks/learning_tables.py FOLDER --curves` writes the
kept curves to FOLDER/curves.csv. Our scripts run with $PYTHON where it is set, else with this interpreter.
Profiles: quick fits a 2-core CPU (hours with PPO Atari), full is CleanRL's budgets, smoke checks the files in
about a minute.

With --cleanrl, --leanrl, --fasttd3 and --sb3-contrib (clones of vwxyzjn/cleanrl, pytorch-labs/LeanRL,
younggyoseo/FastTD3 and Stable-Baselines-Team/stable-baselines3-contrib), each seed of a task also runs the task's
reference scripts after ours, in their default mode (compile and CUDA graphs
off, as ours run without the speed flags), read at the commits of benchmarks/references.py and patched at run time,
with the same flags and seed (FastTD3's train.py: the same settings under its names, references.fasttd3_flags;
SB3-contrib's CrossQ: its class trained by the driver in benchmarks/references.py, with stable-baselines3 installed
in the reference Python); with
--jax-python (a Python with requirements/requirements-jax.txt) the JAX ones too. LeanRL's scripts import
torchrl, whose release for torch 2.13 needs tensordict<0.15 (ours takes 0.15): give them a Python of their own, e.g.
    python -m venv ref && ref/bin/pip install torch==2.13.0 torchrl==0.14.1 "gymnasium[mujoco]" envpool tyro \\
        tensorboard tqdm
and --reference-python ref/bin/python. The references evaluate nothing, so the table compares every side on the
mean training return of the last 20 episodes (LeanRL's: the running mean it logs).

With --until-score, each run stops once it has logged its task's score (read from its TensorBoard every 30 seconds;
a writer flushes every 10 events or two minutes, so a run may go on for that long after it), and with
--max-minutes M, after M minutes: what the seconds to a score need, without the rest of a budget that takes hours.
Such runs keep their own records (<task>[__side]__seed<k>__to-score.json) and count for the seconds to the score
only.
"""

import argparse
import json
import os
import sys
import tempfile
import time

import learning_tables
import runner
from references import check_clones, fasttd3_flags, option, package_versions, script_path, write_reference

# what a reference logs in place of each episode's return: LeanRL's scripts a running mean of the last 20 episodes
# (to wandb); the projects' JAX PPO the mean of each env's last game, every iteration (CleanRL's
# charts/avg_episodic_return, LeanRL's wandb episode_return): a mean over 8 games, not 20
LOGGED_RETURNS = {
    "ppo_atari_envpool_xla_jax": "mean of each env's last game (the JAX PPO scripts' log)",
    "train": "running mean of the last 20 episodes (the log of the env beside FastTD3's train.py)",
    None: "running mean of the last 20 episodes (LeanRL's wandb log)",
}
POLL_SECONDS = 30


class Curve:
    """What a run of `script` in `workdir` has logged so far, read as it runs: its training episodes, else what it
    logs in their place (LOGGED_RETURNS), and its losses/* scalars; its record keeps them slimmed."""

    def __init__(self, workdir, started, script=None):
        self.logs, self.started = runner.Logs(workdir), started
        self.logged_kind = LOGGED_RETURNS.get(script, LOGGED_RETURNS[None])

    def read(self):
        """The full curve: steps, seconds since the command, returns and losses (and returns_kind if logged)."""
        logged = self.logs.read()
        losses = {tag: [[step, value] for step, _, value in logged[tag]] for tag in logged if tag.startswith("losses/")}
        # the JAX PPO scripts log no episode, only each env's last game averaged
        tags = [tag for tag in ("charts/episodic_return", "charts/avg_episodic_return", "wandb/episode_return")]
        tag = next((tag for tag in tags if tag in logged), None)
        points = logged.get(tag, [])
        curve = {"steps": [p[0] for p in points], "seconds": [p[1] - self.started for p in points]}
        curve.update(returns=[p[2] for p in points], losses=losses, seconds_from="command")
        return curve if tag in (None, tags[0]) else {**curve, "returns_kind": self.logged_kind}


def words(table, task, side, profile):
    """(launcher, the script as the repository or the reference clone names it, its flags) of `side`'s run of
    `task`, less the seed."""
    entry, flags = table["tasks"][task], runner.flags(table["tasks"], task, profile)
    if side == "ours":
        eval_episodes = ["--eval-episodes", str(table["eval_episodes"][profile])]
        return entry.get("launcher", []), f"leanrl_scripts/{entry['script']}", flags + eval_episodes
    if "reference_env" in entry:
        flags[flags.index("--env-id") + 1] = entry["reference_env"]
    if side == "FastTD3":  # the same settings under its names
        import torch

        flags = fasttd3_flags(flags, cuda=torch.cuda.is_available())
    return [], script_path(side.removesuffix("-JAX"), dict(entry["references"])[side]), flags


def run_task(task, seed, profile, folder, python, side="ours", repo_dir=None, reference_python=None,
             until_score=False, max_minutes=None):  # fmt: skip
    """One run of `task` with `seed` in a scratch folder, by our script or by `side`'s (a reference: CleanRL's or
    LeanRL's, PyTorch or -JAX, read from the clone `repo_dir`, run by `reference_python`); its record in
    FOLDER/runs/<task>[__<side>]__seed<seed>.json, its curve timed from the command. With `until_score`, the run stops
    at its task's score, and with `max_minutes`, after that many minutes: such a run counts for the seconds to
    the score only, and its record's name ends in __to-score."""
    table = runner.settings()
    score = table["tasks"][task].get("score")
    tag = "" if side == "ours" else f"__{side.lower()}"
    to_score = "__to-score" if until_score or max_minutes else ""
    record_path = os.path.join(folder, "runs", f"{task}{tag}__seed{seed}{to_score}.json")
    if os.path.exists(record_path):
        print(f"{task} {side} seed {seed}: done before ({record_path})", flush=True)
        return
    launcher, script, flags = words(table, task, side, profile)
    reference = None if side == "ours" else os.path.basename(script)[: -len(".py")]
    record = {"task": task, "seed": seed, "profile": profile, "side": side}
    with tempfile.TemporaryDirectory() as workdir:
        path = os.path.join(runner.ROOT, script)
        if reference:
            path, found = write_reference(side.removesuffix("-JAX"), reference, repo_dir, workdir)
            found.pop("script")
            python = reference_python
            record.update(found, packages=package_versions(reference_python))
        started = time.time()
        curve = Curve(workdir, started, reference)

        def stop_when():
            if until_score and learning_tables.seconds_to_score(curve.read(), score) is not None:
                return "at the score"
            if max_minutes is not None and time.time() - started >= max_minutes * 60:
                return f"after {max_minutes:g} minutes"
            return None

        watched = until_score or max_minutes is not None
        command = [python, *launcher, path, *flags, "--seed", str(seed)]
        ended = runner.run(command, workdir, stop_when=stop_when if watched else None, poll_seconds=POLL_SECONDS)
        summary = runner.summary(ended.stdout)
        if (ended.returncode and not ended.stopped) or (side == "ours" and not summary):
            sys.exit(f"error: {task} {side} seed {seed} failed (exit code {ended.returncode}): "
                     f"{' '.join(command)}\n{ended.stderr[-2000:]}")  # fmt: skip
        record.update(curve.read())
    record.update(
        command=runner.record_command(python, [*launcher, script, *flags]),
        total_seconds=ended.seconds,
        steps_done=int(flags[flags.index("--total-timesteps") + 1]) if "--total-timesteps" in flags else None,
    )
    if to_score:
        record.update(until_score=until_score, max_minutes=max_minutes, stopped=ended.stopped)
        if ended.stopped:  # a reference stopped says no more than its last logged step
            record["steps_done"] = max(record["steps"], default=0)
    if side == "ours":
        record.update(summary=summary, steps_done=summary["steps_done"])
    record = learning_tables.slim(record, score)
    os.makedirs(os.path.dirname(record_path), exist_ok=True)
    with open(record_path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(record_path + ".tmp", record_path)
    final = summary["eval_return_mean"] if side == "ours" else record["final_return"]
    reached = record["reached"]["seconds"]
    print(
        f"{task} {side} seed {seed}: {'eval' if side == 'ours' else 'final training'} return {final}, "
        f"{ended.seconds / 60:.1f} minutes"
        + (f", the score after {reached:.0f} s" if reached is not None else ", the score not reached")
        + (f", stopped {ended.stopped}" if ended.stopped else ""),
        flush=True,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    runner.add_arguments(parser)
    parser.add_argument("--seeds", type=int, default=3, help="seeds 1..N of each task")
    parser.add_argument("--until-score", action="store_true", help="stop each run at its task's score")
    parser.add_argument("--max-minutes", type=float, help="stop a run after M minutes")
    args = parser.parse_args()
    if args.max_minutes is not None and not args.max_minutes > 0:
        parser.error("--max-minutes must be more than 0")
    tasks = runner.settings()["tasks"]
    names = args.only.split(",") if args.only else [name for name in tasks if runner.flags(tasks, name, args.profile)]
    if unknown := [name for name in names if name not in tasks or runner.flags(tasks, name, args.profile) is None]:
        parser.error(f"no {args.profile} budget for {', '.join(unknown)}")
    if args.seeds < 1:
        parser.error("--seeds must be 1 or more")
    clones = check_clones(parser, args, required=())
    python = os.environ.get("PYTHON", sys.executable)  # run.sh's, as for its speed runs; else this interpreter
    folder = None if args.dry_run else runner.results_folder(args.results, "learning")
    for name in names:
        references = [
            (side, clones.get(option(side.removesuffix("-JAX"))))
            for side, _ in tasks[name].get("references", [])
            if option(side.removesuffix("-JAX")) in clones and (args.jax_python or not side.endswith("-JAX"))
        ]
        for seed in range(1, args.seeds + 1):
            for side, clone in [("ours", None), *references]:
                reference_python = args.jax_python if side.endswith("-JAX") else args.reference_python
                if args.dry_run:
                    launcher, script, flags = words(runner.settings(), name, side, args.profile)
                    words_ = [*launcher, script, *flags, "--seed", str(seed)]
                    print(runner.record_command(python if side == "ours" else reference_python, words_))
                    continue
                run_task(name, seed, args.profile, folder, python, side, clone, reference_python, args.until_score,
                         args.max_minutes)  # fmt: skip
    if not args.dry_run:
        learning_tables.collect(folder)


if __name__ == "__main__":
    main()
