"""IMPALA (Espeholt et al. 2018) with V-trace, and LASER's replay (Schmitt et al. 2019), actors on Ray, one file.

Ray actors step their envs with a CPU copy of the policy and send unrolls; the learner (on the GPU if there is one)
runs one forward-backward per sample, where PPO runs several epochs, and V-trace corrects for the policy lag that
buys. Each actor has a second unroll queued, so it never waits for the learner beyond fetching weights. The same
command runs on a laptop (a local Ray instance) or a cluster (--ray-address auto); only the learner's loss is compiled.
    python leanrl_scripts/impala_ray.py --env-id Breakout-v5 --num-actors 4 --compile
"""

import atexit
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

# Idle OpenMP threads sleep instead of spinning: a spinning pool takes the cores that the actors (or other programs)
# need. Set before torch loads OpenMP (the actors inherit it); it costs a wake-up (tens of microseconds) per kernel.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import gymnasium as gym
import numpy as np

try:
    import ray
except ModuleNotFoundError:  # --help works without it; a run stops with the line that installs it
    ray = None
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro
from tensordict.nn import CudaGraphModule

from run_bookkeeping import Flag, Run, RunArgs, check_spaces, fail, game_mp4, stop_if_signalled, usable_cores


@dataclass
class Args(RunArgs):
    env_id: str = "Breakout-v5"
    """an envpool Atari game (Breakout-v5: CNN) or a gymnasium id with flat observations (CartPole-v1: MLP)"""
    total_timesteps: int = 10_000_000
    """fresh environment steps the learner trains on, all actors together (0 only with --load-model: evaluate it)"""
    ray_address: str = ""
    """empty: start a local Ray instance; "auto": join the cluster this machine is part of; or host:port"""
    num_actors: Flag.Count = 2
    """the number of Ray actors"""
    envs_per_actor: Flag.Count = 8
    """the environments each actor steps as one batch"""
    unroll_length: Flag.Count = 20
    """steps per unroll (each unroll also carries the observation after its last step)"""
    batch_size: Flag.Count = 32
    """unrolls (one env's trajectory each) per learner update, replayed ones included"""
    broadcast_every: Flag.Count = 1
    """publish the learner's weights to the actors every this many updates"""
    resnet: bool = False
    """Atari: IMPALA's 15-layer residual network instead of the Nature CNN"""
    lstm: bool = False
    """an LSTM core between the torso and the heads (the learner replays each batch through it in one padded call)"""
    hide_obs: tuple[int, ...] = ()
    """flat observations: entries the agent sees as zeros, a task that needs memory (CartPole-v1 --hide-obs 1 3
    hides both velocities: only --lstm learns it)"""
    learning_rate: Flag.Positive = 6e-4
    """the learning rate of Adam"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to 0 over the run"""
    gamma: Flag.Fraction = 0.99
    """the discount factor gamma"""
    norm_adv: bool = True
    """normalize the policy-gradient advantages over each batch (PPO's trick, not the paper's: on CartPole it turned
    runs that swung between 200 and 500 into ones that stay near 500)"""
    norm_reward: bool = True
    """flat observations: divide the rewards by a running std of the discounted return (Atari's are clipped to their
    sign instead). On CartPole the value targets then stay near 3, not 100: unscaled, runs that rose above 300 often
    fell back to 150-250 within a million steps"""
    ent_coef: Flag.AtLeast0 = 0.01
    """coefficient of the entropy bonus"""
    vf_coef: Flag.AtLeast0 = 0.5
    """coefficient of the value loss"""
    max_grad_norm: Flag.Positive = 0.5
    """the maximum norm for the gradient clipping"""
    rho_clip: Flag.Positive = 1.0
    """V-trace: clip of the importance weights in the value targets (rho bar)"""
    pg_rho_clip: Flag.Positive = 1.0
    """V-trace: clip of the importance weights in the policy gradient"""
    c_clip: Flag.Positive = 1.0
    """V-trace: clip of the trace-cutting coefficients (c bar)"""
    replay_ratio: float = 0.0
    """LASER: the fraction of each batch replayed from recent unrolls (0: no replay, on-policy IMPALA)"""
    trust_region: Flag.AtLeast0 = 0.02
    """LASER: an unroll whose behaviour policy is further than this mean KL from the current one: no policy gradient"""
    replay_size: Flag.Count = 1000
    """LASER: how many of the most recent unrolls the replay keeps (on the learner's device)"""
    measure_burnin: Flag.CountFrom0 = 3
    """learner updates that the speed figure leaves out (actor start-up, compilation, graph capture)"""


def env_kind(env_id):
    """'atari' for an envpool Atari game, 'classic' for a gymnasium env with flat observations and discrete actions."""
    try:
        import envpool  # only the Atari games need it

        if env_id in envpool.list_all_envs() and type(envpool.make_spec(env_id)).__name__ == "AtariEnvSpec":
            return "atari"
    except ImportError:
        envpool = None
    try:
        env = gym.make(env_id)
    except Exception as error:  # an unknown id, a missing ROM or package, an old version
        missing = "" if envpool else '; Atari games need envpool: pip install ".[envpool]"'
        known = "an envpool Atari game (Breakout-v5) or a gymnasium id (CartPole-v1)"
        fail(f"unknown env id '{env_id}': {known} ({error}){missing}")
    env.close()  # only its spaces are needed
    hint = "give Atari games by their envpool id (Breakout-v5)"
    check_spaces(env_id, env.action_space, gym.spaces.Discrete, env.observation_space, gym.spaces.Box, hint)
    return "classic"


