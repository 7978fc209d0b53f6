"""No host sync in the pieces a script compiles: each script runs a few updates with torch.compile replaced by a
probe (tests/host_sync_probe.py) that records every call making the host wait for the device on CUDA. On a GPU
such a call stalls the stream every step and cannot be captured in a CUDA graph; on this CPU it costs nothing,
so only a test finds it."""

import json
import os

import pytest

from script_runs import ROOT, SCRIPTS, run_script

PROBE = os.path.join(ROOT, "tests", "host_sync_probe.py")
ATARI = ["--total-timesteps", 256, "--num-envs", 4, "--num-steps", 32, "--num-minibatches", 2, "--update-epochs", 1]
CASES = {
    "sac_continuous_action.py": (
        ["--env-id", "Pendulum-v1", "--total-timesteps", 300, "--learning-starts", 200, "--batch-size", 32],
        {"policy", "critic_loss", "actor_loss", "update_critics", "update_actor"},
    ),
    "td3_continuous_action.py": (
        ["--env-id", "Pendulum-v1", "--total-timesteps", 300, "--learning-starts", 200, "--batch-size", 32],
        {"policy", "critic_loss", "actor_loss", "update_critics", "update_actor"},
    ),
    "fast_td3.py": (
        ["--env-id", "Pendulum-v1", "--num-envs", 4, "--total-timesteps", 300, "--learning-starts", 200]
        + ["--batch-size", 32, "--critic-hidden-dim", 64, "--actor-hidden-dim", 32],
        {"explore", "critic_loss", "actor_loss", "update_critics", "update_actor"},
    ),
    "ppo_continuous_action.py": (
        [
            "--env-id",
            "Pendulum-v1",
            "--total-timesteps",
            128,
            "--num-steps",
            64,
            "--num-minibatches",
            2,
            "--update-epochs",
            1,
        ],
        {"policy", "gae", "ppo_loss", "update"},
    ),
    "ppo_atari_envpool.py": (ATARI, {"policy", "gae", "ppo_loss", "update"}),
    "ppo_atari_envpool_async.py": (ATARI, {"policy", "gae", "ppo_loss", "update"}),
    "ppo_atari_lstm.py": (ATARI, {"policy", "gae", "ppo_loss", "update"}),
    "pqn.py": (
        ["--total-timesteps", 256, "--num-steps", 32, "--num-minibatches", 2, "--update-epochs", 1],
        {"policy", "q_lambda_returns", "td_loss", "update"},
    ),
    "pqn_atari_envpool.py": (ATARI, {"policy", "q_lambda_returns", "td_loss", "update"}),
    "dqn.py": (
        ["--total-timesteps", 700, "--learning-starts", 500, "--buffer-size", 1000],
        {"policy", "td_loss", "update"},
    ),
    "dqn_atari.py": (
        ["--total-timesteps", 300, "--learning-starts", 200, "--buffer-size", 400, "--num-envs", 2, "--start-e", 0.5],
        {"policy", "td_loss", "update"},
    ),
    "rainbow_atari.py": (
        ["--total-timesteps", 300, "--learning-starts", 200, "--buffer-size", 400, "--num-envs", 2],
        {"policy", "rainbow_loss", "sample", "update"},
    ),
    # the learner compiles its loss only: the actor process acts eagerly
    "dqn_atari_async.py": (
        [
            "--env-id",
            "CartPole-v1",
            "--total-timesteps",
            700,
            "--learning-starts",
            500,
            "--buffer-size",
            1000,
            "--batch-size",
            64,
        ],
        {"td_loss", "update"},
    ),
    "impala_ray.py": (
        [
            "--env-id",
            "CartPole-v1",
            "--total-timesteps",
            640,
            "--num-actors",
            1,
            "--envs-per-actor",
            4,
            "--batch-size",
            8,
            "--unroll-length",
            8,
            "--replay-ratio",
            0.5,
        ],
        {"impala_loss", "update"},
    ),
}


@pytest.mark.parametrize("script", CASES)
def test_compiled_pieces_make_no_host_sync(script, tmp_path):
    flags, pieces = CASES[script]
    log = tmp_path / "syncs.json"
    env = {"HOST_SYNC_LOG": str(log), "HOST_SYNC_PIECES": ",".join(sorted(pieces))}
    _, proc = run_script(
        PROBE,
        [os.path.join(SCRIPTS, script), *flags, "--compile", "--eval-episodes", 0],
        tmp_path,
        check=False,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    calls = json.loads(log.read_text())
    assert set(calls) == pieces  # every piece ran under the probe: those handed to torch.compile and the updates
    assert calls == {piece: [] for piece in pieces}


def test_the_probe_finds_host_syncs(tmp_path):
    """The probe itself: a piece that reads a value, branches on a tensor, copies to the host and masks by value."""
    piece = tmp_path / "piece.py"
    piece.write_text(
        "import torch\n"
        "def update(x):\n"
        "    total = x.sum().item()\n"
        "    if x.max() > 0:\n"
        "        x = x.cpu()\n"
        "    return x[x > 0], total\n"
        "torch.compile(update)(torch.arange(-2.0, 3.0))\n"
    )
    log = tmp_path / "syncs.json"
    assert run_script(PROBE, [piece], tmp_path, check=False, env={"HOST_SYNC_LOG": str(log)})[1].returncode == 0
    found = [call.split(" at ")[0] for call in json.loads(log.read_text())["update"]]
    assert found == ["item", "__bool__", "cpu", "__getitem__"]


def test_the_probe_also_watches_the_pieces_a_script_leaves_eager(tmp_path):
    """The updates around the compiled losses are eager; named in HOST_SYNC_PIECES, they are probed all the same."""
    piece = tmp_path / "piece.py"
    piece.write_text(
        "import torch\n"
        "def policy(x):\n"
        "    return x.sum().item()\n"
        "def update(x):\n"
        "    return x.cpu()\n"
        "policy(torch.ones(3))\n"
        "torch.compile(update)(torch.ones(3))\n"
    )
    log = tmp_path / "syncs.json"
    env = {"HOST_SYNC_LOG": str(log), "HOST_SYNC_PIECES": "policy,update"}
    assert run_script(PROBE, [piece], tmp_path, check=False, env=env)[1].returncode == 0
    found = {name: [call.split(" at ")[0] for call in found] for name, found in json.loads(log.read_text()).items()}
    assert found == {"policy": ["item"], "update": ["cpu"]}  # update: once, though compiled and named
