"""Hyperparameter sweeps of any script with Optuna: a study of its flags over env ids and seeds, pruned while its runs
run, kept in a database so that it resumes, and shared by workers on one machine or on many.

    python benchmarks/tune.py STUDY [--space FILE] [--trials N] [--workers N] [--storage URL | --storage FILE]
                                    [--objective eval|train|seconds] [--pruner median|hyperband|none]
                                    [--seeds 1,2] [--results FOLDER] [--poll-seconds S] [-- FLAG ...]
    ./run.sh --tune STUDY [...]                                                         (the same)

STUDY names a [studies.STUDY] table of benchmarks/settings.toml, or of the TOML file given with --space (every key,
with its default: docs/tuning.md):

    [studies.dqn_cartpole]
    script = "dqn.py"                           # in leanrl_scripts/, or a path
    flags = ["--total-timesteps", "500000"]     # fixed flags, passed through (so are the words after --)
    envs = { "CartPole-v1" = [22, 475] }        # each env id: [low, high], by which its returns are normalised
    seeds = [101, 102]
    objective = "seconds"                       # eval | train | seconds
    max_minutes = 2                             # a run's cap, which the seconds objective counts for a missed score
    trials = 30
    [studies.dqn_cartpole.space]                # each flag: {low, high} (and log = true, or a step), or {choices}
    "--learning-rate" = { low = 0.0001, high = 0.003, log = true }
    "--batch-size" = { choices = [64, 128, 256] }

A trial runs the script once per env id and seed, one after the other, in FOLDER/STUDY/trial-N/ENV__seedS/ (its
TensorBoard events, stdout, stderr and summary stay there). Its value is the mean over those runs of:
  eval     the final evaluation's mean return (`eval_episodes` of them, default 10), normalised by the env's [low, high]
  train    the mean return of the last `window` training episodes (default 20), normalised the same way; with several
           env ids this is CleanRL's tuner's objective
  seconds  the seconds from the command to the first point where the last `window` training episodes' mean return
           reaches the env's high (the learning benchmark's seconds to a score), each run stopped there; a run that
           does not get there within `max_minutes` counts as `max_minutes`; lower is better
While a run runs its TensorBoard scalars are read every --poll-seconds, and at every `report_every` steps (seconds for
the seconds objective) the trial's value so far goes to the pruner; a pruned trial's run is stopped with SIGTERM,
which keeps its summary. A run that fails (exit code 2: a refused flag; 1: a crash, a diverged loss) fails its trial
with its last line of stderr, and the study goes on.

The study lives in --storage: by default FOLDER/STUDY.db (SQLite); any database URL SQLAlchemy takes
(postgresql+psycopg://user@host/db, for workers on several machines) or a journal file's path on a disk they share.
The same command again continues the study until --trials trials have ended (a trial whose worker was killed is
marked failed and not counted: it runs again); started with other settings under the same name, it is refused.
--workers N runs N workers here, each run with the machine's cores shared out among them (--torch-threads, unless the
flags name it). At the end FOLDER/STUDY.md: the best trials as commands to paste, the failed ones with their errors,
and Optuna's charts of the study as PNG files beside it.
"""

import argparse
import contextlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import tomllib
import warnings

import compare
import learning_tables
import runner
from learning import Curve
from references import package_versions

try:
    import optuna
    from optuna.trial import TrialState
except ModuleNotFoundError:  # refused in one line by main
    optuna = None

OBJECTIVES = ("eval", "train", "seconds")
PRUNERS = ("median", "hyperband", "none")
DEFAULTS = {"flags": [], "seeds": [1], "objective": "train", "pruner": "median", "trials": 20, "window": 20,
            "eval_episodes": 10, "max_minutes": None, "report_every": None, "startup_trials": 5}  # fmt: skip
KEYS = {*DEFAULTS, "script", "envs", "space"}


class RunFailed(Exception):
    """A run of the trial ended with an error of its own: the trial fails with its line, the study goes on."""