def make_envs(env_id, num_envs, seed=0, training=True, hide_obs=(), render=False):
    """Atari: envpool's preprocessing (noop starts, frame skip 4, 84x84 grey, 4 stacked frames); training envs end an
    episode at each lost life and clip rewards, info["reward"] and info["terminated"] keep the true game.
    Classic control: a gymnasium vector env that resets in the step that ends an episode, `hide_obs` zeroed."""
    if env_kind(env_id) == "atari":
        import envpool

        threads = min(num_envs, usable_cores())  # one per env up to those: envpool's default counts the host's cores
        game = dict(episodic_life=training, reward_clip=training, render_mode="rgb_array" if render else None)
        return envpool.make(env_id, env_type="gymnasium", num_envs=num_envs, num_threads=threads, seed=seed, **game)

    def make_env():
        env = gym.make(env_id, render_mode="rgb_array" if render else None)
        if not hide_obs:
            return env
        mask = np.ones(env.observation_space.shape, env.observation_space.dtype)
        mask[list(hide_obs)] = 0
        return gym.wrappers.TransformObservation(env, lambda obs: obs * mask, env.observation_space)

    envs = gym.vector.SyncVectorEnv([make_env] * num_envs, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    envs.reset(seed=seed)  # later resets continue this seeded stream
    return envs


def spaces(envs):
    """One env's observation shape and number of actions: envpool's spaces are one env's, gymnasium's batched."""
    obs_space = getattr(envs, "single_observation_space", envs.observation_space)
    return obs_space.shape, int(getattr(envs, "single_action_space", envs.action_space).n)


def game_over(infos, terminations, truncations):
    """The end of a whole game: envpool's Atari envs end an episode at each lost life, info["terminated"] the game."""
    return np.asarray(infos.get("terminated", terminations), dtype=bool) | truncations


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias_const)
    return layer


class ResidualBlock(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv0 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return x + self.conv1(F.relu(self.conv0(F.relu(x))))


def conv_sequence(in_channels, out_channels):
    """One of IMPALA's three stages: a convolution, a stride-2 max-pool, two residual blocks."""
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, padding=1),
        nn.MaxPool2d(3, stride=2, padding=1),
        ResidualBlock(out_channels),
        ResidualBlock(out_channels),
    )


class Agent(nn.Module):
    """A torso (Nature CNN or IMPALA's ResNet, shared by both heads; two 64-64 MLPs for flat observations), with
    `lstm` an LSTM core after it, and a policy and a value head. The caller carries the core's state: (h, c), each
    (1, B, lstm_size), of size 0 without a core, so one code path serves both."""

    def __init__(self, obs_shape, num_actions, resnet=False, lstm=False):
        super().__init__()
        self.pixels = len(obs_shape) == 3
        self.value_torso = None
        if not self.pixels:  # two torsos: on small problems the value loss's gradients swamp a shared one
            self.torso, self.value_torso = (
                nn.Sequential(
                    layer_init(nn.Linear(obs_shape[0], 64)), nn.Tanh(), layer_init(nn.Linear(64, 64)), nn.Tanh()
                )
                for _ in range(2)
            )
        elif resnet:
            self.torso = nn.Sequential(
                conv_sequence(obs_shape[0], 16),
                conv_sequence(16, 32),
                conv_sequence(32, 32),
                nn.ReLU(),
                nn.Flatten(),
                nn.Linear(32 * 11 * 11, 256),
                nn.ReLU(),
            )
        else:
            self.torso = nn.Sequential(
                layer_init(nn.Conv2d(obs_shape[0], 32, 8, stride=4)),
                nn.ReLU(),
                layer_init(nn.Conv2d(32, 64, 4, stride=2)),
                nn.ReLU(),
                layer_init(nn.Conv2d(64, 64, 3, stride=1)),
                nn.ReLU(),
                nn.Flatten(),
                layer_init(nn.Linear(64 * 7 * 7, 512)),
                nn.ReLU(),
            )
        if self.pixels:  # mkldnn's channels-last convolutions are about twice as fast on CPU
            self.torso = self.torso.to(memory_format=torch.channels_last)
        features = self.torso[-2].out_features
        self.lstm_size = (256 if self.pixels else 64) if lstm else 0
        if lstm:
            self.lstm = nn.LSTM(features, self.lstm_size)
            for name, param in self.lstm.named_parameters():
                if "bias" in name:
                    nn.init.constant_(param, 0)
                else:
                    nn.init.orthogonal_(param, 1.0)
            features = self.lstm_size
        self.policy_head = layer_init(nn.Linear(features, num_actions), std=0.01)
        value_features = features + (64 if self.value_torso is not None and lstm else 0)
        self.value_head = layer_init(nn.Linear(value_features, 1), std=1.0)

    def initial_state(self, batch, device=None):
        return tuple(torch.zeros(1, batch, self.lstm_size, device=device) for _ in range(2))

    def forward(self, obs, state):
        """One step of B envs: obs (B, ...) -> logits (B, A), values (B,), the core's next state."""
        hidden = self.features(obs)
        if self.lstm_size:
            hidden, state = self.lstm(hidden[None], state)
            hidden = hidden[0]
        return *self.heads(hidden, obs), state

    def replay(self, obs, state, layout):
        """B unrolls at once: obs (T + 1, B, ...) from the core's start states `state` -> logits (T + 1, B, A) and
        values (T + 1, B). The core runs once over the unrolls' episode segments, laid out by `segment_layout`."""
        steps, batch = obs.shape[:2]
        hidden = self.features(obs.flatten(0, 1))
        if self.lstm_size:
            hidden = lstm_padded(self.lstm, hidden.view(steps, batch, -1), *state, *layout).flatten(0, 1)
        logits, values = self.heads(hidden, obs.flatten(0, 1))
        return logits.view(steps, batch, -1), values.view(steps, batch)

    def features(self, obs):
        if self.pixels:
            obs = obs.contiguous(memory_format=torch.channels_last) / 255.0
        return self.torso(obs)

    def heads(self, hidden, obs):
        if self.value_torso is None:
            return self.policy_head(hidden), self.value_head(hidden).squeeze(-1)
        value_hidden = self.value_torso(obs)
        if self.lstm_size:  # the core's memory, read without training it (the value's own torso keeps its gradients)
            value_hidden = torch.cat([value_hidden, hidden.detach()], -1)
        return self.policy_head(hidden), self.value_head(value_hidden).squeeze(-1)


