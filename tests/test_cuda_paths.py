"""What only CUDA does, imitated on this CPU (tests/cuda_imitation.py), where no test would see it otherwise: every
acting view follows its learner after updates, an LSTM's too (cuDNN copies an LSTM's weights into a flat buffer of
its own when they change); a checkpoint loaded onto the device (where .numpy() fails); no copy from pageable memory
that makes the host wait in the scripts whose update loop sends host data (PPO-LSTM's segment plans, IMPALA's replay
indices, DQN's staged replay rows). A continued run trains with the flags it was given, not with the optimizer
settings its checkpoint was saved with. The `cuda` tier (tests/test_cuda.py) checks the same on a GPU."""

import json
import os

import pytest
import torch

from script_runs import ROOT, SCRIPTS, run_script

IMITATION = os.path.join(ROOT, "tests", "cuda_imitation.py")
ATARI = ["--total-timesteps", 512, "--num-envs", 4, "--num-steps", 32, "--num-minibatches", 2, "--update-epochs", 1]
PENDULUM = ["--env-id", "Pendulum-v1", "--total-timesteps", 300, "--learning-starts", 200, "--batch-size", 32]
CARTPOLE = ["--env-id", "CartPole-v1", "--total-timesteps", 1000, "--learning-starts", 500, "--buffer-size", 1000]
PQN = ["--env-id", "CartPole-v1", "--total-timesteps", 512, "--num-steps", 32, "--num-minibatches", 2]
IMPALA = ["--env-id", "CartPole-v1", "--total-timesteps", 1280, "--num-actors", 1, "--envs-per-actor", 4]
IMPALA += ["--batch-size", 8, "--unroll-length", 8, "--replay-ratio", 0.5, "--lstm"]
# script: its flags, and its acting views by the names of the script's globals (view: learner). IMPALA's actors act
# with copies the learner sends them: it has no view, and is here for its copies.
RUNS = {
    "dqn.py": (CARTPOLE, {"q_view": "q_network"}),
    "dqn_atari.py": (
        ["--total-timesteps", 300, "--learning-starts", 200, "--buffer-size", 400, "--num-envs", 2],
        {"q_view": "q_network"},
    ),
    "rainbow_atari.py": (
        ["--total-timesteps", 300, "--learning-starts", 200, "--buffer-size", 400, "--num-envs", 2],
        {"q_view": "q_network"},
    ),
    # the actor process acts with a shared CPU copy, written after every update with --actor-sync-every 1
    "dqn_atari_async.py": ([*CARTPOLE, "--batch-size", 64, "--actor-sync-every", 1], {"actor.q_network": "q_network"}),
    "sac_continuous_action.py": (PENDULUM, {"actor_view": "actor", "qnet_view": "qnet"}),
    # TD3's actor reads the first critic alone
    "td3_continuous_action.py": (PENDULUM, {"actor_view": "actor", "qnet_view": "qnet.members.0"}),
    "fast_td3.py": (
        [*PENDULUM, "--num-envs", 4, "--critic-hidden-dim", 64, "--actor-hidden-dim", 32],
        {"actor_view": "actor", "qnet_view": "qnet"},
    ),
    "ppo_continuous_action.py": (
        ["--env-id", "Pendulum-v1", "--total-timesteps", 256, "--num-steps", 64, "--num-minibatches", 2],
        {"agent_view": "agent"},
    ),
    "ppo_atari_envpool.py": (ATARI, {"agent_view": "agent"}),
    "ppo_atari_envpool_async.py": (ATARI, {"agent_view": "agent"}),
    "ppo_atari_lstm.py": (ATARI, {"agent_view": "agent"}),
    "ppo_atari_lstm.py --lstm-impl loop": ([*ATARI, "--lstm-impl", "loop"], {"agent_view": "agent"}),
    "ppo_atari_multigpu.py": (
        ["--total-timesteps", 512, "--local-num-envs", 4, "--num-steps", 32, "--num-minibatches", 2],
        {"agent_view": "agent"},
    ),
    "pqn.py": (PQN, {"q_view": "q_network"}),
    "pqn_atari_envpool.py": (ATARI, {"q_view": "q_network"}),
    "impala_ray.py --lstm": (IMPALA, {}),
}
# The others send host data once per env step, right after reading the actions back (the stream is idle then), and
# in their evaluation: a blocking copy there waits for nothing.
NO_BLOCKING_COPIES = {
    "dqn.py",
    "pqn.py",
    "ppo_atari_lstm.py",
    "ppo_atari_lstm.py --lstm-impl loop",
    "impala_ray.py --lstm",
}


def imitated_run(script, args, workdir, views=None, check=True):
    """`script` run under the imitation; returns its log and the completed process."""
    log = os.path.join(workdir, "imitation.json")
    env = {"CUDA_IMITATION_LOG": log, "CUDA_IMITATION_VIEWS": ",".join(f"{v}={k}" for v, k in (views or {}).items())}
    _, proc = run_script(IMITATION, [os.path.join(SCRIPTS, script), *args], workdir, check=False, env=env)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    with open(log) as f:
        return json.load(f), proc


