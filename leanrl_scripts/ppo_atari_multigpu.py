"""PPO (Schulman et al. 2017) on Atari with envpool, one process per GPU under torchrun; one file.

Each process steps its own envs with its own copy of the network; an all-reduce per minibatch of one flat gradient
buffer keeps the copies equal.
    torchrun --standalone --nproc-per-node 2 leanrl_scripts/ppo_atari_multigpu.py --env-id Breakout-v5 --compile
"""

import ctypes
import io
import os
import signal
import sys
from contextlib import redirect_stderr
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import Literal, NamedTuple

# Idle OpenMP threads sleep instead of spinning on the cores envpool's workers need; set before torch loads OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

try:
    import envpool
except ModuleNotFoundError:  # --help works without it
    envpool = None
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import tyro
from tensordict import from_module
from tensordict.nn import CudaGraphModule

from run_bookkeeping import Flag, Run, RunArgs, Stopped, fail, game_mp4, stop_if_signalled, usable_cores


@dataclass
class Args(RunArgs):
    device_ids: list[int] = field(default_factory=list)
    """the GPU of each local process (empty: process k on GPU k)"""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """the all-reduce back-end (auto: nccl if each process has a GPU, else gloo)"""
    env_id: str = "Breakout-v5"
    """the id of the envpool Atari game"""
    total_timesteps: int = 10_000_000
    """total environment steps of all processes (0 only with --load-model: evaluate it)"""
    learning_rate: Flag.Positive = 2.5e-4
    """the learning rate of the optimizer"""
    local_num_envs: Flag.Count = 8
    """the number of environments of each process"""
    num_steps: Flag.Count = 128
    """the number of steps per env per rollout"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to 0 over the run"""
    gamma: Flag.Fraction = 0.99
    """the discount factor gamma"""
    gae_lambda: Flag.Fraction = 0.95
    """the lambda for the general advantage estimation"""
    num_minibatches: Flag.Count = 4
    """the number of mini-batches (each process's share from its rollout)"""
    update_epochs: Flag.Count = 4
    """the K epochs to update the policy"""
    norm_adv: bool = True
    """normalize the advantages (per minibatch, over all processes)"""
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
    """the target KL: an iteration's epochs stop above it (None: never)"""
    measure_burnin: Flag.CountFrom0 = 1
    """iterations the speed figure leaves out (compilation, graph capture)"""
    world_size: tyro.conf.Suppress[int] = 1
    """(derived) the number of processes"""
    num_envs: tyro.conf.Suppress[int] = 0
    """(derived) local_num_envs x world_size"""


