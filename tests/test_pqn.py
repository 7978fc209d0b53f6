"""PQN: pqn.py on classic control and pqn_atari_envpool.py on envpool's Atari. The Q(lambda) returns against
CleanRL's reverse loop, the epsilon-greedy step against its definition, the update against a plain CleanRL step,
the sped-up pieces against eager, the channels-last LayerNorm against nn.LayerNorm, the scripts as a user runs them,
and learning (CartPole to its cap, Breakout against a random policy)."""

import math
import os
from functools import partial

import numpy as np
import pytest
import torch
import torch._inductor.config as inductor_config

from checks import (
    ATARI_SCREEN,
    CARTPOLE_SCREEN,
    RECORD,
    SPED_UP_CALLS,
    SUMMARY_KEYS,
    are_whole_game_scores,
    assert_a_seed_learns,
    assert_beats_random,
    assert_compiled_as_designed,
    assert_records_the_first_evaluation_game,
    assert_same_seed_same_numbers,
    assert_writes_cleanrls_tags,
    learned_the_cue,
    modes_here,
    random_policy_scores,
    speed_flags_here,
    speed_up,
)
from reference_implementations import plain_pqn_step, reference_q_lambda
from script_runs import load_script, run_on_standin, run_script, shared_run

CLASSIC, ATARI = "pqn.py", "pqn_atari_envpool.py"
BOTH = pytest.mark.parametrize("script", [CLASSIC, ATARI], ids=["classic", "atari"])
# 2 iterations of 4 envs x 32 steps, 2 epochs of 2 minibatches each.
TINY = ["--num-envs", 4, "--num-steps", 32, "--num-minibatches", 2, "--update-epochs", 2, "--eval-episodes", 2]
TINY += ["--total-timesteps", 256]
ENV = {CLASSIC: ["--env-id", "CartPole-v1"], ATARI: ["--env-id", "Breakout-v5"]}
# The eager run is each script's one tiny run: the same-seed, checkpoint and video tests read it too.
MODES = {
    "eager": RECORD,
    "compile": ["--compile"],
    "cudagraphs": ["--cudagraphs"],
    "compile+cudagraphs": ["--compile", "--cudagraphs"],
}


def tiny_run(script):
    """The arguments of the script's one tiny run, the eager mode test's."""
    return [*ENV[script], *TINY, *MODES["eager"], "--save-model"]


def needs_envpool(script):
    if script == ATARI:
        pytest.importorskip("envpool")


@BOTH
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("q_lambda", [0.0, 0.65, 1.0])
def test_q_lambda_returns_equal_the_reverse_loop(script, compiled, q_lambda):
    """Episode ends at the first and the last observation and at random inside the rollout; lambda 0 (one-step
    targets), CleanRL's 0.65 and 1 (Monte Carlo returns up to the bootstrap)."""
    module = load_script(script)
    g = torch.Generator().manual_seed(0)
    steps, envs = 128, 8
    rewards, values = torch.randn(steps, envs, generator=g), torch.randn(steps, envs, generator=g)
    dones = (torch.rand(steps, envs, generator=g) < 0.05).float()
    dones[0, 0] = dones[-1, -1] = dones[5, 2] = dones[6, 2] = 1.0  # an episode of one step among them
    next_value, next_done = torch.randn(envs, generator=g), torch.tensor([1.0] + [0.0] * (envs - 1))
    q_lambda_returns = speed_up(partial(module.q_lambda_returns, gamma=0.99, q_lambda=q_lambda), compiled, False)
    returns = q_lambda_returns(rewards, values, dones, next_value, next_done)
    expected = reference_q_lambda(rewards, values, dones, next_value, next_done, 0.99, q_lambda)
    torch.testing.assert_close(returns, expected, atol=2e-5, rtol=1e-5)


