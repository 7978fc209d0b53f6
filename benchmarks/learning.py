"""Learning curves over seeds: each script on its benchmark task, N seeds, one run at a time, and what they logged
collected into curves, a table of final returns and a chart per task.

    python benchmarks/learning.py [--profile quick|full|smoke] [--seeds N] [--only sac_pendulum,dqn_cartpole]
                                  [--results FOLDER] [--cleanrl CLONE] [--leanrl CLONE] [--reference-python PY]
                                  [--until-score] [--max-minutes M]
    ./run.sh --learning [--quick | --smoke] [--seeds N] [--results FOLDER] [...]    (the same, FOLDER/learning)

Each run writes FOLDER/runs/<task>__seed<k>.json (the summary and the training returns from TensorBoard, with the
seconds since the run's writer opened, and the losses/* scalars it logged, to compare two sides' runs by more than
their returns); a run whose file exists is not run again, so an interrupted profile goes on where it stopped.
Our scripts run with $PYTHON where it is set (run.sh exports its own), else with this interpreter.
Then FOLDER gets curves.csv (every episode of every run), final.md (per task: the final evaluation
over seeds as mean +- std, a 95% bootstrap confidence interval of the mean and the interquartile mean) and
<task>.png (the training return against steps and against seconds: the mean over seeds as a line, the lowest and the
highest seed as a band). Profiles: quick fits a 2-core CPU (hours with PPO Atari), full is CleanRL's budgets,
smoke checks the files in about a minute.

With --cleanrl and --leanrl (clones of vwxyzjn/cleanrl and pytorch-labs/LeanRL), each seed of a task also runs the
reference scripts after ours: CleanRL's on every task but IMPALA (neither project has one), LeanRL's torchcompile
SAC, TD3 and PPO continuous (in their default mode, compile and CUDA graphs off, as ours run without the speed
flags), read at the commits in REFERENCE_REPOS, with the same flags and seed. They were written for
gymnasium 0.29 (and LeanRL's for tensordict of 2024): a shim put before each script makes gymnasium 1.x hand out
what 0.29 did, and REFERENCE_PATCHES lists the few lines changed beyond it, each with its reason; a record keeps
the commit, the command, the patches and the reference Python's package versions. LeanRL's scripts import torchrl,
whose release for torch 2.13 needs tensordict<0.15 (ours takes 0.15): give them a Python of their own, e.g.
    python -m venv ref && ref/bin/pip install torch==2.13.0 torchrl==0.14.1 "gymnasium[mujoco]" envpool tyro \\
        tensorboard tqdm
and --reference-python ref/bin/python; with --jax-python (a Python with requirements/requirements-jax.txt) the
projects' JAX scripts of DQN, TD3 and PPO Atari run too. The table gives each side's seconds from the command to
the task's score (THRESHOLDS), compilation included. The references evaluate nothing, so the table compares every
side on the mean training return of the last 20 episodes, the running mean LeanRL's scripts log (its last logged
value).

With --until-score, each run stops once it has logged its task's score (read from its TensorBoard every 30 seconds;
a writer flushes every 10 events or two minutes, so a run may go on for that long after it), and with
--max-minutes M, after M minutes: what the seconds to a score need, without the rest of a budget that takes hours
(PPO Atari's). Such runs keep their own records (<task>[__side]__seed<k>__to-score.json), and count for the seconds
to the score only: per seed, a complete run timed from the command where there is one, else the stopped run; the
final returns, minutes and charts stay the complete runs' (a side with stopped runs only: where they stood).
"""