def refuse(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def definition(name, space_file=None):
    """The study `name` of settings.toml (or of `space_file`) with its defaults; one line and exit code 2 for what is
    wrong in it."""
    path = space_file or runner.SETTINGS
    try:
        with open(path, "rb") as f:
            studies = tomllib.load(f).get("studies", {})
    except (OSError, tomllib.TOMLDecodeError) as error:
        refuse(f"{path}: {error}")
    if name not in studies:
        refuse(f"no study '{name}' in {os.path.relpath(path)} (its studies: {', '.join(studies) or 'none'})")
    if not isinstance(studies[name], dict):
        refuse(f"study {name}: a table [studies.{name}] of keys")
    study = {**DEFAULTS, **studies[name]}
    if unknown := set(study) - KEYS:
        refuse(f"study {name}: unknown keys {', '.join(sorted(unknown))} (known: {', '.join(sorted(KEYS))})")
    if not os.path.isfile(os.path.join(runner.ROOT, "leanrl_scripts", str(study.get("script")))):
        refuse(f"study {name}: `script` must name a file of leanrl_scripts/ (or a script's absolute path)")
    if not isinstance(study["flags"], list) or not all(isinstance(word, str) for word in study["flags"]):
        refuse(f'study {name}: `flags` must be words as on a command line, numbers too: ["--total-timesteps", "500"]')
    envs = study.get("envs")
    pairs = list(envs.values()) if isinstance(envs, dict) else []
    numbers = all(isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, int | float) for x in pair)
                  for pair in pairs)  # fmt: skip
    if not pairs or not numbers or not all(low < high for low, high in pairs):
        refuse(f"study {name}: `envs` must give each env id its [low, high] returns, low below high")
    if not isinstance(study["seeds"], list) or not study["seeds"] or not all(type(x) is int for x in study["seeds"]):
        refuse(f"study {name}: `seeds` must be a list of whole numbers")
    numbers = {"window": int, "eval_episodes": int, "trials": int, "startup_trials": int, "max_minutes": float,
               "report_every": float}  # fmt: skip
    for key, kind in numbers.items():
        value, zero_too = study[key], key.endswith("trials")
        if value is None and DEFAULTS[key] is None:
            continue
        if type(value) not in (int, kind) or value < 0 or (value == 0 and not zero_too):
            whole = "whole " if kind is int else ""
            refuse(f"study {name}: `{key}` must be a {whole}number, {'0 or more' if zero_too else 'more than 0'}")
    if not isinstance(study.get("space", {}), dict):
        refuse(f"study {name}: `space` must be a table of flags")
    for flag, choice in study.get("space", {}).items():
        try:
            distribution(choice)
        except (TypeError, ValueError) as error:
            refuse(f"study {name}: {flag}: {error} (a flag takes {{low, high}}, with log = true or a step, or "
                   "{choices = [...]})")  # fmt: skip
    return study


def distribution(choice):
    """Optuna's distribution for a flag of the space: {choices}, or {low, high} with log or step (integers: an integer
    flag); a ValueError or TypeError for anything else."""
    if not isinstance(choice, dict):
        raise TypeError("not a table")
    if set(choice) == {"choices"}:
        return optuna.distributions.CategoricalDistribution(choice["choices"])
    if not {"low", "high"} <= set(choice) <= {"low", "high", "log", "step"}:
        raise ValueError(f"keys {', '.join(sorted(choice))}")
    log, step = choice.get("log", False), choice.get("step")
    if all(type(choice.get(key, 1)) is int for key in ("low", "high", "step")):
        return optuna.distributions.IntDistribution(choice["low"], choice["high"], log=log, step=step or 1)
    return optuna.distributions.FloatDistribution(choice["low"], choice["high"], log=log, step=step)


