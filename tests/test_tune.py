"""The tuner (benchmarks/tune.py, ./run.sh --tune): studies refused in one line, a trial's value held to a hand
computation over env ids and seeds for each objective, a pruned run that keeps its summary, failed trials that cost a
line each, a stopped or killed worker whose study resumes without repeating what ended, two workers on one SQLite
study with dqn.py, and two on PostgreSQL where its server is installed. The other runs are of a stand-in (FAKE) that
logs as our scripts do and ends in a second or two."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

optuna = pytest.importorskip("optuna", reason="the tuner's tests need optuna: pip install '.[tune]'")

from script_runs import ROOT  # noqa: E402

TUNE = os.path.join(ROOT, "benchmarks", "tune.py")

# Episode k (k = 1..total/50, one every 50 steps and --step-seconds) returns ceiling * 50k / total + seed; the ceiling
# is 100 on env A, 1,000 on B; a run FAKE_PLAN calls bad has a tenth of that, at a tenth of the speed. Its
# evaluation returns ceiling + seed. FAKE_PLAN's words go to the runs in turn (counted in the file FAKE_RUNS): good,
# bad, crash (a traceback, exit code 1), refuse (exit code 2). SIGTERM: its summary, then exit code 143. Its pid in
# the file `pid` of the folder it runs in.
FAKE = """
import argparse, json, os, signal, sys, time
parser = argparse.ArgumentParser()
for flag, kind in [("--env-id", str), ("--seed", int), ("--total-timesteps", int), ("--torch-threads", int),
                   ("--eval-episodes", int), ("--learning-rate", float), ("--step-seconds", float)]:
    parser.add_argument(flag, type=kind, default=2000 if flag == "--total-timesteps" else 0)
args = parser.parse_args()
count = int(open(os.environ["FAKE_RUNS"]).read()) if os.path.exists(os.environ["FAKE_RUNS"]) else 0
open(os.environ["FAKE_RUNS"], "w").write(str(count + 1))
plan = os.environ.get("FAKE_PLAN", "").split(",")
how = plan[count] if count < len(plan) and plan[count] else "good"
if how == "refuse":
    print(f"error: --learning-rate {args.learning_rate} is refused", file=sys.stderr)
    sys.exit(2)
if how == "crash":
    raise FloatingPointError("non-finite loss at step 100")
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer.event_file_writer import EventFileWriter
folder = os.path.join("runs", f"{args.env_id}__fake__{args.seed}")
writer = EventFileWriter(folder)
ceiling = {"A": 100.0, "B": 1000.0}[args.env_id] * (0.1 if how == "bad" else 1.0)
returns, step = [], 0
def summary(stopped):
    done = {"steps_done": step, "stopped": stopped, "torch_threads": args.torch_threads, "pid": os.getpid(),
            "eval_return_mean": ceiling + args.seed if args.eval_episodes else None}
    json.dump(done, open(os.path.join(folder, "summary.json"), "w"))
    print("SPEED " + json.dumps(done), flush=True)
def stop(signum, _):
    summary(True)
    sys.exit(128 + signum)
signal.signal(signal.SIGTERM, stop)
open("pid", "w").write(str(os.getpid()))
for step in range(50, args.total_timesteps + 1, 50):
    returns.append(ceiling * step / args.total_timesteps + args.seed)
    value = Summary.Value(tag="charts/episodic_return", simple_value=returns[-1])
    writer.add_event(Event(wall_time=time.time(), step=step, summary=Summary(value=[value])))
    writer.flush()
    time.sleep(args.step_seconds * (10 if how == "bad" else 1))
