"""FastTD3 (Seo et al. 2025): TD3 fed by many parallel environments, one file.

The recipe: --num-envs envs stepping together, each exploring with its own noise scale; batches of thousands; twin
distributional critics (C51) with clipped double Q; observations normalised by running statistics; the replay held
on the device; bf16 autocast and compiled updates. Cost: its defaults are sized for a GPU (128 envs, batches of
32,768, critics 1,024 wide); docs/fast_td3.md gives the settings of a small CPU.
    python leanrl_scripts/fast_td3.py --env-id HalfCheetah-v5 --compile --cudagraphs
"""

import copy
import math
import sys
from dataclasses import dataclass
from functools import partial

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
    total_timesteps: int = 19_200_000
    """total environment steps, all envs together (FastTD3's 150,000 steps of 128 envs)"""
    num_envs: Flag.Count = 128
    """the number of parallel environments"""
    buffer_size: Flag.Count = 51_200
    """the steps of each env the replay keeps"""
    batch_size: Flag.Count = 32_768
    """the transitions of one update, all envs together"""
    num_updates: Flag.Count = 2
    """critic updates per step of the envs"""
    num_steps: Flag.Count = 1
    """n of the n-step returns"""
    gamma: Flag.Fraction = 0.99
    """the discount factor gamma"""
    tau: Flag.PositiveFraction = 0.1
    """target smoothing coefficient, after every critic update"""
    learning_starts: Flag.BeforeTheEnd = 1_280
    """updates follow each step of the envs begun past this many env steps (FastTD3's 10 of 128 envs)"""
    critic_learning_rate: Flag.Positive = 3e-4
    """the critics' learning rate"""
    actor_learning_rate: Flag.Positive = 3e-4
    """the actor's learning rate"""
    weight_decay: Flag.AtLeast0 = 0.1
    """AdamW's weight decay, both networks"""
    policy_frequency: Flag.Count = 2
    """critic updates per actor update"""
    policy_noise: Flag.AtLeast0 = 0.001
    """the scale of the target policy smoothing noise"""
    noise_clip: Flag.AtLeast0 = 0.5
    """the target policy smoothing noise is clipped to this"""
    std_min: Flag.AtLeast0 = 0.001
    """the lowest exploration noise scale an env draws"""
    std_max: Flag.AtLeast0 = 0.4
    """the highest exploration noise scale an env draws"""
    num_atoms: Flag.Count = 101
    """the atoms of the critics' value distributions"""
    v_min: float = -2500.0
    """the lowest value of the atoms"""
    v_max: float = 2500.0
    """the highest value of the atoms"""
    critic_hidden_dim: Flag.Count = 1024
    """the width of the critics' first layer (then half, then a quarter)"""
    actor_hidden_dim: Flag.Count = 512
    """the width of the actor's first layer (then half, then a quarter)"""
    use_cdq: bool = True
    """clipped double Q: the target and the actor take the lower critic"""
    obs_normalization: bool = True
    """normalise observations by their running mean and std"""
    amp: bool = True
    """bf16 autocast of the updates (CUDA only)"""
    measure_burnin: Flag.CountFrom0 = 3
    """critic updates the speed figure leaves out (compilation, graph capture)"""


LOG_EVERY = 100  # iterations between metric reads (a host sync each)


def make_env(env_id, video_folder=None):
    def thunk():
        env = gym.make(env_id, render_mode="rgb_array" if video_folder else None)
        if isinstance(env.observation_space, gym.spaces.Dict):  # dm_control's named observations
            env = gym.wrappers.FlattenObservation(env)
        if video_folder:
            env = gym.wrappers.RecordVideo(env, video_folder, episode_trigger=lambda episode: episode == 0)
        return gym.wrappers.RecordEpisodeStatistics(env)

    return thunk