@BOTH
def test_the_policy_is_epsilon_greedy_with_the_greedy_values(script):
    """Epsilon 0: the argmax and the max of the network's Q-values. Then, on a fixed table of Q-values for 20,000
    observations: epsilon 1 gives uniform actions (a chi-square test over 40,000 draws), epsilon 0.3 an action other
    than the greedy one with probability 0.3 (1 - 1/3)."""
    module = load_script(script)
    torch.manual_seed(0)
    q_network = module.QNetwork(4, 3) if script == CLASSIC else module.QNetwork(3)
    obs = torch.randn(64, 4) if script == CLASSIC else torch.randint(0, 256, (64, 4, 84, 84), dtype=torch.uint8)
    with torch.no_grad():
        q_values = q_network(obs)
        actions, values = module.policy(obs, torch.tensor(0.0), q_network=q_network)
    assert torch.equal(actions, q_values.argmax(-1)) and torch.equal(values, q_values.max(-1).values)
    table = torch.randn(20_000, 3)
    draw = partial(module.policy, torch.zeros(20_000), q_network=lambda obs: table)
    uniform = torch.cat([draw(torch.tensor(1.0))[0] for _ in range(2)])
    counts = torch.bincount(uniform, minlength=3).double()
    assert ((counts - len(uniform) / 3) ** 2 / (len(uniform) / 3)).sum() < 13.8  # chi-square, 2 dof, p = 0.001
    other = torch.cat([draw(torch.tensor(0.3))[0] != table.argmax(-1) for _ in range(2)]).double()
    assert abs(other.mean() - 0.2) < 4 * math.sqrt(0.2 * 0.8 / len(other))


def minibatch(script, generator, rows=32):
    if script == CLASSIC:
        obs = torch.randn(rows, 4, generator=generator)
    else:
        obs = torch.randint(0, 256, (rows, 4, 84, 84), dtype=torch.uint8, generator=generator)
    return obs, torch.randint(0, 2 if script == CLASSIC else 4, (rows,), generator=generator), 5 * torch.randn(rows)


def network(script):
    module = load_script(script)
    return module.QNetwork(4, 2) if script == CLASSIC else module.QNetwork(4)


@BOTH
def test_update_steps_like_a_plain_pqn_step(script):
    """Six minibatch steps of the script's update (RAdam on a learning-rate tensor annealed in place, the clipping
    reached) and of the plain step from the same weights: the same losses and, after each step, the same weights."""
    module = load_script(script)
    torch.manual_seed(0)
    q_network, plain_network = network(script), network(script)
    plain_network.load_state_dict(q_network.state_dict())
    learning_rate = torch.tensor(2.5e-4)
    optimizer = torch.optim.RAdam(q_network.parameters(), lr=learning_rate)
    plain_optimizer = torch.optim.RAdam(plain_network.parameters(), lr=2.5e-4)
    g = torch.Generator().manual_seed(1)
    for step in range(6):
        lr_now = 2.5e-4 * (1 - step / 6)
        learning_rate.fill_(lr_now)
        plain_optimizer.param_groups[0]["lr"] = lr_now
        obs, actions, returns = minibatch(script, g)
        metrics = module.update(
            module.Batch(obs, actions, returns), loss_fn=module.td_loss, q_network=q_network, optimizer=optimizer,
            max_grad_norm=10.0,
        )  # fmt: skip
        expected = plain_pqn_step(plain_network, plain_optimizer, obs, actions, returns)
        for name, value in expected.items():
            torch.testing.assert_close(metrics[name], value.detach(), atol=1e-5, rtol=1e-5)
        for name, value in plain_network.state_dict().items():
            torch.testing.assert_close(q_network.state_dict()[name], value, atol=1e-6, rtol=1e-4)
    assert metrics["grad_norm"] > 10.0  # the clipping was exercised


