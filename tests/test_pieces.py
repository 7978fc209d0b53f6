"""The pieces of SAC and TD3 against plain reference implementations, and compiled against eager."""

import copy
import math
from functools import partial

import gymnasium as gym
import numpy as np
import pytest
import torch
import torch._inductor.config as inductor_config
import torch.nn as nn

from checks import SPED_UP_CALLS, speed_flags_here, speed_up
from reference_implementations import plain_critics
from script_runs import load_script

OBS_DIM, ACT_DIM, BATCH = 5, 3, 32
SPACE = gym.spaces.Box(np.array([-2.0, -1.0, 0.0], dtype=np.float32), np.array([2.0, 1.0, 0.5], dtype=np.float32))


def make_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    obs, next_obs = torch.randn(BATCH, OBS_DIM, generator=g), torch.randn(BATCH, OBS_DIM, generator=g)
    low, high = torch.tensor(SPACE.low), torch.tensor(SPACE.high)
    actions = low + (high - low) * torch.rand(BATCH, ACT_DIM, generator=g)
    rewards, terminations = torch.randn(BATCH, generator=g), (torch.rand(BATCH, generator=g) < 0.2).float()
    return obs, actions, rewards, next_obs, terminations


CRITICS = {"sac_continuous_action.py": "SoftQNetwork", "td3_continuous_action.py": "QNetwork"}


def assert_ensemble_matches(qnet, critics, atol=1e-5):
    for member, critic in zip(qnet.members, critics, strict=True):
        for name, value in member.state_dict().items():
            torch.testing.assert_close(value, critic.state_dict()[name], atol=atol, rtol=0)


def with_layer_norm(critic_class):
    """The script's critic with a LayerNorm after its first Linear: a change of the critic's definition alone."""

    class Critic(critic_class):
        def __init__(self, *args):
            super().__init__(*args)
            self.net.insert(1, nn.LayerNorm(self.net[0].out_features))

    return Critic


@pytest.mark.parametrize("script", ["sac_continuous_action.py", "td3_continuous_action.py"])
def test_q_ensemble_equals_separate_critics(script):
    module = load_script(script)
    critic_class = getattr(module, CRITICS[script])
    torch.manual_seed(0)
    qnet = module.Ensemble(partial(critic_class, OBS_DIM, ACT_DIM))
    torch.manual_seed(0)  # the members are built one after another, as two plain critics would be
    critics = [critic_class(OBS_DIM, ACT_DIM) for _ in range(2)]
    assert_ensemble_matches(qnet, critics, atol=0)
    assert list(qnet.state_dict()) == [f"members.{k}.{name}" for k in range(2) for name in critics[0].state_dict()]
    obs, actions, *_ = make_batch()
    expected = torch.stack([critic(obs, actions) for critic in critics])
    torch.testing.assert_close(qnet(obs, actions), expected)
    assert not torch.equal(expected[0], expected[1])  # the critics are initialised independently
    if script.startswith("td3"):  # the actor's view: the first critic alone
        torch.testing.assert_close(module.detached_view(qnet.members[0])(obs, actions), expected[0])


ENSEMBLE_SCRIPTS = ["sac_continuous_action.py", "td3_continuous_action.py", "fast_td3.py"]