import argparse
import contextlib
import csv
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
from references import REFERENCE_REPOS, check_clone, package_versions, write_reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROFILES = ("smoke", "quick", "full")
IMPALA_CARTPOLE = [
    "--env-id",
    "CartPole-v1",
    "--num-actors",
    2,
    "--envs-per-actor",
    4,
    "--batch-size",
    16,
    "--learning-rate",
    3e-4,
]  # docs/impala.md's CartPole settings, those of its learning test
# task: (script, {profile: flags}); a task missing from a profile does not run in it. quick: tasks a 2-core CPU learns
# in minutes a seed (PPO Atari: 1M steps, about half an hour); full: CleanRL's benchmark budgets and envs.
TASKS = {
    "sac_pendulum": (
        "sac_continuous_action.py",
        {
            "smoke": [
                "--env-id",
                "Pendulum-v1",
                "--total-timesteps",
                400,
                "--learning-starts",
                200,
                "--batch-size",
                32,
            ],
            "quick": ["--env-id", "Pendulum-v1", "--total-timesteps", 15_000, "--learning-starts", 1000],
        },
    ),
    "td3_pendulum": (
        "td3_continuous_action.py",
        {
            "smoke": [
                "--env-id",
                "Pendulum-v1",
                "--total-timesteps",
                400,
                "--learning-starts",
                200,
                "--batch-size",
                32,
            ],
            "quick": ["--env-id", "Pendulum-v1", "--total-timesteps", 15_000, "--learning-starts", 1000],
        },
    ),
    "sac_halfcheetah": (
        "sac_continuous_action.py",
        {"full": ["--env-id", "HalfCheetah-v5", "--total-timesteps", 10**6]},
    ),
    "td3_halfcheetah": (
        "td3_continuous_action.py",
        {"full": ["--env-id", "HalfCheetah-v5", "--total-timesteps", 10**6]},
    ),
    "ppo_continuous_hopper": (
        "ppo_continuous_action.py",
        {
            "smoke": ["--env-id", "Pendulum-v1", "--total-timesteps", 1024, "--num-steps", 512],
            "quick": ["--env-id", "Hopper-v5", "--total-timesteps", 200_000],
            "full": ["--env-id", "Hopper-v5", "--total-timesteps", 10**6],
        },
    ),
    "dqn_cartpole": (
        "dqn.py",
        {
            "smoke": ["--total-timesteps", 2000, "--learning-starts", 500],
            "quick": ["--total-timesteps", 500_000],
            "full": ["--total-timesteps", 500_000],
        },
    ),
    "ppo_atari_breakout": (
        "ppo_atari_envpool.py",
        {
            "smoke": ["--total-timesteps", 512, "--num-envs", 4, "--num-steps", 32, "--num-minibatches", 2],
            "quick": ["--total-timesteps", 10**6],
            "full": ["--total-timesteps", 10**7],
        },
    ),
    "impala_cartpole": (
        "impala_ray.py",
        {
            "smoke": IMPALA_CARTPOLE + ["--total-timesteps", 3000],
            "quick": IMPALA_CARTPOLE + ["--total-timesteps", 10**6],
        },
    ),
    # PPO Atari's 8 envs as two processes of 4 (LAUNCHERS): every process's share of a minibatch in one update
    "ppo_atari_multigpu_breakout": (
        "ppo_atari_multigpu.py",
        {
            "quick": ["--total-timesteps", 10**6, "--local-num-envs", 4],
            "full": ["--total-timesteps", 10**7, "--local-num-envs", 4],
        },
    ),
    # what a user gets who names only the env: every other flag at its default (10M steps)
    "impala_cartpole_defaults": ("impala_ray.py", {"full": ["--env-id", "CartPole-v1"]}),
}
# tasks whose script torchrun starts, and its arguments: the launcher's `python -m torch.distributed.run` goes
# before the script, and the record's command says so
LAUNCHERS = {"ppo_atari_multigpu_breakout": ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]}
EVAL_EPISODES = {"smoke": 2, "quick": 10, "full": 10}

# the score a run reaches (the mean training return of its last 20 episodes) and the seconds from its command to it:
# CartPole near its cap of 500, Pendulum's swing-up held, Hopper hopping, Breakout past the first wall
THRESHOLDS = {
    "sac_pendulum": -200, "td3_pendulum": -200, "sac_halfcheetah": 3000, "td3_halfcheetah": 3000,
    "ppo_continuous_hopper": 1000, "dqn_cartpole": 475, "ppo_atari_breakout": 10, "impala_cartpole": 475,
    "ppo_atari_multigpu_breakout": 10, "impala_cartpole_defaults": 475,
}  # fmt: skip
# side: CleanRL and LeanRL are the projects' PyTorch scripts, "<project>-JAX" their JAX ones (--jax-python runs them)
REFERENCES = {
    "sac_pendulum": [("CleanRL", "sac_continuous_action"), ("LeanRL", "sac_continuous_action_torchcompile")],
    "td3_pendulum": [
        ("CleanRL", "td3_continuous_action"),
        ("LeanRL", "td3_continuous_action_torchcompile"),
        ("CleanRL-JAX", "td3_continuous_action_jax"),
        ("LeanRL-JAX", "td3_continuous_action_jax"),
    ],
    "sac_halfcheetah": [("CleanRL", "sac_continuous_action"), ("LeanRL", "sac_continuous_action_torchcompile")],
    "td3_halfcheetah": [("CleanRL", "td3_continuous_action"), ("LeanRL", "td3_continuous_action_torchcompile")],
    "ppo_continuous_hopper": [("CleanRL", "ppo_continuous_action"), ("LeanRL", "ppo_continuous_action_torchcompile")],
    "dqn_cartpole": [("CleanRL", "dqn"), ("CleanRL-JAX", "dqn_jax"), ("LeanRL-JAX", "dqn_jax")],
    "ppo_atari_breakout": [
        ("CleanRL", "ppo_atari_envpool"),
        ("CleanRL-JAX", "ppo_atari_envpool_xla_jax"),
        ("LeanRL-JAX", "ppo_atari_envpool_xla_jax"),
    ],
}  # IMPALA has no script in either project


