"""Parallelised Q-Network (PQN, Gallici et al. 2024) on Atari with envpool, one file: Q(lambda) learning without
replay memory or target network.

Speed: pqn.py's tricks with PPO Atari's rollout: byte frames through one pinned buffer, channels-last convolutions
and LayerNorms. Cost: each transition trains update_epochs times, then is dropped.
    python leanrl_scripts/pqn_atari_envpool.py --env-id Breakout-v5 --compile --cudagraphs
"""

import os
import sys
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

# before torch loads OpenMP: idle threads sleep, leaving the cores to envpool
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

try:
    import envpool
except ModuleNotFoundError:  # --help works without it
    envpool = None
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro
from tensordict import from_module
from tensordict.nn import CudaGraphModule

from run_bookkeeping import Flag, Run, RunArgs, fail, game_mp4, stop_if_signalled, usable_cores


@dataclass
class Args(RunArgs):
    env_id: str = "Breakout-v5"
    """the id of the envpool Atari game"""
    total_timesteps: int = 10_000_000
    """total env steps (0 with --load-model: only evaluate)"""
    learning_rate: Flag.Positive = 2.5e-4
    """the learning rate of the optimizer"""
    num_envs: Flag.Count = 8
    """the number of parallel game environments"""
    num_steps: Flag.Count = 128
    """the number of steps per env per rollout"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to 0"""
    gamma: Flag.Fraction = 0.99
    """the discount factor gamma"""
    num_minibatches: Flag.Count = 4
    """the number of mini-batches"""
    update_epochs: Flag.Count = 4
    """the K epochs to update the Q-network"""
    max_grad_norm: Flag.Positive = 10.0
    """the maximum global norm of the gradients"""
    start_e: Flag.Fraction = 1.0
    """the starting epsilon for exploration"""
    end_e: Flag.Fraction = 0.01
    """the ending epsilon for exploration"""
    exploration_fraction: Flag.PositiveFraction = 0.10
    """the fraction of `total_timesteps` from start_e to end_e"""
    q_lambda: Flag.Fraction = 0.65
    """the lambda of the Q(lambda) returns (0: one-step, 1: Monte Carlo)"""
    measure_burnin: Flag.CountFrom0 = 1
    """warm-up iterations the speed figure leaves out"""


def make_envs(env_id, num_envs, seed=0, training=True, render=False):
    """envpool's Atari envs (training ones: a lost life ends the episode, rewards clipped); one worker per env up to
    the usable cores."""
    if env_id not in envpool.list_all_envs():
        fail(f"unknown env id '{env_id}': ids come from envpool.list_all_envs(), Atari games look like Breakout-v5")
    if type(envpool.make_spec(env_id)).__name__ != "AtariEnvSpec":
        fail(f"{env_id} is not an Atari game: classic control runs with pqn.py, continuous control with sac or td3")
    return envpool.make(
        env_id,
        env_type="gymnasium",
        num_envs=num_envs,
        num_threads=min(num_envs, usable_cores()),
        episodic_life=training,
        reward_clip=training,
        seed=seed,
        render_mode="rgb_array" if render else None,
    )


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias_const)
    return layer


class ChannelsLastLayerNorm(nn.LayerNorm):
    """nn.LayerNorm over (C, H, W), computed on the channels-last view with permuted weights: the stock module
    reorders to NCHW and the next convolution back."""

    def forward(self, x):
        nhwc = x.permute(0, 2, 3, 1)
        weight, bias = self.weight.permute(1, 2, 0), self.bias.permute(1, 2, 0)
        return F.layer_norm(nhwc, nhwc.shape[1:], weight, bias, self.eps).permute(0, 3, 1, 2)


class QNetwork(nn.Module):
    """The Nature DQN network with LayerNorms, PQN's stand-in for a target network."""

    def __init__(self, num_actions):
        super().__init__()
        self.network = nn.Sequential(
            layer_init(nn.Conv2d(4, 32, 8, stride=4)),
            ChannelsLastLayerNorm([32, 20, 20]),
            nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2)),
            ChannelsLastLayerNorm([64, 9, 9]),
            nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1)),
            ChannelsLastLayerNorm([64, 7, 7]),
            nn.ReLU(),
            nn.Flatten(),
            layer_init(nn.Linear(64 * 7 * 7, 512)),
            nn.LayerNorm(512),
            nn.ReLU(),
            layer_init(nn.Linear(512, num_actions)),
        ).to(memory_format=torch.channels_last)

    def forward(self, obs):
        # channels-last on bytes, before the division
        return self.network(obs.contiguous(memory_format=torch.channels_last) / 255.0)


def policy(obs, epsilon, *, q_network):
    """Epsilon-greedy actions and greedy values; device-side coins keep it one graph."""
    q_values = q_network(obs)
    values, greedy = q_values.max(-1)
    explore = torch.rand(greedy.shape, device=obs.device) < epsilon
    random_actions = torch.randint_like(greedy, q_values.shape[-1])
    return torch.where(explore, random_actions, greedy), values


