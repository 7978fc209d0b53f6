"""PPO on Atari (envpool): GAE and the policy against plain references, the update compiled against eager, the
script as a user runs it (sync and async envpool), and learning measured against a random policy."""

import math
import os
from functools import partial

import numpy as np
import pytest
import torch
import torch._inductor.config as inductor_config
from conftest import (SUMMARY_KEYS, assert_gae_equals_the_reverse_loop, assert_same_seed_same_numbers, load_script,
                      run_script)

envpool = pytest.importorskip("envpool")

SCRIPT = "ppo_atari_envpool.py"
# 2 iterations of 4 envs x 32 steps on Breakout, 2 epochs of 2 minibatches each.
TINY = ["--total-timesteps", 256, "--num-envs", 4, "--num-steps", 32, "--num-minibatches", 2,
        "--update-epochs", 2, "--eval-episodes", 2]
MODES = {"eager": [], "compile": ["--compile"], "cudagraphs": ["--cudagraphs"],
         "compile+cudagraphs": ["--compile", "--cudagraphs"], "envpool-async": ["--envpool-async"]}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gae_equals_the_reverse_loop(compiled):
    assert_gae_equals_the_reverse_loop(SCRIPT, 128, 8, compiled, seed=0, rewards_sign=True)


def test_policy_matches_torch_distributions():
    module = load_script(SCRIPT)
    torch.manual_seed(0)
    agent = module.Agent(4)
    with torch.no_grad():
        agent.actor.weight.mul_(300)  # spread the probabilities out
    obs, actions = torch.randint(0, 256, (16, 4, 84, 84), dtype=torch.uint8), torch.randint(0, 4, (16,))
    _, log_prob, entropy, value = agent.get_action_and_value(obs, actions)
    hidden = agent.network(obs / 255.0)  # the plain NCHW float forward
    categorical = torch.distributions.Categorical(logits=agent.actor(hidden))
    torch.testing.assert_close(log_prob, categorical.log_prob(actions), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, categorical.entropy(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(value, agent.critic(hidden).squeeze(-1), atol=1e-5, rtol=1e-5)
    # Gumbel-max samples follow the softmax: 4,000 draws for each of two observations
    pair = obs[:2].repeat(2000, 1, 1, 1)
    with torch.no_grad():
        sampled, _, _, _ = agent.get_action_and_value(pair)
    for row in range(2):
        frequencies = torch.bincount(sampled[row::2], minlength=4) / 2000
        torch.testing.assert_close(frequencies, categorical.probs[row], atol=0.04, rtol=0)


def build_update(flags):
    module = load_script(SCRIPT)
    torch.manual_seed(0)
    agent = module.Agent(4)
    optimizer = torch.optim.Adam(agent.parameters(), lr=torch.tensor(2.5e-4), eps=1e-5, fused=True)
    return agent, module.speed_up(partial(module.update, agent=agent, optimizer=optimizer, args=module.Args()), *flags)


@pytest.mark.parametrize("flags", [(True, False), (False, True), (True, True)], ids=["compile", "cudagraphs", "both"])
@inductor_config.patch(fallback_random=True)
def test_sped_up_update_equals_eager(flags):
    eager_agent, eager_update = build_update((False, False))
    fast_agent, fast_update = build_update(flags)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        obs = torch.randint(0, 256, (32, 4, 84, 84), dtype=torch.uint8, generator=g)
        actions, logprobs = torch.randint(0, 4, (32,), generator=g), torch.randn(32, generator=g) - 1.4
        advantages, returns, values = (torch.randn(32, generator=g) for _ in range(3))
        batch = load_script(SCRIPT).Batch(obs, actions, logprobs, advantages, returns, values)
        expected, got = eager_update(batch), fast_update(batch)
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], atol=1e-4, rtol=1e-4)
    for name, value in eager_agent.state_dict().items():
        torch.testing.assert_close(fast_agent.state_dict()[name], value, atol=1e-5, rtol=1e-4)
    assert not torch.equal(eager_agent.state_dict()["critic.bias"], torch.zeros(1))  # it did learn


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_writes_a_valid_summary(mode, workdir):
    summary, proc = run_script(SCRIPT, TINY + MODES[mode], workdir)
    assert SUMMARY_KEYS <= summary.keys()
    assert summary["compile"] == ("compile" in mode) and summary["envpool_async"] == (mode == "envpool-async")
    assert summary["compiled_pieces"] == [] and summary["left_eager"] == ["gae", "policy", "update"] * ("compile" in mode)
    assert summary["cudagraphs_requested"] == ("cudagraphs" in mode) and summary["cudagraphs_active"] is False
    assert summary["num_updates"] == 2 * 2 * 2
    if mode != "envpool-async":  # async envs run ahead of each other by a step or two
        assert summary["steady_steps"] == 128  # the first iteration is warm-up
    assert summary["sps"] == pytest.approx(summary["steady_steps"] / summary["steady_seconds"])
    assert len(summary["eval_returns"]) == 2 and all(r >= 0 and r == int(r) for r in summary["eval_returns"])
    assert all(math.isfinite(value) for value in summary["final_metrics"].values())
    assert sum("--cudagraphs needs CUDA" in line for line in proc.stderr.splitlines()) == ("cudagraphs" in mode)