@torch.compiler.disable  # eager under --compile: dynamo does not trace nn.LSTM (it would unroll the time steps)
def lstm_padded(lstm, features, h, c, frame_index, state_index, output_index):
    """The core's outputs (T, B, size) for features (T, B, F) in one LSTM call over left-aligned episode segments
    (see `segment_layout`). Row T*B of the flattened features and row B of the states are the zeros padding reads."""
    num_steps, batch = features.shape[:2]
    flat_features = torch.cat([features.flatten(0, 1), features.new_zeros(1, features.shape[-1])])
    initial_h = torch.cat([h[0], h.new_zeros(1, h.shape[-1])])[state_index]
    initial_c = torch.cat([c[0], c.new_zeros(1, c.shape[-1])])[state_index]
    outputs, _ = lstm(flat_features[frame_index], (initial_h[None], initial_c[None]))
    return outputs.flatten(0, 1)[output_index].view(num_steps, batch, -1)


def segment_layout(dones):
    """Host-side plan for `lstm_padded`, from the dones (T, B) of a batch of unrolls (dones[t]: the step from obs t
    ended an episode). Each unroll is cut where an episode starts (its first segment continues the state it started
    from); segment s is column s of a (T + 1, S_pad) batch, S_pad the next power of two of the segment count, so
    compiled code and CUDA graphs see few shapes. Padding costs (S_pad - B) x (T + 1) steps of the core.
    Returns frame_index (T + 1, S_pad) into the flattened (t * B + b) features, (T + 1) * B for padding;
    state_index (S_pad,): the unroll whose start state opens the segment, B for zeros; output_index ((T + 1) * B,)
    into the flattened (position * S_pad + segment) outputs."""
    batch = dones.shape[1]
    starts = np.concatenate([np.ones((1, batch), dtype=bool), dones.astype(bool)])  # (T + 1, B): obs t opens one
    num_steps = len(starts)
    segment = np.cumsum(starts.T.ravel()).reshape(batch, num_steps).T - 1  # (T + 1, B): segment of each step
    num_segments = segment[-1, -1] + 1
    padded_segments = max(batch, 1 << int(num_segments - 1).bit_length())
    start_time = np.zeros(num_segments, dtype=np.int64)
    times, unrolls = np.nonzero(starts)
    start_time[segment[times, unrolls]] = times
    position = np.arange(num_steps)[:, None] - start_time[segment]  # (T + 1, B): step within its segment
    frame_index = np.full((num_steps, padded_segments), num_steps * batch, dtype=np.int64)
    frame_index[position, segment] = np.arange(num_steps * batch).reshape(num_steps, batch)
    state_index = np.full(padded_segments, batch, dtype=np.int64)
    state_index[segment[0]] = np.arange(batch)
    output_index = (position * padded_segments + segment).ravel()
    return frame_index, state_index, output_index


class Unrolls(NamedTuple):
    """A batch of B unrolls of T steps, as the actors send them and the learner trains on them (one column each)."""

    obs: torch.Tensor  # (T + 1, B, ...): the observation after the last step closes the unroll
    actions: torch.Tensor  # (T, B)
    behaviour_logits: torch.Tensor  # (T, B, A): the actor's policy
    rewards: torch.Tensor  # (T, B), with a time limit's bootstrap added
    dones: torch.Tensor  # (T, B): the step ended an episode
    initial_h: torch.Tensor  # (1, B, lstm_size): the core's state the unroll started from (size 0 without a core)
    initial_c: torch.Tensor


class RewardScale:
    """Rewards divided by the running std of the discounted return G <- gamma G + r (reset at each episode's end),
    gymnasium's NormalizeReward over all of an actor's envs at once, with its statistics (a prior variance of 1 over
    1e-4 samples). An actor restarted after a crash starts its statistics again."""

    def __init__(self, num_envs, gamma):
        self.discounted = np.zeros(num_envs)
        self.gamma = gamma
        self.returns = gym.wrappers.utils.RunningMeanStd(shape=())

    def __call__(self, rewards, dones):
        self.discounted = self.gamma * self.discounted + rewards
        self.returns.update(self.discounted)
        self.discounted *= 1.0 - dones
        return rewards / np.sqrt(self.returns.var + 1e-8)


def policy(obs, state, *, agent, greedy=False):
    """Actions (sampled; `greedy`: the mode), their logits and the core's next state."""
    logits, _, state = agent(obs, state)
    # Gumbel-max: a sample of the softmax
    return (logits if greedy else logits - torch.empty_like(logits).exponential_().log()).argmax(-1), logits, state


