"""PPO (Schulman et al. 2017) with an LSTM policy on Atari, one file.

Speed: the update runs the LSTM once per minibatch, over its episode segments padded into one batch
(`--lstm-impl loop`: CleanRL's per-step loop). Cost: the padded steps.
    python leanrl_scripts/ppo_atari_lstm.py --env-id Breakout-v5 --compile
"""

import os
import sys
from collections import defaultdict, namedtuple
from dataclasses import dataclass
from functools import partial
from typing import Literal

# Idle OpenMP threads free envpool's cores after a short spin that catches the LSTM's small kernels (busy machine:
# GOMP_SPINCOUNT=0); set before torch loads OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "30000")

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
    """total environment steps (0 with --load-model: evaluate only)"""
    learning_rate: Flag.Positive = 2.5e-4
    """the learning rate of the optimizer"""
    num_envs: Flag.Count = 8
    """the number of parallel environments"""
    num_steps: Flag.Count = 128
    """the steps per env per rollout"""
    lstm_impl: Literal["padded", "loop"] = "padded"
    """padded: one LSTM call per minibatch; loop: one per step"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to 0"""
    gamma: Flag.Fraction = 0.99
    """the discount factor gamma"""
    gae_lambda: Flag.Fraction = 0.95
    """the lambda for the general advantage estimation"""
    num_minibatches: Flag.Count = 4
    """the number of mini-batches (of whole env rows)"""
    update_epochs: Flag.Count = 4
    """the K epochs to update the policy"""
    norm_adv: bool = True
    """normalize the advantages"""
    clip_coef: Flag.Positive = 0.1
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """clip the value loss"""
    ent_coef: Flag.AtLeast0 = 0.01
    """coefficient of the entropy"""
    vf_coef: Flag.AtLeast0 = 0.5
    """coefficient of the value function"""
    max_grad_norm: Flag.Positive = 0.5
    """the maximum norm for the gradient clipping"""
    target_kl: Flag.AtLeast0 | None = None
    """the target KL divergence (None: off)"""
    measure_burnin: Flag.CountFrom0 = 1
    """iterations left out of the speed figure"""