def tensorboard_scalars(events, started, tag="charts/episodic_return"):
    """(steps, seconds since `started` (the command's time), returns) of every training episode the run logged to
    TensorBoard (or the values of `tag`), and its losses/* scalars as {tag: [[step, value], ...]}: `events` (an
    EventAccumulator of the run's folder) reads what was written since its last call."""
    events.Reload()
    tags = events.Tags()["scalars"]
    losses = {
        name: [[row.step, row.value] for row in events.Scalars(name)] for name in tags if name.startswith("losses/")
    }
    if tag not in tags:
        return [], [], [], losses
    rows = events.Scalars(tag)
    return [row.step for row in rows], [row.wall_time - started for row in rows], [row.value for row in rows], losses


def logged_running_means(workdir, started):
    """(steps, seconds since `started`, values) of the stub's wandb log: LeanRL's running mean of the last 20
    episodes."""
    rows = []
    if os.path.exists(os.path.join(workdir, "wandb_log.jsonl")):
        with open(os.path.join(workdir, "wandb_log.jsonl")) as f:
            rows = [row for row in map(json.loads, f) if np.isfinite(row.get("episode_return", np.nan))]
    times = [row["time"] - started for row in rows]
    return [row["step"] for row in rows], times, [row["episode_return"] for row in rows]


# what a reference logs in place of each episode's return: LeanRL's scripts a running mean of the last 20 episodes
# (to wandb); the projects' JAX PPO the mean of each env's last game, every iteration (CleanRL's
# charts/avg_episodic_return, LeanRL's wandb episode_return): a mean over 8 games, not 20
LOGGED_RETURNS = {
    "ppo_atari_envpool_xla_jax": "mean of each env's last game (the JAX PPO scripts' log)",
    None: "running mean of the last 20 episodes (LeanRL's wandb log)",
}


class Curve:
    """What a run of `script` in `workdir` has logged so far, read as it runs: its TensorBoard folder's training
    episodes (read on from where the last call stopped), else what it logs in their place (LOGGED_RETURNS)."""

    def __init__(self, workdir, started, script=None):
        self.workdir, self.started, self.events = workdir, started, None
        self.logged_kind = LOGGED_RETURNS.get(script, LOGGED_RETURNS[None])

    def read(self):
        """The record's curve: steps, seconds since the command, returns and losses (and returns_kind if logged)."""
        if self.events is None and (folders := glob.glob(os.path.join(self.workdir, "runs", "*"))):
            from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

            self.events = EventAccumulator(folders[0], size_guidance={"scalars": 0})
        scalars = tensorboard_scalars(self.events, self.started) if self.events else ([], [], [], {})
        curve = dict(zip(("steps", "seconds", "returns", "losses"), scalars), seconds_from="command")
        if curve["returns"]:
            return curve
        steps, seconds, returns = [], [], []
        if self.events:  # the JAX PPO scripts log no episode, only each env's last game averaged
            steps, seconds, returns, _ = tensorboard_scalars(self.events, self.started, "charts/avg_episodic_return")
        if not returns and os.path.exists(os.path.join(self.workdir, "wandb_log.jsonl")):
            steps, seconds, returns = logged_running_means(self.workdir, self.started)
        if not returns:
            return curve
        return {**curve, "steps": steps, "seconds": seconds, "returns": returns, "returns_kind": self.logged_kind}


POLL_SECONDS = 30


def run_watched(command, workdir, curve, threshold=None, max_minutes=None):
    """Runs `command` in `workdir` to its end, or stops it (SIGTERM to its process group, SIGKILL a minute later)
    once `curve` shows the score `threshold` reached (read every POLL_SECONDS; a TensorBoard writer flushes every 10
    events or two minutes, so a run may go on for that long after its score, which its curve dates as logged)
    or once it has run `max_minutes`. Returns (exit code, stdout, stderr, why it was stopped or None). Nothing it
    started outlives it, Ctrl-C included."""
    with open(os.path.join(workdir, "stdout.txt"), "w+") as out, open(os.path.join(workdir, "stderr.txt"), "w+") as err:
        proc = subprocess.Popen(command, cwd=workdir, stdout=out, stderr=err, text=True, start_new_session=True)
        started, stopped = time.time(), None
        watching = threshold is not None or max_minutes is not None
        try:
            while not stopped:
                try:
                    proc.wait(timeout=POLL_SECONDS if watching else None)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if threshold is not None and seconds_to_score(curve.read(), threshold) is not None:
                    stopped = "at the score"
                elif max_minutes is not None and time.time() - started >= max_minutes * 60:
                    stopped = f"after {max_minutes:g} minutes"
            if stopped:
                os.killpg(proc.pid, signal.SIGTERM)  # ours writes its summary and exits 143; the references die
                with contextlib.suppress(subprocess.TimeoutExpired):  # else the SIGKILL below
                    proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        out.seek(0), err.seek(0)
        return proc.returncode, out.read(), err.read(), stopped