class UnrollActor:
    """A Ray actor: its own envs and a CPU copy of the policy; each call returns one unroll of every env."""

    def __init__(self, args, actor_index):
        torch.set_num_threads(1)  # actors share the machine with each other and with the learner
        torch.manual_seed(args.seed + 1000 * actor_index)
        self.envs = make_envs(args.env_id, args.envs_per_actor, args.seed + 1000 * actor_index, hide_obs=args.hide_obs)
        self.agent = Agent(*spaces(self.envs), args.resnet, args.lstm)
        self.agent.requires_grad_(False)
        self.unroll_length = args.unroll_length
        self.gamma = args.gamma
        self.version = -1
        self.obs = self.envs.reset()[0]
        self.state = self.agent.initial_state(args.envs_per_actor)  # the core's, carried across unrolls
        self.node = f"{ray.util.get_node_ip_address()}/{ray.get_runtime_context().get_node_id()[:8]}"
        self.episode_returns = np.zeros(args.envs_per_actor)
        flat = not self.agent.pixels
        self.reward_scale = RewardScale(args.envs_per_actor, args.gamma) if args.norm_reward and flat else None

    def unroll(self, weights, version):
        """Returns the unroll (the fields of Unrolls, numpy arrays), the weights' version that acted, finished games'
        true scores and the seconds spent (all, and in the envs)."""
        start = time.perf_counter()
        env_seconds = 0.0
        finished = []
        if version != self.version:
            self.agent.load_state_dict(weights)
            self.version = version
        steps = self.unroll_length
        num_envs = len(self.obs)
        obs = np.empty((steps + 1, *self.obs.shape), dtype=self.obs.dtype)
        actions = np.empty((steps, num_envs), np.int64)
        rewards = np.empty((steps, num_envs), np.float32)
        dones = np.empty((steps, num_envs), np.float32)
        logits = np.empty((steps, num_envs, self.agent.policy_head.out_features), np.float32)
        initial_h, initial_c = (part.numpy().copy() for part in self.state)
        for t in range(steps):
            obs[t] = self.obs
            actions[t], logits[t], self.state = policy(torch.from_numpy(self.obs), self.state, agent=self.agent)
            env_start = time.perf_counter()
            self.obs, rewards[t], terminations, truncations, infos = self.envs.step(actions[t])
            env_seconds += time.perf_counter() - env_start
            dones[t] = terminations | truncations
            self.episode_returns += infos.get("reward", rewards[t])
            for env in np.flatnonzero(game_over(infos, terminations, truncations)):
                finished.append(float(self.episode_returns[env]))
                self.episode_returns[env] = 0.0
            if self.reward_scale:  # after the true score is counted, before a time limit adds its bootstrap value
                rewards[t] = self.reward_scale(rewards[t], dones[t])
            cut = truncations & ~terminations  # a time limit: the episode could have gone on, so bootstrap from its
            if cut.any() and "final_obs" in infos:  # last state (gymnasium only; envpool's Atari limit is 27k steps)
                final_obs = torch.from_numpy(np.stack(infos["final_obs"][cut]))
                final_state = tuple(part[:, cut] for part in self.state)
                rewards[t, cut] += self.gamma * self.agent(final_obs, final_state)[1].numpy()
            keep = torch.from_numpy(1.0 - dones[t]).view(1, -1, 1)  # a new episode starts from a zero state
            self.state = tuple(part * keep for part in self.state)
        obs[steps] = self.obs
        unroll = Unrolls(obs, actions, logits, rewards, dones, initial_h, initial_c)
        result = dict(unroll=unroll, version=self.version, returns=finished, node=self.node, env_seconds=env_seconds)
        return {**result, "seconds": time.perf_counter() - start}


def vtrace(log_rhos, discounts, rewards, values, bootstrap_value, *, rho_clip=1.0, pg_rho_clip=1.0, c_clip=1.0):
    """V-trace targets vs_t and policy-gradient advantages (Espeholt et al. 2018, eq. 1 and section 4.2).
    Shapes (T, B), bootstrap_value (B,); discounts are gamma, or 0 where an episode ended.
    vs_t - V_t = rho_t delta_t + gamma_t c_t (vs_{t+1} - V_{t+1}) is a linear recurrence, run as a log-depth scan:
    after the round with offset s, each entry sums the next 2s terms, so log2(T) rounds cover the unroll."""
    rhos = log_rhos.exp()
    next_values = torch.cat([values[1:], bootstrap_value[None]])
    corrections = rhos.clamp(max=rho_clip) * (rewards + discounts * next_values - values)
    coeffs = discounts * rhos.clamp(max=c_clip)
    offset = 1
    while offset < len(corrections):
        later = coeffs[:-offset] * corrections[offset:]  # what the entries `offset` steps ahead add
        corrections = torch.cat([corrections[:-offset] + later, corrections[-offset:]])
        coeffs = torch.cat([coeffs[:-offset] * coeffs[offset:], coeffs[-offset:]])
        offset *= 2
    vs = values + corrections
    next_vs = torch.cat([vs[1:], bootstrap_value[None]])
    return vs, rhos.clamp(max=pg_rho_clip) * (rewards + discounts * next_vs - values)


def impala_loss(unrolls, layout, *, agent, args):
    """The IMPALA loss of a batch of Unrolls (`layout`: their `segment_layout` for the core, else empty), and its
    metrics on the device."""
    actions = unrolls.actions
    dones = unrolls.dones
    rewards = unrolls.rewards
    T = len(actions)
    logits, values = agent.replay(unrolls.obs, (unrolls.initial_h, unrolls.initial_c), layout)
    log_probs = logits[:-1].log_softmax(-1)
    action_log_probs = log_probs.gather(-1, actions[..., None]).squeeze(-1)
    behaviour_log_probs_all = unrolls.behaviour_logits.log_softmax(-1)
    behaviour_log_probs = behaviour_log_probs_all.gather(-1, actions[..., None]).squeeze(-1)
    with torch.no_grad():
        log_rhos = action_log_probs - behaviour_log_probs
        clips = dict(rho_clip=args.rho_clip, pg_rho_clip=args.pg_rho_clip, c_clip=args.c_clip)
        vs, pg_advantages = vtrace(log_rhos, args.gamma * (1.0 - dones), rewards, values[:-1], values[-1], **clips)
        # LASER's trust region: an unroll whose behaviour policy is too far from the current one (mean KL over its
        # steps) gives no policy gradient; V-trace still learns values from it. Fresh unrolls are almost always in.
        kl = (behaviour_log_probs_all.exp() * (behaviour_log_probs_all - log_probs)).sum(-1).mean(0)
        trusted = (kl <= args.trust_region).float()
    if args.norm_adv:
        pg_advantages = (pg_advantages - pg_advantages.mean()) / (pg_advantages.std() + 1e-8)
    pg_loss = -(pg_advantages * action_log_probs * trusted).sum() / (T * trusted.sum().clamp(min=1.0))
    value_loss = 0.5 * (vs - values[:-1]).pow(2).mean()
    entropy = -(log_probs.exp() * log_probs).sum(-1).mean()
    loss = pg_loss + args.vf_coef * value_loss - args.ent_coef * entropy
    return loss, {
        "policy_loss": pg_loss.detach(),
        "value_loss": value_loss.detach(),
        "entropy": entropy.detach(),
        "kl": kl.mean(),
        "trusted_fraction": trusted.mean(),
    }