def test_the_channels_last_layer_norm_is_nn_layer_norm():
    """The same outputs and gradients as nn.LayerNorm over (C, H, W), on a channels-last and on a contiguous input,
    and the same state dict names and shapes."""
    module = load_script(ATARI)
    torch.manual_seed(0)
    fast, plain = module.ChannelsLastLayerNorm([32, 20, 20]), torch.nn.LayerNorm([32, 20, 20])
    with torch.no_grad():
        fast.weight.uniform_(0.5, 1.5)
        fast.bias.uniform_(-0.5, 0.5)
    plain.load_state_dict(fast.state_dict())
    for memory_format in (torch.channels_last, torch.contiguous_format):
        x = torch.randn(6, 32, 20, 20).contiguous(memory_format=memory_format)
        outputs = []
        for layer in (fast, plain):
            layer.zero_grad()
            inputs = x.clone().requires_grad_()
            out = layer(inputs)
            (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
            outputs.append((out, inputs.grad, layer.weight.grad, layer.bias.grad))
        for got, expected in zip(*outputs):
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        if memory_format == torch.channels_last:  # the next convolution gets the layout it wants
            assert outputs[0][0].is_contiguous(memory_format=torch.channels_last)


def build_update(script, flags):
    """The script's update on a fresh network on flags[2], its loss compiled (flags[0]), in a CUDA graph (flags[1])."""
    module = load_script(script)
    torch.manual_seed(0)
    with torch.device(flags[2]):
        q_network = network(script)
        learning_rate = torch.tensor(2.5e-4)
    optimizer = torch.optim.RAdam(q_network.parameters(), lr=learning_rate, capturable=flags[1])
    loss_fn = torch.compile(module.td_loss, disable=not flags[0])
    update = partial(module.update, loss_fn=loss_fn, q_network=q_network, optimizer=optimizer, max_grad_norm=10.0)
    return q_network, speed_up(update, False, flags[1])  # the loss compiled, the update in a CUDA graph: as the script


@BOTH
@speed_flags_here()
@inductor_config.patch(fallback_random=True)
def test_sped_up_update_and_policy_equal_eager(script, flags):
    device = flags[2]
    eager_network, eager_update = build_update(script, (False, False, device))
    fast_network, fast_update = build_update(script, flags)
    module = load_script(script)
    for step in range(SPED_UP_CALLS):
        batch = module.Batch(*(t.to(device) for t in minibatch(script, torch.Generator().manual_seed(step))))
        expected, got = eager_update(batch), fast_update(batch)
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], atol=1e-4, rtol=1e-4)
    for name, value in eager_network.state_dict().items():
        torch.testing.assert_close(fast_network.state_dict()[name], value, atol=1e-5, rtol=1e-4)
    obs = minibatch(script, torch.Generator().manual_seed(9))[0].to(device)
    policy = speed_up(partial(module.policy, q_network=fast_network), *flags[:2])
    with torch.no_grad():
        for _ in range(SPED_UP_CALLS):  # the last one a replay
            actions, values = policy(obs, torch.tensor(0.0, device=device))
        q_values = fast_network(obs)
    assert torch.equal(actions, q_values.argmax(-1))
    torch.testing.assert_close(values, q_values.max(-1).values, atol=1e-5, rtol=1e-5)


@BOTH
@pytest.mark.parametrize("mode", modes_here(MODES))
def test_every_mode_writes_a_valid_summary(script, mode, workdir):
    needs_envpool(script)
    summary, proc = shared_run(script, [*ENV[script], *TINY, *MODES[mode], "--save-model"])
    assert SUMMARY_KEYS <= summary.keys() and summary["script"] == script
    assert summary["compile"] == ("compile" in mode)
    assert_compiled_as_designed(summary)
    assert summary["cudagraphs_requested"] == ("cudagraphs" in mode) and summary["cudagraphs_active"] is False
    assert summary["num_updates"] == 2 * 2 * 2 and summary["steady_steps"] == 128  # the first iteration: warm-up
    assert summary["sps"] == pytest.approx(summary["steady_steps"] / summary["steady_seconds"])
    assert len(summary["eval_returns"]) == 2 and are_whole_game_scores(summary["eval_returns"], ENV[script][1])
    assert all(math.isfinite(value) for value in summary["final_metrics"].values())
    assert sum("--cudagraphs needs CUDA" in line for line in proc.stderr.splitlines()) == ("cudagraphs" in mode)


@BOTH
def test_capture_video_records_the_first_evaluation_game(script):
    needs_envpool(script)
    screen = ATARI_SCREEN if script == ATARI else CARTPOLE_SCREEN
    assert_records_the_first_evaluation_game(shared_run(script, tiny_run(script))[0], screen)


def test_every_tag_of_cleanrls_script_is_written():
    assert_writes_cleanrls_tags(shared_run(CLASSIC, tiny_run(CLASSIC))[0])


@BOTH
def test_same_seed_gives_identical_runs(script, workdir):
    needs_envpool(script)
    assert_same_seed_same_numbers(script, tiny_run(script), workdir, ["eval_returns", "final_metrics"])


