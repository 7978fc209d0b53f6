"""PPO on Atari (envpool): GAE, the policy and the update against plain references, the rollouts the updates get
against what the envs played, the update compiled against eager, the scripts as a user runs them (ppo_atari_envpool.py
on envpool's sync mode, ppo_atari_envpool_async.py on its async mode), and learning measured against a random
policy."""

import glob
import json
import math
import os
import runpy
import signal
import sys
from functools import partial

import gymnasium as gym
import numpy as np
import pytest
import torch
import torch._inductor.config as inductor_config

from checks import (
    ATARI_SCREEN,
    RECORD,
    SPED_UP_CALLS,
    SUMMARY_KEYS,
    are_whole_game_scores,
    assert_a_seed_learns,
    assert_beats_random,
    assert_compiled_as_designed,
    assert_gae_equals_the_reverse_loop,
    assert_records_the_first_evaluation_game,
    assert_same_seed_same_numbers,
    learned_the_cue,
    modes_here,
    random_policy_scores,
    speed_flags_here,
    speed_up,
)
from reference_implementations import plain_ppo_step, reference_gae
from script_runs import SCRIPTS, load_script, run_on_standin, run_script, shared_run

envpool = pytest.importorskip("envpool")

SCRIPT = "ppo_atari_envpool.py"
ASYNC_SCRIPT = "ppo_atari_envpool_async.py"  # the same pieces, its own storage and loop
BOTH = pytest.mark.parametrize("script", [SCRIPT, ASYNC_SCRIPT], ids=["sync", "async"])
# 2 iterations of 4 envs x 32 steps on Breakout, 2 epochs of 2 minibatches each.
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
# The eager run is each script's one tiny run: the same-seed, checkpoint and video tests read it too.
MODES = {
    "eager": RECORD,
    "compile": ["--compile"],
    "cudagraphs": ["--cudagraphs"],
    "compile+cudagraphs": ["--compile", "--cudagraphs"],
}
TINY_RUN = [*TINY, *MODES["eager"], "--save-model"]


@BOTH
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gae_equals_the_reverse_loop(script, compiled):
    assert_gae_equals_the_reverse_loop(script, 128, 8, compiled, seed=0, rewards_sign=True)


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


class AtariEnvSpec:  # the spec class the script checks for by name
    pass


class TranscribedAtari:
    """envpool's Atari interface (reset and step; async_reset, recv, send by env id) over a made-up game whose
    observations say which env and which of its steps they are. recv hands back `batch_size` of the due envs in a
    random order, as envpool's async mode returns whichever finish first (its sync mode: every env, by env id); every
    action sent and every step's reward and ends are kept."""

    observation_space = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
    action_space = gym.spaces.Discrete(4)

    def __init__(self, num_envs, batch_size, seed):
        self.num_envs, self.batch_size, self.rng = num_envs, batch_size, np.random.default_rng(seed)
        self.next_k = np.zeros(num_envs, dtype=np.int64)  # the index of each env's next observation
        self.due, self.sent, self.arrived, self.games = [], {}, {}, []
        self.game_returns = np.zeros(num_envs)

    @staticmethod
    def observation(env, k):
        pixels = np.random.default_rng([env, k]).integers(0, 256, (4, 84, 84), dtype=np.uint8)
        pixels[0, 0, :3] = env, k // 256, k % 256
        return pixels

    def async_reset(self):
        self.due = list(range(self.num_envs))

    def recv(self):
        env_ids = self.rng.permutation(self.due)[: self.batch_size]
        if self.batch_size == self.num_envs:
            env_ids.sort()
        self.due = [env for env in self.due if env not in env_ids]
        first = self.next_k[env_ids] == 0  # the reset observation: no step led into it
        reward = np.where(first, 0, self.rng.integers(-1, 2, len(env_ids))).astype(np.float32)
        life_lost = ~first & (self.rng.random(len(env_ids)) < 0.2)
        game_over = life_lost & (self.rng.random(len(env_ids)) < 0.4)
        truncated = ~first & ~life_lost & (self.rng.random(len(env_ids)) < 0.03)
        score = reward * 3  # the unclipped score, which the training returns must count
        for env, k, r, done, s, ended in zip(
            env_ids, self.next_k[env_ids], reward, life_lost | truncated, score, game_over | truncated
        ):
            self.arrived[env, k] = (r, float(done))
            self.game_returns[env] += s
            if ended:
                self.games.append(self.game_returns[env])
                self.game_returns[env] = 0.0
        obs = np.stack([self.observation(env, k) for env, k in zip(env_ids, self.next_k[env_ids])])
        self.next_k[env_ids] += 1
        infos = {"env_id": env_ids, "reward": score, "terminated": game_over.astype(np.int32)}
        return obs, reward, life_lost, truncated, infos

    def send(self, actions, env_ids):
        for env, action in zip(env_ids, actions):
            self.sent[env, self.next_k[env] - 1] = int(action)
        self.due += list(env_ids)

    def reset(self):
        self.async_reset()
        obs, *_, infos = self.recv()
        return obs, infos

    def step(self, actions):
        self.send(actions, np.arange(self.num_envs))
        return self.recv()

    def close(self):
        pass


