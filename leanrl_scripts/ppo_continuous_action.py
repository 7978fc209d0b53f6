"""Proximal Policy Optimization (PPO, Schulman et al. 2017) for continuous actions, one file.

Speed: GAE is a log-depth parallel scan, not a T-step loop, so it compiles in seconds; the rollout lives in device
tensors, and the policy step, GAE and the update take torch.compile and CUDA graphs. Layers this small cost per op:
the parameters share one flat tensor. Cost: the scan does T log T work instead of T, nothing next to the update.
    python leanrl_scripts/ppo_continuous_action.py --env-id HalfCheetah-v5 --compile --cudagraphs
"""

import math
import sys
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import tyro
from tensordict import from_module
from tensordict.nn import CudaGraphModule

from run_bookkeeping import Flag, Run, RunArgs, check_spaces, fail, stop_if_signalled


@dataclass
class Args(RunArgs):
    env_id: str = "HalfCheetah-v5"
    """the id of the gymnasium environment (continuous actions)"""
    total_timesteps: int = 1_000_000
    """total environment steps, all envs together (0 only with --load-model: evaluate it)"""
    learning_rate: Flag.Positive = 3e-4
    """the learning rate of the optimizer"""
    num_envs: Flag.Count = 1
    """the number of parallel environments"""
    num_steps: Flag.Count = 2048
    """the number of steps to run in each environment per policy rollout"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to 0 over the run"""
    gamma: Flag.Fraction = 0.99
    """the discount factor gamma"""
    gae_lambda: Flag.Fraction = 0.95
    """the lambda for the general advantage estimation"""
    num_minibatches: Flag.Count = 32
    """the number of mini-batches"""
    update_epochs: Flag.Count = 10
    """the K epochs to update the policy"""
    norm_adv: bool = True
    """normalize the advantages (per minibatch)"""
    clip_coef: Flag.Positive = 0.2
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """use a clipped loss for the value function, as in the paper"""
    ent_coef: Flag.AtLeast0 = 0.0
    """coefficient of the entropy"""
    vf_coef: Flag.AtLeast0 = 0.5
    """coefficient of the value function"""
    max_grad_norm: Flag.Positive = 0.5
    """the maximum norm for the gradient clipping"""
    target_kl: Flag.AtLeast0 | None = None
    """the target KL: an iteration's epochs stop above it (None: never)"""
    measure_burnin: Flag.CountFrom0 = 1
    """iterations the speed figure leaves out (compilation, graph capture)"""


LOG_STD_NORMAL = 0.5 * math.log(2 * math.pi)


class OneSampleRunningMeanStd(gym.wrappers.utils.RunningMeanStd):
    """gymnasium's running mean and variance, fed one sample at a time by its per-env wrappers: one sample's moments
    are the sample and 0, so the costly np.mean and np.var are skipped. Same statistics bit for bit."""

    def update(self, x):
        if len(x) != 1:
            return super().update(x)
        self.update_from_moments(x[0], 0.0, 1)


def make_env(env_id, gamma, training, video_folder=None):
    """CleanRL's wrapper stack; evaluation envs (`training=False`) leave rewards unnormalized."""

    def thunk():
        env = gym.make(env_id, render_mode="rgb_array" if video_folder else None)
        check_spaces(env_id, env.action_space, gym.spaces.Box)  # before ClipAction, which asserts it
        if video_folder:
            env = gym.wrappers.RecordVideo(env, video_folder, episode_trigger=lambda episode: episode == 0)
        env = gym.wrappers.FlattenObservation(env)
        env = gym.wrappers.RecordEpisodeStatistics(env)
        env = gym.wrappers.ClipAction(env)
        env = gym.wrappers.NormalizeObservation(env)
        env.obs_rms = OneSampleRunningMeanStd(shape=env.observation_space.shape, dtype=env.observation_space.dtype)
        env = gym.wrappers.TransformObservation(env, lambda obs: np.clip(obs, -10, 10), env.observation_space)
        if training:
            env = gym.wrappers.NormalizeReward(env, gamma=gamma)
            env.return_rms = OneSampleRunningMeanStd(shape=())
            env = gym.wrappers.TransformReward(env, lambda reward: np.clip(reward, -10, 10))
        return env

    return thunk