def check(study, name):
    """The settings that only make sense together; report_every filled in."""
    if study["objective"] not in OBJECTIVES or study["pruner"] not in PRUNERS:
        refuse(f"study {name}: objective must be one of {', '.join(OBJECTIVES)}, pruner one of {', '.join(PRUNERS)}")
    if given := {"--env-id", "--seed"} & set(study["flags"]) | {"--env-id", "--seed"} & set(study.get("space", {})):
        refuse(f"study {name}: {' and '.join(sorted(given))} come from `envs` and `seeds`, not from flags")
    if study["objective"] == "seconds" and not study["max_minutes"]:
        refuse(f"study {name}: the seconds objective needs max_minutes, what a run that misses the score counts as")
    if study["pruner"] != "none" and study["objective"] == "seconds":
        study["report_every"] = study["report_every"] or study["max_minutes"] * 60 / 20
    elif study["pruner"] != "none":
        flags = study["flags"]
        budget = flags[flags.index("--total-timesteps") + 1] if "--total-timesteps" in flags[:-1] else ""
        if not budget.isdigit():
            refuse(f"study {name}: pruning compares trials at the same steps: give --total-timesteps N in `flags`")
        study["report_every"] = study["report_every"] or max(int(budget) // 10, 1)


def suggest(trial, space):
    """The trial's flags, each drawn from its range or its choices."""
    for flag, choice in space.items():
        drawn = distribution(choice)
        if isinstance(drawn, optuna.distributions.CategoricalDistribution):
            trial.suggest_categorical(flag, drawn.choices)
        elif isinstance(drawn, optuna.distributions.IntDistribution):
            trial.suggest_int(flag, drawn.low, drawn.high, step=drawn.step, log=drawn.log)
        else:
            trial.suggest_float(flag, drawn.low, drawn.high, step=drawn.step, log=drawn.log)
    return flag_words(trial.params)


def flag_words(params):
    """A trial's parameters as flags; a boolean as tyro takes it: --flag, or --no-flag."""
    words = []
    for flag, value in params.items():
        if isinstance(value, bool):
            words.append(flag if value else f"--no-{flag.removeprefix('--')}")
        else:
            words += [flag, str(value)]
    return words


def normalised(value, low_high):
    low, high = low_high
    return (value - low) / (high - low)


def run_value(study, curve, summary, low_high, upto=None):
    """One run's value at its end, or (`upto`) its value so far: for returns, that of the episodes logged up to step
    `upto` (eval: the training return, as nothing else is logged before the end; NaN before the first episode); for
    seconds, at second `upto`, a lower bound of its value: the seconds so far, where the score is not yet reached."""
    if study["objective"] == "seconds":
        reached = learning_tables.seconds_to_score(curve, low_high[1], study["window"])
        if upto is None:
            return study["max_minutes"] * 60 if reached is None else min(reached, study["max_minutes"] * 60)
        return reached if reached is not None and reached <= upto else upto
    if upto is not None:
        kept = sum(step <= upto for step in curve["steps"])
        curve = {**curve, **{key: curve[key][:kept] for key in ("steps", "seconds", "returns")}}
    if study["objective"] == "eval" and upto is None:
        evaluated = summary.get("eval_return_mean")
        return math.nan if evaluated is None else normalised(evaluated, low_high)
    return normalised(learning_tables.final_training_return(curve, study["window"]), low_high)


class MedianAtThePoint(optuna.pruners.BasePruner if optuna else object):
    """Stops a trial whose value so far is worse than the median of the complete trials' at the same point, once
    `startup_trials` have completed. Optuna's MedianPruner compares a trial's best value so far, which here would be an
    earlier run's (its final value stands for the rest of it) or, for the seconds objective's lower bound that only
    grows, the first."""

    def __init__(self, startup_trials, minimize):
        self.startup_trials, self.minimize = startup_trials, minimize

    def prune(self, study, trial):
        point = trial.last_step
        done = [
            t.intermediate_values.get(point) for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        ]
        done = [value for value in done if value is not None]
        if point is None or not done or len(done) < self.startup_trials:
            return False
        value, median = trial.intermediate_values[point], statistics.median(done)
        return value > median if self.minimize else value < median


class Objective:
    """A trial: the script run with the trial's flags on every env id and seed of the study, one after the other, its
    value so far reported to the pruner as the runs log their episodes."""

    def __init__(self, name, study, folder, threads, poll_seconds):
        self.name, self.study, self.folder, self.threads, self.poll_seconds = name, study, folder, threads, poll_seconds

    def words(self, env_id, flags):
        """The command for `env_id` with the trial's `flags`, relative to the repository, as a user pastes it."""
        episodes = self.study["eval_episodes"] if self.study["objective"] == "eval" else 0
        script = os.path.join("leanrl_scripts", self.study["script"])  # or a path of the user's
        return [script, "--env-id", env_id, *self.study["flags"], *flags, "--eval-episodes", str(episodes)]

    def __call__(self, trial):
        trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
        flags = suggest(trial, self.study.get("space", {}))
        runs = [(env_id, seed) for env_id in self.study["envs"] for seed in self.study["seeds"]]
        values = []
        for index, (env_id, seed) in enumerate(runs):
            value = self.run(trial, index, env_id, seed, flags, values)
            values.append(value)
            trial.set_user_attr("runs", [*trial.user_attrs.get("runs", []), [env_id, seed, value]])
        return sum(values) / len(values)

    def run(self, trial, index, env_id, seed, flags, values):
        """The run `index` of the trial: its value; reported to the pruner at every report_every steps (step k of
        run i is the trial's step i * points + k), where the pruner says so stopped and the trial pruned."""
        study, low_high = self.study, self.study["envs"][env_id]
        words = self.words(env_id, flags)
        words += [] if "--torch-threads" in words else ["--torch-threads", str(self.threads)]
        workdir = os.path.join(self.folder, self.name, f"trial-{trial.number}", f"{env_id}__seed{seed}")
        shutil.rmtree(workdir, ignore_errors=True)  # a study's trial of that number, deleted with its database
        os.makedirs(workdir)
        started = time.time()
        curve = Curve(workdir, started)
        # the report points: every report_every steps of the run (seconds: seconds since its command) to its end
        every, seconds = study["report_every"], study["objective"] == "seconds"
        points, reported = 0, set()
        if every:
            span = study["max_minutes"] * 60 if seconds else int(words[words.index("--total-timesteps") + 1])
            points = int(round(span / every, 6))

        def report(logged, final=None):
            """The trial's value so far at each point the run's events on disk have passed, not reported yet; with
            `final` (the run's value) at all of them, as it stands for the rest of the run. Seconds: up to its last
            episode's (a writer flushes every 10 events), so that a score reached is never hidden."""
            last = max(logged["seconds" if seconds else "steps"], default=0)
            for k in range(1, points + 1):
                if k in reported or (final is None and k * every >= last):
                    continue
                value = run_value(study, logged, None, low_high, k * every) if k * every < last else final
                if math.isfinite(value):
                    reported.add(k)
                    trial.report(sum(values + [value]) / (len(values) + 1), index * points + k)

        def stop_when():
            logged = curve.read()
            if every:
                report(logged)
                if trial.should_prune():
                    return "pruned"
            if seconds and learning_tables.seconds_to_score(logged, low_high[1], study["window"]) is not None:
                return "at the score"
            return None

        command = [os.environ.get("PYTHON", sys.executable), os.path.join(runner.ROOT, words[0]), *words[1:]]
        command += ["--seed", str(seed)]
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads)}
        limit = study["max_minutes"] and study["max_minutes"] * 60
        ended = runner.run(command, workdir, env, limit, stop_when, self.poll_seconds)
        summary, logged = runner.summary(ended.stdout), curve.read()
        if ended.stopped == "pruned":
            raise optuna.TrialPruned(f"{env_id} seed {seed} at step {max(logged['steps'], default=0)}")
        if (ended.returncode and not ended.stopped) or summary is None:
            lines = [line for line in ended.stderr.splitlines() if line.strip()] or ["no summary"]
            trial.set_user_attr("error", f"{env_id} seed {seed}, exit code {ended.returncode}: {lines[-1]}")
            raise RunFailed(trial.user_attrs["error"])
        value = run_value(study, logged, summary, low_high)
        if not math.isfinite(value):
            trial.set_user_attr("error", f"{env_id} seed {seed}: no value (no episode ended, or no evaluation)")
            raise RunFailed(trial.user_attrs["error"])
        if every:
            # eval: the rest of the run at its training return, as every trial's points before the end
            training = run_value({**study, "objective": "train"}, logged, summary, low_high)
            report(logged, final=training if study["objective"] == "eval" else value)
            if trial.should_prune():
                raise optuna.TrialPruned(f"{env_id} seed {seed} at its end")
        return value