summary(False)
"""


def toml_value(value):
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(key)} = {toml_value(item)}" for key, item in value.items()) + " }"
    return json.dumps(value)


def write_study(tmp_path, space=None, name="fake", **keys):
    """A file with the study `name` of FAKE (its keys: these defaults, then `keys`), for --space."""
    (tmp_path / "fake.py").write_text(FAKE)
    keys = {"script": str(tmp_path / "fake.py"), "flags": ["--total-timesteps", "2000", "--step-seconds", "0.02"],
            "envs": {"A": [0, 100]}, "seeds": [1], "trials": 2, "pruner": "none", **keys}  # fmt: skip
    space = space or {"--learning-rate": {"low": 1e-4, "high": 1e-2, "log": True}}
    lines = [f"[studies.{name}]", *[f"{key} = {toml_value(value)}" for key, value in keys.items()]]
    lines += [f"[studies.{name}.space]", *[f'"{flag}" = {toml_value(choice)}' for flag, choice in space.items()]]
    (tmp_path / "space.toml").write_text("\n".join(lines) + "\n")
    return tmp_path / "space.toml"


def tune_command(tmp_path, *args, name="fake"):
    results = tmp_path / "results"
    return [sys.executable, TUNE, name, "--space", str(tmp_path / "space.toml"), "--results", str(results),
            "--poll-seconds", "0.3", *args]  # fmt: skip


def tune(tmp_path, *args, plan="", name="fake", timeout=180):
    env = {**os.environ, "FAKE_RUNS": str(tmp_path / "runs_count"), "FAKE_PLAN": plan}
    return subprocess.run(tune_command(tmp_path, *args, name=name), capture_output=True, text=True, env=env,
                          timeout=timeout)  # fmt: skip


def trials(tmp_path, name="fake", storage=None):
    if storage and "://" not in storage:
        storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(storage))
    storage = storage or f"sqlite:///{tmp_path / 'results' / name}.db"
    return optuna.load_study(study_name=name, storage=storage).get_trials()


@pytest.mark.parametrize(
    "keys, words",
    [
        ({"envs": {"A": [5, 5]}}, "`envs` must give each env id its [low, high] returns, low below high"),
        ({"objective": "seconds"}, "the seconds objective needs max_minutes"),
        ({"pruner": "median", "flags": ["--step-seconds", "0"]}, "give --total-timesteps N in `flags`"),
        ({"flags": ["--seed", "3", "--total-timesteps", "100"]}, "--seed come from `envs` and `seeds`"),
        ({"space": {"--learning-rate": {"low": 1}}}, "--learning-rate: keys low (a flag takes {low, high}"),
        ({"windw": 20}, "unknown keys windw"),
        ({"script": "nothing.py"}, "`script` must name a file of leanrl_scripts/"),
        ({"flags": ["--total-timesteps", 500]}, "`flags` must be words as on a command line"),
        ({"seeds": []}, "`seeds` must be a list of whole numbers"),
        ({"objective": "evl"}, "objective must be one of eval, train, seconds"),
        ({"report_every": 0}, "`report_every` must be a number, more than 0"),
        ({"space": {"--learning-rate": {"low": 0.1, "high": 0.01}}}, "--learning-rate: "),
        ({"space": {"--learning-rate": {"low": 0.0, "high": 0.01, "log": True}}}, "--learning-rate: "),
        ({"space": {"--batch-size": {"choices": []}}}, "--batch-size: "),
    ],
)
def test_a_study_that_cannot_run_is_refused_in_one_line(tmp_path, keys, words):
    space = keys.pop("space", None)
    write_study(tmp_path, space, **keys)
    proc = tune(tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and words in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "runs_count").exists()


@pytest.mark.parametrize("objective", ["train", "eval"])
def test_a_trials_value_is_the_mean_over_envs_and_seeds_of_returns_normalised_by_their_scores(tmp_path, objective):
    """CleanRL's tuner's objective: each run's return, less the env's low, over its high less its low, averaged over
    the runs; train: the mean of the last 20 training episodes, eval: the final evaluation's."""
    write_study(tmp_path, envs={"A": [0, 100], "B": [-200, 800]}, seeds=[1, 2], trials=1, objective=objective)
    proc = tune(tmp_path)
    assert proc.returncode == 0, proc.stderr
    runs = {"A": 100.0, "B": 1000.0}
    episodes = 2000 // 50
    expected = []
    for env_id, (low, high) in {"A": [0, 100], "B": [-200, 800]}.items():
        for seed in (1, 2):
            last = [runs[env_id] * 50 * k / 2000 + seed for k in range(episodes - 19, episodes + 1)]
            value = runs[env_id] + seed if objective == "eval" else sum(last) / 20
            expected.append((value - low) / (high - low))
    (trial,) = trials(tmp_path)
    assert trial.state.name == "COMPLETE" and trial.value == pytest.approx(sum(expected) / 4, rel=1e-6)
    assert [run[:2] for run in trial.user_attrs["runs"]] == [["A", 1], ["A", 2], ["B", 1], ["B", 2]]
    page = (tmp_path / "results" / "fake.md").read_text()
    lr = trial.params["--learning-rate"]
    command = f"`python {tmp_path}/fake.py --env-id B --total-timesteps 2000 --step-seconds 0.02 --learning-rate {lr}"
    assert command in page and "## Best trials" in page