def make_envs(env_id, num_envs, gamma=0.99, training=True, video_folder=None):
    if env_id.startswith("dm_control/"):  # through shimmy, as CleanRL runs it
        try:
            import shimmy  # noqa: F401  (registers the ids)
        except ModuleNotFoundError:
            fail('dm_control tasks need shimmy and dm_control: pip install ".[dm-control]"')
    try:
        thunks = [make_env(env_id, gamma, training, video_folder if i == 0 else None) for i in range(num_envs)]
        envs = gym.vector.SyncVectorEnv(thunks, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    except gym.error.DependencyNotInstalled as error:
        fail(
            f"{env_id}: a package is missing ({error}); MuJoCo: pip install '.[mujoco]', videos: pip install '.[video]'"
        )
    except gym.error.UnregisteredEnv:
        fail(
            f"unknown env id '{env_id}': ids come from gymnasium's registry (gymnasium.pprint_registry()); "
            "Atari games on envpool run with ppo_atari_envpool.py"
        )
    except Exception as error:
        fail(f"{env_id}: {error}")
    return envs


def obs_normalizers(envs):
    """Each env's NormalizeObservation wrapper."""
    found = []
    for env in envs.envs:
        while not isinstance(env, gym.wrappers.NormalizeObservation):
            env = env.env
        found.append(env)
    return found


class ObsStatistics:
    """The observation statistics as a checkpoint holds them: env 0's stand for all; loading sets every env's."""

    def __init__(self, normalizers):
        self.normalizers = normalizers

    def state_dict(self):
        rms = self.normalizers[0].obs_rms
        return {"mean": torch.as_tensor(rms.mean), "var": torch.as_tensor(rms.var), "count": float(rms.count)}

    def load_state_dict(self, state):
        for normalizer in self.normalizers:
            # loaded onto the device, where .numpy() fails
            normalizer.obs_rms.mean = state["mean"].cpu().numpy()
            normalizer.obs_rms.var = state["var"].cpu().numpy()
            normalizer.obs_rms.count = state["count"]


def layer_init(layer, std=math.sqrt(2), bias_const=0.0):
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self, obs_dim, act_dim):
        super().__init__()
        self.critic = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 1), std=1.0),
        )
        self.actor_mean = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, act_dim), std=0.01),
        )
        self.actor_logstd = nn.Parameter(torch.zeros(1, act_dim))

    def get_value(self, obs):
        return self.critic(obs).squeeze(-1)

    def get_action_and_value(self, obs, action=None):
        """Gaussian policy written out: torch.distributions checks its arguments with host syncs."""
        mean = self.actor_mean(obs)
        log_std = self.actor_logstd.expand_as(mean)
        if action is None:  # a sampled action's standardized value is its noise
            standardized = torch.randn_like(mean)
            action = mean + log_std.exp() * standardized
        else:
            standardized = (action - mean) / log_std.exp()
        log_prob = (-0.5 * standardized.pow(2) - log_std - LOG_STD_NORMAL).sum(-1)
        entropy = (0.5 + LOG_STD_NORMAL + log_std).sum(-1)
        return action, log_prob, entropy, self.get_value(obs)


def flatten_parameters(module):
    """Makes the parameters views into one flat tensor, their gradients into another, and returns the flat parameter:
    Adam, the clipping and the zeroing, which at these sizes cost per tensor, then handle one."""
    params = list(module.parameters())
    flat = nn.Parameter(torch.cat([param.detach().flatten() for param in params]))
    flat.grad = torch.zeros_like(flat)
    offset = 0
    for param in params:
        param.data = flat.data[offset : offset + param.numel()].view_as(param)
        param.grad = flat.grad[offset : offset + param.numel()].view_as(param)
        offset += param.numel()
    return flat