def update(unrolls, layout, *, loss_fn, agent, optimizer, args):
    """One step on `loss_fn`, the piece --compile compiles with its backward (with --lstm, the graphs on each side of
    the core), while the backward call, the clipping and the fused Adam step, which dynamo does not trace, run
    outside it. Metrics stay on the device."""
    loss, metrics = loss_fn(unrolls, layout, agent=agent, args=args)
    optimizer.zero_grad()
    loss.backward()
    metrics["grad_norm"] = nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm).detach()
    optimizer.step()
    return metrics


def to_device(tensor, device):
    """A host tensor on `device` with no wait: a copy from pageable memory makes the host wait for the stream's
    queued work, one from pinned memory is queued behind it (the caching host allocator hands the pinned block out
    again only once the copy is done)."""
    return tensor.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else tensor


class UnrollReplay:
    """LASER's replay: a ring of the most recent unrolls on the learner's device, sampled uniformly, and their dones
    on the host too (the core's segment layout is planned there). Costs replay_size x (T + 1) observations of
    memory: 1000 Atari unrolls of 20 steps take 0.6 GB."""

    def __init__(self, capacity, unrolls, device):
        self.storage = Unrolls(
            *(torch.zeros((t.shape[0], capacity, *t.shape[2:]), dtype=t.dtype, device=device) for t in unrolls)
        )
        self.host_dones = np.zeros((unrolls.dones.shape[0], capacity), np.float32)
        self.columns = torch.arange(unrolls.dones.shape[1], device=device)  # slots from the cursor, on the device
        self.capacity = capacity
        self.size = 0
        self.cursor = 0

    def add(self, unrolls, host_dones):
        slots = (self.cursor + np.arange(host_dones.shape[1])) % self.capacity
        device_slots = (self.columns + self.cursor) % self.capacity  # the same slots, with no copy to the device
        for stored, fresh in zip(self.storage, unrolls):
            stored[:, device_slots] = fresh
        self.host_dones[:, slots] = host_dones
        self.cursor = (self.cursor + len(slots)) % self.capacity
        self.size = min(self.size + len(slots), self.capacity)

    def sample(self, n):
        """n stored unrolls and their dones on the host, by torch's CPU generator (no device sync)."""
        index = torch.randint(self.size, (n,))
        device_index = to_device(index, self.storage.dones.device)
        return Unrolls(*(stored[:, device_index] for stored in self.storage)), self.host_dones[:, index.numpy()]

    def state_dict(self):
        return dict(storage=list(self.storage), host_dones=self.host_dones, size=self.size, cursor=self.cursor)

    def load_state_dict(self, saved):  # in place, on the learner's device
        for stored, kept in zip(self.storage, saved["storage"]):
            stored.copy_(kept)
        self.host_dones[:], self.size, self.cursor = saved["host_dones"], saved["size"], saved["cursor"]


def connect(address, num_actors):
    """Start a local Ray instance (address None), or join a cluster (an address is probed first, by watch_driver).
    The actors import the run bookkeeping module: on a cluster it goes with the job, for nodes that hold only Ray."""
    num_cpus = None if address else max(os.cpu_count(), num_actors)  # local: one per actor, shared if need be
    job = {"py_modules": [sys.modules[Run.__module__]]} if address else None
    # "local", not None: ray.init(None) joins a cluster that `ray start` made on this machine, or RAY_ADDRESS's
    try:
        ray.init(
            address=address or "local",
            num_cpus=num_cpus,
            runtime_env=job,
            include_dashboard=False,
            logging_level="ERROR",
        )
    except ConnectionError as error:
        fail(f"--ray-address {address}: {error}")
    if not address:
        end_local_ray_with_this_process()


# The reaper: kills the pids it is given when its stdin (a pipe from the driver) ends without the driver's exit mark
RAY_REAPER = """import contextlib, os, signal, sys
if not sys.stdin.read():
    for pid in sys.argv[1:]:
        with contextlib.suppress(OSError):
            os.kill(int(pid), signal.SIGKILL)
"""


def end_local_ray_with_this_process():
    """A driver killed by SIGKILL cannot shut its local Ray down: the GCS and the raylet follow it, but two of Ray's
    agents (about 85 MB each) stay for a minute, reporting the raylet's death to the GCS that is gone (a 60 s
    timeout). A small reaper (plain Python, no torch: a few MB) watches this process's end; every exit Python makes
    marks it first, any other end (SIGKILL, Ray's own _exit) makes it kill the processes the local Ray started."""
    import psutil  # Ray ships it (ray/thirdparty_files) and puts it on the path

    ray_pids = [str(process.pid) for process in psutil.Process().children(recursive=True)]
    read_end, write_end = os.pipe()
    # its own session: Ctrl-C in the terminal is for the driver, which then shuts Ray down itself
    subprocess.Popen([sys.executable, "-c", RAY_REAPER, *ray_pids], stdin=read_end, start_new_session=True)
    os.close(read_end)
    atexit.register(os.write, write_end, b"x")


