"""The benchmark tooling: the settings written once and every tool's commands made of them, the records a stranger
can rerun, the collector's tables against hand-computed numbers, the runner's clean stop, the comparison and the
learning benchmark against fake clones, and smoke runs of run.sh (speed and learning)."""

import argparse
import csv
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib

import numpy as np
import pytest

import collect
import compare
import learning
import learning_tables
import references
import runner
from checks import is_a_pendulum_return
from script_runs import ROOT, load_script, served_python_env

PYTHON = f"python{sys.version_info[0]}.{sys.version_info[1]}"  # as records name this interpreter


def test_one_budget_changed_in_one_place_and_every_tool_follows(tmp_path):
    """The settings live in benchmarks/settings.toml alone: in a copy of the tooling, DQN's quick budget and its
    learning task's, changed there once, reach `./run.sh --dry-run` (dqn.py, and the actor process that takes DQN's
    budget), `./run.sh --compare --dry-run` (ours and every reference), the thread sweep and `./run.sh --learning
    --dry-run`, and nothing else in their commands changes."""
    shutil.copy(os.path.join(ROOT, "run.sh"), tmp_path)
    shutil.copytree(os.path.join(ROOT, "benchmarks"), tmp_path / "benchmarks", ignore=shutil.ignore_patterns("results"))
    tools = [
        ["--quick"],
        ["--compare", "--quick", "--only", "dqn,td3"],
        ["threads"],
        ["--learning", "--quick", "--seeds", "1"],
    ]

    def commands():
        outputs = []
        for tool in tools:
            command = ["bash", str(tmp_path / "run.sh"), "--dry-run", *tool]
            if tool == ["threads"]:
                command = [sys.executable, str(tmp_path / "benchmarks" / "threads.py"), "--dry-run"]
            proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable})
            assert proc.returncode == 0, proc.stderr
            outputs.append(proc.stdout.splitlines())
        return outputs

    before = commands()
    settings = tmp_path / "benchmarks" / "settings.toml"
    text = settings.read_text().replace('1", "--total-timesteps", "30000"', '1", "--total-timesteps", "31234"')
    task = 'smoke = ["--total-timesteps", "2000", "--learning-starts", "500"]\nquick = ["--total-timesteps", '
    settings.write_text(text.replace(f'{task}"500000"]', f'{task}"4321"]'))  # DQN's learning task: CartPole
    after = commands()
    unbudgeted = [
        [[re.sub("--total-timesteps [0-9]+ ", "", line) for line in lines] for lines in run] for run in (before, after)
    ]
    changed = [[line for line in lines if re.search("--total-timesteps (31234|4321) ", line)] for lines in after]
    assert unbudgeted[0] == unbudgeted[1] and [len(lines) for lines in changed] == [10, 48, 6, 2]
    old_budgets = [line for lines in after for line in lines if re.search("--total-timesteps (30000|500000) ", line)]
    assert not [line for line in old_budgets if "dqn" in line]  # PQN's task has CartPole's 500,000 steps too
    assert [line.split()[1] for line in changed[0][::5]] == [
        "leanrl_scripts/dqn.py",
        "leanrl_scripts/dqn_atari_async.py",
    ]
    references = {line.split()[2] for line in changed[1] if line.startswith("OMP") and "XLA" not in line}
    assert references == {"leanrl/dqn_torchcompile.py", "leanrl/dqn.py", "cleanrl/dqn.py"}
    # the several-process task goes through torchrun, in the learning benchmark and the speed table alike
    torchrun = (
        f"{PYTHON} -m torch.distributed.run --standalone --nproc-per-node 2 leanrl_scripts/ppo_atari_multigpu.py "
    )
    assert all(any(line.startswith(torchrun) for line in after[tool]) for tool in (0, 3))


def test_run_sh_runs_one_groups_rows_or_every_row_and_refuses_an_unknown_group():
    """`./run.sh --dry-run --group G` prints the commands of group G's rows of settings.toml alone (a script's modes
    then its env-only ceiling, a tool's one run), the same lines `./run.sh --dry-run` prints for them; without --group,
    every row's in the file's order; an unknown group is refused in one line that names the known ones."""
    with open(os.path.join(ROOT, "benchmarks", "settings.toml"), "rb") as f:
        rows = tomllib.load(f)["rows"]
    four = ["eager", "compile", "cudagraphs", "compile+cudagraphs"]
    outputs = {
        name: [row["output"]]
        if "tool" in row
        else [*(f"{name}__{m}.json" for m in row.get("modes", four)), f"{name}__env_only.json"]
        for name, row in rows.items()
    }
    env = {**{k: v for k, v in os.environ.items() if k != "MODES"}, "PYTHON": sys.executable}

    def dry_run(*args):
        command = ["bash", os.path.join(ROOT, "run.sh"), "--dry-run", *args]
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)

    every = dry_run().stdout.splitlines()
    assert [line.split(" > ")[-1] for line in every] == [output for name in rows for output in outputs[name]]
    groups = list(dict.fromkeys(row["group"] for row in rows.values()))
    assert len(groups) == 13
    for group in groups:
        expected = [output for name in rows if rows[name]["group"] == group for output in outputs[name]]
        lines = dry_run("--group", group).stdout.splitlines()
        assert [line.split(" > ")[-1] for line in lines] == expected
        assert lines == [line for line in every if line.split(" > ")[-1] in expected]
    unknown = dry_run("--group", "sacc")
    assert (unknown.returncode, unknown.stdout) == (2, "") and unknown.stderr.splitlines() == [
        f"error: no group 'sacc' in settings.toml (its groups: {', '.join(groups)})"
    ]
    for args, error in [(["--group"], "--group needs a group"), (["--group", "sac", "--learning"], "--group is an")]:
        refused = dry_run(*args)
        assert refused.returncode == 2 and refused.stderr.startswith(f"error: {error}"), refused.stderr


def test_every_record_names_its_command_so_that_a_stranger_can_rerun_it():
    """Every landed record's command: environment settings, then the Python by its version, then the script by its
    path in the repository (ours) or in the reference clone, no path of the machine."""
    checked = 0
    for folder, _, files in os.walk(os.path.join(ROOT, "benchmarks", "results")):
        for name in [name for name in files if name.endswith((".json", ".jsonl"))]:
            with open(os.path.join(folder, name)) as f:
                records = [json.loads(line) for line in f if line.strip()] if name.endswith("l") else [json.load(f)]
            for record in [r for r in records if "command" in r and not r["command"].startswith("(not recorded")]:
                words = [word for word in shlex.split(record["command"]) if not re.match("[A-Z_]+=", word)]
                script = next(word for word in words if word.endswith(".py"))
                assert re.fullmatch(r"python3\.\d+", words[0]) and not [
                    w for w in words if re.search("^/|/work/|/tmp/", w)
                ]
                # a reference's path in its clone, ours in the repository
                assert (
                    script == record.get("script_path", script)
                    if "repository" in record
                    else os.path.exists(os.path.join(ROOT, script))
                )
                checked += 1
    assert checked > 500


def summary(mode, sps, steady_steps=1000, env_seconds=1.0, **extra):
    return {
        "script": "sac_continuous_action.py", "env_id": "HalfCheetah-v5", "num_envs": 1, "device": "cpu",
        "torch_version": "2.13.0", "total_timesteps": 6000, "mode": mode, "sps": sps, "steady_steps": steady_steps,
        "steady_seconds": steady_steps / sps, "env_seconds": env_seconds, "warmup_seconds": 3.0, "return_mean": -250.0,
        "cudagraphs_requested": "cudagraphs" in mode, "cudagraphs_active": False, **extra,
    }  # fmt: skip


def collect_rows(folder, runs):
    """Writes each run as folder/<name>.json and runs the collector on the folder: its output, its tables' last
    header and {mode: cells}."""
    folder.mkdir(exist_ok=True)
    for name, run in runs.items():
        (folder / f"{name}.json").write_text(json.dumps(run))
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "collect.py"), folder], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    return proc.stdout, "|".join(lines[0]), {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in lines}


