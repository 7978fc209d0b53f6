"""Proximal Policy Optimization (PPO, Schulman et al. 2017) on Atari with envpool's async mode, one file.

Speed: envpool steps one half of the envs while the network acts for the other half, so the envs' time overlaps
the policy's. Cost: envs come back in any order and some run ahead, so rows past a rollout carry into the next one,
acted on by weights one update older; runs are not bit-reproducible (thread timing).
    python leanrl_scripts/ppo_atari_envpool_async.py --env-id Breakout-v5 --compile --cudagraphs
"""

import os
import sys
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

# Idle OpenMP threads sleep instead of spinning on the cores envpool's workers need; set before torch loads OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

try:
    import envpool
except ModuleNotFoundError:  # --help works without it
    envpool = None
import numpy as np
import torch
import torch.nn as nn
import tyro
from tensordict import from_module
from tensordict.nn import CudaGraphModule

from run_bookkeeping import Flag, Run, RunArgs, fail, game_mp4, stop_if_signalled, usable_cores


@dataclass
class Args(RunArgs):
    env_id: str = "Breakout-v5"
    """the id of the envpool Atari game"""
    total_timesteps: int = 10_000_000
    """total environment steps (0 only with --load-model: evaluate it)"""
    learning_rate: Flag.Positive = 2.5e-4
    """the learning rate of the optimizer"""
    num_envs: Flag.Count = 8
    """the number of parallel environments (even: envpool steps half at a time)"""
    num_steps: Flag.Count = 128
    """the number of steps per env per rollout"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to 0 over the run"""
    gamma: Flag.Fraction = 0.99
    """the discount factor gamma"""
    gae_lambda: Flag.Fraction = 0.95
    """the lambda for the general advantage estimation"""
    num_minibatches: Flag.Count = 4
    """the number of mini-batches"""
    update_epochs: Flag.Count = 4
    """the K epochs to update the policy"""
    norm_adv: bool = True
    """normalize the advantages (per minibatch)"""
    clip_coef: Flag.Positive = 0.1
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """use a clipped loss for the value function"""
    ent_coef: Flag.AtLeast0 = 0.01
    """coefficient of the entropy"""
    vf_coef: Flag.AtLeast0 = 0.5
    """coefficient of the value function"""
    max_grad_norm: Flag.Positive = 0.5
    """the maximum norm for the gradient clipping"""
    target_kl: Flag.AtLeast0 | None = None
    """the target KL divergence threshold (None: none)"""
    measure_burnin: Flag.CountFrom0 = 1
    """iterations the speed figure leaves out"""


