"""Parallelised Q-Network (PQN, Gallici et al. 2024) for classic control, one file: Q(lambda) learning from parallel
envs with LayerNorm, no replay memory or target network.

Speed: device-side rollout and epsilon-greedy, a log-depth scan for the returns, torch.compile and CUDA graphs.
Cost: each transition trains update_epochs times, then is dropped.
    python leanrl_scripts/pqn.py --env-id CartPole-v1 --compile
"""

import sys
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro
from tensordict import from_module
from tensordict.nn import CudaGraphModule

from run_bookkeeping import Flag, Run, RunArgs, check_spaces, fail, stop_if_signalled


@dataclass
class Args(RunArgs):
    env_id: str = "CartPole-v1"
    """the id of the environment (discrete actions, flat observations)"""
    total_timesteps: int = 500_000
    """total env steps, all envs together (0 with --load-model: only evaluate)"""
    learning_rate: Flag.Positive = 2.5e-4
    """the learning rate of the optimizer"""
    num_envs: Flag.Count = 4
    """the number of parallel environments"""
    num_steps: Flag.Count = 128
    """the number of steps per env per rollout"""
    num_minibatches: Flag.Count = 4
    """the number of mini-batches"""
    update_epochs: Flag.Count = 4
    """the K epochs to update the Q-network"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to 0"""
    gamma: Flag.Fraction = 0.99
    """the discount factor gamma"""
    start_e: Flag.Fraction = 1.0
    """the starting epsilon for exploration"""
    end_e: Flag.Fraction = 0.05
    """the ending epsilon for exploration"""
    exploration_fraction: Flag.PositiveFraction = 0.5
    """the fraction of `total_timesteps` from start_e to end_e"""
    max_grad_norm: Flag.Positive = 10.0
    """the maximum global norm of the gradients"""
    q_lambda: Flag.Fraction = 0.65
    """the lambda of the Q(lambda) returns (0: one-step, 1: Monte Carlo)"""
    measure_burnin: Flag.CountFrom0 = 1
    """warm-up iterations the speed figure leaves out"""


def make_envs(env_id, num_envs, video_folder=None):
    """Vector env that resets within the step an episode ends, as CleanRL's script expects."""

    def make_env(record):
        env = gym.make(env_id, render_mode="rgb_array" if record else None)
        if record:
            env = gym.wrappers.RecordVideo(env, video_folder, episode_trigger=lambda episode: episode == 0)
        return gym.wrappers.RecordEpisodeStatistics(env)

    try:
        thunks = [partial(make_env, video_folder and i == 0) for i in range(num_envs)]
        envs = gym.vector.SyncVectorEnv(thunks, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    except gym.error.UnregisteredEnv:
        fail(f"unknown env id '{env_id}': ids come from gymnasium's registry (gymnasium.pprint_registry())")
    except Exception as error:
        fail(f"{env_id}: {error}")
    check_spaces(env_id, envs.single_action_space, gym.spaces.Discrete, envs.single_observation_space, gym.spaces.Box)
    return envs


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias_const)
    return layer


class QNetwork(nn.Module):
    """CleanRL's DQN network with LayerNorms, which keep TD learning stable without a target network."""

    def __init__(self, obs_dim, num_actions):
        super().__init__()
        self.network = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 120)),
            nn.LayerNorm(120),
            nn.ReLU(),
            layer_init(nn.Linear(120, 84)),
            nn.LayerNorm(84),
            nn.ReLU(),
            layer_init(nn.Linear(84, num_actions)),
        )

    def forward(self, obs):
        return self.network(obs)


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


@torch.no_grad()
def evaluate(q_network, args, device, video_folder=None):
    """Undiscounted return of the first episode in each of --eval-episodes envs, acting greedily."""
    envs = make_envs(args.env_id, args.eval_episodes, video_folder)
    obs, _ = envs.reset(seed=args.seed + 10_000)
    returns = np.zeros(envs.num_envs)
    finished = np.zeros(envs.num_envs, dtype=bool)
    while not finished.all():
        stop_if_signalled()
        actions, _ = policy(torch.as_tensor(obs, dtype=torch.float32, device=device), 0.0, q_network=q_network)
        obs, rewards, terminations, truncations, _ = envs.step(actions.cpu().numpy())
        returns += rewards * ~finished
        finished |= terminations | truncations
    envs.close()
    return returns.tolist()