def test_collect_builds_the_table_with_ceilings(tmp_path):
    modes = {"eager": 100.0, "compile": 150.0, "cudagraphs": 100.0, "compile+cudagraphs": 200.0}
    runs = {f"sac__{mode}": summary(mode, sps) for mode, sps in modes.items()}
    stdout, _, rows = collect_rows(tmp_path, {**runs, "sac__env_only": {"env_only_sps": 20000.0}})
    inactive = " (graphs inactive: no CUDA)"
    assert list(rows)[1:] == ["eager", "compile", "cudagraphs" + inactive, "compile+cudagraphs" + inactive]
    # compile: 1000 steps in 1000/150 s, 1 s of it in the env -> learner-bound 1000 / (6.667 - 1) = 176
    # the env took 1 s for 1000 steps that env-only steps in 0.05 s: 20x
    assert rows["compile"] == ["150", "1.50x", "-250.0", "20000", "176", "0.85", "3.0", "20.00"]
    assert rows["eager"][1] == "1.00x" and rows["compile+cudagraphs" + inactive][1] == "2.00x"
    assert (tmp_path / "speed.md").read_text() == stdout and (tmp_path / "speed.png").read_bytes()[:4] == b"\x89PNG"
    _, _, rows = collect_rows(tmp_path / "alone", {"td3__compile": summary("compile", 900.0)})
    assert rows["compile"][:2] == ["900", "n/a"]  # no eager run: no ratio


@pytest.mark.parametrize(
    "name, extra, header, cells",
    [
        # the LSTM script: what its padding costs; learner-bound 1000 steps / (10 - 1) s
        ("ppo_lstm", {"padded_steps": 3000, "real_steps": 1000, "peak_memory_mb": 612.4},
         " padded / real steps | peak memory MB ", ["111", "0.90", "3.00", "612"]),
        # 1000 steps in 10 s, 4 of them spent by the learner waiting for the actor: learner-bound 1000 / 6 = 167
        ("dqn_async", {"env_seconds": 9.0, "async_actor": True, "learner_wait_seconds": 4.0,
                       "replay_ratio_target": 12.8, "replay_ratio_achieved": 12.7},
         " replay ratio achieved / target ", ["167", "0.60", "12.70 / 12.80"]),
        # 2 s of 10 waiting for unrolls: learner-bound 125; the actors' own ceiling 110 is lower: 100 / 110
        ("impala", {"env_seconds": 3.0, "learner_wait_seconds": 2.0, "actor_sps": 110.0, "num_actors": 4,
                    "envs_per_actor": 2, "replay_ratio": 0.5, "policy_lag_mean": 2.25, "policy_lag_max": 5},
         " actors x envs | replayed | actor SPS | policy lag mean / max ",
         ["125", "0.91", "4 x 2", "0.50", "110", "2.2 / 5"]),
    ],
)  # fmt: skip
def test_collect_adds_each_kind_of_scripts_columns(tmp_path, name, extra, header, cells):
    _, head, rows = collect_rows(tmp_path, {f"{name}__eager": summary("eager", 100.0, **extra)})
    assert head.endswith(header) and [*rows["eager"][4:6], *rows["eager"][8:]] == cells  # learner-bound, its ratio


def test_collect_draws_a_grid_and_the_reference_scripts(tmp_path):
    """Five benchmarks make two rows of three panels at 900 pixels wide, not one row of five; the reference
    scripts' speed from reference.json goes under their table (and, hatched, into the chart)."""
    import matplotlib.image

    measured = {"bench1": {"LeanRL --compile": 80}, "bench3": {"LeanRL": 70, "ours, alongside": 90}}
    (tmp_path / "reference.json").write_text(json.dumps({"_measured": "where", **measured}))
    stdout, _, _ = collect_rows(
        tmp_path, {f"bench{i}__{m}": summary(m, 100.0 + i) for i in range(5) for m in ("eager", "compile")}
    )
    line = "Reference scripts on this kind of machine: "
    assert stdout.count(line) == 2 and f"{line}LeanRL --compile 80 SPS." in stdout.split("### bench2")[0]
    assert f"{line}LeanRL 70 SPS (ours measured alongside, alternating runs: 90 SPS)." in stdout.split("### bench3")[1]
    height, width, _ = matplotlib.image.imread(tmp_path / "speed.png").shape
    assert width == 900 and height > width / 2


def test_the_runner_stops_a_run_with_its_children(tmp_path):
    """A run past its limit, or one `stop_when` stops, ends with what it started (a compiler's workers): nothing is
    left running; its output and why it stopped come back."""
    child = "import subprocess, sys, time\nprint(subprocess.Popen(['sleep', '60']).pid, flush=True)\ntime.sleep(60)"
    ended = runner.run([sys.executable, "-c", child], tmp_path, limit=3)
    asked = []
    stop_when = lambda: asked.append(1) or ("enough" if len(asked) > 2 else None)  # noqa: E731
    again = runner.run([sys.executable, "-c", child], tmp_path, stop_when=stop_when, poll_seconds=0.2)
    assert (ended.stopped, again.stopped, again.returncode) == ("after 3 s", "enough", -15) and 3 <= ended.seconds < 30
    time.sleep(0.5)
    for stat in (f"/proc/{int(run.stdout)}/stat" for run in (ended, again)):
        assert not os.path.exists(stat) or open(stat).read().split(")")[-1].split()[0] == "Z"  # gone, or unreaped
    assert runner.summary('x\nSPEED {"sps": 1}\nSPEED {"sps": 2}\n') == {"sps": 2} and runner.summary("") is None


@pytest.mark.slow
def test_run_sh_smoke_produces_a_table_for_every_script(tmp_path):
    """Every row of settings.toml in one of the four modes, eager, the collector's baseline (CI time: two modes took
    15 of a 2-core machine's minutes, one takes 6): each script's own tests run all four, and the collector's tables
    of several modes are checked above. What this run checks is the plumbing of run.sh, every group and row."""
    env = {**served_python_env(), "MODES": "eager"}  # each script's run forked with its imports done
    command = ["bash", os.path.join(ROOT, "run.sh"), "--smoke", "--results", str(tmp_path)]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = runner.settings()["rows"]
    names = [name for name in rows if "tool" not in rows[name]]
    assert len(names) == 22 and proc.stdout.count("| eager") == len(names)
    for name in names:
        run, flags = json.loads((tmp_path / f"{name}__eager.json").read_text()), runner.flags(rows, name, "smoke")
        assert run["mode"] == "eager" and run["sps"] > 0 and run["script"] == rows[name]["script"]
        assert [run["env_id"], str(run["total_timesteps"])] == [
            flags[flags.index(flag) + 1] for flag in ("--env-id", "--total-timesteps")
        ]
        assert run.get("lstm_impl") == {"ppo_lstm": "padded", "ppo_lstm_loop": "loop"}.get(name)
        assert not (tmp_path / f"{name}__compile.json").exists() and f"### {name}: " in proc.stdout
        # a plausible ceiling, not a speed test: Breakout's measured 800-2000 here, beside another test or not
        assert json.loads((tmp_path / f"{name}__env_only.json").read_text())["env_only_sps"] > 100
    assert "### ppo_multigpu: ppo_atari_multigpu.py on Breakout-v5 (2 processes x 2 env, cpu" in proc.stdout
    assert (tmp_path / "speed.png").exists() and "### PPO-LSTM update phase" in proc.stdout
    phase = json.loads((tmp_path / "lstm_update.json").read_text())
    assert phase["padded_steps"] >= phase["real_steps"] and min(phase["cnn_only"], phase["padded"], phase["loop"]) > 0
    machine, *ceilings = [json.loads(line) for line in (tmp_path / "env_ceiling.jsonl").read_text().splitlines()]
    assert machine["usable_cores"] >= 1 and len(ceilings) == 6 and min(row["sps"] for row in ceilings) > 100


@pytest.mark.slow
def test_run_sh_learning_smoke_writes_the_curves_the_table_and_a_chart_per_task(tmp_path):
    """./run.sh --learning --smoke: every task of the smoke profile over two seeds (about a minute); each record is
    slim (no full curve, its curve and losses bounded), the curves (made on demand), the losses and the table are read
    back against the runs' own records, and a second call runs nothing again."""
    env = served_python_env()  # learning.py's runs of our scripts go through $PYTHON too: forked, imports done
    command = ["bash", os.path.join(ROOT, "run.sh"), "--learning", "--smoke", "--seeds", "2", "--results", tmp_path]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    folder = tmp_path / "learning"
    assert not (folder / "curves.csv").exists()
    paths = sorted((folder / "runs").glob("*.json"))
    records = [json.loads(path.read_text()) for path in paths]
    tasks = {record["task"] for record in records}
    assert len(tasks) >= 6 and len(records) == 2 * len(tasks)
    assert max(path.stat().st_size for path in paths) < 40_000
    curves = [sys.executable, os.path.join(ROOT, "benchmarks", "learning_tables.py"), folder, "--curves"]
    assert subprocess.run(curves, capture_output=True).returncode == 0
    with open(folder / "curves.csv") as f:
        rows = list(csv.DictReader(f))
    for record in records:
        points, loss_points = len(record["curve"]["steps"]), max(map(len, record["losses"].values()))
        assert not {"steps", "seconds", "returns"} & set(record) and 0 < points <= learning_tables.CURVE_POINTS
        assert record["episodes"] >= points and loss_points <= learning_tables.LOSS_POINTS
        curve = [
            float(row["return"]) for row in rows if (row["task"], int(row["seed"])) == (record["task"], record["seed"])
        ]
        assert curve == pytest.approx(record["curve"]["returns"]) and curve
        if record["episodes"] <= learning_tables.CURVE_POINTS:  # the curve as it was: its last point the final return
            assert record["final_return"] == pytest.approx(curve[-1], rel=1e-3)
        last_logged = {tag[len("losses/") :]: series[-1][1] for tag, series in record["losses"].items()}
        final_metrics = record["summary"]["final_metrics"]  # what the run logged last, also in its summary
        assert final_metrics and {name: last_logged[name] for name in final_metrics} == pytest.approx(
            final_metrics, rel=1e-3
        )
        assert record["command"].startswith(f"{PYTHON} leanrl_scripts/")
    table = (folder / "final.md").read_text()
    for task in tasks:
        finals = [record["summary"]["eval_return_mean"] for record in records if record["task"] == task]
        row = next(line for line in table.splitlines() if line.startswith(f"| {task} |"))
        assert f"| 2 | {np.mean(finals):.1f} +- {np.std(finals):.1f} |" in row
        assert (folder / f"{task}.png").stat().st_size > 10_000
    again = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0 and again.stdout.count("done before") == len(records)
    refused = subprocess.run(["bash", os.path.join(ROOT, "run.sh"), "--seeds", "2"], capture_output=True, text=True)
    assert refused.returncode == 2 and refused.stderr.startswith("error: --seeds counts the seeds of --learning")