def storage_of(url):
    """Optuna's storage at `url`: a database, whose workers beat every 30 s so that any worker marks a dead one's
    trial failed two minutes after its last beat; else a journal file at that path."""
    if "://" not in url:
        lock = optuna.storages.journal.JournalFileOpenLock(url)
        return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(url, lock))
    engine = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else None  # workers wait for the file
    # the heartbeat's arguments are marked experimental, with a warning each time
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    return optuna.storages.RDBStorage(url, engine, heartbeat_interval=30, grace_period=120)


def shown(url):
    """`url` with its password hidden."""
    return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)


def fail_dead_trials(study):
    """This machine's running trials whose worker is gone (killed, or the machine restarted) marked failed at once,
    as any storage allows: not counted, so the study runs as many trials again."""
    host = socket.gethostname()
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker_host, _, pid = trial.user_attrs.get("worker", "").rpartition(":")
        if worker_host == host and not os.path.exists(f"/proc/{pid}"):
            with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):  # another worker was first
                study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)
                print(
                    f"trial {trial.number}: its worker {trial.user_attrs['worker']} is gone; marked failed", flush=True
                )


def counted(study):
    """The trials that count toward --trials: those running and those ended, but failed ones whose worker stopped."""
    trials = study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.COMPLETE, TrialState.PRUNED,
                                                      TrialState.FAIL))  # fmt: skip
    return sum(trial.state != TrialState.FAIL or "error" in trial.user_attrs for trial in trials)