def test_the_seconds_objective_stops_a_run_at_its_score_and_counts_a_missed_one_as_the_cap(tmp_path):
    """A: the mean of the last 20 episodes reaches 50 at the 49th of 80 (1.25 * (49 - 9.5) + 1 = 50.375), its run
    stopped there with its summary; B: 5,000 never comes, its run counts as max_minutes though it ended sooner."""
    flags = ["--total-timesteps", "4000", "--step-seconds", "0.05"]
    write_study(tmp_path, envs={"A": [0, 50], "B": [0, 5000]}, trials=1, objective="seconds", max_minutes=0.5,
                flags=flags)  # fmt: skip
    proc = tune(tmp_path)
    assert proc.returncode == 0, proc.stderr
    (trial,) = trials(tmp_path)
    (_, _, seconds_a), (_, _, seconds_b) = trial.user_attrs["runs"]
    stopped = json.loads(next((tmp_path / "results/fake/trial-0/A__seed1/runs").glob("*/summary.json")).read_text())
    assert stopped["stopped"] and 49 * 50 <= stopped["steps_done"] < 4000 and 49 * 0.05 < seconds_a < 20
    assert seconds_b == 30.0 and trial.value == pytest.approx((seconds_a + 30) / 2)
    assert optuna.load_study(study_name="fake", storage=f"sqlite:///{tmp_path}/results/fake.db").direction.name == (
        "MINIMIZE"
    )


@pytest.mark.parametrize("objective", ["train", "seconds"])
def test_the_pruner_stops_a_worse_trials_run_which_keeps_its_summary(tmp_path, objective):
    """Median pruning after one trial: the second's run, at a tenth of the first's returns and speed, is stopped with
    SIGTERM at a report point where its value so far is worse than the first's (train: every 200 steps; seconds:
    every half second, once its lower bound, the seconds so far, passes the first's seconds to the score), its summary
    written."""
    seconds = {"objective": "seconds", "max_minutes": 1, "envs": {"A": [0, 50]}, "report_every": 0.5}
    # seconds: the first run reaches its score at its 30th episode, 6 s in, long after the second has started up
    flags = ["--total-timesteps", "2000", "--step-seconds", "0.2" if objective == "seconds" else "0.05"]
    keys = seconds if objective == "seconds" else {"report_every": 200}
    write_study(tmp_path, trials=2, pruner="median", startup_trials=1, flags=flags, **keys)
    proc = tune(tmp_path, plan="good,bad")
    assert proc.returncode == 0, proc.stderr
    assert [trial.state.name for trial in trials(tmp_path)] == ["COMPLETE", "PRUNED"]
    summary = json.loads(next((tmp_path / "results/fake/trial-1/A__seed1/runs").glob("*/summary.json")).read_text())
    assert summary["stopped"] and 0 < summary["steps_done"] < 1000
    points = len(trials(tmp_path)[0].intermediate_values)
    assert "trial 1: pruned" in proc.stdout and points == (10 if objective == "train" else 120)