def test_the_learning_tables_statistics_against_plain_definitions():
    values = [9.0, 1.0, 7.0, 3.0, 5.0, 100.0, 2.0, 4.0]  # sorted: 1 2 3 4 5 7 9 100; a quarter (2) off each end
    assert learning_tables.interquartile_mean(values) == pytest.approx((3 + 4 + 5 + 7) / 4)
    assert learning_tables.interquartile_mean([1.0, 2.0, 30.0]) == pytest.approx(11.0)  # under four seeds: the mean
    low, high = learning_tables.bootstrap_interval(values)
    means = [np.mean(np.random.default_rng(seed).choice(values, len(values))) for seed in range(2000)]
    assert [low, high] == pytest.approx(np.percentile(means, [2.5, 97.5]), abs=3.0) and low < np.mean(values) < high
    assert learning_tables.smoothed([1.0, 3.0, 5.0, 7.0], window=2).tolist() == [1.0, 2.0, 4.0, 6.0]


def test_the_reference_shim_hands_out_what_gymnasium_029_did_against_envs_stepped_by_hand(tmp_path):
    """The reference scripts run with gymnasium 1.x behind the shim: at the step an episode ends, its env's entry of
    final_info has the episode's return and length, final_observation has its last observation, the observation
    handed out is the next episode's first (the same-step autoreset the scripts were written for), and the other
    envs' entries are None. Checked against two envs stepped and reset by hand."""
    script = (
        references.GYMNASIUM_029_SHIM
        + """
import json
import gymnasium as gym
import numpy as np

def make():
    return gym.wrappers.RecordEpisodeStatistics(gym.make("CartPole-v1"))

envs = gym.vector.SyncVectorEnv([make, make])
obs, _ = envs.reset(seed=[3, 4])
plain = [gym.make("CartPole-v1"), gym.make("CartPole-v1")]
for i in range(2):
    plain[i].reset(seed=3 + i)
returns, lengths, checked = [0.0, 0.0], [0, 0], 0
for step in range(300):
    actions = np.array([(step // 3) % 2, (step // 5) % 2])
    obs, rewards, terminations, truncations, infos = envs.step(actions)
    for i in range(2):
        o, r, te, tr, _ = plain[i].step(int(actions[i]))
        returns[i] += r
        lengths[i] += 1
        if te or tr:
            entry = infos["final_info"][i]
            assert entry["episode"]["r"] == returns[i] and entry["episode"]["l"] == lengths[i], (entry, returns)
            assert np.allclose(infos["final_observation"][i], o)
            o, _ = plain[i].reset()
            returns[i], lengths[i], checked = 0.0, 0, checked + 1
        elif "final_info" in infos:
            assert infos["final_info"][i] is None
        assert np.allclose(obs[i], o)
print(json.dumps({"episodes": checked}))
"""
    )
    (tmp_path / "shim_check.py").write_text(script)
    proc = subprocess.run([sys.executable, "shim_check.py"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1])["episodes"] >= 10


def fake_repository(path, files, side, monkeypatch):
    """A git repository of `files`, monkeypatched in as `side`'s pinned clone (its scripts in its folder,
    cleanrl_utils' files put beside them). Returns the commit."""
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    git = ["git", "-C", str(path), "-c", "user.name=t", "-c", "user.email=t@t"]
    for words in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "fake"]):
        subprocess.run(git + words, check=True)
    commit = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    support = [name for name in files if name.startswith("cleanrl_utils/")]
    monkeypatch.setitem(references.REFERENCE_REPOS, side, (f"fake/{side}", commit, side.lower(), support))
    return commit


FAKE_CLEANRL_DQN = """\
# stands in for CleanRL's dqn.py: the 0.29-style loop, returns to TensorBoard
import argparse
import gymnasium as gym
import numpy as np
from cleanrl_utils.buffers import ReplayBuffer  # noqa: F401  (put beside the script from the same commit)
from torch.utils.tensorboard import SummaryWriter

parser = argparse.ArgumentParser()
for flag in ("--total-timesteps", "--learning-starts", "--seed"):
    parser.add_argument(flag, type=int)
args = parser.parse_args()
envs = gym.vector.SyncVectorEnv([lambda: gym.wrappers.RecordEpisodeStatistics(gym.make("CartPole-v1"))])
envs.reset(seed=args.seed)
writer = SummaryWriter("runs/fake")
for global_step in range(args.total_timesteps):
    obs, rewards, terminations, truncations, infos = envs.step(np.array([global_step % 2]))
    if "final_info" in infos:
        for info in infos["final_info"]:
            if info and "episode" in info:
                writer.add_scalar("charts/episodic_return", info["episode"]["r"], global_step)
writer.close()
"""

FAKE_LEANRL_SAC = """\
# stands in for LeanRL's compiled SAC: returns only as wandb's running mean, none before the first episode
import argparse
import math
import wandb

parser = argparse.ArgumentParser()
for flag in ("--env-id", "--total-timesteps", "--learning-starts", "--batch-size", "--seed"):
    parser.add_argument(flag)
args = parser.parse_args()
wandb.init(project="fake")
for step in range(0, int(args.total_timesteps), 100):
    wandb.log({"episode_return": float("nan") if step < 200 else -step / 10 + int(args.seed), "speed": 1.0}, step=step)
"""