def open_study(name, study, storage):
    """The study `name` in `storage`, made where missing; refused where it was started with other settings."""
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # a trial's end is one line of ours
    minimize = study["objective"] == "seconds"
    pruner = optuna.pruners.NopPruner()
    if study["pruner"] == "hyperband":  # successive halving compares the values at one point: a lower bound will do
        pruner = optuna.pruners.HyperbandPruner()
    elif study["pruner"] == "median":
        pruner = MedianAtThePoint(study["startup_trials"], minimize)
    opened = optuna.create_study(
        storage=storage_of(storage),
        study_name=name,
        direction="minimize" if minimize else "maximize",
        sampler=optuna.samplers.TPESampler(constant_liar=True),  # workers at once draw different points
        pruner=pruner,
        load_if_exists=True,
    )
    settings = json.dumps({key: value for key, value in study.items() if key != "trials"}, sort_keys=True)
    if "settings" not in opened.user_attrs:
        opened.set_user_attr("settings", settings)
    elif opened.user_attrs["settings"] != settings:
        refuse(f"the study '{name}' in {shown(storage)} was started with other settings: name another study or storage")
    return opened


def work(name, study, storage, folder, trials, threads, poll_seconds):
    """One worker: trials of the study, one at a time, until --trials of them count."""
    opened = open_study(name, study, storage)
    fail_dead_trials(opened)
    objective = Objective(name, study, folder, threads, poll_seconds)

    def said(_, trial):
        if trial.state == TrialState.COMPLETE:
            print(f"trial {trial.number}: {trial.value:.4g} ({shlex.join(flag_words(trial.params))})", flush=True)
        elif trial.state == TrialState.PRUNED:
            print(f"trial {trial.number}: pruned ({shlex.join(flag_words(trial.params))})", flush=True)
        else:
            print(f"trial {trial.number}: failed: {trial.user_attrs.get('error')}", flush=True)

    while True:
        # a dead worker's trial, on any machine: failed two minutes after its last heartbeat (databases only), so
        # that it no longer counts
        optuna.storages.fail_stale_trials(opened)
        if counted(opened) >= trials:
            break
        opened.optimize(objective, n_trials=1, catch=(RunFailed,), callbacks=[said])