class NormCritic(nn.Module):
    """A critic with the layers a researcher adds: a LayerNorm, a BatchNorm1d (running statistics) and a dropout
    (p=0, so that a loop over plain critics draws the same numbers)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(OBS_DIM + ACT_DIM, 16),
            nn.LayerNorm(16),
            nn.ReLU(),
            nn.Linear(16, 16),
            nn.BatchNorm1d(16),
            nn.ReLU(),
            nn.Dropout(0.0),
            nn.Linear(16, 1),
        )

    def forward(self, obs, actions):
        return self.net(torch.cat([obs, actions], -1)).squeeze(-1)


def outputs_and_loss(net, obs, actions, weights):
    out = net(obs, actions)
    return out, (out * weights).sum()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compile"])
@pytest.mark.parametrize("script", ENSEMBLE_SCRIPTS)
def test_the_ensemble_equals_a_loop_over_plain_critics_with_norm_layers(script, compiled):
    """Outputs, gradients and each member's BatchNorm statistics, in training mode (two calls) and in eval mode."""
    module = load_script(script)
    torch.manual_seed(0)
    qnet = module.Ensemble(NormCritic)
    torch.manual_seed(0)  # the members are built one after another, as the plain critics are here
    critics = [NormCritic() for _ in range(2)]
    for critic in critics:  # the norms' affine weights moved off their init (ones, zeros): each member's own counts
        for param in critic.parameters():
            param.data.add_(torch.randn_like(param) * 0.1)
    for member, critic in zip(qnet.members, critics):
        member.load_state_dict(critic.state_dict())
    call = torch.compile(outputs_and_loss) if compiled else outputs_and_loss
    obs, actions, *_ = make_batch()
    for step in range(2):
        weights = torch.randn(2, BATCH)
        out, loss = call(qnet, obs * (step + 1), actions, weights)
        loss.backward()
        expected = torch.stack([critic(obs * (step + 1), actions) for critic in critics])
        (expected * weights).sum().backward()
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for member, critic in zip(qnet.members, critics):
        for name, param in member.named_parameters():
            torch.testing.assert_close(param.grad, critic.get_parameter(name).grad, atol=1e-5, rtol=1e-5)
        for name, buffer in member.named_buffers():
            torch.testing.assert_close(buffer, critic.get_buffer(name), atol=1e-6, rtol=1e-6)
    assert [member.net[4].num_batches_tracked.item() for member in qnet.members] == [2, 2]
    assert not torch.equal(qnet.members[0].net[4].running_mean, qnet.members[1].net[4].running_mean)
    qnet.eval()
    for critic in critics:
        critic.eval()
    with torch.no_grad():
        out, _ = call(qnet, obs, actions, torch.ones(2, BATCH))
        torch.testing.assert_close(out, torch.stack([critic(obs, actions) for critic in critics]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("script", ENSEMBLE_SCRIPTS)
def test_each_member_draws_its_own_dropout_mask(script):
    module = load_script(script)

    class Dropped(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(OBS_DIM + ACT_DIM, 64), nn.Dropout(0.5))

        def forward(self, obs, actions):
            return self.net(torch.cat([obs, actions], -1))

    torch.manual_seed(0)
    qnet = module.Ensemble(Dropped)
    # both members the same weights: only their masks can tell them apart
    qnet.members[1].load_state_dict(qnet.members[0].state_dict())
    obs, actions, *_ = make_batch()
    out = qnet(obs, actions)
    full = qnet.members[0].net[0].weight @ torch.cat([obs, actions], -1).T
    full = (full.T + qnet.members[0].net[0].bias) * 2  # dropout scales what it keeps by 1 / (1 - p)
    kept = out != 0
    torch.testing.assert_close(out[kept], full.expand(2, -1, -1)[kept].detach())
    assert not torch.equal(kept[0], kept[1]) and 0.4 < kept.float().mean() < 0.6


@pytest.mark.parametrize("script", ENSEMBLE_SCRIPTS)
def test_the_target_update_lerps_parameters_and_copies_buffers(script):
    module = load_script(script)
    torch.manual_seed(0)
    online = module.Ensemble(NormCritic)
    target = copy.deepcopy(online).requires_grad_(False)
    online(*make_batch()[:2]).sum().backward()  # the BatchNorm statistics (an integer count among them) move
    with torch.no_grad():
        for param in online.parameters():
            param.add_(1.0)
    before = copy.deepcopy(target.state_dict())
    module.soft_update(target, online, 0.1)
    for name, param in online.named_parameters():
        torch.testing.assert_close(target.get_parameter(name), before[name] + 0.1 * (param.detach() - before[name]))
    for name, buffer in online.named_buffers():
        assert torch.equal(target.get_buffer(name), buffer)
    assert all(param.grad_fn is None and not param.requires_grad for param in target.parameters())


def test_replay_buffer_returns_what_was_added_across_wraparound():
    module = load_script("sac_continuous_action.py")
    torch.manual_seed(0)
    buffer = module.ReplayBuffer(size=7, obs_dim=2, act_dim=1, num_envs=3, device=torch.device("cpu"))
    for step in range(4):  # 12 rows into 7 slots: the oldest are overwritten
        obs = np.arange(3 * 2, dtype=np.float64).reshape(3, 2) + 100 * step
        buffer.add(obs, obs[:, :1] * -1, np.full(3, float(step)), obs + 0.5, np.array([0, 1, 0], dtype=bool))
    assert buffer.count == 7
    obs, actions, rewards, next_obs, terminations = buffer.sample(500)
    assert set(rewards.tolist()) == {1.0, 2.0, 3.0}  # step 0 is gone, and so is most of step 1
    torch.testing.assert_close(actions, -obs[:, :1])
    torch.testing.assert_close(next_obs, obs + 0.5)
    torch.testing.assert_close(terminations, (obs[:, 0] % 100 == 2).float())
    assert rewards.shape == terminations.shape == (500,)


def test_sac_log_prob_matches_torch_distributions():
    module = load_script("sac_continuous_action.py")
    torch.manual_seed(0)
    actor = module.Actor(OBS_DIM, SPACE).double()
    obs = make_batch()[0].double()
    torch.manual_seed(1)
    actions, log_prob, mean_action = actor(obs)
    hidden = actor.trunk(obs)
    mean, log_std_raw = actor.mean(hidden), torch.tanh(actor.log_std(hidden))
    log_std = module.LOG_STD_MIN + 0.5 * (module.LOG_STD_MAX - module.LOG_STD_MIN) * (log_std_raw + 1)
    torch.manual_seed(1)
    pre_tanh = mean + log_std.exp() * torch.randn_like(mean)
    squashed = torch.tanh(pre_tanh)
    reference = torch.distributions.Normal(mean, log_std.exp()).log_prob(pre_tanh)
    reference = (reference - torch.log(actor.action_scale * (1 - squashed.pow(2)))).sum(-1)
    torch.testing.assert_close(log_prob, reference)
    torch.testing.assert_close(actions, squashed * actor.action_scale + actor.action_bias)
    torch.testing.assert_close(mean_action, torch.tanh(mean) * actor.action_scale + actor.action_bias)
    assert ((actions >= torch.tensor(SPACE.low)) & (actions <= torch.tensor(SPACE.high))).all()


def build(script, flags=(False, False, "cpu"), seed=0, critic_class=None):
    """Networks, optimizers and the script's update pieces bound to them, as the script's main block does: the
    losses compiled (flags[0]), their updates in CUDA graphs (flags[1]) on flags[2]; `critic_class` in place of the
    script's."""
    module = load_script(script)
    torch.manual_seed(seed)
    actor = module.Actor(OBS_DIM, SPACE)
    qnet = module.Ensemble(partial(critic_class or getattr(module, CRITICS[script]), OBS_DIM, ACT_DIM))
    target_qnet = copy.deepcopy(qnet).requires_grad_(False)
    qnet_view = module.detached_view(qnet) if script.startswith("sac") else module.detached_view(qnet.members[0])
    adam = partial(torch.optim.Adam, fused=True, capturable=flags[1])
    q_optimizer, actor_optimizer = (
        adam(qnet.parameters(), lr=torch.tensor(1e-3)),
        adam(actor.parameters(), lr=torch.tensor(1e-3)),
    )
    nets = dict(actor=actor, qnet=qnet, target_qnet=target_qnet)
    maybe_compile = partial(torch.compile, disable=not flags[0])
    if script.startswith("sac"):
        log_alpha = torch.tensor(math.log(0.2), requires_grad=True)
        alpha = log_alpha.detach().exp()
        alpha_optimizer = adam([log_alpha], lr=torch.tensor(1e-3))
        critic = partial(
            module.update_critics,
            loss_fn=maybe_compile(module.critic_loss),
            optimizer=q_optimizer,
            actor=actor,
            qnet=qnet,
            target_qnet=target_qnet,
            alpha=alpha,
            gamma=0.99,
        )
        entropy = dict(alpha=alpha, log_alpha=log_alpha, target_entropy=-float(ACT_DIM))
        optimizers = [actor_optimizer, alpha_optimizer]
        actor_step = partial(
            module.update_actor,
            loss_fn=maybe_compile(module.actor_loss),
            optimizers=optimizers,
            actor=actor,
            qnet_view=qnet_view,
            **entropy,
        )
        nets.update(alpha=alpha, log_alpha=log_alpha)
    else:
        target_actor = copy.deepcopy(actor).requires_grad_(False)
        args = module.Args(gamma=0.99, policy_noise=0.2, noise_clip=0.5)
        critic = partial(
            module.update_critics,
            loss_fn=maybe_compile(module.critic_loss),
            optimizer=q_optimizer,
            target_actor=target_actor,
            qnet=qnet,
            target_qnet=target_qnet,
            args=args,
        )
        actor_step = partial(
            module.update_actor,
            loss_fn=maybe_compile(module.actor_loss),
            optimizer=actor_optimizer,
            actor=actor,
            qnet_view=qnet_view,
        )
        nets.update(target_actor=target_actor)
    return nets, speed_up(critic, False, flags[1]), speed_up(actor_step, False, flags[1])


@pytest.mark.parametrize("layer_norm", [False, True], ids=["plain", "layer-norm"])
@pytest.mark.parametrize("script", ["sac_continuous_action.py", "td3_continuous_action.py"])
def test_critic_update_equals_a_plain_reference(script, layer_norm):
    critic_class = getattr(load_script(script), CRITICS[script])
    nets, critic_step, _ = build(script, critic_class=with_layer_norm(critic_class) if layer_norm else None)
    critics, targets = (plain_critics(nets[name], OBS_DIM, ACT_DIM) for name in ("qnet", "target_qnet"))
    optimizer = torch.optim.Adam([p for c in critics for p in c.parameters()], lr=1e-3, foreach=False)
    obs, actions, rewards, next_obs, terminations = batch = make_batch()
    actor = nets["actor"] if script.startswith("sac") else nets["target_actor"]
    torch.manual_seed(5)
    with torch.no_grad():
        if script.startswith("sac"):
            next_actions, next_log_prob, _ = actor(next_obs)
            soft_value = torch.minimum(*[t(next_obs, next_actions) for t in targets])
            soft_value = soft_value - nets["alpha"] * next_log_prob
        else:
            noise = (torch.randn(BATCH, ACT_DIM) * 0.2).clamp(-0.5, 0.5) * actor.action_scale
            next_actions = torch.max(
                torch.min(actor(next_obs) + noise, torch.tensor(SPACE.high)), torch.tensor(SPACE.low)
            )
            soft_value = torch.minimum(*[t(next_obs, next_actions) for t in targets])
        target = rewards + 0.99 * (1 - terminations) * soft_value
    losses = [nn.functional.mse_loss(c(obs, actions), target) for c in critics]
    optimizer.zero_grad()
    sum(losses).backward()
    optimizer.step()
    torch.manual_seed(5)
    metrics = critic_step(*batch)
    # CleanRL's tags: each critic's loss, and qf_loss their mean
    torch.testing.assert_close(metrics["qf1_loss"], losses[0].detach())
    torch.testing.assert_close(metrics["qf2_loss"], losses[1].detach())
    torch.testing.assert_close(metrics["qf_loss"], sum(losses).detach() / 2)
    assert_ensemble_matches(nets["qnet"], critics)


@pytest.mark.parametrize("script", ["sac_continuous_action.py", "td3_continuous_action.py"])
def test_actor_update_leaves_the_critics_untouched(script):
    nets, _, actor_step = build(script)
    qnet_before, actor_before = copy.deepcopy(nets["qnet"].state_dict()), copy.deepcopy(nets["actor"].state_dict())
    metrics = actor_step(make_batch()[0])
    assert all(p.grad is None for p in nets["qnet"].parameters())  # the detached view computed no weight grads
    for name, value in nets["qnet"].state_dict().items():
        assert torch.equal(value, qnet_before[name])
    assert any(not torch.equal(v, actor_before[k]) for k, v in nets["actor"].state_dict().items())
    if script.startswith("sac"):
        assert torch.isfinite(metrics["alpha_loss"])
        torch.testing.assert_close(nets["alpha"], nets["log_alpha"].detach().exp())  # alpha follows log_alpha
        assert nets["alpha"].item() != pytest.approx(0.2, abs=1e-6)


@speed_flags_here()
@pytest.mark.parametrize("layer_norm", [False, True], ids=["plain", "layer-norm"])
@pytest.mark.parametrize("script", ["sac_continuous_action.py", "td3_continuous_action.py"])
@inductor_config.patch(fallback_random=True)  # else inductor draws its own random numbers, not eager's
def test_sped_up_updates_equal_eager_ones(script, layer_norm, flags):
    """The scripts' wrapping (checks.speed_up) against eager on the same device, the graphs captured and replayed on
    the GPU. With a LayerNorm added to the critic's definition, the same pieces train it in every mode."""
    critic_class = getattr(load_script(script), CRITICS[script])
    critic_class = with_layer_norm(critic_class) if layer_norm else None
    device = flags[2]
    with torch.device(device):
        eager_nets, eager_critic, eager_actor = build(script, (False, False, device), critic_class=critic_class)
        compiled_nets, compiled_critic, compiled_actor = build(script, flags, critic_class=critic_class)
    for step in range(SPED_UP_CALLS):  # the first calls also cover Adam's state initialisation and any recompile
        batch = [tensor.to(device) for tensor in make_batch(seed=step)]
        results = []
        for critic_step, actor_step in ((eager_critic, eager_actor), (compiled_critic, compiled_actor)):
            torch.manual_seed(100 + step)
            results.append({**critic_step(*batch), **actor_step(batch[0])})
        for name in results[0]:
            torch.testing.assert_close(results[1][name], results[0][name], atol=1e-5, rtol=1e-5)
    for key in ("actor", "qnet"):
        eager_state, compiled_state = eager_nets[key].state_dict(), compiled_nets[key].state_dict()
        for name in eager_state:
            torch.testing.assert_close(compiled_state[name], eager_state[name], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("script", ["sac_continuous_action.py", "td3_continuous_action.py"])
def test_truncated_steps_store_the_final_observation_not_the_reset_one(script):
    module = load_script(script)
    envs = module.make_envs("Pendulum-v1", 2)  # truncates every episode at 200 steps
    envs.action_space.seed(0)
    obs, _ = envs.reset(seed=0)
    for step in range(200):
        next_obs, _, terminations, truncations, infos = envs.step(envs.action_space.sample())
        stored = module.true_next_obs(next_obs, infos)
        if step < 199:
            assert not truncations.any() and stored is next_obs
        obs_before, obs = obs, next_obs
    assert truncations.all() and not terminations.any()
    # Pendulum observes (cos, sin, angular velocity): the final observation continues the trajectory
    # (|velocity| <= 8, dt = 0.05), the reset one starts a new episode anywhere.
    turned = np.arctan2(stored[:, 1], stored[:, 0]) - np.arctan2(obs_before[:, 1], obs_before[:, 0])
    assert (np.abs(np.angle(np.exp(1j * turned))) <= 8 * 0.05 + 1e-6).all()
    np.testing.assert_array_equal(stored, np.stack(infos["final_obs"]))
    assert not np.allclose(stored, next_obs)
    envs.close()