def test_the_learning_benchmark_runs_the_references_and_draws_them_beside_ours(tmp_path, monkeypatch):
    """References read from a clone at the pinned commit, patched, run with the task's flags and seed: CleanRL's
    curve comes from its TensorBoard, LeanRL's from the wandb stand-in (its running mean, NaN left out), each kept as
    a record with the commit, command and patches; the table has a row per side with the final training return of
    the records' own curves; a line the patches need that is gone stops the run with one error."""
    utils = {"cleanrl_utils/__init__.py": "", "cleanrl_utils/buffers.py": "class ReplayBuffer:\n    pass\n"}
    files = {"cleanrl/dqn.py": FAKE_CLEANRL_DQN, "cleanrl/dqn_jax.py": FAKE_CLEANRL_DQN, **utils}
    cleanrl = fake_repository(tmp_path / "cleanrl", files, "CleanRL", monkeypatch)
    fake_repository(
        tmp_path / "leanrl", {"leanrl/sac_continuous_action_torchcompile.py": FAKE_LEANRL_SAC}, "LeanRL", monkeypatch
    )
    monkeypatch.setitem(references.REFERENCE_PATCHES, "sac_continuous_action_torchcompile", [])
    folder, python = tmp_path / "results", sys.executable
    runs = [("dqn_cartpole", "CleanRL"), ("sac_pendulum", "LeanRL"), ("dqn_cartpole", "CleanRL-JAX")]
    for (task, side), seed in [(run, seed) for run in runs for seed in (1, 2)]:
        clone = tmp_path / side.split("-")[0].lower()
        learning.run_task(task, seed, "smoke", str(folder), python, side, str(clone), python)
    jax = json.loads((folder / "runs" / "dqn_cartpole__cleanrl-jax__seed1.json").read_text())
    # timed from the command: its imports before the first episode, and no point after the run's end
    seconds = jax["curve"]["seconds"]
    assert jax["seconds_from"] == "command" and 0 < seconds[0] <= seconds[-1] <= jax["total_seconds"]
    dqn = json.loads((folder / "runs" / "dqn_cartpole__cleanrl__seed1.json").read_text())
    assert (
        dqn["commit"] == cleanrl
        and dqn["command"] == f"{PYTHON} cleanrl/dqn.py --total-timesteps 2000 --learning-starts 500"
    )
    assert dqn["steps_done"] == 2000 and dqn["episodes"] > 20 and "returns_kind" not in dqn
    assert dqn["patches"][0].startswith("prepended: gymnasium 1.x's SyncVectorEnv")
    sac = json.loads((folder / "runs" / "sac_pendulum__leanrl__seed2.json").read_text())
    assert sac["curve"] == {"steps": [200, 300], "seconds": sac["curve"]["seconds"], "returns": [-20 + 2, -30 + 2]}
    assert sac["returns_kind"].startswith("running") and sac["episodes"] == 2
    assert sac["final_return"] == -28.0  # LeanRL's: the last running mean it logged
    learning_tables.collect(str(folder))
    table = (folder / "final.md").read_text()
    rows = {line.split(" | ")[1]: line for line in table.splitlines() if line.startswith("| ")}
    assert "| 2 | none | |  | -28.5 +- 0.5 |" in rows["LeanRL: sac_continuous_action_torchcompile.py, its default env"]
    assert "| 475 | not reached (0/2) |" in rows["CleanRL: dqn.py, its default env"]  # alternating actions
    assert f"`{PYTHON} cleanrl/dqn_jax.py --total-timesteps 2000 --learning-starts 500 --seed S`" in table
    curves = [sys.executable, os.path.join(ROOT, "benchmarks", "learning_tables.py"), folder, "--curves"]
    assert subprocess.run(curves, capture_output=True).returncode == 0
    with open(folder / "curves.csv") as f:
        assert {row["side"] for row in csv.DictReader(f)} == {"CleanRL", "CleanRL-JAX", "LeanRL"}
    assert (folder / "dqn_cartpole.png").stat().st_size > 10_000
    monkeypatch.setitem(references.REFERENCE_PATCHES, "dqn", [("a line it lost\n", "", "a fix it needed")])
    with pytest.raises(SystemExit, match="no longer has the line patched for: a fix it needed"):
        learning.run_task("dqn_cartpole", 3, "smoke", str(folder), python, "CleanRL", str(tmp_path / "cleanrl"), python)


