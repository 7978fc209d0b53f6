"""PPO-LSTM on Atari: the padded one-call LSTM against CleanRL's per-step loop (outputs, values, log-probs, loss
and gradients), the script in every mode, and learning measured against a random policy."""

import math
from functools import partial

import numpy as np
import pytest
import torch

from checks import (
    ATARI_SCREEN,
    RECORD,
    SUMMARY_KEYS,
    assert_a_seed_learns,
    assert_beats_random,
    assert_checkpoint_round_trip,
    assert_compiled_as_designed,
    assert_records_the_first_evaluation_game,
    assert_same_loss_and_gradients,
    assert_same_seed_same_numbers,
    done_patterns,
    loss_and_gradients,
    modes_here,
    random_policy_scores,
)
from reference_implementations import reference_lstm_outputs, reference_ppo_lstm_loss
from script_runs import load_script, run_on_standin, run_script, shared_run

envpool = pytest.importorskip("envpool")

SCRIPT = "ppo_atari_lstm.py"
# 2 iterations of 4 envs x 32 steps, 2 minibatches of 2 env rows, 2 epochs.
TINY = [
    "--total-timesteps",
    256,
    "--num-envs",
    4,
    "--num-steps",
    32,
    "--num-minibatches",
    2,
    "--update-epochs",
    2,
    "--eval-episodes",
    2,
]
# The eager run is each script's one tiny run: the same-seed, implementation, checkpoint and video tests read it too.
MODES = {
    "eager": RECORD,
    "compile": ["--compile"],
    "cudagraphs": ["--cudagraphs"],
    "compile+cudagraphs": ["--compile", "--cudagraphs"],
}


def tiny_run(impl="padded", mode_flags=MODES["eager"]):
    """The arguments of a tiny run of `impl`: by default the script's one tiny run, the eager mode test's."""
    return [*TINY, *mode_flags, "--lstm-impl", impl, "--save-model"]