def make_envs(env_id, num_envs, seed=0, training=True, render=False):
    """envpool's Atari preprocessing on one frame; training envs end episodes at lost lives, clip rewards."""
    if env_id not in envpool.list_all_envs():
        fail(f"unknown env id '{env_id}': ids come from envpool.list_all_envs(), Atari games look like Breakout-v5")
    if type(envpool.make_spec(env_id)).__name__ != "AtariEnvSpec":
        fail(f"{env_id} is not an Atari game: continuous control runs with ppo_continuous_action.py")
    game = dict(stack_num=1, episodic_life=training, reward_clip=training, render_mode="rgb_array" if render else None)
    threads = min(num_envs, usable_cores())
    return envpool.make(env_id, env_type="gymnasium", num_envs=num_envs, num_threads=threads, seed=seed, **game)


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    """The Nature DQN network on one frame, an LSTM, and policy and value heads."""

    def __init__(self, num_actions):
        super().__init__()
        self.network = nn.Sequential(
            layer_init(nn.Conv2d(1, 32, 8, stride=4)),
            nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2)),
            nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1)),
            nn.ReLU(),
            nn.Flatten(),
            layer_init(nn.Linear(64 * 7 * 7, 512)),
            nn.ReLU(),
        ).to(memory_format=torch.channels_last)
        self.lstm = nn.LSTM(512, 128)
        for name, param in self.lstm.named_parameters():
            if "bias" in name:
                nn.init.constant_(param, 0)
            else:
                nn.init.orthogonal_(param, 1.0)
        self.actor = layer_init(nn.Linear(128, num_actions), std=0.01)
        self.critic = layer_init(nn.Linear(128, 1), std=1.0)

    def features(self, obs):
        frames = obs.flatten(0, 1).contiguous(memory_format=torch.channels_last) / 255.0
        return self.network(frames).view(*obs.shape[:2], -1)

    def heads(self, hidden, action=None):
        """Categorical policy written out: torch.distributions syncs the host."""
        log_probs = self.actor(hidden).log_softmax(-1)
        if action is None:  # Gumbel-max sampling
            action = (log_probs - torch.empty_like(log_probs).exponential_().log()).argmax(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        return action, log_probs.gather(-1, action[..., None]).squeeze(-1), entropy, self.critic(hidden).squeeze(-1)


# Eager under --compile: traced, the LSTM is unrolled over the steps cuDNN runs in one call.
@torch.compiler.disable
def lstm_loop(lstm, features, h, c, starts):
    """CleanRL's per-step LSTM: the state is zeroed where an episode starts."""
    outputs = []
    for feature, start in zip(features, starts):
        keep = (1.0 - start).view(1, -1, 1)
        output, (h, c) = lstm(feature[None], (keep * h, keep * c))
        outputs.append(output)
    return torch.cat(outputs), (h, c)


@torch.compiler.disable
def lstm_padded(lstm, features, h, c, frame_index, state_index, output_index):
    """The same outputs from one LSTM call over padded episode segments (zero rows for padding)."""
    num_steps, batch = features.shape[:2]
    flat_features = torch.cat([features.flatten(0, 1), features.new_zeros(1, features.shape[-1])])
    initial_h = torch.cat([h[0], h.new_zeros(1, h.shape[-1])])[state_index]
    initial_c = torch.cat([c[0], c.new_zeros(1, c.shape[-1])])[state_index]
    outputs, _ = lstm(flat_features[frame_index], (initial_h[None], initial_c[None]))
    return outputs.flatten(0, 1)[output_index].view(num_steps, batch, -1)


def segment_layout(starts):
    """Host-side plan for `lstm_padded`: episode segments as columns of a (T, S_pad) batch, S_pad a power of two for
    few compiled shapes and CUDA graphs. Padding costs (S_pad - B) x T x (512 + LSTM activations) floats."""
    num_steps, batch = starts.shape
    cuts = starts.astype(bool)
    cuts[0] = True
    segment = np.cumsum(cuts.T.ravel()).reshape(batch, num_steps).T - 1
    num_segments = segment[-1, -1] + 1
    padded_segments = max(batch, 1 << int(num_segments - 1).bit_length())
    start_time = np.zeros(num_segments, dtype=np.int64)
    times, envs = np.nonzero(cuts)
    start_time[segment[times, envs]] = times
    position = np.arange(num_steps)[:, None] - start_time[segment]
    frame_index = np.full((num_steps, padded_segments), num_steps * batch, dtype=np.int64)
    frame_index[position, segment] = np.arange(num_steps * batch).reshape(num_steps, batch)
    state_index = np.full(padded_segments, batch, dtype=np.int64)
    first = ~starts[0].astype(bool)  # envs that continue the stored state
    state_index[segment[0, first]] = np.nonzero(first)[0]
    output_index = (position * padded_segments + segment).ravel()
    return frame_index, state_index, output_index


def policy(obs, h, c, start, *, agent):
    """One step for every env: actions, log-probabilities, values and the next LSTM state."""
    with torch.no_grad():  # the view's LSTM is the learner's own
        keep = (1.0 - start).view(1, -1, 1)
        hidden, (h, c) = agent.lstm(agent.features(obs[None]), (keep * h, keep * c))
        action, log_prob, _, value = agent.heads(hidden[0])
    return action, log_prob, value, h, c


def gae(rewards, values, dones, next_value, next_done, *, gamma, gae_lambda):
    """GAE as a parallel scan of log2(T) rounds."""
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


# Whole env rows, their first LSTM states and segment layout. dones[t]: obs t ends an episode; starts[t]: it starts one.
Minibatch = namedtuple(
    "Minibatch",
    "obs dones starts initial_h initial_c actions logprobs advantages returns values "
    "frame_index state_index output_index",
)


def ppo_loss(minibatch, *, agent, args):
    """The clipped-surrogate loss without envpool's reset steps (after an episode's last frame): CleanRL's wrappers
    never store them."""
    features = agent.features(minibatch.obs)
    h = minibatch.initial_h
    c = minibatch.initial_c
    if args.lstm_impl == "loop":
        hidden, _ = lstm_loop(agent.lstm, features, h, c, minibatch.starts)
    else:
        hidden = lstm_padded(
            agent.lstm, features, h, c, minibatch.frame_index, minibatch.state_index, minibatch.output_index
        )
    _, new_logprob, entropy, new_value = agent.heads(hidden, minibatch.actions)
    advantages = minibatch.advantages
    returns = minibatch.returns
    values = minibatch.values
    kept = 1.0 - minibatch.dones  # 0 at the reset steps
    weights = kept / kept.sum()  # a mean over kept steps: (x * weights).sum()
    logratio = new_logprob - minibatch.logprobs
    ratio = logratio.exp()
    with torch.no_grad():
        old_approx_kl = (-logratio * weights).sum()
        approx_kl = (((ratio - 1) - logratio) * weights).sum()
        clipfrac = (((ratio - 1.0).abs() > args.clip_coef) * weights).sum()
    if args.norm_adv:
        centered = advantages - (advantages * weights).sum()
        advantages = centered / (((centered.pow(2) * kept).sum() / (kept.sum() - 1)).sqrt() + 1e-8)
    pg_loss = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef))
    if args.clip_vloss:
        clipped_value = values + (new_value - values).clamp(-args.clip_coef, args.clip_coef)
        v_loss = 0.5 * torch.max((new_value - returns).pow(2), (clipped_value - returns).pow(2))
    else:
        v_loss = 0.5 * (new_value - returns).pow(2)
    pg_loss, v_loss, entropy_loss = ((term * weights).sum() for term in (pg_loss, v_loss, entropy))
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
    """One optimizer step on `loss_fn`, the compiled piece."""
    loss, metrics = loss_fn(minibatch, agent=agent, args=args)
    optimizer.zero_grad()
    loss.backward()
    metrics["grad_norm"] = nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm).detach()
    optimizer.step()
    return metrics


