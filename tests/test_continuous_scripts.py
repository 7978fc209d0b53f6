"""SAC and TD3 as a user runs them: every speed mode, bad input, determinism, checkpoints, videos."""

import math
import os

import pytest
import torch

from checks import (
    PENDULUM_SCREEN,
    RECORD,
    SUMMARY_KEYS,
    assert_compiled_as_designed,
    assert_records_the_first_evaluation_game,
    assert_same_seed_same_numbers,
    assert_writes_cleanrls_tags,
    is_a_pendulum_return,
    modes_here,
)
from script_runs import run_script, shared_run

SCRIPTS = ["sac_continuous_action.py", "td3_continuous_action.py"]
# A small Pendulum run: 200 random steps, then 200 updates of which 5 are warm-up.
TINY = [
    "--env-id",
    "Pendulum-v1",
    "--total-timesteps",
    400,
    "--learning-starts",
    200,
    "--measure-burnin",
    5,
    "--batch-size",
    64,
    "--eval-episodes",
    2,
]
MODES = {
    "eager": [],
    "compile": ["--compile"],
    "cudagraphs": ["--cudagraphs"],
    "compile+cudagraphs": ["--compile", "--cudagraphs"],
}


def tiny_run(script):
    """The arguments of the script's one tiny run, its eager mode test's, which the checkpoint tests read too; SAC's
    records its first evaluation game for the video test (TD3 wraps its env in gymnasium's RecordVideo as SAC does,
    and a Pendulum video costs a run 3-5 s)."""
    return [*TINY, *(RECORD if script == "sac_continuous_action.py" else []), "--save-model"]


@pytest.mark.parametrize("mode", modes_here(MODES))
@pytest.mark.parametrize("script", SCRIPTS)
def test_every_mode_writes_a_valid_summary(script, mode, workdir):
    summary, proc = shared_run(script, tiny_run(script) if mode == "eager" else [*TINY, *MODES[mode], "--save-model"])
    assert SUMMARY_KEYS <= summary.keys()
    assert summary["script"] == script and summary["env_id"] == "Pendulum-v1" and summary["mode"] == mode
    assert summary["compile"] == ("compile" in mode)
    assert summary["cudagraphs_requested"] == ("cudagraphs" in mode)
    assert summary["cudagraphs_active"] is False and summary["device"] == "cpu"  # the test machines have no GPU
    assert os.path.basename(summary["run_dir"]).startswith(f"Pendulum-v1__{script[:-3]}__1__{mode}__")
    # The steady phase starts after learning_starts steps and measure_burnin updates.
    assert summary["steady_steps"] == 400 - 200 - 5
    assert summary["sps"] == pytest.approx(summary["steady_steps"] / summary["steady_seconds"])
    assert 0 <= summary["env_seconds"] < summary["steady_seconds"]
    assert summary["warmup_seconds"] + summary["steady_seconds"] <= summary["total_seconds"]
    assert summary["num_updates"] == 200
    assert is_a_pendulum_return(summary["return_mean"]) and is_a_pendulum_return(summary["eval_return_mean"])
    assert len(summary["eval_returns"]) == 2 and summary["peak_memory_mb"] > 0
    assert all(math.isfinite(value) for value in summary["final_metrics"].values())
    warnings = [line for line in proc.stderr.splitlines() if "--cudagraphs needs CUDA" in line]
    assert len(warnings) == ("cudagraphs" in mode)
    assert_compiled_as_designed(summary)


@pytest.mark.parametrize("script", SCRIPTS)
def test_same_seed_gives_identical_runs(script, workdir):
    # the thread count is pinned: by default it follows the cores idle at start, and it changes the rounding
    (first, _), _ = assert_same_seed_same_numbers(
        script, TINY + ["--torch-threads", 2], workdir, ["return_mean", "eval_returns", "final_metrics"]
    )
    other_seed, _ = run_script(script, TINY + ["--seed", 2], workdir)
    assert other_seed["eval_returns"] != first["eval_returns"]


def is_a_state_dict(state):
    return isinstance(state, dict) and state and all(isinstance(value, torch.Tensor) for value in state.values())