def make_envs(env_id, num_envs, video_folder=None):
    """A vector env that records episodes; a step that ends one returns the reset observation, the final in infos."""
    if env_id.startswith("dm_control/"):  # through shimmy, as CleanRL runs it
        try:
            import shimmy  # noqa: F401  (registers the ids)
        except ModuleNotFoundError:
            fail('dm_control tasks need shimmy and dm_control: pip install ".[dm-control]"')
    try:
        thunks = [make_env(env_id, i == 0 and video_folder) for i in range(num_envs)]
        envs = gym.vector.SyncVectorEnv(thunks, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    except gym.error.DependencyNotInstalled as error:
        fail(
            f"{env_id}: a package is missing ({error}); MuJoCo: pip install '.[mujoco]', videos: pip install '.[video]'"
        )
    except gym.error.UnregisteredEnv:
        fail(f"unknown env id '{env_id}': ids come from gymnasium's registry (gymnasium.pprint_registry())")
    except Exception as error:
        fail(f"{env_id}: {error}")
    check_spaces(env_id, envs.single_action_space, gym.spaces.Box, envs.single_observation_space, gym.spaces.Box)
    if not np.isfinite(envs.single_action_space.low).all() or not np.isfinite(envs.single_action_space.high).all():
        fail(f"{env_id} has actions {envs.single_action_space}: fast_td3.py needs bounded ones")
    return envs


def to_env_actions(actions, space):
    """The actor's actions in [-1, 1] scaled to the bounds of the env's `space`."""
    return space.low + (actions + 1) / 2 * (space.high - space.low)


def true_next_obs(next_obs, infos):
    """The observations the step led to: the final one where an episode ended (a truncated one bootstraps from it)."""
    if "final_obs" not in infos:
        return next_obs
    ended = infos["_final_obs"]
    real_next_obs = next_obs.copy()
    real_next_obs[ended] = np.stack(infos["final_obs"][ended])
    return real_next_obs


class EmpiricalNormalization(nn.Module):
    """Observations less their running mean, over their running std plus 0.01 (FastTD3's), of every observation the
    envs handed out (Chan et al.'s parallel merge)."""

    def __init__(self, obs_dim, enabled=True):
        super().__init__()
        self.enabled = enabled
        self.register_buffer("mean", torch.zeros(obs_dim))
        self.register_buffer("var", torch.ones(obs_dim))
        self.register_buffer("count", torch.zeros(()))

    def forward(self, obs):
        if not self.enabled:
            return obs
        return (obs - self.mean) / (self.var.sqrt() + 0.01)

    @torch.no_grad()
    def update(self, obs):
        batch_mean, batch_var = obs.mean(0), obs.var(0, unbiased=False)
        count = self.count + len(obs)
        delta = batch_mean - self.mean
        self.mean.add_(delta * len(obs) / count)
        between = delta**2 * self.count * len(obs) / count**2
        self.var.mul_(self.count / count).add_(batch_var * len(obs) / count + between)
        self.count.copy_(count)


class Actor(nn.Module):
    """Deterministic policy: actions in [-1, 1], scaled to the env's bounds as it steps."""

    def __init__(self, obs_dim, act_dim, hidden):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(obs_dim, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden // 2),
            nn.ReLU(),
            nn.Linear(hidden // 2, hidden // 4),
            nn.ReLU(),
            nn.Linear(hidden // 4, act_dim),
            nn.Tanh(),
        )
        # FastTD3's init_scale: the first actions near 0 whatever the observations
        nn.init.normal_(self.net[-2].weight, 0, 0.01)
        nn.init.zeros_(self.net[-2].bias)

    def forward(self, obs):
        return self.net(obs)


class DistributionalQNetwork(nn.Module):
    """The logits of Q(s, a)'s distribution over the atoms (C51)."""

    def __init__(self, obs_dim, act_dim, hidden, num_atoms):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(obs_dim + act_dim, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden // 2),
            nn.ReLU(),
            nn.Linear(hidden // 2, hidden // 4),
            nn.ReLU(),
            nn.Linear(hidden // 4, num_atoms),
        )

    def forward(self, obs, actions):
        return self.net(torch.cat([obs, actions], -1))


class Ensemble(nn.Module):
    """Two networks from `make()`, each its own initial weights, called as one: outputs stacked."""

    def __init__(self, make):
        super().__init__()
        self.members = nn.ModuleList(make() for _ in range(2))

    def forward(self, *inputs):
        return torch.stack([member(*inputs) for member in self.members])


class ReplayBuffer:
    """Each env's last `size` steps as rows [obs | action | reward | next_obs | termination | episode end] of one
    device tensor: a step is one copy in; a batch gathers windows of n steps of one env each."""

    def __init__(self, size, obs_dim, act_dim, num_envs, num_steps, gamma, device):
        self.columns = [obs_dim, act_dim, 1, obs_dim, 1, 1]
        self.rows = torch.zeros(size, num_envs, sum(self.columns), device=device)
        self.steps = torch.arange(num_steps, device=device)
        self.gamma = gamma
        self.size = size
        self.pos = 0
        self.filled = 0

    def add(self, obs, actions, rewards, next_obs, terminations, ended):
        step = np.concatenate([obs, actions, rewards[:, None], next_obs, terminations[:, None], ended[:, None]], 1)
        self.rows[self.pos] = torch.from_numpy(step).to(self.rows)
        self.pos = (self.pos + 1) % self.size
        self.filled = min(self.filled + 1, self.size)

    def sample(self, batch_size):
        """obs, actions, discounted rewards, the obs they led to, bootstrap (0 after a termination), its discount.
        A window stops at an episode's end and never reaches past the newest step."""
        device = self.rows.device
        first = (
            torch.randint(self.filled - len(self.steps) + 1, (batch_size, 1), device=device) + self.pos - self.filled
        )
        env = torch.randint(self.rows.shape[1], (batch_size, 1), device=device)
        window = self.rows[(first + self.steps) % self.size, env]
        obs, actions, rewards, next_obs, terminations, ended = window.split(self.columns, -1)
        counted = nn.functional.pad(
            torch.cumprod(1 - ended[:, :-1, 0], 1), (1, 0), value=1
        )  # no episode ended before the step
        n = counted.sum(1)
        last = (n - 1).long()
        batch = torch.arange(batch_size, device=device)
        returns = (rewards[..., 0] * counted * self.gamma**self.steps).sum(1)
        return obs[:, 0], actions[:, 0], returns, next_obs[batch, last], 1 - terminations[batch, last, 0], self.gamma**n


def policy(obs, *, actor, normalizer):
    """Deterministic actions in [-1, 1]; `actor`, a detached view, records no graph."""
    return actor(normalizer(obs))


def explore(obs, ended, noise_scales, *, actor, normalizer, args):
    """Noisy actions and each env's noise scale, redrawn where its episode ended; the observations update the
    normalizer."""
    normalizer.update(obs)
    drawn = torch.rand_like(noise_scales) * (args.std_max - args.std_min) + args.std_min
    noise_scales = torch.where(ended[:, None], drawn, noise_scales)
    actions = policy(obs, actor=actor, normalizer=normalizer)
    return (actions + torch.randn_like(actions) * noise_scales).clamp(-1, 1), noise_scales


def project(next_probs, rewards, bootstrap, discount, support):
    """C51's projection: distributions over `support` moved to rewards + discount * bootstrap * support and spread back
    onto it, each atom's mass split between the two atoms it lands between."""
    v_min, v_max = support[0], support[-1]
    target_z = rewards[:, None] + (discount * bootstrap)[:, None] * support
    b = (target_z.clamp(v_min, v_max) - v_min) / (v_max - v_min) * (len(support) - 1)
    lower, upper = b.floor(), b.ceil()
    # the indices clamped: a diverged run's nan (out of bounds as an integer) reaches the loss, not the scatter
    lower_index, upper_index = (
        index.long().clamp(0, len(support) - 1).expand(next_probs.shape) for index in (lower, upper)
    )
    projected = torch.zeros_like(next_probs)
    # landing on an atom (lower == upper), the mass goes to it whole
    projected.scatter_add_(-1, lower_index, next_probs * (upper + (lower == upper) - b))
    return projected.scatter_add_(-1, upper_index, next_probs * (b - lower))


def critic_loss(
    obs, actions, rewards, next_obs, bootstrap, discount, *, actor, normalizer, qnet, target_qnet, support, args
):
    """The critics' cross-entropy to the projected target distribution, summed over critics; with clipped double Q,
    each transition's target is that of the target critic with the lower mean."""
    obs, next_obs = normalizer(obs), normalizer(next_obs)
    with torch.no_grad():
        # target policy smoothing with the current actor: FastTD3 keeps no target actor
        next_actions = actor(next_obs)
        noise = (torch.randn_like(next_actions) * args.policy_noise).clamp(-args.noise_clip, args.noise_clip)
        next_probs = target_qnet(next_obs, (next_actions + noise).clamp(-1, 1)).softmax(-1)
        target = project(next_probs, rewards, bootstrap, discount, support)
        target_values = (target * support).sum(-1)
        if args.use_cdq:
            target = torch.where((target_values[0] < target_values[1])[:, None], target[0], target[1])
    loss = -(target * qnet(obs, actions).log_softmax(-1)).sum(-1).mean(-1).sum()
    return loss, {
        "qf_loss": loss.detach(),
        "qf_max": target_values[0].max(),
        "qf_min": target_values[0].min(),
        "buffer_rewards": rewards.mean(),
    }


def actor_loss(obs, *, actor, normalizer, qnet_view, support, use_cdq):
    """The deterministic policy gradient through both critics (`qnet_view`, detached): the lower mean, or without
    clipped double Q their average."""
    obs = normalizer(obs)
    values = (qnet_view(obs, actor(obs)).softmax(-1) * support).sum(-1)
    loss = -(values.min(0).values if use_cdq else values.mean(0)).mean()
    return loss, {"actor_loss": loss.detach()}


def update_critics(*batch, loss_fn, actor, normalizer, qnet, target_qnet, support, args, optimizer, autocast):
    """One step of the critics on `loss_fn` (critic_loss), under `autocast`."""
    with autocast:
        loss, metrics = loss_fn(
            *batch, actor=actor, normalizer=normalizer, qnet=qnet, target_qnet=target_qnet, support=support, args=args
        )
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return metrics


def update_actor(obs, *, loss_fn, actor, normalizer, qnet_view, support, use_cdq, optimizer, autocast):
    """One step of the actor on `loss_fn` (actor_loss), under `autocast`."""
    with autocast:
        loss, metrics = loss_fn(
            obs, actor=actor, normalizer=normalizer, qnet_view=qnet_view, support=support, use_cdq=use_cdq
        )
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return metrics


def detached_view(module):
    """`module` copied to the meta device, reading its weights shared and without grad."""
    view = copy.deepcopy(module).to("meta")
    from_module(module).data.to_module(view)
    return view.requires_grad_(False)


@torch.no_grad()
def soft_update(target, online, tau):
    """Parameters lerp'd by `tau`, buffers (BatchNorm statistics) copied, as SB3 does."""
    for target_param, param in zip(target.parameters(), online.parameters()):
        target_param.lerp_(param, tau)
    for target_buffer, buffer in zip(target.buffers(), online.buffers()):
        target_buffer.copy_(buffer)


def evaluate(actor, normalizer, args, device, video_folder):
    """The return of one episode in each of --eval-episodes envs, with the deterministic action."""
    envs = make_envs(args.env_id, args.eval_episodes, video_folder)
    obs, _ = envs.reset(seed=args.seed + 10_000)
    returns = np.zeros(envs.num_envs)
    finished = np.zeros(envs.num_envs, dtype=bool)
    while not finished.all():
        stop_if_signalled()
        actions = policy(torch.as_tensor(obs, dtype=torch.float32, device=device), actor=actor, normalizer=normalizer)
        env_actions = to_env_actions(actions.cpu().numpy(), envs.single_action_space)
        obs, rewards, terminations, truncations, _ = envs.step(env_actions)
        returns += rewards * ~finished
        finished |= terminations | truncations
    envs.close()
    return returns.tolist()


if __name__ == "__main__":
    args = tyro.cli(Args)
    run = Run(args)
    if args.std_min > args.std_max:
        fail(f"--std-min {args.std_min} must be at most --std-max {args.std_max}")
    if not 0 < args.v_max - args.v_min < math.inf:
        fail(f"--v-min {args.v_min} must be below --v-max {args.v_max}, both finite")
    if args.num_atoms < 2:
        fail(f"--num-atoms must be 2 or more, not {args.num_atoms}")
    if args.critic_hidden_dim < 4 or args.actor_hidden_dim < 4:
        fail("--critic-hidden-dim and --actor-hidden-dim must be 4 or more (the layers are a half and a quarter)")
    if args.learning_starts < args.num_steps * args.num_envs or args.buffer_size < args.num_steps:
        fail(f"--learning-starts and --buffer-size must cover --num-steps {args.num_steps} steps of every env")
    device = run.device
    # the cores idle at start: a second thread pays on an idle machine, not beside busy processes
    run.tune_cpu(threads="idle")

    envs = make_envs(args.env_id, args.num_envs)
    obs_dim = math.prod(envs.single_observation_space.shape)
    act_dim = math.prod(envs.single_action_space.shape)
    run.check_fits(args.buffer_size * args.num_envs * (2 * obs_dim + act_dim + 3) * 4, "--buffer-size")

    actor = Actor(obs_dim, act_dim, args.actor_hidden_dim).to(device)
    qnet = Ensemble(partial(DistributionalQNetwork, obs_dim, act_dim, args.critic_hidden_dim, args.num_atoms)).to(
        device
    )
    target_qnet = copy.deepcopy(qnet).requires_grad_(False)
    support = torch.linspace(args.v_min, args.v_max, args.num_atoms, device=device)
    normalizer = EmpiricalNormalization(obs_dim, args.obs_normalization).to(device)
    actor_view = detached_view(actor)
    qnet_view = detached_view(qnet)
    # Tensor learning rates and capturable state let CUDA graphs replay the optimizer step.
    adamw = partial(torch.optim.AdamW, weight_decay=args.weight_decay, fused=True, capturable=run.cudagraphs)
    q_optimizer = adamw(qnet.parameters(), lr=torch.tensor(args.critic_learning_rate, device=device))
    actor_optimizer = adamw(actor.parameters(), lr=torch.tensor(args.actor_learning_rate, device=device))
    states = dict(
        actor=actor,
        qnet=qnet,
        target_qnet=target_qnet,
        normalizer=normalizer,
        q_optimizer=q_optimizer,
        actor_optimizer=actor_optimizer,
    )
    run.save_and_load(states, obs_dim=obs_dim, act_dim=act_dim)

    # each function compiled before its arguments are bound: a compiled partial is one wrapper, one cache, to dynamo
    maybe_compile = partial(torch.compile, disable=not args.compile)
    policy_step = partial(maybe_compile(explore), actor=actor_view, normalizer=normalizer, args=args)
    amp = args.amp and device.type == "cuda"
    autocast = torch.autocast(device.type, torch.bfloat16, enabled=amp)
    critic_step = partial(
        update_critics,
        loss_fn=maybe_compile(critic_loss),
        optimizer=q_optimizer,
        autocast=autocast,
        actor=actor_view,
        normalizer=normalizer,
        qnet=qnet,
        target_qnet=target_qnet,
        support=support,
        args=args,
    )
    actor_step = partial(
        update_actor,
        loss_fn=maybe_compile(actor_loss),
        optimizer=actor_optimizer,
        autocast=autocast,
        actor=actor,
        normalizer=normalizer,
        qnet_view=qnet_view,
        support=support,
        use_cdq=args.use_cdq,
    )
    if run.cudagraphs:  # captured after the first calls (compilation, AdamW's state)
        graphed = partial(CudaGraphModule, warmup=5)
        policy_step, critic_step, actor_step = map(graphed, (policy_step, critic_step, actor_step))

    rb = ReplayBuffer(args.buffer_size, obs_dim, act_dim, args.num_envs, args.num_steps, args.gamma, device)
    noise_scales = torch.zeros(args.num_envs, 1, device=device)
    ended = torch.ones(args.num_envs, dtype=torch.bool, device=device)  # each env draws its first noise scale
    critic_updates = actor_updates = first_iteration = 0
    metrics = {}
    global_step = 0
    num_iterations = args.total_timesteps // args.num_envs
    obs, _ = envs.reset(seed=args.seed)
    # with --resume: every state and random generator as its last checkpoint left them, and the loop's counters
    if resumed := run.resumable(rb=rb, envs=envs):
        first_iteration, obs = resumed["iteration"], resumed["obs"]
        critic_updates, actor_updates = resumed["critic_updates"], resumed["actor_updates"]
        noise_scales, ended, metrics = resumed["noise_scales"], resumed["ended"], resumed["metrics"]
    run.start()
    with run.stoppable():
        for iteration in range(first_iteration, num_iterations):
            global_step = iteration * args.num_envs
            run.checkpoint_if_due(
                global_step,
                iteration=iteration,
                critic_updates=critic_updates,
                actor_updates=actor_updates,
                obs=obs,
                metrics=metrics,
                noise_scales=noise_scales,
                ended=ended,
            )
            stop_if_signalled()
            if global_step > args.learning_starts and critic_updates >= args.measure_burnin:
                run.start_speed_measure(global_step)
            actions, noise_scales = policy_step(
                torch.as_tensor(obs, dtype=torch.float32, device=device), ended, noise_scales
            )
            actions = actions.cpu().numpy()
            env_actions = to_env_actions(actions, envs.single_action_space)
            next_obs, rewards, terminations, truncations, infos = run.timed_env_call(envs.step, env_actions)
            run.record_gymnasium_episodes(global_step, infos)
            episode_ended = terminations | truncations
            rb.add(obs, actions, rewards, true_next_obs(next_obs, infos), terminations, episode_ended)
            ended = torch.from_numpy(episode_ended).to(device)
            obs = next_obs

            if global_step > args.learning_starts:
                for i in range(args.num_updates):
                    batch = rb.sample(args.batch_size)
                    metrics.update(critic_step(*batch))
                    soft_update(target_qnet, qnet, args.tau)
                    critic_updates += 1
                    # FastTD3's: a step's updates 2, f+2, ... (each at f=1); one a step: each f-th step
                    if (i - 1 if args.num_updates > 1 else iteration) % args.policy_frequency == 0:
                        metrics.update(actor_step(batch[0]))
                        actor_updates += 1
            if iteration % LOG_EVERY == 0:
                run.log(global_step, metrics)
        global_step = num_iterations * args.num_envs
    run.end_training(global_step, metrics)
    envs.close()

    summary = {
        "critic_updates": critic_updates,
        "actor_updates": actor_updates,
        "amp_active": amp,
        "compiled_pieces": ["actor_loss", "critic_loss", "explore"] if args.compile else [],
    }
    sys.exit(run.write_and_evaluate(partial(evaluate, actor_view, normalizer, args, device, run.video_folder), summary))