PR_SET_PDEATHSIG = 1  # prctl's option: a signal to this process when its parent dies


def watch_driver(address):
    """On a cluster, the run goes on in a child process, watched by this one. Ray ends a driver whose machine loses
    its Ray processes (the head going away, when the driver runs on it) with _exit(1): no line, no clean-up. The
    child marks every exit Python makes; an unmarked one is Ray's, and this process says so. Costs a second
    Python process (its memory and start-up) on cluster runs only."""
    if "IMPALA_EXIT_MARK_FD" in os.environ:  # the watched child: mark each exit Python makes, and train
        return atexit.register(os.write, int(os.environ["IMPALA_EXIT_MARK_FD"]), b"x")
    if address != "auto":  # probed before the child starts: ray.init would retry a wrong address for minutes
        host, _, port = address.removeprefix("ray://").rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except (OSError, ValueError) as error:
            fail(f"cannot reach a Ray cluster at --ray-address {address} ({error})")
    marks, mark_end = os.pipe()
    # A driver on another machine than the head keeps its Ray processes when the head goes away, and by default
    # trains on for 60 s, blind, before Ray ends it: 10 s. (A head that comes back needs GCS fault tolerance.)
    env = {"RAY_gcs_rpc_server_reconnect_timeout_s": "10", **os.environ, "IMPALA_EXIT_MARK_FD": str(mark_end)}
    prctl = getattr(ctypes.CDLL(None), "prctl", None)  # Linux: the child gets a SIGTERM if this process is killed
    on_parent_death = prctl and (lambda: prctl(PR_SET_PDEATHSIG, signal.SIGTERM))
    child = subprocess.Popen([sys.executable, *sys.argv], pass_fds=[mark_end], env=env, preexec_fn=on_parent_death)
    os.close(mark_end)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the child too (one process group)
    signal.signal(signal.SIGTERM, lambda signum, frame: child.send_signal(signum))
    code = child.wait()
    if not os.read(marks, 1):  # Python never got to exit: Ray ended the child, or a signal did
        cause = (
            f"the driver was killed by {signal.Signals(-code).name}"
            if code < 0
            else f"Ray ended the driver: the Ray cluster at --ray-address {address} went away (its head, or the Ray "
            f"processes on this machine, stopped)"
        )
        print(f"error: {cause}; no summary was written", file=sys.stderr)
    sys.exit(code if code >= 0 else 128 - code)


class ActorPool:
    """The Ray actors and their calls in flight, two per actor (the second is queued, so an actor never idles).
    A dead actor (a crash, a lost node) is restarted by Ray; its calls in flight fail and count as lost unrolls,
    its death once as a restart. An actor that cannot start, or whose code raises, ends the run: one error line."""

    def __init__(self, args, agent, version):
        # SPREAD: on a cluster, one actor per node in turn rather than filling the first node's CPUs
        remote = ray.remote(num_cpus=1, max_restarts=-1, max_task_retries=0, scheduling_strategy="SPREAD")
        self.actors = [remote(UnrollActor).remote(args, index) for index in range(args.num_actors)]
        self.envs_per_actor = args.envs_per_actor
        self.publish(agent, version)
        self.pending = {}
        self.calls = 0  # call in flight -> (actor index, call number)
        # Per actor, None while it is up, else the number of the last call made before a failure was seen: a call
        # made earlier may still succeed (it ran before the death) or fail; only a later one shows it is back.
        self.down_since = [None] * args.num_actors
        self.restarts = self.unrolls_lost = 0
        self.nodes = ["starting"] * args.num_actors  # where each actor's last unroll came from: "IP/node id"
        for index in [*range(args.num_actors)] * 2:
            self.call(index)

    def call(self, index):
        self.calls += 1
        self.pending[self.actors[index].unroll.remote(self.weights, self.version)] = index, self.calls

    def publish(self, agent, version):
        """The actors' next calls fetch the agent's weights, as they are now, through the object store."""
        self.weights = ray.put({k: v.cpu() for k, v in agent.state_dict().items()})
        self.version = version

    def next_unroll(self):
        """The result of the next call that succeeds, and the seconds spent waiting for it."""
        waited = 0.0
        while True:
            wait_start = time.perf_counter()
            (ready,), _ = ray.wait(list(self.pending), num_returns=1)
            waited += time.perf_counter() - wait_start
            index, number = self.pending.pop(ready)
            try:
                result = ray.get(ready)
            except ray.exceptions.RayActorError as error:  # the actor died: Ray restarts it, this call is lost
                self.count_loss(index, error)
                result = None
            except ray.exceptions.RayTaskError as error:  # an exception in the actor's code: a bug, not a crash
                actor_error(index, "failed", error)
            self.call(index)
            if result is not None:
                if self.down_since[index] is not None and number > self.down_since[index]:
                    self.down_since[index] = None
                self.nodes[index] = result["node"]
                return result, waited

    def count_loss(self, index, error):
        if error.actor_init_failed:  # it cannot even start (a package missing on a node?): restarts won't help
            actor_error(index, "could not start", error)
        self.unrolls_lost += self.envs_per_actor
        if self.down_since[index] is None:  # the first failed call of this death (the calls queued behind fail too)
            self.restarts, self.down_since[index], self.nodes[index] = self.restarts + 1, self.calls, "restarting"
            print(f"warning: actor {index} died; Ray restarts it ({type(error).__name__})", file=sys.stderr)


def actor_error(index, what, error):
    """An actor's error that restarts will not mend ends the run: one line, exit code 1."""
    print(f"error: actor {index} {what}: {str(error).strip().splitlines()[-1]}", file=sys.stderr)
    sys.exit(1)