def q_lambda_returns(rewards, values, dones, next_value, next_done, *, gamma, q_lambda):
    """Peng's Q(lambda) returns: CleanRL's reverse loop as a log-depth parallel scan. Shapes (T, num_envs);
    `dones[t]`: the step into obs t ended an episode."""
    next_values = torch.cat([values[1:], next_value[None]])
    next_nonterminal = 1.0 - torch.cat([dones[1:], next_done[None]])
    returns = rewards + gamma * next_nonterminal * (1 - q_lambda) * next_values
    returns[-1] += gamma * next_nonterminal[-1] * q_lambda * next_value  # R_T = V_T
    coeffs = gamma * q_lambda * next_nonterminal
    offset = 1
    while offset < len(returns):
        returns = torch.cat([returns[:-offset] + coeffs[:-offset] * returns[offset:], returns[-offset:]])
        coeffs = torch.cat([coeffs[:-offset] * coeffs[offset:], coeffs[-offset:]])
        offset *= 2
    return returns


class Batch(NamedTuple):
    """Rollout tensors flattened over (step, env)."""

    obs: torch.Tensor
    actions: torch.Tensor
    returns: torch.Tensor


def td_loss(minibatch, *, q_network):
    """The TD loss and its metrics on the device."""
    old_val = q_network(minibatch.obs).gather(1, minibatch.actions[:, None]).squeeze(1)
    loss = F.mse_loss(minibatch.returns, old_val)
    return loss, {"td_loss": loss.detach(), "q_values": old_val.mean().detach()}


def update(minibatch, *, loss_fn, q_network, optimizer, max_grad_norm):
    """One step on `loss_fn` (compiled); the clipping and RAdam's step run eagerly."""
    loss, metrics = loss_fn(minibatch, q_network=q_network)
    optimizer.zero_grad()
    loss.backward()
    metrics["grad_norm"] = nn.utils.clip_grad_norm_(q_network.parameters(), max_grad_norm).detach()
    optimizer.step()
    return metrics


def epsilon_at(step, args):
    """The linear epsilon schedule, then end_e."""
    slope = (args.end_e - args.start_e) / (args.exploration_fraction * args.total_timesteps)
    return max(slope * step + args.start_e, args.end_e)


def evaluate(q_network, args, device, video_folder=None):
    """True score of the first game in each of --eval-episodes envs at epsilon 0.05 (a greedy agent can stall)."""
    envs = make_envs(
        args.env_id, args.eval_episodes, seed=args.seed + 10_000, training=False, render=video_folder is not None
    )
    torch.manual_seed(args.seed)  # a checkpoint scores as its run reported
    epsilon = torch.tensor(0.05, device=device)
    obs, _ = envs.reset()
    video = game_mp4(video_folder, envs.render()[0]) if video_folder else None  # envpool renders env 0
    returns = np.zeros(envs.num_envs)
    finished = np.zeros(envs.num_envs, dtype=bool)
    while not finished.all():
        stop_if_signalled()
        with torch.no_grad():
            actions = policy(torch.from_numpy(obs).to(device), epsilon, q_network=q_network)[0]
        obs, rewards, terminations, truncations, _ = envs.step(actions.cpu().numpy())
        if video and not finished[0]:
            video.write_frame(envs.render()[0])
        returns += rewards * ~finished
        finished |= terminations | truncations
    if video:
        video.close()
    envs.close()
    return returns.tolist()