def test_a_failed_trial_costs_one_line_and_the_study_goes_on(tmp_path):
    """A refused flag (exit code 2) and a crash (a traceback, exit code 1) fail their trials with their last line of
    stderr, one line each in the log (the traceback stays in the run's folder); both count, the third trial runs."""
    write_study(tmp_path, trials=3, flags=["--step-seconds", "0.02"])  # no pruning: no --total-timesteps needed
    proc = tune(tmp_path, plan="refuse,crash,good")
    assert proc.returncode == 0, proc.stderr
    states = [(trial.state.name, trial.user_attrs.get("error")) for trial in trials(tmp_path)]
    lr = trials(tmp_path)[0].params["--learning-rate"]
    assert states == [
        ("FAIL", f"A seed 1, exit code 2: error: --learning-rate {lr} is refused"),
        ("FAIL", "A seed 1, exit code 1: FloatingPointError: non-finite loss at step 100"),
        ("COMPLETE", None),
    ]
    assert [line.split(":")[0] for line in proc.stdout.splitlines()[:3]] == ["trial 0", "trial 1", "trial 2"]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "Traceback" in (tmp_path / "results/fake/trial-1/A__seed1/stderr.txt").read_text()
    assert "- trial 1: A seed 1, exit code 1: FloatingPointError" in (tmp_path / "results/fake.md").read_text()


def wait_for(path, seconds=60):
    deadline = time.time() + seconds
    while not os.path.exists(path):
        assert time.time() < deadline, f"no {path}"
        time.sleep(0.1)