def first_screen(envs):
    """The first env's screen: envpool renders env 0 by its id, a gymnasium vector env through its first env."""
    return envs.envs[0].render() if isinstance(envs, gym.vector.SyncVectorEnv) else envs.render()[0]


@torch.no_grad()
def evaluate(agent, args, device, video_folder=None):
    """True score of the first whole game in each of --eval-episodes envs (the first env's recorded in `video_folder`).
    Flat observations: the greedy action; Atari: sampled actions, since a greedy policy can stall (Breakout: never
    launching a new ball) until the time limit."""
    envs = make_envs(
        args.env_id, args.eval_episodes, args.seed + 10_000, False, args.hide_obs, render=video_folder is not None
    )
    torch.manual_seed(args.seed)  # sampled actions: a checkpoint evaluates to the score its run reported
    obs, _ = envs.reset()
    # one frame per agent step: an Atari step is 4 frames at 60 Hz (15 fps), a classic one its env's render_fps
    fps = 15 if agent.pixels else envs.envs[0].metadata.get("render_fps", 30)
    video = game_mp4(video_folder, first_screen(envs), fps) if video_folder else None
    returns = np.zeros(len(obs))
    finished = np.zeros(len(obs), dtype=bool)
    state = agent.initial_state(len(obs), device)
    while not finished.all():
        stop_if_signalled()
        actions, _, state = policy(torch.as_tensor(obs, device=device), state, agent=agent, greedy=not agent.pixels)
        obs, rewards, terminations, truncations, infos = envs.step(actions.cpu().numpy())
        if video and not finished[0]:
            video.write_frame(first_screen(envs))
        returns += infos.get("reward", rewards) * ~finished
        finished |= game_over(infos, terminations, truncations)
        keep = torch.as_tensor(~(terminations | truncations), dtype=torch.float32, device=device).view(1, -1, 1)
        state = tuple(part * keep for part in state)
    if video:
        video.close()
    envs.close()
    return returns.tolist()