def policy(obs, *, agent, deterministic=False):
    """Sampled actions (`deterministic`: the mean), their log-probabilities and the values; `agent` is a detached
    view."""
    action, log_prob, _, value = agent.get_action_and_value(obs, agent.actor_mean(obs) if deterministic else None)
    return action, log_prob, value


def gae(rewards, values, dones, next_value, next_done, *, gamma, gae_lambda):
    """GAE A_t = delta_t + c_t A_{t+1}, c_t = gamma lambda (1 - done_{t+1}), as a parallel scan: after the round with
    offset s, A_t sums the next 2s deltas. Shapes (T, num_envs); `dones[t]` says obs t started an episode."""
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
    """Rollout tensors flattened over (step, env), or a minibatch of them."""

    obs: torch.Tensor
    actions: torch.Tensor
    logprobs: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    values: torch.Tensor


def ppo_loss(minibatch, *, agent, args):
    """The clipped-surrogate loss of a minibatch and its metrics on the device."""
    _, new_logprob, entropy, new_value = agent.get_action_and_value(minibatch.obs, minibatch.actions)
    advantages = minibatch.advantages
    returns = minibatch.returns
    values = minibatch.values
    logratio = new_logprob - minibatch.logprobs
    ratio = logratio.exp()
    with torch.no_grad():
        old_approx_kl = (-logratio).mean()
        approx_kl = ((ratio - 1) - logratio).mean()  # low-variance estimator of KL(old || new)
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


def update(minibatch, *, loss_fn, agent, params, optimizer, args):
    """One step on `loss_fn`, the piece --compile compiles; the clipping and the fused Adam step run eagerly."""
    loss, metrics = loss_fn(minibatch, agent=agent, args=args)
    optimizer.zero_grad(set_to_none=False)  # in place: None would detach them from the flat buffer
    loss.backward()
    metrics["grad_norm"] = nn.utils.clip_grad_norm_(params, args.max_grad_norm).detach()
    optimizer.step()
    return metrics


