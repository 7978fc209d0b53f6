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

from script_runs import IMITATED_RUNS, NO_BLOCKING_COPIES, RESUMED_RUNS, imitated_run, resumed_imitated_run, run_script


@pytest.mark.parametrize("run", IMITATED_RUNS)
def test_acting_views_follow_the_learner_and_the_update_loop_never_waits_on_a_copy(run, workdir):
    flags, views = IMITATED_RUNS[run]
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


@pytest.mark.parametrize("run", RESUMED_RUNS)
def test_a_run_resumed_onto_the_device_goes_on_and_its_views_follow_the_learner(run, workdir):
    """--resume loads the snapshot onto the run's device (where a loaded tensor's .numpy() fails) and restores each
    state in place: the acting views, bound to the learner's tensors, follow it still (an LSTM's flat weights too), and
    the resumed run trains to its new end, writing its model and its next snapshot."""
    resumed_imitated_run(run, workdir)