@pytest.mark.parametrize("pattern", ["none", "t0", "last", "every", "many_short", "random"])
def test_padded_lstm_equals_the_loop(pattern):
    module = load_script(SCRIPT)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(512, 128)
    features = torch.randn(16, 3, 512, generator=g)
    h, c = torch.randn(1, 3, 128, generator=g), torch.randn(1, 3, 128, generator=g)
    starts = done_patterns(16, 3, g)[pattern]
    expected = reference_lstm_outputs(lstm, features, h, c, starts)
    looped, _ = module.lstm_loop(lstm, features, h, c, starts)
    layout = [torch.from_numpy(a) for a in module.segment_layout(starts.numpy())]
    padded = module.lstm_padded(lstm, features, h, c, *layout)
    torch.testing.assert_close(looped, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(padded, expected, atol=1e-5, rtol=1e-5)


def test_segment_layout_pads_to_a_power_of_two():
    module = load_script(SCRIPT)
    starts = np.zeros((8, 2), dtype=np.float32)
    starts[[2, 5], 0] = 1.0  # env 0: three segments, env 1: one
    frame_index, state_index, output_index = module.segment_layout(starts)
    assert frame_index.shape == (8, 4) and sorted(output_index) != list(range(16))
    assert list(state_index) == [0, 2, 2, 1]  # env 0's stored state, zeros, zeros, env 1's stored state
    assert (frame_index == 16).sum() == 4 * 8 - 16  # every other slot reads the zero row
    every = module.segment_layout(np.ones((8, 2), dtype=np.float32))[0]
    assert every.shape == (8, 16)


def restarts_before(starts):
    """envpool's dones for these episode starts: the step before a first frame is the restart that follows an
    episode's last frame (its action ignored)."""
    return torch.cat([starts[1:], torch.zeros_like(starts[:1])])


def ppo_loss_of(module, agent, impl, compiled):
    """The script's loss, compiled as --compile compiles it (the LSTM held by dynamo and run eagerly)."""
    return partial(torch.compile(module.ppo_loss, disable=not compiled), agent=agent, args=module.Args(lstm_impl=impl))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("pattern", ["none", "t0", "every", "many_short", "random"])
@torch._dynamo.config.patch(allow_rnn=True)  # as the script sets it with --compile
def test_padded_loss_and_gradients_equal_the_loop(pattern, compiled):
    module = load_script(SCRIPT)
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    agent = module.Agent(4)
    num_steps, batch = 12, 2
    obs = torch.randint(0, 256, (num_steps, batch, 1, 84, 84), dtype=torch.uint8, generator=g)
    starts = done_patterns(num_steps, batch, g)[pattern]
    dones = restarts_before(starts)
    h, c = torch.randn(1, batch, 128, generator=g), torch.randn(1, batch, 128, generator=g)
    layout = [torch.from_numpy(a) for a in module.segment_layout(starts.numpy())]
    if compiled:  # as the script marks them: one graph for every segment count, whichever pattern compiles first
        torch._dynamo.maybe_mark_dynamic(layout[0], 1)
        torch._dynamo.maybe_mark_dynamic(layout[1], 0)
    actions = torch.randint(0, 4, (num_steps, batch), generator=g)
    logprobs, advantages, returns, values = (torch.randn(num_steps, batch, generator=g) for _ in range(4))
    rollout = [actions, logprobs - 1.4, advantages, returns, values]
    minibatch = module.Minibatch(obs, dones, starts, h, c, *rollout, *layout)
    looped = loss_and_gradients(ppo_loss_of(module, agent, "loop", False), agent, minibatch)
    padded = loss_and_gradients(ppo_loss_of(module, agent, "padded", compiled), agent, minibatch)
    assert_same_loss_and_gradients(padded, looped)
    loop_grads = looped[2]
    assert loop_grads["lstm.weight_ih_l0"].abs().sum() > 0
    # the recurrent weights get gradients unless every step starts an episode (then every state is zero)
    assert (loop_grads["lstm.weight_hh_l0"].abs().sum() > 0) == (pattern != "every")


@pytest.mark.parametrize("impl", ["padded", "loop"])
def test_the_loss_leaves_out_envpools_restarts_as_cleanrl_never_stores_them(impl):
    """Equal to CleanRL's loss over the kept steps, and blind to what the restarts hold."""
    module = load_script(SCRIPT)
    g = torch.Generator().manual_seed(2)
    torch.manual_seed(2)
    agent = module.Agent(4)
    num_steps, batch = 12, 2
    starts = torch.zeros(num_steps, batch)
    starts[[3, 9], 0] = starts[6, 1] = 1.0  # episodes of 2 and 4 steps between restarts, one from the stored state
    dones = restarts_before(starts)
    obs = torch.randint(0, 256, (num_steps, batch, 1, 84, 84), dtype=torch.uint8, generator=g)
    h, c = torch.randn(1, batch, 128, generator=g), torch.randn(1, batch, 128, generator=g)
    layout = [torch.from_numpy(a) for a in module.segment_layout(starts.numpy())]
    actions = torch.randint(0, 4, (num_steps, batch), generator=g)
    logprobs, advantages, returns, values = (torch.randn(num_steps, batch, generator=g) for _ in range(4))
    rollout = [actions, logprobs - 1.4, advantages, returns, values]
    minibatch = module.Minibatch(obs, dones, starts, h, c, *rollout, *layout)
    script_loss = ppo_loss_of(module, agent, impl, False)
    ours = loss_and_gradients(script_loss, agent, minibatch)
    expected = loss_and_gradients(partial(reference_ppo_lstm_loss, agent), agent, minibatch)
    assert_same_loss_and_gradients(ours, expected)
    # what a restart holds (its ignored action, its advantage, its return) changes nothing
    noise = [torch.where(dones.bool(), t.roll(1, 0) + 3, t) for t in rollout]
    noise[0] = noise[0] % 4
    noisy = loss_and_gradients(script_loss, agent, module.Minibatch(obs, dones, starts, h, c, *noise, *layout))
    assert_same_loss_and_gradients(noisy, ours)


@pytest.mark.parametrize("impl", ["padded", "loop"])
@pytest.mark.parametrize("mode", modes_here(MODES))
def test_every_mode_writes_a_valid_summary(mode, impl, workdir):
    summary, proc = shared_run(SCRIPT, tiny_run(impl, MODES[mode]))
    assert SUMMARY_KEYS <= summary.keys()
    assert summary["compile"] == ("compile" in mode) and summary["lstm_impl"] == impl
    assert_compiled_as_designed(summary)
    assert summary["cudagraphs_requested"] == ("cudagraphs" in mode) and summary["cudagraphs_active"] is False
    assert summary["num_updates"] == 2 * 2 * 2 and summary["steady_steps"] == 128
    assert summary["real_steps"] == 2 * 2 * 2 * 2 * 32
    assert (
        summary["padded_steps"] >= summary["real_steps"]
        if impl == "padded"
        else summary["padded_steps"] == summary["real_steps"]
    )
    assert summary["sps"] == pytest.approx(summary["steady_steps"] / summary["steady_seconds"])
    assert len(summary["eval_returns"]) == 2 and all(math.isfinite(v) for v in summary["final_metrics"].values())
    assert sum("--cudagraphs needs CUDA" in line for line in proc.stderr.splitlines()) == ("cudagraphs" in mode)


def test_capture_video_records_the_first_evaluation_game():
    assert_records_the_first_evaluation_game(shared_run(SCRIPT, tiny_run())[0], ATARI_SCREEN)


def test_same_seed_gives_identical_runs(workdir):
    assert_same_seed_same_numbers(SCRIPT, tiny_run(), workdir, ["eval_returns", "final_metrics"])


def test_target_kl_stops_an_iterations_epochs(workdir):
    """CleanRL's --target-kl: once the last minibatch's approximate KL exceeds it, the iteration's other epochs are
    left out (here after the first: any update moves the policy further than 1e-12)."""
    summary, _ = run_script(SCRIPT, [*TINY, "--target-kl", 1e-12, "--eval-episodes", 0], workdir)
    assert summary["num_updates"] == 2 * 2  # 2 iterations x 2 minibatches, one of the 2 epochs each


def test_padded_and_loop_runs_take_the_same_steps(workdir):
    """Same seed, same minibatches: the two implementations train to the same numbers (up to float rounding)."""
    padded, _ = shared_run(SCRIPT, tiny_run("padded"))
    loop, _ = shared_run(SCRIPT, tiny_run("loop"))
    for name, value in loop["final_metrics"].items():
        assert padded["final_metrics"][name] == pytest.approx(value, rel=1e-3, abs=1e-5), name


@pytest.mark.parametrize(
    "args, message",
    [
        (["--env-id", "Foo-v5"], "unknown env id 'Foo-v5'"),
        (["--env-id", "HalfCheetah-v5"], "not an Atari game"),
        (["--num-minibatches", 3], "must divide --num-envs"),
        (["--lstm-impl", "cudnn"], "lstm-impl"),
    ],
)
def test_bad_input_exits_with_code_2(args, message, workdir):
    _, proc = run_script(SCRIPT, TINY + args, workdir, check=False, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


@pytest.mark.learning
def test_the_lstm_learns_to_recall_a_cue_that_no_frame_stack_holds(workdir):
    """Recall-v5 (tests/standin/envpool.py) through the script's envpool code: a quadrant lit at a game's start,
    answered seven frames later; the frames at the question never show it (tests/test_standin_envpool.py), so a
    policy without memory scores a random policy's 0.25. 12,288 steps, rollouts of 32 steps, lr 1e-3: about 100 s;
    at 8,192 steps a run's training games scored 0.85, its evaluation 0.65."""
    args = ["--env-id", "Recall-v5", "--total-timesteps", 12_288, "--num-steps", 32, "--learning-rate", 1e-3]
    args += ["--eval-episodes", 20]
    assert_a_seed_learns(
        lambda seed: run_on_standin(SCRIPT, [*args, "--seed", seed], workdir)[0],
        lambda summary: summary["return_mean"] >= 0.5 and summary["eval_return_mean"] >= 0.5,
    )


@pytest.mark.benchmark
@pytest.mark.learning
def test_learns_breakout_well_above_a_random_policy(workdir):
    """About 4 minutes on a 2-core CPU: 98,304 steps with CleanRL's settings except one env row per minibatch
    and a doubled learning rate (twice the gradient steps on the same samples)."""
    summary, _ = run_script(
        SCRIPT,
        [
            "--total-timesteps",
            98_304,
            "--num-minibatches",
            8,
            "--learning-rate",
            5e-4,
            "--eval-episodes",
            20,
            "--seed",
            1,
        ],
        workdir,
    )
    random_scores = random_policy_scores(SCRIPT, "Breakout-v5", 30, seed=1, training=False)  # about 1.5
    trained = np.array(summary["eval_returns"])
    assert_beats_random(trained, random_scores, factor=2)


def test_a_checkpoint_loads_back_to_the_same_weights(workdir):
    assert_checkpoint_round_trip(SCRIPT, tiny_run(), "agent", workdir)