def test_same_seed_gives_identical_runs(workdir):
    assert_same_seed_same_numbers(SCRIPT, TINY, workdir, ["eval_returns", "final_metrics"])


def test_checkpoint_evaluates_to_the_reported_score(workdir):
    trained, _ = run_script(SCRIPT, TINY + ["--save-model"], workdir)
    checkpoint = os.path.join(trained["run_dir"], "model.pt")
    evaluated, _ = run_script(SCRIPT, ["--total-timesteps", 0, "--eval-episodes", 2, "--load-model", checkpoint], workdir)
    assert evaluated["eval_returns"] == trained["eval_returns"]
    _, proc = run_script(SCRIPT, ["--env-id", "Pong-v5", "--total-timesteps", 0, "--load-model", checkpoint],
                         workdir, check=False, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --load-model")
    assert "Pong-v5 has num_actions 6" in proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--env-id", "Foo-v5"], "unknown env id 'Foo-v5'"),
    (["--env-id", "HalfCheetah-v5"], "not an Atari game"),  # envpool has it, as a MuJoCo task
    (["--envpool-async", "--num-envs", 3], "must be even"),
    (["--num-minibatches", 3], "must divide num_envs x num_steps"),
])
def test_bad_input_is_one_clear_line_and_exit_code_2(args, message, workdir):
    _, proc = run_script(SCRIPT, TINY + args, workdir, check=False, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr


def random_policy_scores(script, env_id, games, seed):
    """True scores of whole games with uniformly random actions, on the script's own evaluation envs."""
    envs = load_script(script).make_envs(env_id, games, seed=seed, training=False)
    envs.reset()
    rng = np.random.default_rng(seed)
    scores, finished = np.zeros(games), np.zeros(games, dtype=bool)
    while not finished.all():
        _, rewards, terminations, truncations, _ = envs.step(rng.integers(envs.action_space.n, size=games))
        scores += rewards * ~finished
        finished |= terminations | truncations
    return scores


@pytest.mark.learning
def test_learns_breakout_well_above_a_random_policy(workdir):
    """About 3 minutes on a 2-core CPU: 98,304 steps with CleanRL's settings except 8 minibatches and a doubled
    learning rate (twice the gradient steps on the same samples). Seeds 1-3 evaluated 5-6 (20 games). The
    `--envpool-async` mode runs the same update on differently ordered steps: it is checked by the mode test,
    not by a second 3-minute learning run (CI's time budget)."""
    args = ["--total-timesteps", 98_304, "--num-minibatches", 8, "--learning-rate", 5e-4, "--eval-episodes", 20,
            "--seed", 1]
    summary, _ = run_script(SCRIPT, args, workdir)
    random_scores = random_policy_scores(SCRIPT, "Breakout-v5", 30, seed=1)  # about 1.5
    trained = np.array(summary["eval_returns"])
    standard_error = math.sqrt(trained.var(ddof=1) / len(trained) + random_scores.var(ddof=1) / len(random_scores))
    assert trained.mean() >= 2 * random_scores.mean(), (trained, random_scores.mean())
    assert trained.mean() - random_scores.mean() >= 3 * standard_error, (trained, random_scores)
    assert summary["return_mean"] >= 2 * random_scores.mean()  # the last 20 training games, true score
