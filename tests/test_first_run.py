"""A newcomer's first commands: --help before the extras are installed, a run that needs a missing extra, a
mistyped flag, CleanRL's Atari ids, and run.sh's usage."""

import os
import subprocess

import pytest

from script_runs import ALL_SCRIPTS, ROOT, run_script

# script -> (a run that needs the extra, the modules hidden, the install line it must name)
NEEDS_EXTRA = {
    "ppo_atari_envpool.py": ([], ["envpool"], 'pip install ".[envpool]"'),
    "ppo_atari_envpool_async.py": ([], ["envpool"], 'pip install ".[envpool]"'),
    "ppo_atari_lstm.py": ([], ["envpool"], 'pip install ".[envpool]"'),
    "dqn_atari.py": ([], ["envpool"], 'pip install ".[envpool]"'),
    "dqn_atari_async.py": ([], ["envpool"], 'pip install ".[envpool]"'),
    "pqn_atari_envpool.py": ([], ["envpool"], 'pip install ".[envpool]"'),
    "rainbow_atari.py": ([], ["envpool"], 'pip install ".[envpool]"'),
    "impala_ray.py": ([], ["ray"], 'pip install ".[ray]"'),
}


def without(modules, tmp_path):
    """An environment whose imports of `modules` fail as if they were not installed."""
    for module in modules:
        (tmp_path / f"{module}.py").write_text(f"raise ModuleNotFoundError('hidden by the test', name={module!r})\n")
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT])}


def run(script, args, cwd, env):
    return run_script(script, args, cwd, check=False, timeout=300, env=env)[1]


@pytest.mark.parametrize("script", NEEDS_EXTRA)
def test_help_works_without_the_extras_and_a_run_names_the_install(script, tmp_path):
    run_args, hidden, install = NEEDS_EXTRA[script]
    env = without(["envpool", "ray", "cv2", "ale_py"], tmp_path)
    proc = run(script, ["--help"], tmp_path, env)
    assert proc.returncode == 0 and "usage:" in proc.stdout and "--total-timesteps" in proc.stdout, proc.stderr[-2000:]

    (tmp_path / "hidden").mkdir()  # this time only the script's own extra is missing
    proc = run(script, run_args, tmp_path, without(hidden, tmp_path / "hidden"))
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and install in lines[0], (
        proc.stderr[-2000:]
    )
    assert not os.path.exists(tmp_path / "runs")


def test_the_gymnasium_back_end_names_the_atari_extra(tmp_path):
    proc = run("dqn_atari.py", ["--env-backend", "gymnasium"], tmp_path, without(["ale_py"], tmp_path))
    assert proc.returncode == 2 and proc.stderr.strip() == (
        'error: the gymnasium back-end needs ale-py and OpenCV: pip install ".[atari]"'
    ), proc.stderr[-2000:]


@pytest.mark.parametrize("script", ["sac_continuous_action.py", "td3_continuous_action.py", "ppo_continuous_action.py"])
def test_a_dm_control_task_without_shimmy_names_the_extra(script, tmp_path):
    proc = run(script, ["--env-id", "dm_control/cartpole-balance-v0"], tmp_path, without(["shimmy"], tmp_path))
    assert proc.returncode == 2 and proc.stderr.strip() == (
        'error: dm_control tasks need shimmy and dm_control: pip install ".[dm-control]"'
    ), proc.stderr[-2000:]


@pytest.mark.parametrize("script", ALL_SCRIPTS)
def test_a_mistyped_flag_exits_2_with_a_hint(script, tmp_path):
    _, proc = run_script(script, ["--num_env", 4], tmp_path, check=False, timeout=300)
    assert proc.returncode == 2 and "Unrecognized options: --num_env" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


PPO_TINY = ["--total-timesteps", 128, "--num-envs", 4, "--num-steps", 32, "--num-minibatches", 2, "--update-epochs", 1]
DQN_TINY = ["--total-timesteps", 300, "--learning-starts", 200, "--buffer-size", 300, "--batch-size", 32]


@pytest.mark.parametrize(
    "script, args",
    [
        ("ppo_atari_envpool.py", PPO_TINY),
        ("ppo_atari_envpool_async.py", PPO_TINY),
        ("ppo_atari_lstm.py", PPO_TINY),
        ("dqn_atari.py", DQN_TINY),
        ("dqn_atari.py", [*DQN_TINY, "--env-backend", "gymnasium"]),
        ("dqn_atari_async.py", DQN_TINY),
        ("pqn_atari_envpool.py", PPO_TINY),
        ("rainbow_atari.py", DQN_TINY),
    ],
)
def test_cleanrls_atari_id_runs_as_the_v5_id_of_the_same_game(script, args, tmp_path):
    """CleanRL's Atari scripts name games by gymnasium's NoFrameskip-v4 ids, whose settings (no sticky actions, frame
    skip left to the wrappers, 108,000 frames at most) are those of the v5 ids here: the run plays that game, and its
    summary and folder name the id it ran."""
    summary, _ = run_script(script, ["--env-id", "BreakoutNoFrameskip-v4", *args, "--eval-episodes", 0], tmp_path)
    assert summary["env_id"] == "Breakout-v5" and summary["steps_done"] >= args[1]
    assert [name.split("__")[0] for name in os.listdir(tmp_path / "runs")] == ["Breakout-v5"]


def run_sh(*args, cwd=ROOT):
    return subprocess.run(
        ["bash", os.path.join(ROOT, "run.sh"), *args], cwd=cwd, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_run_sh_help_prints_its_usage(flag):
    proc = run_sh(flag)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: ./run.sh") and "--results" in proc.stdout


@pytest.mark.parametrize(
    "args", [["some_folder"], ["--fast"], ["--results"], ["--rounds", "2"], ["--compare", "--learning"]]
)
def test_run_sh_refuses_what_it_does_not_know_before_any_work(args, tmp_path):
    proc = run_sh(*args, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "usage: ./run.sh" in proc.stderr
    assert os.listdir(tmp_path) == []