def decode(obs):
    """(env, k) of each observation in a batch."""
    corner = obs[:, 0, 0, :3].long()
    return list(zip(corner[:, 0].tolist(), (corner[:, 1] * 256 + corner[:, 2]).tolist()))


@BOTH
def test_each_update_gets_the_rollout_the_envs_played(script, workdir, monkeypatch):
    """The script run on a made-up game that keeps what it was sent: each update's rows hold, for every env and step,
    the observation, the action the env received after it, the log-probability and value the policy gave with that
    action, and the advantages and returns of CleanRL's reverse loop over the rewards and episode ends the env
    returned; the training returns are the games' unclipped scores."""
    made = []

    def make(env_id, num_envs, seed, batch_size=None, **_):
        made.append(TranscribedAtari(num_envs, batch_size or num_envs, seed))
        return made[-1]

    fake = type(sys)("envpool")
    fake.list_all_envs, fake.make_spec, fake.make = lambda: ["Breakout-v5"], lambda env_id: AtariEnvSpec(), make
    monkeypatch.setitem(sys.modules, "envpool", fake)
    T, num_envs, iterations = 8, 4, 5
    monkeypatch.setattr(
        sys,
        "argv",
        [
            script,
            "--total-timesteps",
            str(T * num_envs * iterations),
            "--num-envs",
            str(num_envs),
            "--num-steps",
            str(T),
            "--num-minibatches",
            "1",
            "--update-epochs",
            "1",
            "--eval-episodes",
            "0",
        ],
    )
    monkeypatch.chdir(workdir)
    path = os.path.join(SCRIPTS, script)
    acted, updates, fresh_logprobs = {}, [], []  # acted: observation -> what the policy gave, each time it was called

    def watch(frame, event, result):  # the script's own policy and update calls, seen from outside
        if frame.f_code.co_filename != path:
            return
        if event == "return" and frame.f_code.co_name == "policy":
            for key, *row in zip(decode(frame.f_locals["obs"]), *result):
                acted.setdefault(key, []).append([value.item() for value in row])
        elif event == "call" and frame.f_code.co_name == "update":
            minibatch = frame.f_locals["minibatch"]
            latest = {key: calls[-1] for key, calls in acted.items()}  # what the policy last gave, as the update starts
            updates.append(([t.clone() for t in minibatch], latest))
            with torch.no_grad():  # the log-probs of the weights this update starts from
                fresh_logprobs.append(frame.f_locals["agent"].get_action_and_value(minibatch.obs, minibatch.actions)[1])

    # what the run sets for the process (threads, signal handlers, OMP_WAIT_POLICY) is put back for the later tests
    threads, handlers = torch.get_num_threads(), {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    environ = dict(os.environ)
    sys.setprofile(watch)
    try:
        with pytest.raises(SystemExit) as ended:  # the script exits with the code the run returns
            runpy.run_path(path, run_name="__main__")
        assert ended.value.code == 0
    finally:
        sys.setprofile(None)
        torch.set_num_threads(threads)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        os.environ.clear()
        os.environ.update(environ)
    (envs,) = made
    assert len(updates) == iterations
    for key, action in envs.sent.items():
        assert acted[key][-1][0] == action, f"observation {key}: the env got another action than the policy chose"
    # sync: the bootstrap observation gets its value before the update and its action after it, as in CleanRL's
    bootstraps = {(env, i * T) for env in range(num_envs) for i in range(1, iterations)} if script == SCRIPT else set()
    assert {key for key, calls in acted.items() if len(calls) > 1} == bootstraps
    for i, ((obs, actions, logprobs, advantages, returns, values), latest) in enumerate(updates):
        if script == SCRIPT:  # on-policy: every row was acted on by the weights the update starts from
            torch.testing.assert_close(logprobs, fresh_logprobs[i], atol=1e-5, rtol=1e-5)
        rows = decode(obs)
        assert sorted(rows) == sorted((env, i * T + t) for env in range(num_envs) for t in range(T))
        torch.testing.assert_close(actions, torch.tensor([latest[key][0] for key in rows]))
        torch.testing.assert_close(logprobs, torch.tensor([latest[key][1] for key in rows]))
        torch.testing.assert_close(values, torch.tensor([latest[key][2] for key in rows]))
        # (T + 1, num_envs) tables over this rollout's observations, the last one bootstrapping
        steps = range(i * T, (i + 1) * T + 1)
        arrived = torch.tensor([[envs.arrived[env, k][:2] for env in range(num_envs)] for k in steps])
        step_rewards, dones = arrived[1:, :, 0], arrived[..., 1]  # row t: the reward of the step from obs t
        step_values = torch.tensor([[latest[env, k][2] for env in range(num_envs)] for k in steps])
        expected = reference_gae(step_rewards, step_values[:T], dones[:T], step_values[T], dones[T], 0.99, 0.95)
        where = torch.tensor([k - i * T for env, k in rows]), torch.tensor([env for env, k in rows])
        torch.testing.assert_close(advantages, expected[0][where], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(returns, expected[1][where], atol=1e-5, rtol=1e-5)
    (run_dir,) = glob.glob(os.path.join(workdir, "runs", "*"))
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    assert len(envs.games) >= 5 and summary["return_mean"] == pytest.approx(np.mean(envs.games[-20:]))


@BOTH
def test_update_steps_like_a_plain_ppo_step(script):
    """Six minibatch steps of the script's update (fused Adam on a learning-rate tensor annealed in place) and of the
    plain step from the same weights: the same losses and, after each step, the same weights."""
    module = load_script(script)
    torch.manual_seed(0)
    agent, plain_agent = module.Agent(4), module.Agent(4)
    plain_agent.load_state_dict(agent.state_dict())
    learning_rate = torch.tensor(2.5e-4)
    optimizer = torch.optim.Adam(agent.parameters(), lr=learning_rate, eps=1e-5, fused=True)
    plain_optimizer = torch.optim.Adam(plain_agent.parameters(), lr=2.5e-4, eps=1e-5)
    g = torch.Generator().manual_seed(1)
    for step in range(6):
        lr_now = 2.5e-4 * (1 - step / 6)
        learning_rate.fill_(lr_now)
        plain_optimizer.param_groups[0]["lr"] = lr_now
        obs = torch.randint(0, 256, (32, 4, 84, 84), dtype=torch.uint8, generator=g)
        actions = torch.randint(0, 4, (32,), generator=g)
        with torch.no_grad():  # the log-probabilities and values of a policy a little behind, as in a later epoch
            _, logprobs, _, values = agent.get_action_and_value(obs, actions)
        noise = torch.randn(4, 32, generator=g)
        minibatch = module.Batch(
            obs, actions, logprobs + 0.2 * noise[0], noise[1], values + noise[2], values + 0.1 * noise[3]
        )
        args = module.Args(max_grad_norm=0.5)
        metrics = module.update(minibatch, loss_fn=module.ppo_loss, agent=agent, optimizer=optimizer, args=args)
        expected = plain_ppo_step(plain_agent, plain_optimizer, minibatch)
        for name, value in expected.items():
            torch.testing.assert_close(metrics[name], value.detach(), atol=1e-5, rtol=1e-5)
        for name, value in plain_agent.state_dict().items():
            torch.testing.assert_close(agent.state_dict()[name], value, atol=1e-6, rtol=1e-4)
    assert 0 < metrics["clipfrac"] < 1  # the clipping was exercised


def build_update(flags):
    """The script's update on a fresh agent on flags[2], its loss compiled (flags[0]), in a CUDA graph (flags[1])."""
    module = load_script(SCRIPT)
    torch.manual_seed(0)
    with torch.device(flags[2]):
        agent = module.Agent(4)
        learning_rate = torch.tensor(2.5e-4)
    optimizer = torch.optim.Adam(agent.parameters(), lr=learning_rate, eps=1e-5, fused=True, capturable=flags[1])
    loss_fn = torch.compile(module.ppo_loss, disable=not flags[0])
    update = partial(
        module.update, loss_fn=loss_fn, agent=agent, optimizer=optimizer, args=module.Args(max_grad_norm=0.5)
    )
    return agent, speed_up(update, False, flags[1])  # the loss compiled, the update in a CUDA graph: as the script


@speed_flags_here()
@inductor_config.patch(fallback_random=True)
def test_sped_up_update_equals_eager(flags):
    device = flags[2]
    eager_agent, eager_update = build_update((False, False, device))
    fast_agent, fast_update = build_update(flags)
    for step in range(SPED_UP_CALLS):
        g = torch.Generator().manual_seed(step)
        obs = torch.randint(0, 256, (32, 4, 84, 84), dtype=torch.uint8, generator=g)
        actions, logprobs = torch.randint(0, 4, (32,), generator=g), torch.randn(32, generator=g) - 1.4
        advantages, returns, values = (torch.randn(32, generator=g) for _ in range(3))
        batch = [obs, actions, logprobs, advantages, returns, values]
        batch = load_script(SCRIPT).Batch(*(tensor.to(device) for tensor in batch))
        expected, got = eager_update(batch), fast_update(batch)
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], atol=1e-4, rtol=1e-4)
    for name, value in eager_agent.state_dict().items():
        torch.testing.assert_close(fast_agent.state_dict()[name], value, atol=1e-5, rtol=1e-4)
    assert eager_agent.state_dict()["critic.bias"].count_nonzero() == 1  # it did learn


