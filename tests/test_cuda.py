"""The `cuda` tier's runs: what only a GPU shows, skipped without CUDA (docs/contributing.md: the tier, its command on a
lent GPU, and when to run it; the pieces' equivalence tests in the algorithms' test files are in it too). Every
script in its four modes at tiny budgets, its pieces captured and replayed; the acting views equal to their learners
after updates, with cuDNN's own LSTM, and after a resume with graphs captured; a run continued with --cudagraphs from
an eager run's checkpoint; a checkpoint saved on the GPU loaded on a CPU and back; no host sync inside the pieces
that CUDA graphs capture."""

import json
import math
import os

import pytest
import torch

from checks import assert_compiled_as_designed
from script_runs import (
    IMITATED_RUNS,
    NO_BLOCKING_COPIES,
    PROBE,
    PROBED_RUNS,
    RESUMED_RUNS,
    SCRIPTS,
    imitated_run,
    load_script,
    resumed_imitated_run,
    run_script,
)

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
MODES = {"eager": [], "compile": ["--compile"], "cudagraphs": ["--cudagraphs"]}
MODES["compile+cudagraphs"] = ["--compile", "--cudagraphs"]
# IMITATED_RUNS's budgets, every piece called more than CudaGraphModule's 5 warm-up calls (PPO's GAE: once an iteration)
LONGER = {"ppo_continuous_action.py": ["--total-timesteps", 512]}
LONGER.update({run: ["--total-timesteps", 1024] for run in IMITATED_RUNS if run.startswith(("ppo_atari", "pqn"))})


@pytest.fixture(autouse=True)
def fresh_interpreters(monkeypatch):
    """Each run in an interpreter of its own: a process forked from the script server must not use CUDA."""
    monkeypatch.setenv("LEANRL_TESTS_FRESH", "1")


def flags_of(run):
    script = run.split(" ")[0]
    return script, [*IMITATED_RUNS[run][0], *LONGER.get(run, []), "--eval-episodes", 1]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("run", [run for run in IMITATED_RUNS if "--lstm-impl" not in run])
def test_every_script_runs_in_its_four_modes_on_the_gpu(run, mode, workdir):
    script, flags = flags_of(run)
    summary, proc = run_script(script, [*flags, *MODES[mode]], workdir)
    assert summary["device"].startswith("cuda") and summary["cudagraphs_active"] == ("cudagraphs" in mode)
    assert summary["steps_done"] == summary["total_timesteps"] and summary["peak_cuda_memory_mb"] > 0
    # the last update's losses, read back from the GPU into the summary: there, and finite
    assert summary["final_metrics"] and all(math.isfinite(value) for value in summary["final_metrics"].values())
    assert_compiled_as_designed(summary, " --lstm" if "--lstm" in flags else "")
    assert "--cudagraphs needs CUDA" not in proc.stderr


@pytest.mark.parametrize("run", IMITATED_RUNS)
def test_acting_views_follow_the_learner_on_the_gpu(run, workdir):
    """tests/cuda_imitation.py on the GPU: cuDNN flattens the LSTM's weights itself; with CUDA graphs captured."""
    script, flags = flags_of(run)
    log, _ = imitated_run(script, [*flags, "--compile", "--cudagraphs"], workdir, IMITATED_RUNS[run][1])
    for view in IMITATED_RUNS[run][1]:
        seen = log["views"][view]
        assert seen["equal"] and seen["learner_changed"] and seen["compared"] > 0, seen
    if run in NO_BLOCKING_COPIES:
        assert log["copies"] == []


@pytest.mark.parametrize("run", RESUMED_RUNS)
def test_a_run_resumed_on_the_gpu_goes_on_with_graphs_and_its_views_follow_the_learner(run, workdir):
    """An eager run's snapshot resumed on the GPU with --compile --cudagraphs: its loop's tensors on the device, the
    graphs captured over the states restored in place (cuDNN's LSTM weights flattened anew), its views following."""
    resumed_imitated_run(run, workdir, ["--compile", "--cudagraphs"])


@pytest.mark.parametrize("script", ["dqn.py", "sac_continuous_action.py", "ppo_continuous_action.py", "pqn.py"])
def test_an_eager_checkpoint_continues_with_cudagraphs_and_moves_between_devices(script, workdir):
    """Trained eagerly on the GPU (its Adam not capturable), continued with --cudagraphs (the script's capturable
    setting, not the checkpoint's); loaded on a CPU and saved, then loaded on the GPU again: the same weights."""
    script, flags = flags_of(script)
    trained, _ = run_script(script, [*flags, "--save-model"], workdir)
    model = os.path.join(trained["run_dir"], "model.pt")
    continued, _ = run_script(script, [*flags, "--load-model", model, "--cudagraphs", "--compile"], workdir)
    assert continued["cudagraphs_active"] and continued["steps_done"] == continued["total_timesteps"]
    evaluate = [*flags[:-2], "--total-timesteps", 0, "--eval-episodes", 0, "--save-model"]
    on_cpu, _ = run_script(script, [*evaluate, "--load-model", model, "--no-cuda"], workdir)
    back, _ = run_script(script, [*evaluate, "--load-model", os.path.join(on_cpu["run_dir"], "model.pt")], workdir)
    assert on_cpu["device"] == "cpu" and back["device"].startswith("cuda")
    saved = [torch.load(os.path.join(run["run_dir"], "model.pt"), map_location="cpu") for run in (trained, back)]
    networks = [key for key, value in saved[0].items() if isinstance(value, dict) and "param_groups" not in value]
    for name in (name for name in networks if name != "args"):
        assert all(torch.equal(saved[0][name][k], saved[1][name][k]) for k in saved[0][name]), name


@pytest.mark.parametrize("script", PROBED_RUNS)
def test_no_host_sync_in_the_pieces_on_the_gpu(script, tmp_path):
    """tests/host_sync_probe.py with the pieces on the GPU, as CUDA graphs capture them."""
    flags, pieces = PROBED_RUNS[script]
    log = tmp_path / "syncs.json"
    env = {"HOST_SYNC_LOG": str(log), "HOST_SYNC_PIECES": ",".join(sorted(pieces))}
    args = [os.path.join(SCRIPTS, script), *flags, "--compile", "--eval-episodes", 0]
    _, proc = run_script(PROBE, args, tmp_path, check=False, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(log.read_text()) == {piece: [] for piece in pieces}


def test_fast_td3s_ensemble_runs_under_bf16_autocast_as_its_critics_do():
    """The updates' autocast reaches inside the ensemble's critics on CUDA: bf16 logits, as each plain critic gives
    alone."""
    module = load_script("fast_td3.py")
    torch.manual_seed(0)
    qnet = module.Ensemble(lambda: module.DistributionalQNetwork(5, 3, 64, 11)).cuda()
    critics = [module.DistributionalQNetwork(5, 3, 64, 11).cuda() for _ in range(2)]
    for member, critic in zip(qnet.members, critics):
        critic.load_state_dict(member.state_dict())
    obs, actions = torch.randn(32, 5, device="cuda"), torch.rand(32, 3, device="cuda") * 2 - 1
    with torch.autocast("cuda", torch.bfloat16):
        logits = qnet(obs, actions)
        expected = torch.stack([critic(obs, actions) for critic in critics])
    assert logits.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(logits, expected, atol=2e-2, rtol=2e-2)