@pytest.mark.parametrize("run", RUNS)
def test_acting_views_follow_the_learner_and_the_update_loop_never_waits_on_a_copy(run, workdir):
    flags, views = RUNS[run]
    script = run.split(" ")[0]
    log, _ = imitated_run(script, [*flags, "--eval-episodes", 1], workdir, views)
    for view in views:  # the learner trained, and the view holds its weights, an LSTM's flat weights included
        seen = log["views"][view]
        assert seen["equal"] and seen["learner_changed"] and seen["compared"] > 0, seen
    if run in NO_BLOCKING_COPIES:
        assert log["copies"] == []


def test_the_imitation_sees_a_stale_lstm_view_and_a_blocking_copy(tmp_path):
    """The imitation itself: a view of an LSTM made as the scripts made theirs, whose first forward gives it weights of
    its own, so that it no longer follows its learner; a plain copy of a numpy array to the device."""
    piece = tmp_path / "piece.py"
    piece.write_text(
        "import numpy as np, torch\n"
        "from tensordict import from_module\n"
        "lstm, view = torch.nn.LSTM(3, 2), torch.nn.LSTM(3, 2).to('meta')\n"
        "from_module(lstm).data.to_module(view)\n"
        "view(torch.zeros(1, 1, 3))\n"
        "with torch.no_grad():\n"
        "    lstm.weight_hh_l0.add_(1.0)\n"
        "pinned = torch.from_numpy(np.zeros(3)).pin_memory().to(torch.device('cpu'))\n"
        "pageable = torch.from_numpy(np.zeros(3)).to(torch.device('cpu'))\n"
        "asked = torch.from_numpy(np.zeros(3)).to(torch.device('cpu'), non_blocking=True)\n"
    )
    log, _ = imitated_run(str(piece), [], tmp_path, views={"view": "lstm"})
    assert log["copies"] == ["piece.py:9"]
    assert log["views"]["view"]["equal"] is False and log["views"]["view"]["compared"] == 8  # 4 weights, 4 flat


def test_a_checkpoint_loaded_onto_the_device_restores_the_observation_statistics(workdir):
    """PPO continuous's normalizer statistics come from the checkpoint, loaded onto the run's device: on a GPU their
    .numpy() fails. Loaded as a GPU run loads them, the evaluation is the one a plain load gives."""
    args = ["--env-id", "Pendulum-v1", "--num-steps", 64, "--num-minibatches", 2, "--update-epochs", 1]
    trained, _ = run_script("ppo_continuous_action.py", [*args, "--total-timesteps", 256, "--save-model"], workdir)
    evaluate = [*args, "--total-timesteps", 0, "--eval-episodes", 2]
    evaluate += ["--load-model", os.path.join(trained["run_dir"], "model.pt")]
    plain, _ = run_script("ppo_continuous_action.py", evaluate, workdir)
    _, proc = imitated_run("ppo_continuous_action.py", evaluate, workdir)
    imitated = json.loads(proc.stdout.strip().splitlines()[-1][len("SPEED ") :])
    assert imitated["eval_returns"] == plain["eval_returns"] and len(plain["eval_returns"]) == 2


@pytest.mark.parametrize(
    "script, args",
    [
        ("dqn.py", ["--total-timesteps", 1500, "--learning-starts", 500, "--buffer-size", 1000]),
        ("ppo_continuous_action.py", ["--env-id", "Pendulum-v1", "--total-timesteps", 256, "--num-steps", 64]),
    ],
)
def test_a_continued_run_trains_at_its_own_learning_rate(script, args, workdir):
    """Continued from one checkpoint with two learning rates, two runs train differently: the optimizer's state
    comes from the checkpoint, its settings (the learning rate tensor the schedule writes into) from the flags."""
    trained, _ = run_script(script, [*args, "--save-model", "--eval-episodes", 0], workdir)
    checkpoint = os.path.join(trained["run_dir"], "model.pt")
    continued = [
        run_script(script, [*args, "--load-model", checkpoint, "--learning-rate", lr, "--save-model"], workdir)[0]
        for lr in (3e-4, 3e-2)
    ]
    weights = [torch.load(os.path.join(run["run_dir"], "model.pt"), weights_only=True) for run in continued]
    name = "q_network" if script == "dqn.py" else "agent"
    assert any(not torch.equal(weights[0][name][key], weights[1][name][key]) for key in weights[0][name])
    # the rate each run trained at to its end: the flag's (PPO's annealed to its last iteration, 1/4 of it)
    last = [w["optimizer"]["param_groups"][0]["lr"].item() for w in weights]
    assert last == pytest.approx([3e-4, 3e-2] if script == "dqn.py" else [3e-4 / 4, 3e-2 / 4])