@BOTH
@pytest.mark.parametrize("mode", modes_here(MODES))
def test_every_mode_writes_a_valid_summary(script, mode, workdir):
    summary, proc = shared_run(script, [*TINY, *MODES[mode], "--save-model"])
    assert SUMMARY_KEYS <= summary.keys() and summary["script"] == script
    assert summary["compile"] == ("compile" in mode)
    assert_compiled_as_designed(summary)
    assert summary["cudagraphs_requested"] == ("cudagraphs" in mode) and summary["cudagraphs_active"] is False
    assert summary["num_updates"] == 2 * 2 * 2
    if script == SCRIPT:  # async envs run ahead of each other by a step or two
        assert summary["steady_steps"] == 128  # the first iteration is warm-up
    assert summary["sps"] == pytest.approx(summary["steady_steps"] / summary["steady_seconds"])
    assert len(summary["eval_returns"]) == 2 and are_whole_game_scores(summary["eval_returns"], "Breakout-v5")
    assert all(math.isfinite(value) for value in summary["final_metrics"].values())
    assert sum("--cudagraphs needs CUDA" in line for line in proc.stderr.splitlines()) == ("cudagraphs" in mode)


@BOTH
def test_capture_video_records_the_first_evaluation_game(script):
    assert_records_the_first_evaluation_game(shared_run(script, TINY_RUN)[0], ATARI_SCREEN)