def make_envs(env_id, num_envs, seed=0, training=True, render=False, threads=None):
    """envpool's Atari preprocessing; training envs end an episode at each lost life and clip rewards (info["reward"]
    keeps the score)."""
    if env_id not in envpool.list_all_envs():
        fail(f"unknown env id '{env_id}': ids come from envpool.list_all_envs(), Atari games look like Breakout-v5")
    if type(envpool.make_spec(env_id)).__name__ != "AtariEnvSpec":
        fail(f"{env_id} is not an Atari game: continuous control runs with ppo_continuous_action.py")
    return envpool.make(
        env_id,
        env_type="gymnasium",
        num_envs=num_envs,
        num_threads=min(num_envs, threads or usable_cores()),
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
    """The Nature DQN network (Mnih et al. 2015) with a policy head and a value head."""

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
        """Categorical policy written out: torch.distributions checks its arguments with host syncs."""
        hidden = self.hidden(obs)
        log_probs = self.actor(hidden).log_softmax(-1)
        if action is None:  # Gumbel-max sampling: argmax(log p - log E), E ~ Exp(1)
            action = (log_probs - torch.empty_like(log_probs).exponential_().log()).argmax(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        return action, log_probs.gather(-1, action[:, None]).squeeze(-1), entropy, self.critic(hidden).squeeze(-1)


def policy(obs, *, agent):
    """Sampled actions, their log-probabilities and the values."""
    action, log_prob, _, value = agent.get_action_and_value(obs)
    return action, log_prob, value


def gae(rewards, values, dones, next_value, next_done, *, gamma, gae_lambda):
    """Advantages A_t = delta_t + gamma lambda (1 - done_{t+1}) A_{t+1}, by a scan of log2(T) rounds, and returns;
    `dones[t]`: the step into obs t ended an episode."""
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


def gradients_in_one_buffer(agent):
    """Makes every .grad a view (with the parameter's strides) into one flat buffer, returned: one all-reduce
    averages it."""
    params = list(agent.parameters())
    flat_grads = torch.zeros(sum(param.numel() for param in params), device=params[0].device)
    offset = 0
    for param in params:
        param.grad = flat_grads.as_strided(param.shape, param.stride(), offset)
        offset += param.numel()
    return flat_grads


def ppo_loss(minibatch, advantage_mean, advantage_std, *, agent, args):
    """The clipped-surrogate loss of this process's share of a minibatch (advantages normalised over the whole one),
    and its metrics."""
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
        advantages = (advantages - advantage_mean) / (advantage_std + 1e-8)
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


def loss_and_gradients(*minibatch, loss_fn, flat_grads, agent, args):
    """`loss_fn`'s metrics, its gradients written into `flat_grads`."""
    loss, metrics = loss_fn(*minibatch, agent=agent, args=args)
    flat_grads.zero_()
    loss.backward()
    return metrics


def apply_gradients(*, agent, optimizer, flat_grads, args):
    """The mean of the summed gradients, clipping and Adam, alike in every process."""
    flat_grads.div_(args.world_size)
    grad_norm = nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
    optimizer.step()
    return grad_norm.detach()


def all_reduce(tensor, group, op=dist.ReduceOp.SUM):
    """dist.all_reduce in place; if a peer ended, stop with one line, not a traceback."""
    if group is None:
        return
    try:
        dist.all_reduce(tensor, op=op, group=group)
    except RuntimeError as error:  # NCCL's DistBackendError is one too
        reason = (str(error).strip() or type(error).__name__).splitlines()[0].split(". ")[0]
        raise Stopped(f"another process of this run ended ({reason})", 1) from None


def minibatch_statistics(advantages, order, num_minibatches, group):
    """Each minibatch's advantage mean and std over all processes, by one all-reduce of counts, sums and squares
    (float64: no cancellation)."""
    shares = advantages[order].view(num_minibatches, -1).double()
    sums = torch.stack([torch.full_like(shares[:, 0], shares.shape[1]), shares.sum(1), shares.pow(2).sum(1)])
    all_reduce(sums, group)
    count, total, squares = sums
    mean = total / count
    return mean.float(), ((squares - count * mean**2) / (count - 1)).clamp(min=0).sqrt().float()


def update_epoch(batch, order, *, loss_step, apply_step, flat_grads, args, group):
    """One pass over the rollout in `order`: the minibatches' metrics. The all-reduce runs eagerly between captured
    halves (gloo's cannot be captured)."""
    means, stds = minibatch_statistics(batch.advantages, order, args.num_minibatches, group)
    minibatch_metrics = []
    for index, rows in enumerate(order.view(args.num_minibatches, -1)):
        metrics = loss_step(Batch._make(t[rows] for t in batch), means[index], stds[index])
        all_reduce(flat_grads, group)
        minibatch_metrics.append({**metrics, "grad_norm": apply_step()})
    return minibatch_metrics


def mean_over_processes(values, group):
    """The mean over the processes: all decide alike."""
    values = values.clone()
    if group is not None:
        all_reduce(values, group)
        values /= dist.get_world_size(group)
    return values


def signal_of_any_process(signum, group):
    """The signal any process got (0: none): all stop at one step, none left in a collective."""
    signum = torch.tensor([signum])
    if group is not None:
        all_reduce(signum, group, dist.ReduceOp.MAX)
    return int(signum.item())


def evaluate(agent, args, device, video_folder=None):
    """True score of one whole game in each of --eval-episodes envs, actions sampled: a greedy policy can stall."""
    envs = make_envs(
        args.env_id, args.eval_episodes, seed=args.seed + 10_000, training=False, render=video_folder is not None
    )
    torch.manual_seed(args.seed)  # a checkpoint evaluates to its run's score
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
    # from torchrun (absent: one process); only the first process reports bad input
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if "LOCAL_RANK" in os.environ and hasattr(libc := ctypes.CDLL(None), "prctl"):
        # PR_SET_PDEATHSIG: torchrun's processes (own groups) stop with it, killed at once
        libc.prctl(1, signal.SIGTERM)
    with redirect_stderr(sys.stderr if rank == 0 else io.StringIO()):
        args = tyro.cli(Args)
        args.env_id = args.env_id.replace("NoFrameskip-v4", "-v5")  # CleanRL's Atari ids: the same game and settings
        args.world_size = int(os.environ.get("WORLD_SIZE", 1))
        args.num_envs = args.local_num_envs * args.world_size
        if envpool is None:
            fail('envpool is not installed: pip install ".[envpool]"')
        run = Run(args)
        device = run.device
        gpus = torch.cuda.device_count() if device.type == "cuda" else 0
        if gpus and args.device_ids and (len(args.device_ids) != local_world_size or max(args.device_ids) >= gpus):
            fail(f"--device-ids needs one GPU id below {gpus} for each of this machine's {local_world_size} processes")
        if gpus:  # "cuda" below means this process's GPU
            torch.cuda.set_device(args.device_ids[local_rank] if args.device_ids else local_rank % gpus)
        local_batch_size = args.local_num_envs * args.num_steps
        if local_batch_size % args.num_minibatches:
            fail(
                f"--num-minibatches {args.num_minibatches} must divide local_num_envs x num_steps = {local_batch_size}"
            )
        batch_size = local_batch_size * args.world_size
        if 0 < args.total_timesteps < batch_size:
            fail(f"--total-timesteps {args.total_timesteps} is less than one rollout of every process ({batch_size})")
        gpu_each = gpus > 0 and len(set(args.device_ids or range(local_world_size))) == local_world_size <= gpus
        backend = ("nccl" if gpu_each else "gloo") if args.backend == "auto" else args.backend
        if backend == "nccl" and not gpu_each and args.world_size > 1:
            fail("--backend nccl needs a CUDA GPU for each process of a machine (processes sharing one use gloo)")
        threads = max(1, usable_cores() // local_world_size)  # a machine's processes share out its cores
        run.tune_cpu(threads=threads, keep_freed_memory=True)

        # seeded as one process of all envs (envpool: env i gets seed + i)
        envs = make_envs(args.env_id, args.local_num_envs, seed=args.seed + rank * args.local_num_envs, threads=threads)
        num_actions = int(envs.action_space.n)
        agent = Agent(num_actions).to(device)
        learning_rate = torch.tensor(args.learning_rate, device=device)  # annealed in place: no recapture
        optimizer = torch.optim.Adam(
            agent.parameters(), lr=learning_rate, eps=1e-5, fused=True, capturable=run.cudagraphs
        )
        run.save_and_load({"agent": agent, "optimizer": optimizer}, num_actions=num_actions)
        resumed = run.resumable() or dict(iteration=0, num_updates=0)

    group = stop_group = None  # gradients and statistics; the per-step stop signal
    if args.world_size > 1:
        dist.init_process_group(backend, timeout=timedelta(minutes=5))  # torchrun's rendezvous
        group = dist.group.WORLD
        stop_group = dist.new_group(backend="gloo") if backend == "nccl" else group  # on the CPU: no device sync
        for tensor in agent.state_dict().values():
            dist.broadcast(tensor, src=0)  # the first process's weights to all
    else:
        print("one process: torchrun starts several (torchrun --nproc-per-node N ppo_atari_multigpu.py ...)")
    # each process (and resume) samples its own actions and minibatches
    torch.manual_seed(args.seed + 1_000_003 * rank + resumed["iteration"])
    flat_grads = gradients_in_one_buffer(agent)
    agent_view = Agent(num_actions).to("meta")  # the learner's weights, shared and without grad
    from_module(agent).data.to_module(agent_view)
    agent_view.requires_grad_(False)

    # compiled before their arguments are bound: one wrapper, one cache, to dynamo
    maybe_compile = partial(torch.compile, disable=not args.compile)
    policy_step = partial(maybe_compile(policy), agent=agent_view)
    gae_step = partial(maybe_compile(gae), gamma=args.gamma, gae_lambda=args.gae_lambda)
    loss_step = partial(
        loss_and_gradients, loss_fn=maybe_compile(ppo_loss), flat_grads=flat_grads, agent=agent, args=args
    )
    apply_step = partial(apply_gradients, agent=agent, optimizer=optimizer, flat_grads=flat_grads, args=args)
    if run.cudagraphs:  # captured after the first calls (compilation, Adam's state)
        graphed = partial(CudaGraphModule, warmup=5)
        policy_step, gae_step, loss_step, apply_step = map(graphed, (policy_step, gae_step, loss_step, apply_step))

    T = args.num_steps
    E = args.local_num_envs
    obs = torch.zeros((T, E, *envs.observation_space.shape), dtype=torch.uint8, device=device)
    actions = torch.zeros((T, E), dtype=torch.long, device=device)
    logprobs, rewards, dones, values = (torch.zeros((T, E), device=device) for _ in range(4))
    episode_returns = np.zeros(E)
    episode_lengths = np.zeros(E, dtype=np.int64)
    metrics = {}
    first_iteration, num_updates = resumed["iteration"], resumed["num_updates"]
    global_step = first_iteration * batch_size
    num_iterations = args.total_timesteps // batch_size
    next_obs = torch.from_numpy(envs.reset()[0]).to(device)
    next_done = torch.zeros(E, device=device)
    any_signal = partial(signal_of_any_process, group=stop_group)
    run.start(write=rank == 0)  # only the first process writes
    with run.stoppable():
        for iteration in range(first_iteration, num_iterations):
            if rank == 0:
                run.checkpoint_if_due(global_step, iteration=iteration, num_updates=num_updates)
            if iteration == args.measure_burnin:
                run.start_speed_measure(global_step)
            lr_now = (1.0 - iteration / num_iterations) * args.learning_rate if args.anneal_lr else args.learning_rate
            learning_rate.fill_(lr_now)

            for step in range(T):
                stop_if_signalled(agree=any_signal)
                obs[step] = next_obs
                dones[step] = next_done
                actions[step], logprobs[step], values[step] = policy_step(next_obs)
                step_result = run.timed_env_call(envs.step, actions[step].cpu().numpy())
                next_obs_np, reward, terminations, truncations, infos = step_result
                global_step += args.num_envs  # the processes step in lockstep
                step_data = np.stack([reward, terminations | truncations]).astype(np.float32)
                step_data = torch.from_numpy(step_data).to(device, non_blocking=True)
                next_obs = torch.from_numpy(next_obs_np).to(device, non_blocking=True)
                rewards[step] = step_data[0]
                next_done = step_data[1]
                # the true score: info["reward"] is unclipped, info["terminated"] ends the game, not a life
                episode_returns += infos["reward"]
                episode_lengths += 1
                for env_id in np.nonzero(infos["terminated"].astype(bool) | truncations)[0]:
                    run.record_episode(global_step, episode_returns[env_id], episode_lengths[env_id])
                    episode_returns[env_id] = 0.0
                    episode_lengths[env_id] = 0

            # as CleanRL's: next_obs bootstraps GAE, and the next rollout acts on it with the updated weights
            next_value = policy_step(next_obs)[2]
            advantages, returns = gae_step(rewards, values, dones, next_value, next_done)
            batch = Batch(*(t.flatten(0, 1) for t in (obs, actions, logprobs, advantages, returns, values)))
            minibatch_metrics = []
            for _ in range(args.update_epochs):
                order = torch.randperm(local_batch_size, device=device)
                minibatch_metrics += update_epoch(
                    batch,
                    order,
                    loss_step=loss_step,
                    apply_step=apply_step,
                    flat_grads=flat_grads,
                    args=args,
                    group=group,
                )
                num_updates += args.num_minibatches
                kl = minibatch_metrics[-1]["approx_kl"]
                if args.target_kl is not None and mean_over_processes(kl, group) > args.target_kl:
                    break  # one sync per epoch; every process decides alike
            # logged: means over minibatches and processes
            metrics = {key: torch.stack([m[key] for m in minibatch_metrics]).mean() for key in minibatch_metrics[0]}
            returns_var = batch.returns.var(correction=0).clamp_min(1e-8)
            metrics["explained_variance"] = 1 - (batch.returns - batch.values).var(correction=0) / returns_var
            averaged = mean_over_processes(torch.stack(list(metrics.values())), group)
            metrics = dict(zip(metrics, averaged))
            run.log(global_step, metrics, charts=dict(learning_rate=lr_now))  # every process checks the same numbers
    envs.close()
    if group is not None and run.exit_code() != 1:  # not after a failed collective
        dist.destroy_process_group()
    if rank != 0:
        sys.exit(run.exit_code())
    run.end_training(global_step, metrics)

    summary = {"world_size": args.world_size, "local_num_envs": args.local_num_envs, "num_updates": num_updates}
    summary["backend"] = backend if args.world_size > 1 else None
    summary["compiled_pieces"] = ["gae", "policy", "ppo_loss"] if args.compile else []
    sys.exit(run.write_and_evaluate(partial(evaluate, agent_view, args, device, run.video_folder), summary))