def make_envs(env_id, num_envs, batch_size=None, seed=0, training=True, render=False):
    """envpool's Atari preprocessing; training envs end an episode at each lost life and clip rewards."""
    if env_id not in envpool.list_all_envs():
        fail(f"unknown env id '{env_id}': ids come from envpool.list_all_envs(), Atari games look like Breakout-v5")
    if type(envpool.make_spec(env_id)).__name__ != "AtariEnvSpec":
        fail(f"{env_id} is not an Atari game: continuous control runs with ppo_continuous_action.py")
    return envpool.make(
        env_id,
        env_type="gymnasium",
        num_envs=num_envs,
        batch_size=batch_size or num_envs,
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


class Agent(nn.Module):
    """The Nature DQN network with a policy head and a value head."""

    def __init__(self, num_actions):
        super().__init__()
        self.network = nn.Sequential(
            layer_init(nn.Conv2d(4, 32, 8, stride=4)),
            nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2)),
            nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1)),
            nn.ReLU(),
            nn.Flatten(),
            layer_init(nn.Linear(64 * 7 * 7, 512)),
            nn.ReLU(),
        ).to(memory_format=torch.channels_last)
        self.actor = layer_init(nn.Linear(512, num_actions), std=0.01)
        self.critic = layer_init(nn.Linear(512, 1), std=1.0)

    def hidden(self, obs):
        # channels-last on uint8, before the float conversion (a no-op for the storage)
        return self.network(obs.contiguous(memory_format=torch.channels_last) / 255.0)

    def get_value(self, obs):
        return self.critic(self.hidden(obs)).squeeze(-1)

    def get_action_and_value(self, obs, action=None):
        """Categorical policy written out: torch.distributions syncs to check its arguments."""
        hidden = self.hidden(obs)
        log_probs = self.actor(hidden).log_softmax(-1)
        if action is None:  # Gumbel-max sampling
            action = (log_probs - torch.empty_like(log_probs).exponential_().log()).argmax(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        return action, log_probs.gather(-1, action[:, None]).squeeze(-1), entropy, self.critic(hidden).squeeze(-1)


def policy(obs, *, agent):
    """Sampled actions, their log-probabilities and the values."""
    action, log_prob, _, value = agent.get_action_and_value(obs)
    return action, log_prob, value


def gae(rewards, values, dones, next_value, next_done, *, gamma, gae_lambda):
    """GAE's advantages and returns as a parallel scan of log2(T) rounds."""
    next_values = torch.cat([values[1:], next_value[None]])
    next_nonterminal = 1.0 - torch.cat([dones[1:], next_done[None]])
    advantages = rewards + gamma * next_values * next_nonterminal - values
    coeffs = gamma * gae_lambda * next_nonterminal
    offset = 1
    while offset < len(advantages):
        advantages = torch.cat([advantages[:-offset] + coeffs[:-offset] * advantages[offset:], advantages[-offset:]])
        coeffs = torch.cat([coeffs[:-offset] * coeffs[offset:], coeffs[-offset:]])
        offset *= 2
    return advantages, advantages + values


class Batch(NamedTuple):
    """Rollout tensors flattened over (step, env)."""

    obs: torch.Tensor
    actions: torch.Tensor
    logprobs: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    values: torch.Tensor


def ppo_loss(minibatch, *, agent, args):
    """The clipped-surrogate loss of a minibatch and its metrics."""
    _, new_logprob, entropy, new_value = agent.get_action_and_value(minibatch.obs, minibatch.actions)
    advantages = minibatch.advantages
    returns = minibatch.returns
    values = minibatch.values
    logratio = new_logprob - minibatch.logprobs
    ratio = logratio.exp()
    with torch.no_grad():
        old_approx_kl = (-logratio).mean()
        approx_kl = ((ratio - 1) - logratio).mean()
        clipfrac = ((ratio - 1.0).abs() > args.clip_coef).float().mean()
    if args.norm_adv:
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    pg_loss = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef)).mean()
    if args.clip_vloss:
        clipped_value = values + (new_value - values).clamp(-args.clip_coef, args.clip_coef)
        v_loss = 0.5 * torch.max((new_value - returns).pow(2), (clipped_value - returns).pow(2)).mean()
    else:
        v_loss = 0.5 * (new_value - returns).pow(2).mean()
    entropy_loss = entropy.mean()
    loss = pg_loss - args.ent_coef * entropy_loss + args.vf_coef * v_loss
    return loss, {
        "policy_loss": pg_loss.detach(),
        "value_loss": v_loss.detach(),
        "entropy": entropy_loss.detach(),
        "old_approx_kl": old_approx_kl,
        "approx_kl": approx_kl,
        "clipfrac": clipfrac,
    }


def update(minibatch, *, loss_fn, agent, optimizer, args):
    """One step on `loss_fn`, the compiled piece."""
    loss, metrics = loss_fn(minibatch, agent=agent, args=args)
    optimizer.zero_grad()
    loss.backward()
    metrics["grad_norm"] = nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm).detach()
    optimizer.step()
    return metrics