def test_same_seed_gives_identical_runs(workdir):
    assert_same_seed_same_numbers(SCRIPT, TINY_RUN, workdir, ["eval_returns", "final_metrics"])


@BOTH
def test_checkpoint_evaluates_to_the_reported_score(script, workdir):
    trained, _ = shared_run(script, TINY_RUN)
    checkpoint = os.path.join(trained["run_dir"], "model.pt")
    evaluated, _ = run_script(
        script, ["--total-timesteps", 0, "--eval-episodes", 2, "--load-model", checkpoint], workdir
    )
    assert evaluated["eval_returns"] == trained["eval_returns"]
    _, proc = run_script(
        script,
        ["--env-id", "Pong-v5", "--total-timesteps", 0, "--load-model", checkpoint],
        workdir,
        check=False,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.startswith("error: --load-model")
    assert "Pong-v5 has num_actions 6" in proc.stderr


@pytest.mark.parametrize(
    "script, args, message",
    [
        (SCRIPT, ["--env-id", "Foo-v5"], "unknown env id 'Foo-v5'"),
        (SCRIPT, ["--env-id", "HalfCheetah-v5"], "not an Atari game"),  # envpool has it, as a MuJoCo task
        (SCRIPT, ["--num-minibatches", 3], "must divide num_envs x num_steps"),
        (ASYNC_SCRIPT, ["--num-envs", 3], "--num-envs 3 must be even"),
        (ASYNC_SCRIPT, ["--env-id", "Foo-v5"], "unknown env id 'Foo-v5'"),
        (ASYNC_SCRIPT, ["--num-minibatches", 3], "must divide num_envs x num_steps"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_code_2(script, args, message, workdir):
    _, proc = run_script(script, TINY + args, workdir, check=False, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (
        proc.stderr
    )


@pytest.mark.learning
@pytest.mark.parametrize("script", [SCRIPT, ASYNC_SCRIPT])
def test_learns_the_cue_task(script, workdir):
    """Cue-v5 (tests/standin/envpool.py) through the script's envpool code: 5,120 steps, rollouts of 32 steps and
    lr 1e-3 (20 updates of 16 minibatches), about 35 s. A random policy scores 8 a game, a learned one 20-32."""
    args = ["--env-id", "Cue-v5", "--total-timesteps", 5120, "--num-steps", 32, "--learning-rate", 1e-3]
    args += ["--eval-episodes", 10]
    assert_a_seed_learns(lambda seed: run_on_standin(script, [*args, "--seed", seed], workdir)[0], learned_the_cue)


@pytest.mark.benchmark
@pytest.mark.learning
def test_learns_breakout_well_above_a_random_policy(workdir):
    """About 3 minutes on a 2-core CPU: 98,304 steps with CleanRL's settings except 8 minibatches and a doubled
    learning rate (twice the gradient steps on the same samples). Seeds 1-3 evaluated 5-6 (20 games). The async
    script runs the same update on differently ordered steps: its learning is held by the cue task above."""
    args = [
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
    ]
    summary, _ = run_script(SCRIPT, args, workdir)
    random_scores = random_policy_scores(SCRIPT, "Breakout-v5", 30, seed=1, training=False)  # about 1.5
    trained = np.array(summary["eval_returns"])
    assert_beats_random(trained, random_scores, factor=2)
    assert summary["return_mean"] >= 2 * random_scores.mean()  # the last 20 training games, true score