def test_the_seconds_to_a_score_against_a_plain_definition():
    """The time to a score: the first episode at which the mean of the last 20 episodes' returns (all 20 there)
    reaches the threshold, or LeanRL's logged running mean does; its seconds as the record counts them from the
    command; None when never, or when the record's times are not the command's."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        returns = list(np.cumsum(rng.normal(1, 3, rng.integers(1, 80))))
        seconds = list(np.cumsum(rng.uniform(0.1, 2, len(returns))))
        threshold = float(rng.uniform(0, 60))
        plain = next(
            (seconds[end - 1] for end in range(20, len(returns) + 1) if np.mean(returns[end - 20 : end]) >= threshold),
            None,
        )
        assert (
            learning_tables.seconds_to_score(
                {"returns": returns, "seconds": seconds, "seconds_from": "command"}, threshold
            )
            == plain
        )
    logged = {"returns": [1.0, 5.0, 9.0], "seconds": [2.0, 3.0, 4.0], "seconds_from": "command", "returns_kind": "r"}
    assert learning_tables.seconds_to_score(logged, 5.0) == 3.0
    assert learning_tables.seconds_to_score({**logged, "seconds_from": None}, 5.0) is None
    # the table reads each record's `reached`, which slim takes from the full curve at the task's score
    logged.update(steps=[100, 200, 300], side="ours", task="td3_pendulum")
    seeds = ((1, 0, [-900.0] * 3), (2, 10, [-300.0, -150.0, -100.0]), (3, 4, [-150.0] * 3))
    full = [{**logged, "seed": seed, "returns": returns, "seconds": [2.0 + shift, 3.0 + shift, 4.0 + shift]}
            for seed, shift, returns in seeds]  # fmt: skip
    runs = [learning_tables.slim(run, -200) for run in full]
    assert learning_tables.time_to_score("td3_pendulum", runs) == "10 [6, 13] (2/3)"
    assert learning_tables.time_to_score("td3_pendulum", runs[:1]) == "not reached (0/1)"
    # a seed's run stopped at the score counts where its complete run is not timed from the command, and only there
    stopped = {**full[0], "returns": [-150.0] * 3, "until_score": True, "max_minutes": None, "stopped": "at the score"}
    cut = {**stopped, "returns": [-900.0] * 3, "max_minutes": 12, "stopped": "after 12 minutes"}
    stopped, cut = (learning_tables.slim(run, -200) for run in (stopped, cut))
    assert learning_tables.time_to_score("td3_pendulum", runs + [stopped]) == "10 [6, 13] (2/3)"
    runs[0]["seconds_from"] = None
    assert learning_tables.time_to_score("td3_pendulum", runs + [stopped]) == "6 [2, 13] (3/3)"
    assert learning_tables.time_to_score("td3_pendulum", runs + [cut]) == "10 [6, 13] (2/3; 1 stopped at 12 min)"
    with pytest.raises(SystemExit, match="its record times the score -150, settings.toml's is -200"):
        learning_tables.time_to_score("td3_pendulum", [learning_tables.slim(full[1], -150)])


def full_record(rng, side, seed, logged):
    """A run of thousands of episodes on dqn_cartpole as learning.py reads it before `slim`: returns rising to the
    score with noise, several episodes at a step, a losses/* scalar at every episode; `logged`: LeanRL's running mean
    in their place."""
    episodes = int(rng.integers(3000, 6000))
    steps = np.sort(rng.integers(0, 500_000, episodes)).tolist()
    seconds = (np.array(steps) / 5000 + 2 + np.sort(rng.uniform(0, 0.5, episodes))).tolist()
    returns = np.clip(np.array(steps) / 800 + rng.normal(0, 80, episodes), 8, 500)
    returns[:10] = 500  # a lucky start: its mean counts only once all 20 are in (LeanRL's logged mean at once)
    returns = returns.tolist()
    losses = {"losses/td_loss": [[step, 1 / value] for step, value in zip(steps, returns)]}
    record = {
        "task": "dqn_cartpole", "seed": seed, "side": side, "profile": "quick", "command": "python3.11 dqn.py",
        "total_seconds": seconds[-1] + 1, "steps_done": 500_000, "seconds_from": "command", "steps": steps,
        "seconds": seconds, "returns": returns, "losses": losses,
    }  # fmt: skip
    if side == "ours":
        record["summary"] = {"script": "dqn.py", "env_id": "CartPole-v1", "eval_return_mean": 490.0 + seed}
    else:
        record.update(repository=f"fake/{side}", commit="0123456789")
    if logged:
        record.update(returns=learning_tables.smoothed(returns).tolist(), returns_kind="running mean of the last 20")
    return record


def test_slim_records_give_the_tables_of_their_full_curves(tmp_path):
    """Records of thousands of episodes kept slim: final.md's and the README's cells are those of the full curves by
    plain definitions (the mean of the last 20 episodes; the first episode at which it reached the score, all 20
    there; LeanRL's logged mean as it is), each record tens of kB, its curve the running mean's means over equal bins
    of steps; a folder of records that keep every episode is refused until --slim-records rewrote it."""
    rng, runs, plain = np.random.default_rng(1), tmp_path / "runs", {}
    runs.mkdir()
    for side in ("ours", "CleanRL", "LeanRL"):
        for seed in (1, 2, 3):
            full = full_record(rng, side, seed, logged=side == "LeanRL")
            returns, seconds, steps = full["returns"], full["seconds"], full["steps"]
            means = (
                returns
                if side == "LeanRL"
                else [np.mean(returns[max(end - 20, 0) : end]) for end in range(1, len(returns) + 1)]
            )
            reached = next(i for i in range(0 if side == "LeanRL" else 19, len(means)) if means[i] >= 475)
            plain.setdefault(side, []).append((means[-1], seconds[reached]))
            kept = learning_tables.slim(full, 475)
            assert kept["final_return"] == pytest.approx(means[-1], rel=1e-12)
            assert kept["reached"] == {"score": 475, "step": steps[reached], "seconds": seconds[reached]}
            assert kept["episodes"] == len(returns) and len(json.dumps(kept)) < 30_000
            edges = np.linspace(steps[0], steps[-1], learning_tables.CURVE_POINTS + 1)
            bins = [[i for i, step in enumerate(steps) if low <= step < high or step == high == steps[-1]]
                    for low, high in zip(edges, edges[1:])]  # fmt: skip
            assert kept["curve"]["returns"] == pytest.approx(
                [np.mean([means[i] for i in b]) for b in bins if b], rel=1e-3
            )
            assert kept["curve"]["steps"] == pytest.approx([np.mean([steps[i] for i in b]) for b in bins if b], abs=0.5)
            assert len(kept["losses"]["losses/td_loss"]) <= learning_tables.LOSS_POINTS
            (runs / f"dqn_cartpole__{side.lower()}__seed{seed}.json").write_text(json.dumps(full))
    with pytest.raises(SystemExit, match="keeps every episode"):
        learning_tables.load_records(tmp_path)
    learning_tables.slim_records(tmp_path)
    table = learning_tables.final_table(learning_tables.load_records(tmp_path))
    readme = learning_tables.readme_table(tmp_path)
    for side, figures in plain.items():
        finals, times = [final for final, _ in figures], sorted(seconds for _, seconds in figures)
        row = next(line for line in table.splitlines() if line.startswith(f"| dqn_cartpole | {side}:"))
        reached = f"{np.median(times):.0f} [{times[0]:.0f}, {times[-1]:.0f}] (3/3)"
        assert f"| {learning_tables.mean_std_interval(finals)} | 475 | {reached} |" in row
        assert f"{side} {np.mean(finals):.1f}" in readme and f"{side} {np.median(times):.0f} (3/3)" in readme


FAKE_CLEANRL_DQN_SLOW = """\
# stands in for a long run of CleanRL's dqn.py: an episode every 20 ms, flushed at once; seed 1's returns rise to
# CartPole's score (its mean of 20 reaches 475 at step 57), seed 2's stay far below it
import argparse
import os
import time
from torch.utils.tensorboard import SummaryWriter

parser = argparse.ArgumentParser()
for flag in ("--total-timesteps", "--learning-starts", "--seed"):
    parser.add_argument(flag, type=int)
args = parser.parse_args()
with open(os.environ["PID_FILE"], "a") as f:
    f.write(f"{os.getpid()}\\n")
writer = SummaryWriter("runs/fake")
for global_step in range(args.total_timesteps):
    writer.add_scalar("charts/episodic_return", 10 * global_step if args.seed == 1 else 9.0, global_step)
    writer.flush()
    time.sleep(0.02)
"""


def test_the_learning_benchmark_stops_a_run_at_its_score_or_its_time_limit(tmp_path, monkeypatch):
    """--until-score stops a run once its curve shows the score, --max-minutes one that has not reached it by then:
    the process is gone, the record (named __to-score) says why it stopped and where it stood, and the table counts it
    for the seconds to the score only, the stopped seed said so."""
    files = {"cleanrl/dqn.py": FAKE_CLEANRL_DQN_SLOW, "cleanrl_utils/__init__.py": "", "cleanrl_utils/buffers.py": ""}
    fake_repository(tmp_path / "cleanrl", files, "CleanRL", monkeypatch)
    monkeypatch.setenv("PID_FILE", str(tmp_path / "pids"))
    monkeypatch.setattr(learning, "POLL_SECONDS", 0.2)
    folder, python = tmp_path / "results", sys.executable
    for seed in (1, 2):  # 2,000 steps: 40 s unless stopped
        learning.run_task("dqn_cartpole", seed, "smoke", str(folder), python, "CleanRL", str(tmp_path / "cleanrl"),
                          python, until_score=True, max_minutes=0.1)  # fmt: skip
    for pid in map(int, (tmp_path / "pids").read_text().split()):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    reached, cut = (
        json.loads((folder / "runs" / f"dqn_cartpole__cleanrl__seed{seed}__to-score.json").read_text())
        for seed in (1, 2)
    )
    assert reached["stopped"] == "at the score" and cut["stopped"] == "after 0.1 minutes"
    assert 57 <= reached["steps_done"] < 1999  # stopped before its end, on a loaded machine too
    assert cut["total_seconds"] >= 6 and cut["curve"]["steps"][-1] <= cut["steps_done"] < 1999
    seconds = reached["reached"]["seconds"]
    assert seconds < reached["total_seconds"] and cut["reached"] == {"score": 475, "step": None, "seconds": None}
    learning_tables.collect(str(folder))
    table = (folder / "final.md").read_text()
    [row] = [line for line in table.splitlines() if "| dqn_cartpole |" in line]
    assert (
        "CleanRL (stopped runs: where they stood): dqn.py" in row
        and f"| 475 | {seconds:.0f} (1/2; 1 stopped at 0.1 min) |" in row
    )
    assert f"- dqn_cartpole, CleanRL, stopped at the score or after 0.1 minutes: `{PYTHON} cleanrl/dqn.py" in table


def test_the_curve_of_a_script_that_logs_no_episode(tmp_path):
    """The JAX PPO scripts log each env's last game averaged (charts/avg_episodic_return), no episode: their curve is
    that, labelled so, and read on as the run writes more; a script with episodes keeps them."""
    from torch.utils.tensorboard import SummaryWriter

    started = time.time() - 5
    writer = SummaryWriter(str(tmp_path / "runs" / "jax"))
    writer.add_scalar("charts/avg_episodic_return", 0.0, 1024, walltime=started + 1)
    writer.add_scalar("losses/value_loss", 0.5, 1024, walltime=started + 1)
    writer.flush()
    curve = learning.Curve(str(tmp_path), started, "ppo_atari_envpool_xla_jax")
    first = curve.read()
    assert (first["returns"], first["steps"], first["losses"]) == ([0.0], [1024], {"losses/value_loss": [[1024, 0.5]]})
    assert first["seconds"] == pytest.approx([1.0]) and first["returns_kind"].startswith("mean of each env's last game")
    writer.add_scalar("charts/avg_episodic_return", 12.5, 2048, walltime=started + 3)
    writer.flush()
    assert curve.read()["returns"] == [0.0, 12.5] and learning_tables.seconds_to_score(
        curve.read(), 10
    ) == pytest.approx(3)
    writer.add_scalar("charts/episodic_return", 4.0, 2050, walltime=started + 4)
    writer.close()
    assert curve.read()["returns"] == [4.0] and "returns_kind" not in curve.read()


FAKE_OURS_FOR_SPEED = """\
# stands in for one of our scripts: its SPEED line, faster compiled and with more threads
import json
import os
import sys

if os.environ.get("MUJOCO_GL") != "disable":  # as importing mujoco fails where EGL is asked for and missing
    sys.exit("AttributeError: 'NoneType' object has no attribute 'eglQueryString'")

threads = int(sys.argv[sys.argv.index("--torch-threads") + 1]) if "--torch-threads" in sys.argv else 2
sps = 100.0 * (2 if "--compile" in sys.argv else 1) + threads
print("SPEED " + json.dumps({"sps": sps, "warmup_seconds": 1.5, "torch_threads": threads, "device": "cpu"}))
"""

FAKE_LEANRL_FOR_SPEED = """\
# stands in for LeanRL's scripts: the speed since its burn-in, logged to wandb; 30 plain, 60 compiled
import sys
import wandb

for step in range(0, 1000, 100):
    wandb.log({"speed": 60.0 if "--compile" in sys.argv else 30.0}, step=step)
"""

FAKE_CLEANRL_FOR_SPEED = """\
# stands in for CleanRL's scripts: SPS points to TensorBoard, 40 steps a second by their wall times after learning
# starts, 1000 a second before (its random steps)
from torch.utils.tensorboard import SummaryWriter

writer = SummaryWriter("runs/fake")
for step in range(100, 1100, 100):
    writer.add_scalar("charts/SPS", 1, step, walltime=1e9 + (step / 1000 if step <= 200 else 0.2 + (step - 200) / 40))
writer.close()
"""

# stand in for LeanRL's JAX scripts (a running speed logged to wandb from before the first update, whose JIT
# compilation, a second here, it counts; a step as the JAX array its loop carries) and CleanRL's (TensorBoard SPS
# points, 2000 steps a second by their wall times at XLA's default threads and 500 at one, after a slow first update)
FAKE_LEANRL_JAX = """\
import time
import tomllib

import numpy as np
import wandb

for step in range(100, 1100, 100):
    time.sleep(1.0 if step == 300 else 0.1)
    wandb.log({"speed": 7.0, "episode_return": 1.0}, step=np.array(step))
"""

FAKE_CLEANRL_JAX = """\
import os

from torch.utils.tensorboard import SummaryWriter

rate = 500 if "xla_cpu_multi_thread_eigen=false" in os.environ.get("XLA_FLAGS", "") else 2000
writer = SummaryWriter("runs/fake")
for step in range(100, 1100, 100):
    writer.add_scalar("charts/SPS", 1, step, walltime=1e9 + (0 if step <= 300 else 50 + (step - 300) / rate))
writer.close()
"""


@pytest.fixture
def fake_sides(tmp_path, monkeypatch):
    """Fake clones of both projects, our fake script as the repository's leanrl_scripts/fake.py, and settings.toml
    stood in for by one row "fake" (each test gives its references): (the clones' commits, the compare.py argv)."""
    leanrl = {f"leanrl/{name}.py": FAKE_LEANRL_FOR_SPEED for name in ("fake", "fake_compiled")}
    cleanrl = {"cleanrl/fake.py": FAKE_CLEANRL_FOR_SPEED, "cleanrl/fake_jax.py": FAKE_CLEANRL_JAX}
    commits = {
        "leanrl": fake_repository(
            tmp_path / "leanrl", {**leanrl, "leanrl/fake_jax.py": FAKE_LEANRL_JAX}, "LeanRL", monkeypatch
        )
    }
    commits["cleanrl"] = fake_repository(
        tmp_path / "cleanrl", {**cleanrl, "cleanrl/fake_scan.py": FAKE_CLEANRL_JAX}, "CleanRL", monkeypatch
    )
    (tmp_path / "ours" / "leanrl_scripts").mkdir(parents=True)
    (tmp_path / "ours" / "leanrl_scripts" / "fake.py").write_text(FAKE_OURS_FOR_SPEED)
    monkeypatch.setattr(runner, "ROOT", str(tmp_path / "ours"))
    monkeypatch.delenv("PYTHON", raising=False)
    argv = ["compare.py", "--leanrl", str(tmp_path / "leanrl"), "--cleanrl", str(tmp_path / "cleanrl")]
    return commits, argv + ["--results", str(tmp_path / "results")]


def test_the_comparison_alternates_resumes_keeps_to_its_budget_and_tables_the_sides(
    fake_sides, tmp_path, monkeypatch, capsys
):
    """`./run.sh --compare`'s sweep against fake clones and a fake script of ours: each side's headline runs first
    (ours in both modes, so that --compile is timed beside eager), the first side and mode swapping each round, a
    JAX script for CUDA only left out on a CPU; every run one JSON line the moment it ends, and a second call runs
    only what is missing; a budget too small for any run starts none; SPS read the way each side reports it (ours'
    summary, LeanRL's logged speed, CleanRL's TensorBoard wall times after learning starts, the JAX scripts' by the
    wall times of their points from the third after learning starts, so that neither their JIT compilation nor the
    speed LeanRL's logs counts from before it is in); the table's best settings and ratios; a smoke runs one round
    of every side's headline runs, and a Python without jax leaves the JAX scripts out with one line."""
    commits, argv = fake_sides
    jax = [["LeanRL", "fake_jax"], ["CleanRL", "fake_jax"], ["CleanRL", "fake_scan", "cuda"]]
    # LeanRL's plain script named as CleanRL's, as in the real rows: the headline runs are told apart by side
    row = {"script": "fake.py", "leanrl": ["fake", "fake_compiled"], "cleanrl": "fake", "jax": jax}
    monkeypatch.setattr(
        runner,
        "settings",
        lambda: {
            "rows": {"fake": {**row, "quick": ["--learning-starts", "200"], "smoke": ["--learning-starts", "200"]}}
        },
    )
    rows = runner.settings()["rows"]
    monkeypatch.setenv("MUJOCO_GL", "egl")  # a GPU machine's setting for videos; the comparison renders nothing
    order = [run[1:5] for run in compare.plan(rows, ["fake"], rounds=2, cuda=False)]
    assert order[:10] == [
        ("ours", "fake.py", "eager", "default"), ("ours", "fake.py", "compile", "default"),
        ("leanrl", "fake_compiled", "compile", 1), ("cleanrl", "fake", "eager", 1),
        ("jax", "leanrl/fake_jax", "jit", "default"), ("jax", "cleanrl/fake_jax", "jit", "default"),
        ("ours", "fake.py", "eager", 1), ("ours", "fake.py", "compile", 1), ("ours", "fake.py", "eager", 2),
        ("ours", "fake.py", "compile", 2),
    ]  # fmt: skip
    assert len(order) == 32 and order[16][0] == "jax" and order[20:22] == [order[1], order[0]]  # round 2 reversed
    cuda_order = compare.plan(rows, ["fake"], rounds=1, cuda=True)
    assert cuda_order[0][3] == "compile+cudagraphs" and ("jax", "cleanrl/fake_scan", "jit", 1, 1) in [
        run[1:] for run in cuda_order
    ]
    assert {run[4] for run in cuda_order if run[1] != "ours"} == {1}
    argv += ["--profile", "quick", "--rounds", "1", "--sides", "ours,leanrl,cleanrl"]
    monkeypatch.setattr(sys, "argv", argv + ["--budget-minutes", "0.001"])
    compare.main()
    assert "left for a later call" in capsys.readouterr().out and not (tmp_path / "results" / "runs.jsonl").exists()
    monkeypatch.setattr(sys, "argv", argv)
    compare.main()
    records = compare.load_runs(tmp_path / "results" / "runs.jsonl")
    assert [(r["side"], r["script"], r["mode"], r["threads"]) for r in records] == [
        run for run in order[:16] if run[0] != "jax"
    ]
    sps = {(r["side"], r["mode"], r["threads"]): r["sps"] for r in records}
    assert [
        sps["ours", "compile", 1],
        sps["ours", "eager", "default"],
        sps["leanrl", "compile", 2],
        sps["leanrl", "eager", 1],
    ] == [201, 102, 60, 30]
    assert sps["cleanrl", "eager", 1] == pytest.approx(40, rel=1e-3)
    assert all(
        r["commit"] == commits[r["side"]] and r["patches"] and r["script_path"].startswith(r["side"])
        for r in records[2:4]
    )
    assert (
        records[2]["command"]
        == f"OMP_NUM_THREADS=1 {PYTHON} leanrl/fake_compiled.py --learning-starts 200 --compile --seed 1"
    )
    lines = (tmp_path / "results" / "runs.jsonl").read_text().splitlines()
    (tmp_path / "results" / "runs.jsonl").write_text("\n".join(lines[:-2]) + "\n")  # cut off two runs before its end
    capsys.readouterr()
    compare.main()
    assert [line for line in capsys.readouterr().out.splitlines() if line.endswith(" SPS")] == [
        "fake leanrl fake eager 2 threads round 1: 30.0 SPS",
        "fake cleanrl fake eager 2 threads round 1: 40.0 SPS",
    ]  # only the two missing runs
    assert [compare.run_key(r) for r in compare.load_runs(tmp_path / "results" / "runs.jsonl")] == [
        compare.run_key(r) for r in records
    ]
    table = (tmp_path / "results" / "compare.md").read_text()
    assert (
        "| fake, its default env | 202 (compile, its default threads) | 60 (compile, 1 thread) | 40 (eager, 1 thread) "
        "| 3.37x | 5.05x |" in table
    )
    smoke = argv[:5] + ["--results", str(tmp_path / "smoke"), "--profile", "smoke", "--sides", "ours,jax"]
    monkeypatch.setattr(sys, "argv", smoke)
    monkeypatch.setattr(compare, "missing_jax", lambda python: "jax, flax")
    compare.main()
    assert "lacks jax, flax: the JAX scripts are left out" in capsys.readouterr().out
    monkeypatch.setattr(compare, "missing_jax", lambda python: "")
    compare.main()
    records = {r["script"]: r for r in compare.load_runs(tmp_path / "smoke" / "runs.jsonl")}
    assert list(records) == ["fake.py", "leanrl/fake_jax", "cleanrl/fake_jax"] and {
        r["round"] for r in records.values()
    } == {1}
    assert 300 < records["leanrl/fake_jax"]["sps"] <= 1000  # 100 steps a 0.1 s sleep: not its logged 7, nor the JIT
    assert (
        records["cleanrl/fake_jax"]["sps"] == pytest.approx(2000, rel=1e-3)
        and "XLA" not in records["cleanrl/fake_jax"]["command"]
    )
    table = (tmp_path / "smoke" / "compare.md").read_text()
    assert (
        "| 202 (compile, its default threads) | - | - | 2000 (CleanRL's fake_jax, its default threads) | - | - "
        "| 0.10x |" in table
    )
    assert "JIT compilation" in table and "They ran at XLA's default threads only" in table
    args = argparse.Namespace(profile="smoke", jax_python=sys.executable)
    one_thread = compare.run_one(
        args, {"cleanrl": str(tmp_path / "cleanrl")}, rows, ("fake", "jax", "cleanrl/fake_jax", "jit", 1, 1), limit=60
    )
    assert one_thread["sps"] == pytest.approx(500, rel=1e-3)
    assert one_thread["command"].startswith(f"OMP_NUM_THREADS=1 XLA_FLAGS='{compare.XLA_ONE_THREAD}' {PYTHON} cleanrl/")


FAKE_FASTTD3_TRAIN = """\
# stands in for FastTD3's train.py: its speed to wandb (env steps, as patched), 70 eager and 90 compiled; the module
# beside it that it imports by its name
import sys

import wandb
from fast_td3_utils import SPEED

assert sys.argv[sys.argv.index("--env_name") + 1] == "Pendulum-v1" and "--no_cuda" in sys.argv
for step in range(0, 1000, 100):
    wandb.log({"speed": SPEED["--compile" in sys.argv]}, step=step)
"""


def compare_without_then_with_the_clone(argv, side, clone, tmp_path, monkeypatch):
    """compare.main() run for ours and `side` without `side`'s clone (its runs left out), then with it: `side`'s one
    record."""
    argv = [*argv, "--profile", "quick", "--rounds", "1", "--sides", f"ours,{side}", "--headline"]
    monkeypatch.setattr(sys, "argv", argv)
    compare.main()
    assert not any(r["side"] == side for r in compare.load_runs(tmp_path / "results" / "runs.jsonl"))
    monkeypatch.setattr(sys, "argv", argv + [f"--{side.replace('_', '-')}", str(clone)])
    compare.main()
    (record,) = [r for r in compare.load_runs(tmp_path / "results" / "runs.jsonl") if r["side"] == side]
    return record


def test_the_comparison_runs_fasttd3s_train_py_with_our_settings_under_its_names(fake_sides, tmp_path, monkeypatch):
    """A row naming `fasttd3`: FastTD3's train.py (a fake clone) runs eager and compiled at one and two threads,
    its own module put beside it, our flags under its names; its SPS is the speed it logs; the table gets its column
    and ratio; without --fasttd3 its runs are left out."""
    commit = fake_repository(
        tmp_path / "fasttd3",
        {"fast_td3/train.py": FAKE_FASTTD3_TRAIN, "fast_td3/fast_td3_utils.py": "SPEED = {False: 70.0, True: 90.0}\n"},
        "FastTD3",
        monkeypatch,
    )
    monkeypatch.setitem(
        references.REFERENCE_REPOS, "FastTD3", ("fake/FastTD3", commit, "fast_td3", ["fast_td3/fast_td3_utils.py"])
    )
    monkeypatch.setitem(references.REFERENCE_PATCHES, "train", [])
    budget = ["--env-id", "Pendulum-v1", "--num-envs", "4", "--total-timesteps", "800", "--learning-starts", "200"]
    row = {"script": "fake.py", "fasttd3": "train", "quick": budget}
    monkeypatch.setattr(runner, "settings", lambda: {"rows": {"fake": row}})
    order = [run[1:5] for run in compare.plan(runner.settings()["rows"], ["fake"], rounds=1, cuda=False)]
    assert [run for run in order if run[0] == "fasttd3"] == [
        ("fasttd3", "train", "eager", 1), ("fasttd3", "train", "eager", 2),
        ("fasttd3", "train", "compile", 1), ("fasttd3", "train", "compile", 2),
    ]  # fmt: skip
    record = compare_without_then_with_the_clone(fake_sides[1], "fasttd3", tmp_path / "fasttd3", tmp_path, monkeypatch)
    assert record["sps"] == 70.0 and record["commit"] == commit and record["threads"] == 1
    words = record["command"].split()
    given = {word: words[i + 1] for i, word in enumerate(words[:-1]) if word.startswith("--")}
    assert (given["--num_envs"], given["--total_timesteps"], given["--learning_starts"]) == ("4", "200", "50")
    table = (tmp_path / "results" / "compare.md").read_text()
    assert "| FastTD3: best | ours / LeanRL | ours / CleanRL | ours / FastTD3 |" in table
    assert "| 202 (compile, its default threads) | - | - | 70 (eager, 1 thread) | - | - | 2.89x |" in table


FAKE_SB3_CONTRIB_DRIVER = """\
# stands in for the driver of SB3-contrib's CrossQ: the package put beside it imported, our flags taken, its
# returns and its SPS points to TensorBoard, 60 steps a second by the points' wall times
import argparse
import os

import sb3_contrib
from torch.utils.tensorboard import SummaryWriter

beside = os.path.join(os.path.dirname(__file__), "sb3_contrib")
assert sb3_contrib.PINNED and os.path.dirname(sb3_contrib.__file__) == beside
parser = argparse.ArgumentParser()
for flag in ("--env-id", "--total-timesteps", "--learning-starts", "--critic-hidden-dim", "--seed"):
    parser.add_argument(flag)
args = parser.parse_args()
assert args.env_id == "Pendulum-v1" and args.critic_hidden_dim == "64"
writer = SummaryWriter("runs/fake")
for step in range(100, int(args.total_timesteps) + 1, 100):
    writer.add_scalar("charts/SPS", 1.0, step, walltime=1e9 + step / 60)
    writer.add_scalar("charts/episodic_return", -step / 10 + int(args.seed), step)
writer.close()
"""


def test_sb3_contribs_class_runs_through_our_driver_in_the_comparison_and_the_learning_benchmark(
    fake_sides, tmp_path, monkeypatch
):
    """A row or task naming SB3-contrib: the driver (a stand-in here) runs beside its package, read from a (fake)
    clone at the pinned commit, with our flags and seed; the comparison runs it eager at one and two threads, its SPS
    from its points' wall times after learning starts, with its column and ratio, and leaves it out without
    --sb3-contrib; the learning benchmark keeps its curve as a record with the commit."""
    files = {"sb3_contrib/__init__.py": "PINNED = True\n", "sb3_contrib/crossq/__init__.py": ""}
    commit = fake_repository(tmp_path / "sb3", files, "SB3-contrib", monkeypatch)
    monkeypatch.setitem(references.REFERENCE_REPOS, "SB3-contrib", ("fake/SB3-contrib", commit, "", ["sb3_contrib"]))
    monkeypatch.setitem(references.DRIVERS["SB3-contrib"], "crossq", FAKE_SB3_CONTRIB_DRIVER)
    budget = ["--env-id", "Pendulum-v1", "--total-timesteps", "1000", "--learning-starts", "200"]
    row = {"script": "fake.py", "flags": ["--critic-hidden-dim", "64"], "sb3_contrib": "crossq", "quick": budget}
    task = {**row, "smoke": budget, "score": -50, "references": [["SB3-contrib", "crossq"]]}
    monkeypatch.setattr(runner, "settings", lambda: {"rows": {"fake": row}, "tasks": {"fake": task}})
    order = [run[1:5] for run in compare.plan(runner.settings()["rows"], ["fake"], rounds=1, cuda=False)]
    assert [run for run in order if run[0] == "sb3_contrib"] == [
        ("sb3_contrib", "crossq", "eager", 1), ("sb3_contrib", "crossq", "eager", 2)
    ]  # fmt: skip
    record = compare_without_then_with_the_clone(fake_sides[1], "sb3_contrib", tmp_path / "sb3", tmp_path, monkeypatch)
    assert record["sps"] == pytest.approx(60.0) and record["commit"] == commit and record["threads"] == 1
    assert record["script_path"] == "crossq.py" and "the driver in benchmarks/references.py" in record["patches"][0]
    table = (tmp_path / "results" / "compare.md").read_text()
    assert "| SB3-contrib: best | ours / LeanRL | ours / CleanRL | ours / SB3-contrib |" in table
    assert "| 202 (compile, its default threads) | - | - | 60 (eager, 1 thread) | - | - | 3.37x |" in table
    folder = tmp_path / "learning"
    clone, python = str(tmp_path / "sb3"), sys.executable
    learning.run_task("fake", 2, "smoke", str(folder), python, "SB3-contrib", clone, python)
    sb3 = json.loads((folder / "runs" / "fake__sb3-contrib__seed2.json").read_text())
    assert sb3["commit"] == commit and sb3["command"].split()[1:4] == ["crossq.py", "--critic-hidden-dim", "64"]
    assert sb3["steps_done"] == 1000 and sb3["episodes"] == 10 and sb3["final_return"] == -53.0  # -8 ... -98


def test_the_readme_speed_tables_are_the_results_files():
    """The README's comparison and learning tables are what `benchmarks/collect.py --readme` makes of the results
    files: a number typed by hand, or results that changed without the README, fail here."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    blocks = [(tag, body, collect.readme_block) for _, tag, body, _ in collect.README_BLOCK.findall(readme)]
    blocks += [(tag, body, collect.learning_block) for _, tag, body, _ in collect.LEARNING_BLOCK.findall(readme)]
    assert [tag for tag, _, _ in blocks] == ["nvidia-h200", "cpu-2core", "cpu-2core/compare-jax", "cpu-2core"]
    for tag, body, make in blocks:
        assert body == make(tag), f"README's {tag} table: run python benchmarks/collect.py --readme"


@pytest.mark.slow
def test_the_real_clones_patch_cleanly_and_their_dqn_runs_give_a_steady_sps():
    """The reference scripts as upstream wrote them, where clones are given (LEANRL_CLONE and CLEANRL_CLONE, and
    REFERENCE_PYTHON: a Python with stable-baselines3 and torchrl, else this one): every script settings.toml names,
    the JAX ones included, is read at its pinned commit, every patch finds its line and the result parses; then
    DQN's reference runs (LeanRL plain and compiled, CleanRL, and with JAX_PYTHON both dqn_jax.py) at the smoke
    budget each give a steady SPS, read the way compare.py reads it from the real logs."""
    import ast

    clones = {"LeanRL": os.environ.get("LEANRL_CLONE"), "CleanRL": os.environ.get("CLEANRL_CLONE")}
    for side, clone in clones.items():
        if not clone:
            pytest.skip(f"no clone of {side}: set {side.upper()}_CLONE to one (a plain git clone) to run this test")
        if problem := references.check_clone(side, clone):
            pytest.fail(problem)
    table = runner.settings()
    rows = table["rows"]
    named = [("LeanRL", name) for row in rows.values() for name in row.get("leanrl", [])]
    named += [("CleanRL", row["cleanrl"]) for row in rows.values() if "cleanrl" in row]
    named += [(side, name) for row in rows.values() for side, name, *_ in row.get("jax", [])]
    named += [
        (side.split("-")[0], name)
        for task in table["tasks"].values()
        for side, name in task.get("references", [])
        if side not in ("FastTD3", "SB3-contrib")  # their own tests below
    ]
    assert ("CleanRL", "ppo_atari_envpool_xla_jax_scan") in named and ("LeanRL", "dqn_jax") in named
    for side, name in set(named):
        _, text, reasons = references.reference_script(side, name, clones[side])
        assert ast.parse(text) and len(reasons) == 1 + len(references.REFERENCE_PATCHES.get(name, []))
    args = argparse.Namespace(profile="smoke", reference_python=os.environ.get("REFERENCE_PYTHON", sys.executable))
    args.jax_python = os.environ.get("JAX_PYTHON")
    runs = [
        ("leanrl", rows["dqn"]["leanrl"][0], "eager"),
        ("leanrl", rows["dqn"]["leanrl"][1], "compile"),
        ("cleanrl", "dqn", "eager"),
    ]
    # with JAX_PYTHON (a Python with requirements/requirements-jax.txt), both projects' dqn_jax.py as well
    runs += [("jax", f"{side.lower()}/{name}", "jit") for side, name in rows["dqn"]["jax"]] * bool(args.jax_python)
    for side, script, mode in runs:
        record = compare.run_one(
            args,
            {"leanrl": clones["LeanRL"], "cleanrl": clones["CleanRL"]},
            rows,
            ("dqn", side, script, mode, 1, 1),
            limit=600,
        )
        assert record["sps"] > 0 and record["commit"] in (references.REFERENCE_REPOS[side][1] for side in clones), (
            record
        )


def test_fast_td3s_settings_reach_fasttd3s_train_py_under_its_names():
    """Our flags as FastTD3's train.py takes them: the same names with underscores, its step counts per env, every
    flag whose default differs between the two given (its defaults for a gymnasium id are MuJoCo Playground's), each
    such default ours."""
    module = load_script("fast_td3.py")
    ours = module.Args()
    assert {name: str(getattr(ours, name)) for name in references.FASTTD3_OUR_DEFAULTS} == (
        references.FASTTD3_OUR_DEFAULTS
    )
    flags = ["--env-id", "HalfCheetah-v5", "--num-envs", "8", "--no-use-cdq", "--total-timesteps", "300000"]
    words = references.fasttd3_flags([*flags, "--batch-size", "1024", "--v-max", "-5"])
    assert words[words.index("--no_use_cdq") + 1].startswith("--")  # a switch, its own word
    words.remove("--no_use_cdq")
    given = dict(zip(words[::2], words[1::2]))
    assert given["--env_name"] == "HalfCheetah-v5" and given["--num_envs"] == "8" and given["--batch_size"] == "1024"
    assert given["--total_timesteps"] == "37500" and given["--learning_starts"] == "160"  # 300,000 and 1,280 over 8
    assert given["--v_min"] == "-2500.0" and given["--v_max"] == "-5" and given["--buffer_size"] == "51200"
    assert words[-2:] == ["--no_compile", "--no_cuda"] and "--no_cuda" not in references.fasttd3_flags(flags, True)


@pytest.mark.slow
def test_fasttd3s_train_py_patches_cleanly_and_runs_a_gymnasium_task(tmp_path):
    """FastTD3's own train.py, where a clone is given (FASTTD3_CLONE): read at its pinned commit, every patch finds
    its line; on Pendulum-v1 (episodes of 200 steps) with our settings under its names it trains, and the wandb
    stand-in keeps its speed in env steps and its episodes' running mean, at env steps."""
    clone = os.environ.get("FASTTD3_CLONE")
    if not clone:
        pytest.skip("no clone of FastTD3: set FASTTD3_CLONE to one (a plain git clone) to run this test")
    if problem := references.check_clone("FastTD3", clone):
        pytest.fail(problem)
    path, record = references.write_reference("FastTD3", "train", clone, str(tmp_path))
    assert len(record["patches"]) == 1 + len(references.REFERENCE_PATCHES["train"])
    flags = ["--env-id", "Pendulum-v1", "--num-envs", "4", "--total-timesteps", "1600", "--learning-starts", "400"]
    flags += ["--batch-size", "64", "--critic-hidden-dim", "64", "--actor-hidden-dim", "32", "--seed", "1"]
    env = {**os.environ, "MUJOCO_GL": "disable"}
    proc = subprocess.run(
        [sys.executable, path, *references.fasttd3_flags(flags)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "wandb_log.jsonl").read_text().splitlines()]
    returns = [row for row in rows if "episode_return" in row]
    speeds = [row for row in rows if "speed" in row]
    # each env's episode ends at its 200th step: 800 env steps, then 1,600
    assert [row["step"] for row in returns] == [800, 1600] and all(
        is_a_pendulum_return(row["episode_return"]) for row in returns
    )
    assert speeds and all(row["speed"] > 0 for row in speeds)


def test_sb3_contribs_crossq_runs_through_the_driver_with_our_settings(tmp_path):
    """SB3-contrib's CrossQ, where a clone is given (SB3_CONTRIB_CLONE) and stable-baselines3 is installed: its package
    read at the pinned commit; on Pendulum-v1 (episodes of 200 steps) the driver trains the class with every setting
    of ours as given, read back from the class, and logs each episode's return and its SPS to TensorBoard."""
    clone = os.environ.get("SB3_CONTRIB_CLONE")
    if not clone:
        pytest.skip("no clone of SB3-contrib: set SB3_CONTRIB_CLONE to one (a plain git clone) to run this test")
    pytest.importorskip("stable_baselines3", reason="SB3-contrib's CrossQ needs stable-baselines3")
    if problem := references.check_clone("SB3-contrib", clone):
        pytest.fail(problem)
    path, record = references.write_reference("SB3-contrib", "crossq", clone, str(tmp_path))
    assert record["commit"] == references.REFERENCE_REPOS["SB3-contrib"][1]
    flags = ["--env-id", "Pendulum-v1", "--total-timesteps", "600", "--learning-starts", "200", "--batch-size", "32"]
    flags += ["--critic-hidden-dim", "64", "--buffer-size", "1000", "--learning-rate", "3e-4", "--gamma", "0.98"]
    flags += ["--policy-delay", "2", "--batch-renorm-momentum", "0.02", "--batch-renorm-warmup", "300", "--seed", "3"]
    proc = subprocess.run([sys.executable, path, *flags], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ran = json.loads(proc.stdout.split("SB3-contrib CrossQ ran with ", 1)[1])
    assert ran == {
        "lr": 3e-4, "buffer": 1000, "starts": 200, "batch": 32, "gamma": 0.98, "delay": 2, "critic": [64, 64],
        "actor": [256, 256], "betas": [0.5, 0.999], "momentum": 0.02, "warmup": 300, "envs": 1,
    }  # fmt: skip
    logged = runner.Logs(str(tmp_path)).read()
    assert [step for step, _, _ in logged["charts/episodic_return"]] == [200, 400, 600]
    assert all(is_a_pendulum_return(value) for _, _, value in logged["charts/episodic_return"])
    assert [step for step, _, _ in logged["charts/SPS"]] == list(range(100, 601, 100))