@pytest.mark.parametrize("script", SCRIPTS)
def test_checkpoint_reloads_to_the_same_policy_and_continues(script, workdir):
    trained, _ = shared_run(script, tiny_run(script))
    checkpoint = os.path.join(trained["run_dir"], "model.pt")
    assert os.path.isfile(checkpoint) and not os.path.exists(checkpoint + ".tmp")
    evaluated, _ = run_script(
        script,
        ["--env-id", "Pendulum-v1", "--total-timesteps", 0, "--eval-episodes", 2, "--load-model", checkpoint]
        + ["--save-model"],
        workdir,
    )
    assert evaluated["eval_returns"] == trained["eval_returns"]  # same weights, same evaluation seed
    assert evaluated["num_updates"] == 0 and evaluated["sps"] is None
    again = os.path.join(evaluated["run_dir"], "model.pt")
    saved, saved_again = (torch.load(path, weights_only=True) for path in (checkpoint, again))
    weights = [name for name, state in saved.items() if isinstance(state, torch.Tensor) or is_a_state_dict(state)]
    assert weights and saved.keys() == saved_again.keys()
    for name in weights:  # the networks and SAC's log_alpha (a tensor state) came back as they were saved
        torch.testing.assert_close(saved[name], saved_again[name], rtol=0, atol=0)
    if script == "sac_continuous_action.py":
        assert "log_alpha" in weights and math.isclose(saved["log_alpha"].exp().item(), trained["alpha"], rel_tol=1e-6)
    continued, _ = run_script(script, TINY + ["--load-model", checkpoint], workdir)
    assert continued["num_updates"] == 200
    assert continued["eval_returns"] != trained["eval_returns"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_several_envs_step_together(script, workdir):
    args = TINY[:2] + [
        "--num-envs",
        3,
        "--total-timesteps",
        600,
        "--learning-starts",
        300,
        "--measure-burnin",
        5,
        "--batch-size",
        64,
        "--eval-episodes",
        2,
    ]
    summary, _ = run_script(script, args, workdir)
    assert summary["num_envs"] == 3
    assert summary["num_updates"] == 100  # one update per vector step once 300 env steps are in the buffer
    assert summary["steady_steps"] == 600 - 3 * 105  # the steady phase starts at the step of update 5
    assert is_a_pendulum_return(summary["return_mean"])  # the three envs' episodes ended (truncated) together


# Each continuous script's shortest run: SAC and TD3 as TINY, PPO 4 iterations of 64 steps.
DM_CONTROL = {
    "sac_continuous_action.py": ["--total-timesteps", 400, "--learning-starts", 200, "--batch-size", 64],
    "td3_continuous_action.py": ["--total-timesteps", 400, "--learning-starts", 200, "--batch-size", 64],
    "ppo_continuous_action.py": ["--total-timesteps", 256, "--num-steps", 64, "--num-minibatches", 4],
}


@pytest.mark.parametrize("script", DM_CONTROL)
def test_a_dm_control_task_trains_through_shimmy_as_cleanrls_do(script, workdir):
    """dm_control's tasks hand out named observations (a dict), flattened into one vector as CleanRL's PPO does; the
    run folder is one folder despite the id's slash."""
    pytest.importorskip("shimmy")
    pytest.importorskip("dm_control")
    task = "dm_control/cartpole-balance-v0"
    summary, _ = run_script(script, ["--env-id", task, *DM_CONTROL[script], "--eval-episodes", 1], workdir)
    # no training episode ends this soon (1000 steps each); the evaluation plays one: a reward in [0, 1] a step
    assert summary["env_id"] == task and 0 < summary["eval_return_mean"] <= 1000
    assert [name.split("__")[0] for name in os.listdir(os.path.join(workdir, "runs"))] == [
        "dm_control-cartpole-balance-v0"
    ]


@pytest.mark.parametrize("autotune, alpha_changes", [(["--no-autotune", "--alpha", 0.1], False), ([], True)])
def test_sac_entropy_coefficient_fixed_or_autotuned(autotune, alpha_changes, workdir):
    summary, _ = run_script("sac_continuous_action.py", TINY + autotune, workdir)
    assert ("alpha_loss" in summary["final_metrics"]) == alpha_changes
    if alpha_changes:  # from 1.0, as CleanRL's: 200 Adam steps of 1e-3 on log alpha cannot take it near 0.2
        assert 0.5 < summary["alpha"] < 2.0 and summary["alpha"] != pytest.approx(1.0, abs=1e-4)
    else:
        assert summary["alpha"] == pytest.approx(0.1)


def test_capture_video_records_the_first_evaluation_game():
    summary, _ = shared_run("sac_continuous_action.py", tiny_run("sac_continuous_action.py"))
    assert_records_the_first_evaluation_game(summary, PENDULUM_SCREEN)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_tag_of_cleanrls_script_is_written(script):
    assert_writes_cleanrls_tags(shared_run(script, tiny_run(script))[0])


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize(
    "args, message",
    [
        (["--env-id", "CartPole-v1"], "continuous (Box) actions"),
        (["--env-id", "NoSuchEnv-v0"], "unknown env id 'NoSuchEnv-v0'"),
        (["--env-id", "tests.image_env:ImageObs-v0"], "needs a flat (1-D Box) one"),
        (["--env-id", "tests.image_env:MovedAway-v0"], "moved to another package"),
        (["--env-id", "tests.image_env:Broken-v0"], "the ROM of this game is missing"),
        (["--total-timesteps", 0], "--total-timesteps must be positive"),
        (["--total-timesteps", -10], "--total-timesteps must be positive"),
        (["--num-envs", 0], "--num-envs must be positive"),
        (["--load-model", "missing.pt"], "no checkpoint at missing.pt"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_code_2(script, args, message, workdir):
    _, proc = run_script(script, ["--env-id", "Pendulum-v1"] + args, workdir, check=False, timeout=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr
    assert not os.path.exists(os.path.join(workdir, "runs"))


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_checkpoint_from_another_env_is_refused(script, workdir):
    trained, _ = shared_run(script, tiny_run(script))
    _, proc = run_script(
        script,
        [
            "--env-id",
            "MountainCarContinuous-v0",
            "--total-timesteps",
            0,
            "--load-model",
            os.path.join(trained["run_dir"], "model.pt"),
        ],
        workdir,
        check=False,
    )
    assert proc.returncode == 2 and "was trained on Pendulum-v1" in proc.stderr