if __name__ == "__main__":
    args = tyro.cli(Args)
    args.env_id = args.env_id.replace("NoFrameskip-v4", "-v5")  # CleanRL's Atari ids: the same game and settings
    if ray is None:
        fail('Ray is not installed: pip install ".[ray]"')
    if args.ray_address:
        watch_driver(args.ray_address)
    run = Run(args)
    if not 0.0 <= args.replay_ratio < 1.0:
        fail(f"--replay-ratio {args.replay_ratio} must be in [0, 1): the fraction of each batch that is replayed")
    num_replayed = round(args.batch_size * args.replay_ratio)
    num_fresh = args.batch_size - num_replayed
    if num_fresh % args.envs_per_actor:
        fresh = f"its {num_fresh} fresh unrolls (--batch-size x (1 - --replay-ratio)) must be a multiple"
        fail(f"each batch takes whole actor calls: {fresh} of --envs-per-actor {args.envs_per_actor}")
    kind = env_kind(args.env_id)
    if args.resnet and kind != "atari":
        fail(f"--resnet is for Atari images; {args.env_id} has flat observations (an MLP)")
    if args.hide_obs and kind == "atari":
        fail(f"--hide-obs is for flat observations; {args.env_id} has images")
    device = run.device
    # a CNN: the usable cores less those of the actors beside it (on a cluster, Ray may place them anywhere); the small
    # MLPs of flat observations: one (waking threads costs them more than the math)
    threads = usable_cores() - (0 if args.ray_address else args.num_actors) if kind == "atari" else 1
    run.tune_cpu(threads=threads, keep_freed_memory=True)

    probe = make_envs(args.env_id, 1)
    obs_shape, num_actions = spaces(probe)
    probe.close()
    for index in args.hide_obs:
        if not 0 <= index < obs_shape[0]:
            fail(f"--hide-obs {index}: {args.env_id}'s observations have entries 0 to {obs_shape[0] - 1}")
    agent = Agent(obs_shape, num_actions, args.resnet, args.lstm).to(device)
    learning_rate = torch.tensor(args.learning_rate, device=device)  # a tensor: annealing never recaptures a graph
    optimizer = torch.optim.Adam(agent.parameters(), lr=learning_rate, eps=1e-5, fused=True, capturable=run.cudagraphs)
    architecture = dict(obs_shape=[*obs_shape], num_actions=num_actions, resnet=args.resnet, lstm=args.lstm)
    run.save_and_load(
        {"agent": agent, "optimizer": optimizer}, **architecture
    )  # the actors get its weights as they start
    # --compile compiles the learner's loss: the function itself, its keyword arguments bound after, so a graph break
    # inside it (the core, with --lstm) resumes there
    loss_fn = torch.compile(impala_loss) if args.compile else impala_loss
    if args.compile:  # dynamo may then hold the LSTM and hand it to the eager lstm_padded, not give the loss up
        torch._dynamo.config.allow_rnn = True
    update_step = partial(update, loss_fn=loss_fn, agent=agent, optimizer=optimizer, args=args)
    # One update graph per padded segment count of the core, made at its first use: a CUDA graph has fixed shapes.
    # Without a core, the layout is empty and there is one. Its first calls compile and initialise Adam's state.
    update_steps = defaultdict(lambda: CudaGraphModule(update_step, warmup=5) if run.cudagraphs else update_step)
    no_layout = tuple(torch.zeros(0, dtype=torch.long, device=device) for _ in range(3))

    # Fresh unrolls are gathered column by column in host memory (pinned on CUDA), then sent to the device at once.
    steps = args.unroll_length
    envs_per_actor = args.envs_per_actor
    calls_per_batch = num_fresh // envs_per_actor
    steps_per_call = steps * envs_per_actor
    pin = device.type == "cuda"
    obs_dtype = torch.uint8 if agent.pixels else torch.float32
    staging = Unrolls(
        torch.empty((steps + 1, num_fresh, *obs_shape), dtype=obs_dtype, pin_memory=pin),
        torch.empty((steps, num_fresh), dtype=torch.long, pin_memory=pin),
        torch.empty((steps, num_fresh, num_actions), pin_memory=pin),
        torch.empty((steps, num_fresh), pin_memory=pin),
        torch.empty((steps, num_fresh), pin_memory=pin),
        *(torch.empty((1, num_fresh, agent.lstm_size), pin_memory=pin) for _ in range(2)),
    )
    staging_np = Unrolls(*(t.numpy() for t in staging))
    replay = UnrollReplay(args.replay_size, staging, device) if num_replayed else None

    metrics = {}
    num_updates = 0
    global_step = 0
    actor_steps = 0
    learner_wait = 0.0
    actor_busy = 0.0
    lags = []
    core_steps = padded_core_steps = 0
    # with --resume: the learner's states and the loop's counters as the last snapshot left them; new actors
    if resumed := run.resumable(**({"replay": replay} if replay else {})):
        num_updates, global_step, lags = resumed["num_updates"], resumed["global_step"], resumed["lags"]
        actor_steps, learner_wait, actor_busy = resumed["actor_steps"], resumed["learner_wait"], resumed["actor_busy"]

    connect(args.ray_address or None, args.num_actors)
    run.start()  # after ray.init, which sets its own SIGTERM handler; before the actors start
    actor_pool = ActorPool(args, agent, num_updates)
    with run.stoppable():
        while global_step < args.total_timesteps:
            loop = dict(num_updates=num_updates, global_step=global_step, lags=lags, actor_steps=actor_steps)
            run.checkpoint_if_due(global_step, **loop, learner_wait=learner_wait, actor_busy=actor_busy)
            if num_updates == args.measure_burnin:
                run.start_speed_measure(global_step)
                learner_wait = actor_busy = actor_steps = 0
            for call_index in range(calls_per_batch):  # each call brings envs_per_actor columns of the batch
                stop_if_signalled()
                result, waited = actor_pool.next_unroll()
                learner_wait += waited
                columns = slice(call_index * envs_per_actor, (call_index + 1) * envs_per_actor)
                for stage, part in zip(staging_np, result["unroll"]):
                    stage[:, columns] = part
                lags.append(num_updates - result["version"])
                actor_steps, global_step = actor_steps + steps_per_call, global_step + steps_per_call
                actor_busy += result["seconds"]
                # per actor: each steps its envs in turn
                run.clock.add_env_seconds(result["env_seconds"] / args.num_actors)
                for episode_return in result["returns"]:
                    run.record_episode(global_step, episode_return)

            if args.anneal_lr:
                learning_rate.fill_(args.learning_rate * max(0.0, 1.0 - global_step / args.total_timesteps))
            # reusing the staging buffers is safe: the metrics read in run.log waits for the update, hence the copy
            batch = Unrolls(*(t.to(device, non_blocking=True) for t in staging))
            host_dones = staging_np.dones
            if replay is not None:  # fresh unrolls go in first, so the first batches replay them rather than zeros
                replay.add(batch, host_dones)
                replayed, replayed_dones = replay.sample(num_replayed)
                batch = Unrolls(*(torch.cat([fresh, old], 1) for fresh, old in zip(batch, replayed)))
                host_dones = np.concatenate([host_dones, replayed_dones], 1)
            layout = no_layout
            if args.lstm:
                layout = tuple(to_device(torch.from_numpy(a), device) for a in segment_layout(host_dones))
                if args.compile:  # one compiled loss for every segment count, not a compile for each
                    torch._dynamo.maybe_mark_dynamic(layout[0], 1)
                    torch._dynamo.maybe_mark_dynamic(layout[1], 0)
                core_steps, padded_core_steps = core_steps + layout[2].numel(), padded_core_steps + layout[0].numel()
            metrics = update_steps[layout[0].shape[-1]](batch, layout)
            num_updates += 1
            if num_updates % args.broadcast_every == 0:
                actor_pool.publish(agent, num_updates)
            run.log(global_step, metrics, charts=dict(policy_lag=lags[-1]))  # one sync per update
    run.end_training(global_step, metrics)
    ray.shutdown()

    steady_updates = num_updates - args.measure_burnin
    summary = dict(num_envs=args.num_actors * envs_per_actor, num_actors=args.num_actors, envs_per_actor=envs_per_actor)
    summary.update(replay_ratio=args.replay_ratio, ray_address=args.ray_address or "local", num_updates=num_updates)
    summary["learner_updates_per_second"] = run.clock.per_steady_second(steady_updates)
    # what the actors would produce if they never waited: their steps over the time their calls took
    summary["actor_sps"] = actor_steps / actor_busy * args.num_actors if actor_busy > 0 else None
    summary.update(learner_wait_seconds=learner_wait, policy_lag_mean=float(np.mean(lags)) if lags else None)
    summary.update(policy_lag_max=max(lags, default=None), actor_restarts=actor_pool.restarts, lstm=args.lstm)
    # actors per node at the end ("restarting": not back yet); the core's padded steps per real one, the cost of
    # replaying a batch in one call
    summary.update(unrolls_lost=actor_pool.unrolls_lost, actor_nodes=dict(Counter(actor_pool.nodes)))
    summary["lstm_padding"] = padded_core_steps / core_steps if core_steps else None
    summary["compiled_pieces"] = ["impala_loss"] if args.compile else []
    sys.exit(run.write_and_evaluate(partial(evaluate, agent, args, device, run.video_folder), summary))