def evaluate(agent, obs_stats, args, device, video_folder):
    """Undiscounted return of the first episode in each of --eval-episodes envs, with the mean action and the frozen
    training statistics `obs_stats`."""
    envs = make_envs(args.env_id, args.eval_episodes, args.gamma, training=False, video_folder=video_folder)
    for normalizer in obs_normalizers(envs):
        normalizer.update_running_mean = False
        normalizer.obs_rms = obs_stats
    obs, _ = envs.reset(seed=args.seed + 10_000)
    returns = np.zeros(envs.num_envs)
    finished = np.zeros(envs.num_envs, dtype=bool)
    while not finished.all():
        stop_if_signalled()
        actions = policy(torch.as_tensor(obs, dtype=torch.float32, device=device), agent=agent, deterministic=True)[0]
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
    # one CPU thread: layers this small gain little from a second (docs/ppo_continuous.md)
    run.tune_cpu(threads=1)

    envs = make_envs(args.env_id, args.num_envs, args.gamma)
    normalizers = obs_normalizers(envs)
    obs_dim = math.prod(envs.single_observation_space.shape)
    act_dim = math.prod(envs.single_action_space.shape)
    agent = Agent(obs_dim, act_dim).to(device)
    flat_params = flatten_parameters(agent)
    # a tensor learning rate, filled in place: the graphs never recapture
    learning_rate = torch.tensor(args.learning_rate, device=device)
    optimizer = torch.optim.Adam([flat_params], lr=learning_rate, eps=1e-5, fused=True, capturable=run.cudagraphs)
    states = {"agent": agent, "optimizer": optimizer, "obs_statistics": ObsStatistics(normalizers)}
    loaded = run.save_and_load(states, obs_dim=obs_dim, act_dim=act_dim)
    agent_view = Agent(obs_dim, act_dim).to("meta")  # acts with the learner's weights, shared and without grad
    from_module(agent).data.to_module(agent_view)
    agent_view.requires_grad_(False)

    # compile the functions, then bind their keywords: each keeps its own graph cache (compiled partials share one)
    maybe_compile = partial(torch.compile, disable=not args.compile)
    policy_step = partial(maybe_compile(policy), agent=agent_view)
    gae_step = partial(maybe_compile(gae), gamma=args.gamma, gae_lambda=args.gae_lambda)
    update_step = partial(
        update, loss_fn=maybe_compile(ppo_loss), agent=agent, params=[flat_params], optimizer=optimizer, args=args
    )
    if run.cudagraphs:  # warm-up calls compile and create Adam's state
        graphed = partial(CudaGraphModule, warmup=5)
        policy_step, gae_step, update_step = map(graphed, (policy_step, gae_step, update_step))

    obs = torch.zeros(args.num_steps, args.num_envs, obs_dim, device=device)
    actions = torch.zeros(args.num_steps, args.num_envs, act_dim, device=device)
    logprobs, rewards, dones, values = (torch.zeros(args.num_steps, args.num_envs, device=device) for _ in range(4))
    metrics = {}
    num_updates = 0
    global_step = 0
    for normalizer in normalizers:  # the reset must not move a loaded checkpoint's statistics
        normalizer.update_running_mean = not loaded
    next_obs_np, _ = envs.reset(seed=args.seed)
    for normalizer in normalizers:
        normalizer.update_running_mean = True
    next_obs = torch.as_tensor(next_obs_np, dtype=torch.float32, device=device)
    next_done = torch.zeros(args.num_envs, device=device)
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

            for step in range(args.num_steps):
                stop_if_signalled()
                obs[step] = next_obs
                dones[step] = next_done
                # obs[step], not next_obs, whose strides differ after the first reset: one layout for the graphs
                actions[step], logprobs[step], values[step] = policy_step(obs[step])
                next_obs_np, reward, terminations, truncations, infos = run.timed_env_call(
                    envs.step, actions[step].cpu().numpy()
                )
                global_step += args.num_envs
                # one host-to-device copy for observations, rewards and dones
                step_data = np.concatenate([next_obs_np, reward[:, None], (terminations | truncations)[:, None]], 1)
                step_data = torch.from_numpy(step_data).to(device, torch.float32)
                next_obs, rewards[step], next_done = (
                    step_data[:, :obs_dim],
                    step_data[:, obs_dim],
                    step_data[:, obs_dim + 1],
                )
                run.record_gymnasium_episodes(global_step, infos)

            advantages, returns = gae_step(rewards, values, dones, agent_view.get_value(next_obs), next_done)
            batch = Batch._make(t.flatten(0, 1) for t in (obs, actions, logprobs, advantages, returns, values))
            minibatch_metrics = []
            for _ in range(args.update_epochs):
                order = torch.randperm(batch_size, device=device)
                for start in range(0, batch_size, minibatch_size):
                    indices = order[start : start + minibatch_size]
                    minibatch_metrics.append(update_step(Batch._make(t[indices] for t in batch)))
                    num_updates += 1
                if args.target_kl is not None and minibatch_metrics[-1]["approx_kl"].item() > args.target_kl:
                    break  # one sync per epoch
            # means over minibatches, read in the log's one sync
            metrics = {key: torch.stack([m[key] for m in minibatch_metrics]).mean() for key in minibatch_metrics[0]}
            returns_var = batch.returns.var(correction=0).clamp_min(1e-8)
            metrics["explained_variance"] = 1 - (batch.returns - batch.values).var(correction=0) / returns_var
            run.log(global_step, metrics, charts=dict(learning_rate=lr_now))
    run.end_training(global_step, metrics)
    envs.close()

    obs_stats = normalizers[0].obs_rms
    evaluation = partial(evaluate, agent_view, obs_stats, args, device, run.video_folder)
    summary = {"num_updates": num_updates, "compiled_pieces": ["gae", "policy", "ppo_loss"] if args.compile else []}
    sys.exit(run.write_and_evaluate(evaluation, summary))