if __name__ == "__main__":
    args = tyro.cli(Args)
    args.env_id = args.env_id.replace("NoFrameskip-v4", "-v5")
    if envpool is None:
        fail('envpool is not installed: pip install ".[envpool]"')
    run = Run(args)
    batch_size = args.num_envs * args.num_steps
    if batch_size % args.num_minibatches:
        fail(f"--num-minibatches {args.num_minibatches} must divide num_envs x num_steps = {batch_size}")
    if 0 < args.total_timesteps < batch_size:
        fail(f"--total-timesteps {args.total_timesteps} is less than one rollout (num_envs x num_steps = {batch_size})")
    minibatch_size = batch_size // args.num_minibatches
    num_iterations = args.total_timesteps // batch_size
    device = run.device
    # every usable core: envs and network take turns
    run.tune_cpu(threads=usable_cores(), keep_freed_memory=True)

    envs = make_envs(args.env_id, args.num_envs, seed=args.seed)
    num_actions = int(envs.action_space.n)
    q_network = QNetwork(num_actions).to(device)
    # a tensor learning rate, filled in place: the graphs never recapture
    learning_rate = torch.tensor(args.learning_rate, device=device)
    optimizer = torch.optim.RAdam(q_network.parameters(), lr=learning_rate, capturable=run.cudagraphs)
    run.save_and_load({"q_network": q_network, "optimizer": optimizer}, num_actions=num_actions)
    q_view = QNetwork(num_actions).to("meta")  # a detached view of the learner's weights
    from_module(q_network).data.to_module(q_view)
    q_view.requires_grad_(False)

    # compile before binding keywords: compiled partials would share one graph cache
    maybe_compile = partial(torch.compile, disable=not args.compile)
    policy_step = partial(maybe_compile(policy), q_network=q_view)
    returns_step = partial(maybe_compile(q_lambda_returns), gamma=args.gamma, q_lambda=args.q_lambda)
    update_step = partial(
        update,
        loss_fn=maybe_compile(td_loss),
        q_network=q_network,
        optimizer=optimizer,
        max_grad_norm=args.max_grad_norm,
    )
    if run.cudagraphs:  # warm-up calls compile and create RAdam's state
        graphed = partial(CudaGraphModule, warmup=5)
        policy_step, returns_step, update_step = map(graphed, (policy_step, returns_step, update_step))

    T = args.num_steps
    frame_shape = envs.observation_space.shape
    # stored channels-last, as the network reads them
    obs = torch.empty(
        (T * args.num_envs, *frame_shape), dtype=torch.uint8, device=device, memory_format=torch.channels_last
    )
    obs = obs.view(T, args.num_envs, *frame_shape)
    actions = torch.zeros((T, args.num_envs), dtype=torch.long, device=device)
    rewards, dones, values = (torch.zeros((T, args.num_envs), device=device) for _ in range(3))
    epsilon = torch.tensor(args.start_e, device=device)  # the graphed policy reads it in place
    # one pinned buffer, reused: the host waits for the actions before the next copy
    staging = torch.empty((args.num_envs, *frame_shape), dtype=torch.uint8, pin_memory=device.type == "cuda")
    staging_np = staging.numpy()

    def to_device(next_obs_np):
        np.copyto(staging_np, next_obs_np)  # numpy's copy: torch's would wake its thread pool
        return staging.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)

    episode_returns = np.zeros(args.num_envs)
    episode_lengths = np.zeros(args.num_envs, dtype=np.int64)
    metrics = {}
    num_updates = 0
    global_step = 0
    first_iteration = 0
    if resumed := run.resumable():
        first_iteration, global_step, num_updates = resumed["iteration"], resumed["global_step"], resumed["num_updates"]
        # envpool cannot save its games mid-episode: new ones, seeded apart
        envs = make_envs(args.env_id, args.num_envs, seed=args.seed + global_step)
    next_obs = to_device(run.timed_env_call(envs.reset)[0])
    next_done = torch.zeros(args.num_envs, device=device)
    run.start()
    with run.stoppable():
        for iteration in range(first_iteration, num_iterations):
            run.checkpoint_if_due(global_step, iteration=iteration, global_step=global_step, num_updates=num_updates)
            if iteration == args.measure_burnin:
                run.start_speed_measure(global_step)
            lr_now = (1.0 - iteration / num_iterations) * args.learning_rate if args.anneal_lr else args.learning_rate
            learning_rate.fill_(lr_now)

            for step in range(T):
                stop_if_signalled()
                global_step += args.num_envs
                obs[step] = next_obs
                dones[step] = next_done
                epsilon.fill_(epsilon_at(global_step, args))
                actions[step], values[step] = policy_step(next_obs, epsilon)
                step_result = run.timed_env_call(envs.step, actions[step].cpu().numpy())
                next_obs_np, reward, terminations, truncations, infos = step_result
                step_data = np.stack([reward, terminations | truncations]).astype(np.float32)
                step_data = torch.from_numpy(step_data).to(device, non_blocking=True)
                rewards[step] = step_data[0]
                next_done = step_data[1]
                next_obs = to_device(next_obs_np)
                # the true score: unclipped rewards, games not lives
                episode_returns += infos["reward"]
                episode_lengths += 1
                for env_id in np.nonzero(infos["terminated"].astype(bool) | truncations)[0]:
                    run.record_episode(global_step, episode_returns[env_id], episode_lengths[env_id])
                    episode_returns[env_id] = 0.0
                    episode_lengths[env_id] = 0

            # next_obs's greedy value bootstraps, as CleanRL's
            next_value = policy_step(next_obs, epsilon)[1]
            returns = returns_step(rewards, values, dones, next_value, next_done)
            batch = Batch(obs.flatten(0, 1), actions.flatten(0, 1), returns.flatten(0, 1))
            minibatch_metrics = []
            for _ in range(args.update_epochs):
                order = torch.randperm(batch_size, device=device)
                for start in range(0, batch_size, minibatch_size):
                    indices = order[start : start + minibatch_size]
                    minibatch_metrics.append(update_step(Batch._make(t[indices] for t in batch)))
                    num_updates += 1
            # means over minibatches, read in the log's one sync
            metrics = {key: torch.stack([m[key] for m in minibatch_metrics]).mean() for key in minibatch_metrics[0]}
            charts = dict(
                learning_rate=lr_now,
                epsilon=epsilon_at(global_step, args),
                avg_episodic_return=run.sinks.recent_return(),  # CleanRL's last 20 games
            )
            run.log(global_step, metrics, charts=charts)
    run.end_training(global_step, metrics)
    envs.close()

    summary = {
        "num_updates": num_updates,
        "compiled_pieces": ["policy", "q_lambda_returns", "td_loss"] if args.compile else [],
    }
    sys.exit(run.write_and_evaluate(partial(evaluate, q_view, args, device, run.video_folder), summary))
