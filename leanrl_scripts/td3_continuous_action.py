"""Twin Delayed DDPG (TD3, Fujimoto et al. 2018) for continuous actions, one file.

Speed: the actor's loss reads the first critic alone through a detached view, the replay buffer is one preallocated
device tensor, and the update, the policy step and the actor step can be wrapped in torch.compile and CUDA graphs.
Cost: plain tensors in and out of the pieces, no TensorDicts.
    python leanrl_scripts/td3_continuous_action.py --env-id HalfCheetah-v5 --compile --cudagraphs
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
    total_timesteps: int = 1_000_000
    """total environment steps (0 only with --load-model: evaluate it)"""
    num_envs: Flag.Count = 1
    """the number of parallel environments"""
    buffer_size: Flag.Count = 1_000_000
    """the replay memory buffer size"""
    gamma: Flag.Fraction = 0.99
    """the discount factor gamma"""
    tau: Flag.PositiveFraction = 0.005
    """target smoothing coefficient"""
    batch_size: Flag.Count = 256
    """the batch size of samples from the replay memory"""
    learning_starts: Flag.BeforeTheEnd = 25_000
    """environment steps of random actions before learning starts"""
    learning_rate: Flag.Positive = 3e-4
    """the learning rate of both optimizers"""
    exploration_noise: Flag.AtLeast0 = 0.1
    """the scale of the exploration noise (in half action ranges)"""
    policy_noise: Flag.AtLeast0 = 0.2
    """the scale of the target policy smoothing noise"""
    noise_clip: Flag.AtLeast0 = 0.5
    """the target policy smoothing noise is clipped to this"""
    policy_frequency: Flag.Count = 2
    """the frequency of delayed actor and target updates"""
    measure_burnin: Flag.CountFrom0 = 50
    """updates the speed figure leaves out (compilation, graph capture)"""


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
        thunks = [make_env(env_id, video_folder if i == 0 else None) for i in range(num_envs)]
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
    return envs


def true_next_obs(next_obs, infos):
    """The observations the step led to: the final one where an episode ended (a truncated one bootstraps from it)."""
    if "final_obs" not in infos:
        return next_obs
    ended = infos["_final_obs"]
    real_next_obs = next_obs.copy()
    real_next_obs[ended] = np.stack(infos["final_obs"][ended])
    return real_next_obs


class Actor(nn.Module):
    """Deterministic policy squashed by tanh into the action bounds."""

    def __init__(self, obs_dim, action_space):
        super().__init__()
        act_dim = math.prod(action_space.shape)
        self.net = nn.Sequential(
            nn.Linear(obs_dim, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, act_dim)
        )
        high = torch.tensor(action_space.high)
        low = torch.tensor(action_space.low)
        self.register_buffer("action_scale", ((high - low) / 2).float())
        self.register_buffer("action_bias", ((high + low) / 2).float())

    def forward(self, obs):
        return torch.tanh(self.net(obs)) * self.action_scale + self.action_bias

    def add_noise(self, actions, scale, clip=math.inf):
        """Gaussian noise of std `scale` (in half-ranges, clipped to `clip`), then back into the bounds."""
        noise = (torch.randn_like(actions) * scale).clamp(-clip, clip) * self.action_scale
        return (actions + noise).clamp(self.action_bias - self.action_scale, self.action_bias + self.action_scale)


class QNetwork(nn.Module):
    def __init__(self, obs_dim, act_dim):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(obs_dim + act_dim, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)
        )

    def forward(self, obs, actions):
        return self.net(torch.cat([obs, actions], -1)).squeeze(-1)


class Ensemble(nn.Module):
    """Two networks from `make()`, each its own initial weights, called as one: their outputs stacked."""

    def __init__(self, make):
        super().__init__()
        self.members = nn.ModuleList(make() for _ in range(2))

    def forward(self, *inputs):
        return torch.stack([member(*inputs) for member in self.members])


class ReplayBuffer:
    """Transitions as rows [obs | action | reward | next_obs | termination] of one device tensor: a step is one
    copy in, a batch one gather."""

    def __init__(self, size, obs_dim, act_dim, num_envs, device):
        self.columns = [obs_dim, act_dim, 1, obs_dim, 1]
        self.rows = torch.zeros(size, sum(self.columns), device=device)
        self.env_offsets = torch.arange(num_envs, device=device)
        self.size = size
        self.pos = 0
        self.count = 0

    def add(self, obs, actions, rewards, next_obs, terminations):
        step = np.concatenate([obs, actions, rewards[:, None], next_obs, terminations[:, None]], 1)
        self.rows[(self.pos + self.env_offsets) % self.size] = torch.from_numpy(step).to(self.rows)
        self.pos = (self.pos + len(step)) % self.size
        self.count = min(self.count + len(step), self.size)

    def sample(self, batch_size):
        """obs, actions, rewards, next_obs, terminations."""
        batch = self.rows[torch.randint(0, self.count, (batch_size,), device=self.rows.device)]
        obs, actions, rewards, next_obs, terminations = batch.split(self.columns, dim=1)
        return obs, actions, rewards.squeeze(1), next_obs, terminations.squeeze(1)


def policy(obs, *, actor, exploration_noise=0.0):
    """Deterministic actions, noisy while exploring; `actor`, a detached view, records no graph."""
    actions = actor(obs)
    return actor.add_noise(actions, exploration_noise) if exploration_noise else actions


def critic_loss(obs, actions, rewards, next_obs, terminations, *, target_actor, qnet, target_qnet, args):
    """The critics' TD loss, summed over critics, and CleanRL's metrics."""
    with torch.no_grad():
        # target policy smoothing: the target is averaged over nearby actions, not a sharp peak of Q
        next_actions = target_actor.add_noise(target_actor(next_obs), args.policy_noise, args.noise_clip)
        next_q = target_qnet(next_obs, next_actions).min(0).values
        q_target = rewards + args.gamma * (1 - terminations) * next_q
    q_values = qnet(obs, actions)
    q_losses = (q_values - q_target).pow(2).mean(1)
    losses = q_losses.detach()
    q_means = q_values.detach().mean(1)  # CleanRL's tags: qf_loss is the critics' mean
    metrics = {"qf_loss": losses.mean(), "qf1_loss": losses[0], "qf2_loss": losses[1]}
    return q_losses.sum(), {**metrics, "qf1_values": q_means[0], "qf2_values": q_means[1]}


def actor_loss(obs, *, actor, qnet_view):
    """Deterministic policy gradient through the first critic; `qnet_view` reads it detached."""
    loss = -qnet_view(obs, actor(obs)).mean()
    return loss, {"actor_loss": loss.detach()}


def update_critics(*batch, loss_fn, target_actor, qnet, target_qnet, args, optimizer):
    """One step of the critics on `loss_fn`, the compiled critic_loss."""
    loss, metrics = loss_fn(*batch, target_actor=target_actor, qnet=qnet, target_qnet=target_qnet, args=args)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return metrics


def update_actor(obs, *, loss_fn, actor, qnet_view, optimizer):
    """One step of the actor on `loss_fn`, the compiled actor_loss."""
    loss, metrics = loss_fn(obs, actor=actor, qnet_view=qnet_view)
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
    """Parameters lerp'd by `tau`, buffers (BatchNorm's statistics) copied, as in SB3."""
    for target_param, param in zip(target.parameters(), online.parameters()):
        target_param.lerp_(param, tau)
    for target_buffer, buffer in zip(target.buffers(), online.buffers()):
        target_buffer.copy_(buffer)


def evaluate(actor, args, device, video_folder):
    """The return of one episode in each of --eval-episodes envs, with the deterministic action."""
    envs = make_envs(args.env_id, args.eval_episodes, video_folder)
    obs, _ = envs.reset(seed=args.seed + 10_000)
    returns = np.zeros(envs.num_envs)
    finished = np.zeros(envs.num_envs, dtype=bool)
    while not finished.all():
        stop_if_signalled()
        actions = policy(torch.as_tensor(obs, dtype=torch.float32, device=device), actor=actor)
        obs, rewards, terminations, truncations, _ = envs.step(actions.cpu().numpy())
        returns += rewards * ~finished
        finished |= terminations | truncations
    envs.close()
    return returns.tolist()


if __name__ == "__main__":
    args = tyro.cli(Args)
    run = Run(args)
    if args.buffer_size < args.batch_size:
        fail(f"--buffer-size {args.buffer_size} must hold at least one batch (--batch-size {args.batch_size})")
    device = run.device
    # the cores idle at start: a second thread pays on an idle machine, not beside busy processes
    run.tune_cpu(threads="idle")

    envs = make_envs(args.env_id, args.num_envs)
    envs.action_space.seed(args.seed)
    obs_dim = math.prod(envs.single_observation_space.shape)
    act_dim = math.prod(envs.single_action_space.shape)
    run.check_fits(args.buffer_size * (2 * obs_dim + act_dim + 2) * 4, "--buffer-size")

    actor = Actor(obs_dim, envs.single_action_space).to(device)
    target_actor = copy.deepcopy(actor).requires_grad_(False)
    qnet = Ensemble(partial(QNetwork, obs_dim, act_dim)).to(device)
    target_qnet = copy.deepcopy(qnet).requires_grad_(False)
    actor_view = detached_view(actor)
    qnet_view = detached_view(qnet.members[0])  # the first critic alone
    # A tensor learning rate and capturable state let CUDA graphs replay the optimizer step.
    learning_rate = torch.tensor(args.learning_rate, device=device)
    adam = partial(torch.optim.Adam, lr=learning_rate, fused=True, capturable=run.cudagraphs)
    q_optimizer = adam(qnet.parameters())
    actor_optimizer = adam(actor.parameters())
    states = dict(
        actor=actor,
        qnet=qnet,
        target_actor=target_actor,
        target_qnet=target_qnet,
        q_optimizer=q_optimizer,
        actor_optimizer=actor_optimizer,
    )
    loaded = run.save_and_load(states, obs_dim=obs_dim, act_dim=act_dim)

    # each function compiled before its arguments are bound: a compiled partial is one wrapper, one cache, to dynamo
    maybe_compile = partial(torch.compile, disable=not args.compile)
    policy_step = partial(maybe_compile(policy), actor=actor_view, exploration_noise=args.exploration_noise)
    critic_step = partial(
        update_critics,
        loss_fn=maybe_compile(critic_loss),
        optimizer=q_optimizer,
        target_actor=target_actor,
        qnet=qnet,
        target_qnet=target_qnet,
        args=args,
    )
    actor_step = partial(
        update_actor, loss_fn=maybe_compile(actor_loss), optimizer=actor_optimizer, actor=actor, qnet_view=qnet_view
    )
    if run.cudagraphs:  # captured after the first calls (compilation, Adam's state)
        graphed = partial(CudaGraphModule, warmup=5)
        policy_step, critic_step, actor_step = map(graphed, (policy_step, critic_step, actor_step))

    rb = ReplayBuffer(args.buffer_size, obs_dim, act_dim, args.num_envs, device)
    num_updates, first_iteration = 0, 0
    metrics = {}
    global_step = 0
    num_iterations = args.total_timesteps // args.num_envs
    obs, _ = envs.reset(seed=args.seed)
    # with --resume: every state and random generator as its last checkpoint left them, and the loop's counters
    if resumed := run.resumable(rb=rb, envs=envs):
        first_iteration, num_updates = resumed["iteration"], resumed["num_updates"]
        obs, metrics = resumed["obs"], resumed["metrics"]
    run.start()
    with run.stoppable():
        for iteration in range(first_iteration, num_iterations):
            global_step = iteration * args.num_envs
            run.checkpoint_if_due(global_step, iteration=iteration, num_updates=num_updates, obs=obs, metrics=metrics)
            stop_if_signalled()
            if global_step >= args.learning_starts and num_updates >= args.measure_burnin:
                run.start_speed_measure(global_step)
            if global_step < args.learning_starts and not loaded:
                actions = envs.action_space.sample()
            else:
                actions = policy_step(torch.as_tensor(obs, dtype=torch.float32, device=device)).cpu().numpy()
            next_obs, rewards, terminations, truncations, infos = run.timed_env_call(envs.step, actions)
            run.record_gymnasium_episodes(global_step, infos)
            rb.add(obs, actions, rewards, true_next_obs(next_obs, infos), terminations)
            obs = next_obs

            if global_step + args.num_envs > args.learning_starts:
                batch = rb.sample(args.batch_size)
                metrics.update(critic_step(*batch))
                num_updates += 1
                if num_updates % args.policy_frequency == 0:
                    metrics.update(actor_step(batch[0]))
                    soft_update(target_actor, actor, args.tau)
                    soft_update(target_qnet, qnet, args.tau)
            if iteration % LOG_EVERY == 0:
                run.log(global_step, metrics)
        global_step = num_iterations * args.num_envs
    run.end_training(global_step, metrics)
    envs.close()

    pieces = ["actor_loss", "critic_loss", "policy"]
    summary = {"num_updates": num_updates, "compiled_pieces": pieces if args.compile else []}
    sys.exit(run.write_and_evaluate(partial(evaluate, actor_view, args, device, run.video_folder), summary))
