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
import json
import math
import os
import re
import shlex
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
    study = {**DEFAULTS, **studies[name]}
    if unknown := set(study) - KEYS:
        refuse(f"study {name}: unknown keys {', '.join(sorted(unknown))} (known: {', '.join(sorted(KEYS))})")
    if not os.path.isfile(os.path.join(runner.ROOT, "leanrl_scripts", str(study.get("script")))):
        refuse(f"study {name}: `script` must name a file of leanrl_scripts/ (or a script's path)")
    pairs = list(study.get("envs", {}).values())
    numbers = all(isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, int | float) for x in pair)
                  for pair in pairs)  # fmt: skip
    if not pairs or not numbers or not all(low < high for low, high in pairs):
        refuse(f"study {name}: `envs` must give each env id its [low, high] returns, low below high")
    for flag, choice in study.get("space", {}).items():
        ranged = isinstance(choice, dict) and {"low", "high"} <= set(choice) <= {"low", "high", "log", "step"}
        if not ranged and not (isinstance(choice, dict) and set(choice) == {"choices"}):
            refuse(f"study {name}: {flag} needs {{low, high}} (and log or step) or {{choices}}")
    return study


def check(study, name):
    """The settings that only make sense together; report_every filled in."""
    if given := {"--env-id", "--seed"} & set(study["flags"]) | {"--env-id", "--seed"} & set(study.get("space", {})):
        refuse(f"study {name}: {' and '.join(sorted(given))} come from `envs` and `seeds`, not from flags")
    if study["objective"] == "seconds" and not study["max_minutes"]:
        refuse(f"study {name}: the seconds objective needs max_minutes, what a run that misses the score counts as")
    if study["pruner"] != "none" and study["objective"] == "seconds":
        study["report_every"] = study["report_every"] or study["max_minutes"] * 60 / 20
    elif study["pruner"] != "none":
        if "--total-timesteps" not in study["flags"]:
            refuse(f"study {name}: pruning compares trials at the same steps: give --total-timesteps in `flags`")
        budget = int(study["flags"][study["flags"].index("--total-timesteps") + 1])
        study["report_every"] = study["report_every"] or max(budget // 10, 1)


def suggest(trial, space):
    """The trial's flags, each drawn from its range or its choices."""
    for flag, choice in space.items():
        if "choices" in choice:
            trial.suggest_categorical(flag, choice["choices"])
        elif all(isinstance(choice.get(key, 1), int) for key in ("low", "high", "step")):
            trial.suggest_int(flag, choice["low"], choice["high"], step=choice.get("step", 1),
                              log=choice.get("log", False))  # fmt: skip
        else:
            trial.suggest_float(flag, choice["low"], choice["high"], step=choice.get("step"),
                                log=choice.get("log", False))  # fmt: skip
    return flag_words(trial.params)


def flag_words(params):
    """A trial's parameters as flags: booleans as tyro takes them."""
    return [word for flag, value in params.items() for word in (flag, str(value).lower() if isinstance(value, bool)
            else str(value))]  # fmt: skip


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


class MedianOfLowerBounds(optuna.pruners.BasePruner if optuna else object):
    """The seconds objective's pruner: a trial stops once its value so far, a lower bound that only grows, is above the
    median of the complete trials' at the same point. (Optuna's MedianPruner takes a trial's best value so far: for a
    lower bound, its first.)"""

    def __init__(self, startup_trials):
        self.startup_trials = startup_trials

    def prune(self, study, trial):
        point = trial.last_step
        done = [
            t.intermediate_values.get(point) for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        ]
        done = [value for value in done if value is not None]
        return len(done) >= max(self.startup_trials, 1) and trial.intermediate_values[point] > statistics.median(done)


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
        flags = suggest(trial, self.study.get("space", {}))
        trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
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
        os.makedirs(workdir, exist_ok=True)
        started = time.time()
        curve = Curve(workdir, started)
        # the report points: every report_every steps of the run (seconds: seconds since its command) to its end
        every, seconds = study["report_every"], study["objective"] == "seconds"
        span = study["max_minutes"] * 60 if seconds else int(words[words.index("--total-timesteps") + 1])
        points, reported = int(span // every) if every else 0, set()

        def report(logged, final=None):
            """The trial's value so far at each point the run has passed and not reported yet; with `final` (the
            run's value) at all of them, as it stands for the rest of the run."""
            last = time.time() - started if seconds else max(logged["steps"], default=0)
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
            report(logged, final=value)
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
            study.tell(trial.number, state=TrialState.FAIL)
            print(f"trial {trial.number}: its worker {trial.user_attrs['worker']} is gone; marked failed", flush=True)


def counted(study):
    """The trials that count toward --trials: those running and those ended, but failed ones whose worker stopped."""
    trials = study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.COMPLETE, TrialState.PRUNED,
                                                      TrialState.FAIL))  # fmt: skip
    return sum(trial.state != TrialState.FAIL or "error" in trial.user_attrs for trial in trials)


def open_study(name, study, storage):
    """The study `name` in `storage`, made where missing; refused where it was started with other settings."""
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # a trial's end is one line of ours
    pruner = optuna.pruners.NopPruner()
    if study["pruner"] == "hyperband":  # successive halving compares values at one point: a lower bound will do
        pruner = optuna.pruners.HyperbandPruner()
    elif study["pruner"] == "median" and study["objective"] == "seconds":
        pruner = MedianOfLowerBounds(study["startup_trials"])
    elif study["pruner"] == "median":
        pruner = optuna.pruners.MedianPruner(n_startup_trials=study["startup_trials"])
    opened = optuna.create_study(
        storage=storage_of(storage),
        study_name=name,
        direction="minimize" if study["objective"] == "seconds" else "maximize",
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

    while counted(opened) < trials:
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
    print(f"stopped by {signal.Signals(signum).name}: the running trial will run again", file=sys.stderr, flush=True)
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
        except KeyboardInterrupt as stop:
            sys.exit(stop.args[0] if stop.args else 130)
    else:
        open_study(args.study, study, storage)  # made once, before the workers race to make it
        # sessions of their own, out of the terminal's reach: a Ctrl-C comes to them once, passed on from here
        workers = [subprocess.Popen([sys.executable, *sys.argv], env={**os.environ, "TUNE_WORKER": "1"},
                                    start_new_session=True, preexec_fn=runner.die_with_parent)
                   for _ in range(args.workers)]  # fmt: skip
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda signum, _: [worker.send_signal(signum) for worker in workers])
        if codes := [code for code in [worker.wait() for worker in workers] if code]:
            sys.exit(codes[0])
    if not os.environ.get("TUNE_WORKER"):
        page(args.study, study, storage, folder, sys.argv[1:])


if __name__ == "__main__":
    main()