def page(name, study, storage, folder, argv):
    """FOLDER/STUDY.md and its charts: the machine, the date, the versions, the command (`argv`), the space, the best
    trials as commands to paste, the failed ones with their errors."""
    opened = optuna.load_study(study_name=name, storage=storage_of(storage))
    trials = opened.get_trials(deepcopy=False)
    done = sorted([t for t in trials if t.state == TrialState.COMPLETE], key=lambda t: t.value,
                  reverse=opened.direction == optuna.study.StudyDirection.MAXIMIZE)  # fmt: skip
    states = [(sum(t.state == state for t in trials), state.name.lower()) for state in TrialState]
    counts = ", ".join(f"{count} {state}" for count, state in states if count) or "none"
    unit = " s" if study["objective"] == "seconds" else ""
    objective = Objective(name, study, folder, None, None)
    lines = [
        f"# {name}: {study['script']}, objective {study['objective']}, pruner {study['pruner']}",
        "",
        f"{compare.machine()}, {time.strftime('%Y-%m-%d')}; optuna {optuna.__version__}, "
        f"{package_versions(sys.executable)}.",
        "",
        f"    {shlex.join(['./run.sh', '--tune', *(relative(word) for word in argv)])}",
        "",
        f"Env ids and their [low, high]: {json.dumps(study['envs'])}; seeds {study['seeds']}; fixed flags "
        f"`{shlex.join(study['flags'])}`; trials: {counts}. The space:",
        "",
        *[f"- `{flag}`: {json.dumps(choice)}" for flag, choice in study.get("space", {}).items()],
        "",
        "## Best trials",
        "",
    ]
    for trial in done[:5]:
        runs = ", ".join(f"{env_id} seed {seed}: {value:.4g}{unit}" for env_id, seed, value in trial.user_attrs["runs"])
        lines.append(f"- trial {trial.number}: {trial.value:.4g}{unit} ({runs})")
        for env_id in study["envs"]:
            lines.append(f"  `python {shlex.join(objective.words(env_id, flag_words(trial.params)))}`")
    lines += [] if done else ["None complete yet."]
    if failed := [t for t in trials if t.state == TrialState.FAIL]:
        lines += ["", "## Failed trials", ""]
        lines += [f"- trial {t.number}: {t.user_attrs.get('error', 'its worker stopped')}" for t in failed]
    lines += charts(opened, folder, name)
    with open(os.path.join(folder, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"{os.path.join(folder, name)}.md: {len(done)} trials complete of {len(trials)}", flush=True)


def relative(word):
    """A word of the command as the page keeps it: a path in the repository relative to it, any other path (or a
    database URL) by its name, a password nowhere."""
    if "://" in word:
        return shown(word)
    if os.path.isabs(word):
        return os.path.relpath(word, runner.ROOT) if word.startswith(runner.ROOT + os.sep) else os.path.basename(word)
    return word


def charts(opened, folder, name):
    """Optuna's charts of the study (its history, the flags' importances, the parallel coordinates) as PNG files in
    FOLDER, and the page's lines that show them; none where matplotlib is missing or fewer than two trials ended."""
    plt = runner.pyplot()
    if plt is None or len(opened.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))) < 2:
        return []
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", "Target and region quantiles", UserWarning)  # few trials: equal importances
    plots, importance = optuna.visualization.matplotlib, optuna.importance
    drawn = {
        "history": lambda: plots.plot_optimization_history(opened),
        # PED-ANOVA needs no scikit-learn, unlike Optuna's default fANOVA
        "importances": lambda: plots.plot_param_importances(opened, evaluator=importance.PedAnovaImportanceEvaluator()),
        "parallel": lambda: plots.plot_parallel_coordinate(opened),
    }
    lines = ["", "## Charts", ""]
    for kind, draw in drawn.items():
        try:
            axes = draw()
        except (ValueError, RuntimeError) as error:  # a flag with one value, say
            lines.append(f"No {kind} chart: {error}")
            continue
        axes.figure.savefig(os.path.join(folder, f"{name}_{kind}.png"), dpi=100, bbox_inches="tight")
        plt.close(axes.figure)
        lines.append(f"![{kind}]({name}_{kind}.png)")
    return lines