def to_device(array, device):
    """A host array on `device`; pinned, its copy does not wait."""
    tensor = torch.from_numpy(array)
    return tensor.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else tensor


def evaluate(agent, args, device, video_folder=None):
    """True score of one game per env, actions sampled: a greedy policy can stall."""
    envs = make_envs(
        args.env_id, args.eval_episodes, seed=args.seed + 10_000, training=False, render=video_folder is not None
    )
    torch.manual_seed(args.seed)
    obs, _ = envs.reset()
    video = game_mp4(video_folder, envs.render()[0]) if video_folder else None
    h = c = torch.zeros(1, envs.num_envs, agent.lstm.hidden_size, device=device)
    no_start = torch.zeros(envs.num_envs, device=device)  # one game: never reset
    returns = np.zeros(envs.num_envs)
    finished = np.zeros(envs.num_envs, dtype=bool)
    while not finished.all():
        stop_if_signalled()
        with torch.no_grad():
            actions, _, _, h, c = policy(to_device(obs, device), h, c, no_start, agent=agent)
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
    if args.num_envs % args.num_minibatches:
        rows = f"--num-envs {args.num_envs}: minibatches are whole env rows"
        fail(f"--num-minibatches {args.num_minibatches} must divide {rows}")
    envs_per_batch = args.num_envs // args.num_minibatches
    batch_size = args.num_envs * args.num_steps
    if 0 < args.total_timesteps < batch_size:
        fail(f"--total-timesteps {args.total_timesteps} is less than one rollout (num_envs x num_steps = {batch_size})")
    num_iterations = args.total_timesteps // batch_size
    device = run.device
    # every usable core: envs and network take turns
    run.tune_cpu(threads=usable_cores(), keep_freed_memory=True)
    rng = np.random.default_rng(args.seed)

    envs = make_envs(args.env_id, args.num_envs, seed=args.seed)
    num_actions = int(envs.action_space.n)
    agent = Agent(num_actions).to(device)
    # a tensor, annealed in place: the graphs never recapture
    learning_rate = torch.tensor(args.learning_rate, device=device)
    optimizer = torch.optim.Adam(agent.parameters(), lr=learning_rate, eps=1e-5, fused=True, capturable=run.cudagraphs)
    run.save_and_load({"agent": agent, "optimizer": optimizer}, num_actions=num_actions)
    agent_view = Agent(num_actions).to("meta")  # the learner's weights, shared and without grad
    from_module(agent).data.to_module(agent_view)
    agent_view.requires_grad_(False)
    # ...but the learner's own LSTM: on CUDA a view's LSTM would act with the weights cuDNN copied at its first call
    agent_view.lstm = agent.lstm

    graphed = partial(CudaGraphModule, warmup=5)  # captured after the first calls (compilation, Adam's state)
    # compiled before its arguments are bound: dynamo sees one function, one cache
    maybe_compile = partial(torch.compile, disable=not args.compile)
    if args.compile:  # the policy's LSTM step is traced
        torch._dynamo.config.allow_rnn = True
    policy_step = partial(maybe_compile(policy), agent=agent_view)
    gae_step = partial(maybe_compile(gae), gamma=args.gamma, gae_lambda=args.gae_lambda)
    update_step = partial(update, loss_fn=maybe_compile(ppo_loss), agent=agent, optimizer=optimizer, args=args)
    if run.cudagraphs:
        policy_step, gae_step = graphed(policy_step), graphed(gae_step)
    # a CUDA graph per segment count: fixed shapes
    update_steps = defaultdict(lambda: graphed(update_step) if run.cudagraphs else update_step)
    no_layout = tuple(torch.zeros(0, dtype=torch.long, device=device) for _ in range(3))

    T = args.num_steps
    E = args.num_envs
    obs = torch.zeros((T, E, *envs.observation_space.shape), dtype=torch.uint8, device=device)
    actions = torch.zeros((T, E), dtype=torch.long, device=device)
    logprobs, rewards, dones, starts, values = (torch.zeros((T, E), device=device) for _ in range(5))
    starts_host = np.zeros((T, E), dtype=np.float32)  # for the segment plans: no device sync
    episode_returns = np.zeros(E)
    episode_lengths = np.zeros(E, dtype=np.int64)
    metrics = {}
    num_updates = 0
    padded_steps = 0
    real_steps = 0
    global_step = 0
    first_iteration = 0
    if resumed := run.resumable(rng=rng):
        first_iteration, global_step, num_updates = resumed["iteration"], resumed["global_step"], resumed["num_updates"]
        padded_steps, real_steps = resumed["padded_steps"], resumed["real_steps"]
        # envpool cannot save its games mid-episode: new ones, seeded apart
        envs = make_envs(args.env_id, args.num_envs, seed=args.seed + global_step)
    next_obs_np, _ = envs.reset()
    next_obs = to_device(next_obs_np, device)
    next_done_np = np.zeros(E, dtype=np.float32)
    next_start_np = np.zeros(E, dtype=np.float32)
    next_done = torch.zeros(E, device=device)
    next_start = torch.zeros(E, device=device)
    # two tensors: one for both recompiles the policy
    h, c = (torch.zeros(1, E, agent.lstm.hidden_size, device=device) for _ in range(2))
    run.start()
    with run.stoppable():
        for iteration in range(first_iteration, num_iterations):
            loop = dict(iteration=iteration, global_step=global_step, num_updates=num_updates, real_steps=real_steps)
            run.checkpoint_if_due(global_step, **loop, padded_steps=padded_steps)
            if iteration == args.measure_burnin:
                run.start_speed_measure(global_step)
            lr_now = (1.0 - iteration / num_iterations) * args.learning_rate if args.anneal_lr else args.learning_rate
            learning_rate.fill_(lr_now)

            initial_h = h.clone()
            initial_c = c.clone()  # the update starts from these
            for step in range(T):
                stop_if_signalled()
                obs[step] = next_obs
                dones[step] = next_done
                starts[step] = next_start
                starts_host[step] = next_start_np
                actions[step], logprobs[step], values[step], h, c = policy_step(next_obs, h, c, next_start)
                next_obs_np, reward, terminations, truncations, infos = run.timed_env_call(
                    envs.step, actions[step].cpu().numpy()
                )
                global_step += E
                # envpool's reset step follows an episode's last frame: zero the state after it
                next_start = next_done
                next_start_np = next_done_np
                next_done_np = (terminations | truncations).astype(np.float32)
                step_data = np.stack([reward.astype(np.float32), next_done_np])
                step_data = torch.from_numpy(step_data).to(device, non_blocking=True)
                next_obs = torch.from_numpy(next_obs_np).to(device, non_blocking=True)
                rewards[step] = step_data[0]
                next_done = step_data[1]
                # the true score: unclipped rewards, games not lives
                episode_returns += infos["reward"]
                episode_lengths += 1
                for env_id in np.nonzero(infos["terminated"].astype(bool) | truncations)[0]:
                    run.record_episode(global_step, episode_returns[env_id], episode_lengths[env_id])
                    episode_returns[env_id] = 0.0
                    episode_lengths[env_id] = 0

            next_value = policy_step(next_obs, h, c, next_start)[2]
            advantages, returns = gae_step(rewards, values, dones, next_value, next_done)
            rollout = (obs, dones, starts, initial_h, initial_c, actions, logprobs, advantages, returns, values)
            minibatch_metrics = []
            for _ in range(args.update_epochs):
                env_order = rng.permutation(E)
                for start in range(0, E, envs_per_batch):
                    env_ids = env_order[start : start + envs_per_batch]
                    real_steps += T * len(env_ids)
                    if args.lstm_impl == "padded":
                        layout = tuple(to_device(a, device) for a in segment_layout(starts_host[:, env_ids]))
                        if args.compile:  # one compile for every segment count
                            torch._dynamo.maybe_mark_dynamic(layout[0], 1)
                            torch._dynamo.maybe_mark_dynamic(layout[1], 0)
                        padded_steps += layout[0].numel()
                    else:
                        layout = no_layout
                        padded_steps += T * len(env_ids)
                    columns = to_device(env_ids, device)
                    minibatch = Minibatch(*(t[:, columns] for t in rollout), *layout)
                    minibatch_metrics.append(update_steps[layout[0].shape[-1]](minibatch))
                    num_updates += 1
                if args.target_kl is not None and minibatch_metrics[-1]["approx_kl"].item() > args.target_kl:
                    break  # one sync per epoch
            metrics = {key: torch.stack([m[key] for m in minibatch_metrics]).mean() for key in minibatch_metrics[0]}
            returns_var = returns.var(correction=0).clamp_min(1e-8)
            metrics["explained_variance"] = 1 - (returns - values).var(correction=0) / returns_var
            run.log(global_step, metrics, charts=dict(learning_rate=lr_now))
    run.end_training(global_step, metrics)
    envs.close()

    pieces = ["gae", "policy", "ppo_loss"]
    summary = dict(lstm_impl=args.lstm_impl, padded_steps=padded_steps, real_steps=real_steps, num_updates=num_updates)
    summary.update(update_shapes=len(update_steps))
    summary["compiled_pieces"] = pieces if args.compile else []
    sys.exit(run.write_and_evaluate(partial(evaluate, agent_view, args, device, run.video_folder), summary))