def run_task(
    task,
    seed,
    profile,
    folder,
    python,
    side="ours",
    repo_dir=None,
    reference_python=None,
    until_score=False,
    max_minutes=None,
):
    """One run of `task` with `seed` in a scratch folder, by our script or by `side`'s (a reference: CleanRL's or
    LeanRL's, PyTorch or -JAX, read from the clone `repo_dir`, run by `reference_python`); its record in
    FOLDER/runs/<task>[__<side>]__seed<seed>.json, its curve timed from the command. With `until_score`, the run stops
    at its task's score, and with `max_minutes`, after that many minutes: such a run counts for the seconds to
    the score only, and its record's name ends in __to-score."""
    tag = "" if side == "ours" else f"__{side.lower()}"
    to_score = "__to-score" if until_score or max_minutes else ""
    record_path = os.path.join(folder, "runs", f"{task}{tag}__seed{seed}{to_score}.json")
    if os.path.exists(record_path):
        print(f"{task} {side} seed {seed}: done before ({record_path})", flush=True)
        return
    flags = [*map(str, TASKS[task][1][profile])]
    record = {"task": task, "seed": seed, "profile": profile, "side": side}
    with tempfile.TemporaryDirectory() as workdir:
        if side == "ours":
            script = f"leanrl_scripts/{TASKS[task][0]}"
            path = os.path.join(ROOT, script)
            flags += ["--eval-episodes", str(EVAL_EPISODES[profile])]
        else:
            path, reference = write_reference(side.split("-")[0], dict(REFERENCES[task])[side], repo_dir, workdir)
            script = reference.pop("script")
            record.update(reference, packages=package_versions(reference_python))
        launcher = LAUNCHERS.get(task, []) if side == "ours" else []
        command = [python if side == "ours" else reference_python, *launcher, path, *flags, "--seed", str(seed)]
        started = time.time()
        curve = Curve(workdir, started, None if side == "ours" else dict(REFERENCES[task])[side])
        threshold = THRESHOLDS.get(task) if until_score else None
        returncode, stdout, stderr, stopped = run_watched(command, workdir, curve, threshold, max_minutes)
        seconds = time.time() - started
        speed = [line for line in stdout.splitlines() if line.startswith("SPEED ")]
        if (returncode and not stopped) or (side == "ours" and not speed):
            raise SystemExit(
                f"error: {task} {side} seed {seed} failed (exit code {returncode}): "
                f"{' '.join(command)}\n{stderr[-2000:]}"
            )
        record.update(curve.read())
    record.update(
        command=" ".join([*launcher, script, *flags]),
        total_seconds=seconds,
        steps_done=int(flags[flags.index("--total-timesteps") + 1]) if "--total-timesteps" in flags else None,
    )
    if to_score:
        record.update(until_score=until_score, max_minutes=max_minutes, stopped=stopped)
        if stopped:  # a reference stopped says no more than its last logged step
            record["steps_done"] = max(record["steps"], default=0)
    if side == "ours":
        record["summary"] = json.loads(speed[-1][len("SPEED ") :])
        record["steps_done"] = record["summary"]["steps_done"]
    os.makedirs(os.path.dirname(record_path), exist_ok=True)
    with open(record_path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(record_path + ".tmp", record_path)
    reached = seconds_to_score(record, THRESHOLDS.get(task))
    final = record["summary"]["eval_return_mean"] if side == "ours" else final_training_return(record)
    print(
        f"{task} {side} seed {seed}: {'eval' if side == 'ours' else 'final training'} return {final}, "
        f"{seconds / 60:.1f} minutes"
        + (f", the score after {reached:.0f} s" if reached is not None else ", the score not reached")
        + (f", stopped {stopped}" if stopped else ""),
        flush=True,
    )


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
    seconds = [(run, seconds_to_score(run, THRESHOLDS.get(task))) for run in timed.values()]
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
            script = first["summary"]["script"] if side == "ours" else os.path.basename(first["command"].split()[0])
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
                f"{training} | {THRESHOLDS.get(task, '-')} | {time_to_score(task, runs)} | {minutes:.1f} |"
            )
            where = (
                ""
                if side == "ours"
                else f" ({first['repository']} at {first['commit'][:8]}, patched as its record says)"
            )
            for kind in (complete(runs), [run for run in runs if "until_score" in run]):
                if kind:
                    stops = "" if "until_score" not in kind[0] else ", " + stop_words(kind[0])
                    commands.append(
                        f"- {task}, {side}{stops}: `python {kind[0]['command']} --seed S`{where}, "
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
    for task in [task for task in TASKS if task in records]:
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
            f"| {task} ({env_id}) | {steps:,} | {seeds} | {THRESHOLDS.get(task, '-')} | "
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    try:
        for task, sides in records.items():
            chart(task, sides, os.path.join(folder, f"{task}.png"))
    except ModuleNotFoundError:
        print("note: matplotlib is not installed (pip install '.[dev]'): no charts", file=sys.stderr)
    print(table, end="")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=PROFILES, default="full")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 1..N of each task")
    parser.add_argument("--only", default="", help="comma-separated tasks from: " + ", ".join(TASKS))
    parser.add_argument("--results", help="default: benchmarks/results/<machine-tag>/learning")
    for side, (repository, commit, _, _) in REFERENCE_REPOS.items():
        parser.add_argument(
            f"--{side.lower()}",
            metavar="CLONE",
            help=f"a clone of {repository} (it needs "
            f"{commit[:8]}): run its scripts on the same tasks and seeds, after ours, seed by seed",
        )
    parser.add_argument(
        "--reference-python",
        default=sys.executable,
        help="the Python that runs the references (LeanRL's need torchrl 0.14, which needs "
        "tensordict<0.15; default: this one)",
    )
    parser.add_argument(
        "--jax-python",
        help="the Python that runs the JAX references (requirements/requirements-jax.txt); without it they do not run",
    )
    parser.add_argument(
        "--until-score",
        action="store_true",
        help="stop each run at its task's score (the seconds to it are what it is for): it counts for the seconds to "
        "the score only, its record named <task>[__side]__seed<k>__to-score.json",
    )
    parser.add_argument(
        "--max-minutes",
        type=float,
        help="stop a run after M minutes, its seconds to the score counted as not reached there (a reference far "
        "slower than ours need not run for hours to show it)",
    )
    args = parser.parse_args()
    if args.max_minutes is not None and not args.max_minutes > 0:
        parser.error("--max-minutes must be more than 0")
    tasks = args.only.split(",") if args.only else [task for task in TASKS if args.profile in TASKS[task][1]]
    if unknown := [task for task in tasks if task not in TASKS or args.profile not in TASKS[task][1]]:
        parser.error(f"no {args.profile} budget for {', '.join(unknown)}")
    if args.seeds < 1:
        parser.error("--seeds must be 1 or more")
    for name in ("reference_python", "jax_python"):  # the runs start in scratch folders: a relative path from here
        if getattr(args, name) and os.sep in getattr(args, name):
            setattr(args, name, os.path.abspath(getattr(args, name)))
    clones = {side: getattr(args, side.lower()) for side in REFERENCE_REPOS if getattr(args, side.lower())}
    for side, clone in clones.items():
        if problem := check_clone(side, clone):
            parser.error(problem)
    folder = args.results or os.path.join(ROOT, "benchmarks", "results", machine_tag(), "learning")
    os.makedirs(folder, exist_ok=True)
    python = os.environ.get("PYTHON", sys.executable)  # run.sh's, as for its speed runs; else this interpreter
    for task in tasks:
        references = [
            (side, clones[side.split("-")[0]])
            for side, _ in REFERENCES.get(task, [])
            if side.split("-")[0] in clones and (args.jax_python or not side.endswith("-JAX"))
        ]
        for seed in range(1, args.seeds + 1):
            for side, clone in [("ours", None), *references]:
                reference_python = args.jax_python if side.endswith("-JAX") else args.reference_python
                run_task(
                    task, seed, args.profile, folder, python, side, clone, reference_python, args.until_score,
                    args.max_minutes,
                )  # fmt: skip
    collect(folder)


def machine_tag():
    """The speed tables' folder name (benchmarks/lib.sh): the GPU's name, else cpu-<cores>core."""
    import re

    import torch

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu-{os.cpu_count()}core"
    return re.sub("[^A-Za-z0-9]+", "-", name).strip("-").lower()


if __name__ == "__main__":
    main()