def test_a_stopped_or_killed_worker_leaves_nothing_running_and_the_study_resumes(tmp_path):
    """SIGTERM: the worker stops its trial's run (which writes its summary), marks the trial failed, says so in one
    line and exits with 143. SIGKILL: its run gets a SIGTERM all the same, and the rerun of the command marks that
    trial failed. Neither counts: the study ends with three trials that ran to their end, none run twice."""
    write_study(tmp_path, trials=3, flags=["--total-timesteps", "2000", "--step-seconds", "0.1"])
    env = {**os.environ, "FAKE_RUNS": str(tmp_path / "runs_count")}
    for signum, trial in ((signal.SIGTERM, 1), (signal.SIGKILL, 2)):
        worker = subprocess.Popen(tune_command(tmp_path), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)  # fmt: skip
        pid_file = tmp_path / f"results/fake/trial-{trial}/A__seed1/pid"
        wait_for(pid_file)
        time.sleep(0.5)
        worker.send_signal(signum)
        stdout, stderr = worker.communicate(timeout=60)
        run_pid = int(pid_file.read_text())
        deadline = time.time() + 10
        while (
            os.path.exists(f"/proc/{run_pid}") and open(f"/proc/{run_pid}/stat").read().split(")")[-1].split()[0] != "Z"
        ):
            assert time.time() < deadline, "the run outlived its worker"
            time.sleep(0.1)
        summary = json.loads(next(pid_file.parent.glob("runs/*/summary.json")).read_text())
        assert summary["stopped"] and summary["pid"] == run_pid
        if signum == signal.SIGTERM:
            assert worker.returncode == 143 and stderr.strip().splitlines() == [
                "stopped by SIGTERM: the running trial will run again"
            ], stderr
            assert [t.state.name for t in trials(tmp_path)] == ["COMPLETE", "FAIL"]
    assert [t.state.name for t in trials(tmp_path)] == ["COMPLETE", "FAIL", "RUNNING"]
    proc = subprocess.run(tune_command(tmp_path), env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    worker_gone = f"trial 2: its worker {socket.gethostname()}:{worker.pid} is gone; marked failed"
    assert proc.stdout.splitlines()[0] == worker_gone
    assert [t.state.name for t in trials(tmp_path)] == ["COMPLETE", "FAIL", "FAIL", "COMPLETE", "COMPLETE"]
    assert sorted(os.listdir(tmp_path / "results" / "fake")) == [f"trial-{n}" for n in range(5)]


def test_a_ctrl_c_stops_every_worker_of_the_command_and_their_runs_once(tmp_path):
    """--workers 2, Ctrl-C to the command: each worker hears it once (a second would stop it at once), stops its run
    (which writes its summary) and marks its trial failed; the command exits with 130 and nothing it started is left
    running. Each run had half the cores."""
    write_study(tmp_path, trials=4, flags=["--total-timesteps", "2000", "--step-seconds", "0.1"])
    env = {**os.environ, "FAKE_RUNS": str(tmp_path / "runs_count")}
    command = subprocess.Popen(tune_command(tmp_path, "--workers", "2"), env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    for trial in (0, 1):
        wait_for(tmp_path / f"results/fake/trial-{trial}/A__seed1/pid")
    time.sleep(0.5)
    os.killpg(command.pid, signal.SIGINT)  # as a terminal sends it: to the command's whole process group
    _, stderr = command.communicate(timeout=60)
    assert command.returncode == 130
    assert stderr.splitlines() == ["stopped by SIGINT: the running trial will run again"] * 2, stderr
    assert [t.state.name for t in trials(tmp_path)] == ["FAIL", "FAIL"]
    for trial in (0, 1):
        folder = tmp_path / f"results/fake/trial-{trial}/A__seed1"
        summary = json.loads(next(folder.glob("runs/*/summary.json")).read_text())
        assert summary["stopped"] and not os.path.exists(f"/proc/{summary['pid']}")
        assert summary["torch_threads"] == max(1, os.cpu_count() // 2)  # the cores shared out


def test_a_study_started_with_other_settings_is_refused(tmp_path):
    """In a journal file this time: the same command again goes on with the study, other seeds under its name are
    refused."""
    journal = str(tmp_path / "studies.log")
    write_study(tmp_path, trials=1)
    assert tune(tmp_path, "--storage", journal).returncode == 0
    proc = tune(tmp_path, "--storage", journal, "--seeds", "1,2")
    assert proc.returncode == 2 and "was started with other settings" in proc.stderr
    again = tune(tmp_path, "--storage", journal, "--trials", "2")  # more trials: not a change of its settings
    assert again.returncode == 0 and [t.state.name for t in trials(tmp_path, storage=journal)] == ["COMPLETE"] * 2


def test_each_kind_of_flag_is_drawn_and_written_as_the_scripts_take_it():
    """Integers in steps, floats on a log scale, choices; a boolean as tyro's --flag or --no-flag."""
    import tune

    space = {
        "--batch-size": {"low": 32, "high": 256, "step": 32},
        "--learning-rate": {"low": 1e-4, "high": 1e-2, "log": True},
        "--compile": {"choices": [True, False]},
        "--gamma": {"choices": [0.99, 0.995]},
    }
    drawn = {"--batch-size": 96, "--learning-rate": 0.002, "--compile": False, "--gamma": 0.995}
    words = tune.suggest(optuna.trial.FixedTrial(drawn), space)
    assert words == ["--batch-size", "96", "--learning-rate", "0.002", "--no-compile", "--gamma", "0.995"]
    assert tune.flag_words({"--compile": True}) == ["--compile"]


@pytest.mark.slow
def test_two_workers_share_one_sqlite_study_of_dqn(tmp_path):
    """dqn.py on CartPole-v1 for 3,000 steps, four trials in two workers: each worker's runs get one of the two
    cores' torch threads, the two workers' trials interleave in one SQLite file, and the page has the best
    trial's command, which a user can paste."""
    (tmp_path / "space.toml").write_text(
        '[studies.dqn_tiny]\nscript = "dqn.py"\nflags = ["--total-timesteps", "3000", "--learning-starts", "500"]\n'
        'envs = { "CartPole-v1" = [20, 500] }\ntrials = 4\npruner = "none"\n[studies.dqn_tiny.space]\n'
        '"--learning-rate" = { low = 1e-4, high = 1e-2, log = true }\n"--batch-size" = { choices = [32, 64] }\n'
    )
    proc = tune(tmp_path, "--workers", "2", name="dqn_tiny", timeout=600)
    assert proc.returncode == 0, proc.stderr
    done = trials(tmp_path, "dqn_tiny")
    assert [t.state.name for t in done] == ["COMPLETE"] * 4 and len({t.user_attrs["worker"] for t in done}) == 2
    for trial in done:
        summary = json.loads(next((tmp_path / f"results/dqn_tiny/trial-{trial.number}").glob("*/runs/*/summary.json"))
                             .read_text())  # fmt: skip
        assert summary["total_timesteps"] == 3000 and trial.value == pytest.approx((summary["return_mean"] - 20) / 480)
    best = max(done, key=lambda t: t.value)
    page = (tmp_path / "results" / "dqn_tiny.md").read_text()
    line = f"- trial {best.number}: {best.value:.4g} (CartPole-v1 seed 1: {best.value:.4g})\n"
    assert line + "  `python leanrl_scripts/dqn.py --env-id CartPole-v1" in page
    assert all((tmp_path / "results" / f"dqn_tiny_{kind}.png").exists() for kind in ("history", "parallel"))


@pytest.fixture
def postgresql():
    """A PostgreSQL server of this machine's in a scratch folder, on a port of its own and loopback only (as the user
    postgres where the tests run as root, which initdb refuses): its URL; then the server stopped, its folder gone."""
    if not shutil.which("initdb") or not shutil.which("pg_ctl"):
        pytest.skip("no PostgreSQL server here: Debian's postgresql package, its bin folder on PATH")
    pytest.importorskip("psycopg", reason="PostgreSQL's driver: pip install '.[tune]'")
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    folder = tempfile.mkdtemp(prefix="leanrl-postgresql-")
    if as_user:
        shutil.chown(folder, "postgres")
    data, port = os.path.join(folder, "data"), str(20000 + os.getpid() % 10000)
    subprocess.run([*as_user, "initdb", "-D", data, "-U", "tuner", "--auth", "trust"], check=True, capture_output=True)
    start = ["pg_ctl", "-D", data, "-l", os.path.join(folder, "log"), "-o", f"-p {port} -h 127.0.0.1 -k ''", "-w"]
    subprocess.run([*as_user, *start, "start"], check=True, capture_output=True)
    try:
        subprocess.run(["createdb", "-h", "127.0.0.1", "-p", port, "-U", "tuner", "studies"], check=True)
        yield f"postgresql+psycopg://tuner:secret@127.0.0.1:{port}/studies"  # any password: the server trusts
    finally:
        subprocess.run([*as_user, "pg_ctl", "-D", data, "-m", "immediate", "stop"], capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
def test_two_workers_share_one_study_on_a_postgresql_server(tmp_path, postgresql):
    """Two workers on one database URL, as two machines would run the same command: the study's four trials, each
    worker's among them; the URL's password in no output."""
    write_study(tmp_path, trials=4, flags=["--total-timesteps", "2000", "--step-seconds", "0.05"])
    proc = tune(tmp_path, "--storage", postgresql, "--workers", "2")
    assert proc.returncode == 0, proc.stderr
    done = optuna.load_study(study_name="fake", storage=postgresql).get_trials()
    assert [t.state.name for t in done] == ["COMPLETE"] * 4 and len({t.user_attrs["worker"] for t in done}) == 2
    page = (tmp_path / "results" / "fake.md").read_text()
    assert "secret" not in proc.stdout + proc.stderr + page and "psycopg://tuner:***@127.0.0.1" in page