def evaluate(agent, args, device, video_folder=None):
    """True score of one game in each of --eval-episodes envs, actions sampled (a greedy policy can stall)."""
    envs = make_envs(
        args.env_id, args.eval_episodes, seed=args.seed + 10_000, training=False, render=video_folder is not None
    )
    torch.manual_seed(args.seed)
    obs, _ = envs.reset()
    video = game_mp4(video_folder, envs.render()[0]) if video_folder else None  # envpool renders env 0
    returns = np.zeros(envs.num_envs)
    finished = np.zeros(envs.num_envs, dtype=bool)
    while not finished.all():
        stop_if_signalled()
        with torch.no_grad():
            actions = policy(torch.from_numpy(obs).to(device), agent=agent)[0]
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
    args.env_id = args.env_id.replace("NoFrameskip-v4", "-v5")  # CleanRL's Atari ids, the same game
    if envpool is None:
        fail('envpool is not installed: pip install ".[envpool]"')
    run = Run(args)
    if args.num_envs % 2:
        fail(f"--num-envs {args.num_envs} must be even: envpool steps half of the envs at a time")
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

    env_batch = args.num_envs // 2
    envs = make_envs(args.env_id, args.num_envs, env_batch, seed=args.seed)
    num_actions = int(envs.action_space.n)
    agent = Agent(num_actions).to(device)
    # a tensor learning rate, annealed in place: the graphs never recapture
    learning_rate = torch.tensor(args.learning_rate, device=device)
    optimizer = torch.optim.Adam(agent.parameters(), lr=learning_rate, eps=1e-5, fused=True, capturable=run.cudagraphs)
    run.save_and_load({"agent": agent, "optimizer": optimizer}, num_actions=num_actions)
    agent_view = Agent(num_actions).to("meta")  # the learner's weights, shared and without grad
    from_module(agent).data.to_module(agent_view)
    agent_view.requires_grad_(False)

    # compiled before the arguments are bound: to dynamo, compiled partials share one wrapper and one cache
    maybe_compile = partial(torch.compile, disable=not args.compile)
    policy_step = partial(maybe_compile(policy), agent=agent_view)
    gae_step = partial(maybe_compile(gae), gamma=args.gamma, gae_lambda=args.gae_lambda)
    update_step = partial(update, loss_fn=maybe_compile(ppo_loss), agent=agent, optimizer=optimizer, args=args)
    if run.cudagraphs:  # captured after the first calls
        graphed = partial(CudaGraphModule, warmup=5)
        policy_step, gae_step, update_step = map(graphed, (policy_step, gae_step, update_step))

    # Row r of env e: its r-th observation of the rollout, the reward and done that came with it, the policy's
    # answer. A rollout is complete when every env has num_steps + 1 rows; rows past that move to the front.
    T = args.num_steps
    frame_shape = envs.observation_space.shape
    rows = 2 * T + 1
    # frames stored channels-last, as the policy and the update read them
    obs = torch.empty(
        (rows * args.num_envs, *frame_shape), dtype=torch.uint8, device=device, memory_format=torch.channels_last
    )
    obs = obs.view(rows, args.num_envs, *frame_shape)
    actions = torch.zeros((rows, args.num_envs), dtype=torch.long, device=device)
    logprobs, rewards, dones, values = (torch.zeros((rows, args.num_envs), device=device) for _ in range(4))
    storage = (obs, actions, logprobs, rewards, dones, values)
    row_of_env = np.zeros(args.num_envs, dtype=np.int64)
    # one pinned buffer, reused: the host waits for the actions before the next recv
    staging = torch.empty((env_batch, *frame_shape), dtype=torch.uint8, pin_memory=device.type == "cuda")
    staging_np = staging.numpy()
    episode_returns = np.zeros(args.num_envs)
    episode_lengths = np.zeros(args.num_envs, dtype=np.int64)
    metrics = {}
    num_updates = 0
    global_step = 0
    first_iteration = 0
    # --resume: the learner restored; new episodes in the envs
    if resumed := run.resumable():
        first_iteration, global_step, num_updates = resumed["iteration"], resumed["global_step"], resumed["num_updates"]

    envs.async_reset()
    run.start()
    with run.stoppable():
        for iteration in range(first_iteration, num_iterations):
            run.checkpoint_if_due(global_step, iteration=iteration, global_step=global_step, num_updates=num_updates)
            if iteration == args.measure_burnin:
                run.start_speed_measure(global_step)
            lr_now = (1.0 - iteration / num_iterations) * args.learning_rate if args.anneal_lr else args.learning_rate
            learning_rate.fill_(lr_now)

            while row_of_env.min() <= T:
                stop_if_signalled()
                next_obs_np, reward, terminations, truncations, infos = run.timed_env_call(envs.recv)
                env_ids = infos["env_id"]
                if row_of_env[env_ids].max() >= rows:
                    raise RuntimeError(f"env {env_ids[row_of_env[env_ids].argmax()]} ran {T} steps ahead of another")
                # rewards, dones and storage indices in one copy
                step_data = np.stack([reward, terminations | truncations, row_of_env[env_ids], env_ids])
                step_data = torch.from_numpy(step_data.astype(np.float32)).to(device, non_blocking=True)
                row, env = step_data[2:].long()
                np.copyto(staging_np, next_obs_np)  # numpy's copy: torch's would wake its thread pool
                next_obs = staging.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
                obs[row, env] = next_obs
                rewards[row, env] = step_data[0]
                dones[row, env] = step_data[1]
                action, logprobs[row, env], values[row, env] = policy_step(next_obs)
                actions[row, env] = action
                run.timed_env_call(envs.send, action.cpu().numpy(), env_ids)
                # row 0 of the first rollout: no step led to it
                global_step += int(np.count_nonzero(row_of_env[env_ids]))
                row_of_env[env_ids] += 1
                # the true score: info["reward"] is unclipped, info["terminated"] ends the game
                episode_returns[env_ids] += infos["reward"]
                episode_lengths[env_ids] += 1
                for env_id in env_ids[infos["terminated"].astype(bool) | truncations]:
                    run.record_episode(global_step, episode_returns[env_id], episode_lengths[env_id])
                    episode_returns[env_id] = 0.0
                    episode_lengths[env_id] = 0

            # row T: each env's bootstrap observation
            advantages, returns = gae_step(rewards[1 : T + 1], values[:T], dones[:T], values[T], dones[T])
            batch = Batch(
                obs[:T].flatten(0, 1),
                actions[:T].flatten(),
                logprobs[:T].flatten(),
                advantages.flatten(),
                returns.flatten(),
                values[:T].flatten(),
            )
            minibatch_metrics = []
            for _ in range(args.update_epochs):
                order = torch.randperm(batch_size, device=device)
                for start in range(0, batch_size, minibatch_size):
                    indices = order[start : start + minibatch_size]
                    minibatch_metrics.append(update_step(Batch._make(t[indices] for t in batch)))
                    num_updates += 1
                if args.target_kl is not None and minibatch_metrics[-1]["approx_kl"].item() > args.target_kl:
                    break  # one sync per epoch
            # logged: the means over the iteration's minibatches
            metrics = {key: torch.stack([m[key] for m in minibatch_metrics]).mean() for key in minibatch_metrics[0]}
            returns_var = batch.returns.var(correction=0).clamp_min(1e-8)
            metrics["explained_variance"] = 1 - (batch.returns - batch.values).var(correction=0) / returns_var
            # the rows past the rollout start the next one, acted on by weights one update older (PPO's ratio and
            # clip account for it)
            carried = row_of_env.max() - T
            for t in storage:
                t[:carried] = t[T : T + carried].clone()
            row_of_env -= T
            run.log(
                global_step, metrics, charts=dict(learning_rate=lr_now, avg_episodic_return=run.sinks.recent_return())
            )
    run.end_training(global_step, metrics)
    envs.close()

    summary = {"num_updates": num_updates, "compiled_pieces": ["gae", "policy", "ppo_loss"] if args.compile else []}
    sys.exit(run.write_and_evaluate(partial(evaluate, agent_view, args, device, run.video_folder), summary))