if __name__ == "__main__":
    args = tyro.cli(Args)
    run = Run(args)
    batch_size = args.num_envs * args.num_steps
    if batch_size % args.num_minibatches:
        fail(f"--num-minibatches {args.num_minibatches} must divide num_envs x num_steps = {batch_size}")
    if 0 < args.total_timesteps < batch_size:
        fail(f"--total-timesteps {args.total_timesteps} is less than one rollout (num_envs x num_steps = {batch_size})")
    minibatch_size = batch_size // args.num_minibatches
    num_iterations = args.total_timesteps // batch_size
    device = run.device
    # one CPU thread: waking intra-op threads costs more than this MLP's math
    run.tune_cpu(threads=1)

    envs = make_envs(args.env_id, args.num_envs)
    obs_dim = envs.single_observation_space.shape[0]
    num_actions = int(envs.single_action_space.n)
    q_network = QNetwork(obs_dim, num_actions).to(device)
    # a tensor learning rate, filled in place: the graphs never recapture
    learning_rate = torch.tensor(args.learning_rate, device=device)
    optimizer = torch.optim.RAdam(q_network.parameters(), lr=learning_rate, capturable=run.cudagraphs)
    run.save_and_load({"q_network": q_network, "optimizer": optimizer}, obs_dim=obs_dim, num_actions=num_actions)
    q_view = QNetwork(obs_dim, num_actions).to("meta")  # a detached view of the learner's weights
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
    obs = torch.zeros((T, args.num_envs, obs_dim), device=device)
    actions = torch.zeros((T, args.num_envs), dtype=torch.long, device=device)
    rewards, dones, values = (torch.zeros((T, args.num_envs), device=device) for _ in range(3))
    epsilon = torch.tensor(args.start_e, device=device)  # the graphed policy reads it in place
    # reusing the pinned buffer is safe: the host waits for the actions that follow each copy
    staging = torch.zeros((args.num_envs, obs_dim + 2), pin_memory=device.type == "cuda")
    staging_np = staging.numpy()

    metrics = {}
    num_updates = 0
    global_step = 0
    staging_np[:, :obs_dim] = envs.reset(seed=args.seed)[0]
    step_data = staging.to(device, non_blocking=True)
    next_obs, next_done = step_data[:, :obs_dim], step_data[:, -1]
    first_iteration = 0
    # with --resume: every state and random generator as its last checkpoint left them, and the loop's counters
    if resumed := run.resumable(envs=envs):
        first_iteration, global_step, num_updates = resumed["iteration"], resumed["global_step"], resumed["num_updates"]
        next_obs, next_done = resumed["next_obs"], resumed["next_done"]
    run.start()
    with run.stoppable():
        for iteration in range(first_iteration, num_iterations):
            loop = dict(iteration=iteration, global_step=global_step, num_updates=num_updates)
            run.checkpoint_if_due(global_step, **loop, next_obs=next_obs, next_done=next_done)
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
                staging_np[:, :obs_dim] = next_obs_np
                staging_np[:, -2] = reward
                staging_np[:, -1] = terminations | truncations  # as CleanRL's: a time limit ends the returns too
                step_data = staging.to(device, non_blocking=True)
                next_obs, rewards[step], next_done = step_data[:, :obs_dim], step_data[:, -2], step_data[:, -1]
                run.record_gymnasium_episodes(global_step, infos)

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
            run.log(global_step, metrics, charts=dict(learning_rate=lr_now, epsilon=epsilon_at(global_step, args)))
    run.end_training(global_step, metrics)
    envs.close()

    summary = {
        "num_updates": num_updates,
        "compiled_pieces": ["policy", "q_lambda_returns", "td_loss"] if args.compile else [],
    }
    sys.exit(run.write_and_evaluate(partial(evaluate, q_view, args, device, run.video_folder), summary))