def stop_with(signum, _):
    """A worker's first Ctrl-C or SIGTERM: its trial's run stopped and the trial marked failed (Optuna does it for
    a KeyboardInterrupt), not counted; a second stops it at once."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    line = f"stopped by {signal.Signals(signum).name}: the running trial will run again\n"
    os.write(sys.stderr.fileno(), line.encode())  # one write: whole beside another worker's
    raise KeyboardInterrupt(128 + signum)


def main():
    argv = sys.argv[1:]
    ours, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("study", help="a [studies.STUDY] table of benchmarks/settings.toml, or of --space")
    parser.add_argument("--space", help="a TOML file of [studies.NAME] tables, in place of settings.toml")
    parser.add_argument("--trials", type=int, help="trials in the whole study, all workers' (default: the study's)")
    parser.add_argument("--workers", type=int, default=1, help="workers on this machine, its cores shared out")
    parser.add_argument("--storage", help="a database URL or a journal file's path (default: FOLDER/STUDY.db, SQLite)")
    parser.add_argument("--objective", choices=OBJECTIVES, help="default: the study's, else train")
    parser.add_argument("--pruner", choices=PRUNERS, help="default: the study's, else median")
    parser.add_argument("--seeds", help="comma-separated seeds (default: the study's)")
    parser.add_argument("--results", help="FOLDER (default: benchmarks/results/<machine-tag>/tuning)")
    parser.add_argument("--poll-seconds", type=float, default=5, help="how often a run's TensorBoard is read")
    args = parser.parse_args(ours)
    if optuna is None:
        refuse("the tuner needs optuna: pip install '.[tune]'")
    study = definition(args.study, args.space)
    study["flags"] = [*study["flags"], *extra]
    for key in ("objective", "pruner"):
        study[key] = getattr(args, key) or study[key]
    if args.seeds:
        if not re.fullmatch(r"\d+(,\d+)*", args.seeds):
            refuse("--seeds needs whole numbers such as 1,2")
        study["seeds"] = [int(word) for word in args.seeds.split(",")]
    check(study, args.study)
    trials = study["trials"] if args.trials is None else args.trials
    if trials < 0 or args.workers < 1 or args.poll_seconds <= 0:
        refuse("--trials takes 0 or more, --workers 1 or more, --poll-seconds more than 0")
    folder = runner.results_folder(args.results, "tuning")
    storage = args.storage or f"sqlite:///{os.path.join(folder, args.study)}.db"
    if args.workers == 1 or os.environ.get("TUNE_WORKER"):
        signal.signal(signal.SIGINT, stop_with)
        signal.signal(signal.SIGTERM, stop_with)
        threads = max(1, (os.cpu_count() or 1) // args.workers)
        try:
            work(args.study, study, storage, folder, trials, threads, args.poll_seconds)
            if not os.environ.get("TUNE_WORKER"):
                page(args.study, study, storage, folder, sys.argv[1:])
        except KeyboardInterrupt as stop:
            sys.exit(stop.args[0] if stop.args else 130)
        return
    fail_dead_trials(open_study(args.study, study, storage))  # made, and cleared, once: the workers would race
    # sessions of their own, out of the terminal's reach: a Ctrl-C comes to them once, passed on from here
    workers = [subprocess.Popen([sys.executable, *sys.argv], env={**os.environ, "TUNE_WORKER": "1"},
                                start_new_session=True, preexec_fn=runner.dies_with_parent())
               for _ in range(args.workers)]  # fmt: skip
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda signum, _: [worker.send_signal(signum) for worker in workers])
    codes = [worker.wait() for worker in workers]
    if stopped := [code for code in codes if code in (130, 143)]:
        sys.exit(stopped[0])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        page(args.study, study, storage, folder, sys.argv[1:])  # what the workers did, where one failed too
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(next((code for code in codes if code), 0))


if __name__ == "__main__":
    main()