@BOTH
def test_checkpoint_evaluates_to_the_reported_score(script, workdir):
    needs_envpool(script)
    trained, _ = shared_run(script, tiny_run(script))
    checkpoint = os.path.join(trained["run_dir"], "model.pt")
    evaluate = ["--total-timesteps", 0, "--eval-episodes", 2, "--load-model", checkpoint]
    evaluated, _ = run_script(script, [*ENV[script], *evaluate], workdir)
    assert evaluated["eval_returns"] == trained["eval_returns"]
    other = ["--env-id", "Acrobot-v1"] if script == CLASSIC else ["--env-id", "Pong-v5"]
    _, proc = run_script(script, [*other, "--total-timesteps", 0, "--load-model", checkpoint], workdir, check=False)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --load-model")
    assert ("Acrobot-v1 has obs_dim 6" if script == CLASSIC else "Pong-v5 has num_actions 6") in proc.stderr


@pytest.mark.parametrize(
    "script, args, message",
    [
        (CLASSIC, ["--env-id", "Foo-v1"], "unknown env id 'Foo-v1'"),
        (CLASSIC, ["--env-id", "Pendulum-v1"], "pqn.py needs discrete actions"),
        (CLASSIC, ["--num-minibatches", 3], "must divide num_envs x num_steps"),
        (CLASSIC, ["--q-lambda", 1.5], "--q-lambda must be in [0, 1]"),
        (CLASSIC, ["--total-timesteps", 100], "less than one rollout"),
        (ATARI, ["--env-id", "Foo-v5"], "unknown env id 'Foo-v5'"),
        (ATARI, ["--env-id", "HalfCheetah-v5"], "not an Atari game"),  # envpool has it, as a MuJoCo task
        (ATARI, ["--num-minibatches", 3], "must divide num_envs x num_steps"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_code_2(script, args, message, workdir):
    needs_envpool(script)
    _, proc = run_script(script, [*TINY, *args], workdir, check=False, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (
        proc.stderr
    )


@pytest.mark.learning
def test_learns_cartpole_in_150k_steps(workdir):
    """CleanRL's settings but for the budget (epsilon annealed over the first 75,000 steps), about 75 s: seeds 2 and 3
    evaluated 121 and 200 (10 greedy games); a random policy's CartPole game lasts about 21 steps."""
    args = ["--total-timesteps", 150_000, "--eval-episodes", 10]
    assert_a_seed_learns(
        lambda seed: run_script(CLASSIC, [*args, "--seed", seed], workdir)[0],
        lambda summary: summary["eval_return_mean"] >= 100,
        seeds=(2, 3, 4),
    )


@pytest.mark.benchmark
@pytest.mark.learning
def test_learns_cartpole_to_its_cap(workdir):
    """About 2 minutes on a 2-core CPU: CleanRL's settings and budget (500,000 steps). Seeds 1-3 ended at a mean of
    500 over their last 20 episodes and evaluated to 500."""
    summary, _ = run_script(CLASSIC, ["--seed", 2, "--eval-episodes", 10], workdir)
    assert summary["return_mean"] >= 475 and np.mean(summary["eval_returns"]) >= 475


@pytest.mark.learning
def test_learns_the_cue_task(workdir):
    """Cue-v5 (tests/standin/envpool.py) through pqn_atari_envpool.py's envpool code: 4,096 steps, rollouts of 32
    steps and lr 1e-3, epsilon annealed over the first 410, about 35 s. A random policy scores 8 a game."""
    args = ["--env-id", "Cue-v5", "--total-timesteps", 4096, "--num-steps", 32, "--learning-rate", 1e-3]
    args += ["--eval-episodes", 10]
    assert_a_seed_learns(lambda seed: run_on_standin(ATARI, [*args, "--seed", seed], workdir)[0], learned_the_cue)


@pytest.mark.benchmark
@pytest.mark.learning
def test_learns_breakout_well_above_a_random_policy(workdir):
    """About 5 minutes on a 2-core CPU: 49,152 steps with CleanRL's settings but for the budget, so exploration ends
    after 4,915 steps. Seed 1 evaluated to 3.8 (20 games at epsilon 0.05) against a random policy's 1.4 (z = 4.0);
    its training return, the last 20 games with epsilon still in them, was 2.65."""
    pytest.importorskip("envpool")
    args = ["--total-timesteps", 49_152, "--eval-episodes", 20, "--seed", 1]
    summary, _ = run_script(ATARI, args, workdir)
    random_scores = random_policy_scores(ATARI, "Breakout-v5", 30, seed=1, training=False)  # about 1.4
    assert_beats_random(summary["eval_returns"], random_scores, factor=2)
