"""Rainbow (Hessel et al. 2018) on Atari, one file: C51, dueling heads, noisy layers, n-step returns, double Q and
prioritized replay.

Speed: the priorities are a two-level sum tree on the device, so the whole update is one CUDA graph with no host sync.
Cost: O(sqrt(capacity)) work a draw.
    python leanrl_scripts/rainbow_atari.py --env-id Breakout-v5 --compile
"""

import math
import os
import sys
from dataclasses import dataclass
from functools import partial
from typing import Literal

# Before torch loads OpenMP: idle threads sleep, leaving envs their cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

try:
    import cv2
except ModuleNotFoundError:  # --help works without it
    cv2 = None
import gymnasium as gym
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
    """the Atari game id (Breakout-v5, ...)"""
    env_backend: Literal["envpool", "gymnasium"] = "envpool"
    """envpool, or gymnasium with ALE"""
    total_timesteps: int = 10_000_000
    """total environment steps (0 with --load-model: evaluate only)"""
    learning_rate: Flag.Positive = 6.25e-5
    """the learning rate of the optimizer"""
    num_envs: Flag.Count = 1
    """the number of parallel environments"""
    buffer_size: Flag.Count = 1_000_000
    """the replay memory size (transitions)"""
    gamma: Flag.Fraction = 0.99
    """the discount factor gamma"""
    tau: Flag.PositiveFraction = 1.0
    """the target network update rate (1: a hard copy)"""
    target_network_frequency: Flag.Count = 8000
    """environment steps between target updates"""
    batch_size: Flag.Count = 32
    """the replay batch size"""
    learning_starts: Flag.BeforeTheEnd = 80_000
    """environment steps before learning starts"""
    train_frequency: Flag.Count = 4
    """environment steps per update"""
    n_step: Flag.Count = 3
    """the steps summed before a return bootstraps"""
    prioritized_replay_alpha: Flag.AtLeast0 = 0.5
    """the priority exponent (0: uniform replay)"""
    prioritized_replay_beta: Flag.Fraction = 0.4
    """the importance-sampling exponent, annealed to 1"""
    prioritized_replay_eps: Flag.Positive = 1e-6
    """added to every priority (none is 0)"""
    n_atoms: int = 51
    """the number of return atoms"""
    v_min: float = -10.0
    """the return lower bound"""
    v_max: float = 10.0
    """the return upper bound"""
    noisy: bool = True
    """explore with noisy layers (--no-noisy: epsilon-greedy)"""
    start_e: Flag.Fraction = 1.0
    """the starting epsilon"""
    end_e: Flag.Fraction = 0.01
    """the ending epsilon"""
    exploration_fraction: Flag.PositiveFraction = 0.10
    """the fraction of the run from start_e to end_e"""
    measure_burnin: Flag.CountFrom0 = 50
    """updates left out of the speed figure"""


LOG_EVERY = 100  # a host sync each


class EpisodicLife(gym.Wrapper):
    """A lost life ends the learner's episode, not the game."""

    def __init__(self, env):
        super().__init__(env)
        self.lives = 0
        self.game_over = True

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.game_over = terminated or truncated
        lives = self.unwrapped.ale.lives()
        info = {**info, "reward": reward, "terminated": terminated}
        terminated = terminated or 0 < lives < self.lives
        self.lives = lives
        return obs, reward, terminated, truncated, info

    def reset(self, **kwargs):
        if self.game_over:
            obs, info = self.env.reset(**kwargs)
        else:
            obs, _, _, _, info = self.env.step(0)
        self.lives = self.unwrapped.ale.lives()
        return obs, {**info, "reward": 0.0, "terminated": False}


class FireReset(gym.Wrapper):
    """Press FIRE after each reset."""

    def reset(self, **kwargs):
        self.env.reset(**kwargs)
        for action in (1, 2):
            obs, _, terminated, truncated, info = self.env.step(action)
            if terminated or truncated:
                obs, info = self.env.reset(**kwargs)
        return obs, info


def make_gym_env(env_id, render=False):
    """The DQN stack on ALE at envpool's v5 settings."""
    env = gym.make(
        f"ALE/{env_id}", frameskip=1, repeat_action_probability=0.0, render_mode="rgb_array" if render else None
    )
    env = EpisodicLife(gym.wrappers.AtariPreprocessing(env, noop_max=30, frame_skip=4, screen_size=84))
    if "FIRE" in env.unwrapped.get_action_meanings():
        env = FireReset(env)
    env = gym.wrappers.TransformReward(env, np.sign)
    return gym.wrappers.FrameStackObservation(env, 4, padding_type="reset")


def make_envs(env_id, num_envs, seed=0, backend="envpool", render=False):
    """Training envs of either back-end; the step after an episode's end is a reset, not a transition (envpool's
    after a lost life too)."""
    if backend == "envpool":
        try:
            import envpool
        except ModuleNotFoundError:
            fail('envpool is not installed: pip install ".[envpool]" (or run with --env-backend gymnasium)')
        if env_id not in envpool.list_all_envs():
            fail(f"unknown env id '{env_id}': ids come from envpool.list_all_envs(), Atari games look like Breakout-v5")
        if type(envpool.make_spec(env_id)).__name__ != "AtariEnvSpec":
            fail(f"{env_id} is not an Atari game (continuous control: sac_continuous_action.py, classic: dqn.py)")
        threads = min(num_envs, usable_cores())  # envpool's default counts the host's cores
        game = dict(episodic_life=True, reward_clip=True, render_mode="rgb_array" if render else None)
        return envpool.make(env_id, env_type="gymnasium", num_envs=num_envs, num_threads=threads, seed=seed, **game)
    try:
        import ale_py  # registers the ALE/ ids
    except ModuleNotFoundError:
        ale_py = None
    if ale_py is None or cv2 is None:
        fail('the gymnasium back-end needs ale-py and OpenCV: pip install ".[atari]"')
    gym.register_envs(ale_py)
    try:
        envs = gym.vector.SyncVectorEnv(
            [partial(make_gym_env, env_id, render)] * num_envs, autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP
        )
    except Exception as error:
        fail(f"unknown env id '{env_id}' on ALE, or it cannot be made (games look like Breakout-v5): {error}")
    envs.reset(seed=seed)
    return envs


class NoisyLinear(nn.Linear):
    """A linear layer with factorized Gaussian noise (Fortunato et al. 2018), drawn at every training call."""

    def __init__(self, in_features, out_features, std_init=0.5):
        super().__init__(in_features, out_features)
        self.weight_sigma = nn.Parameter(torch.full((out_features, in_features), std_init / math.sqrt(in_features)))
        self.bias_sigma = nn.Parameter(torch.full((out_features,), std_init / math.sqrt(in_features)))

    def noise(self):
        noise = torch.randn(self.in_features + self.out_features, device=self.weight.device)
        noise = noise.sign() * noise.abs().sqrt()
        return noise[: self.in_features], noise[self.in_features :]

    def forward(self, x):
        if not self.training:
            return super().forward(x)
        noise_in, noise_out = self.noise()
        # the noise matrix never made: a second matrix product costs less
        noisy = F.linear(x * noise_in, self.weight_sigma, self.bias_sigma) * noise_out
        return F.linear(x, self.weight, self.bias) + noisy


class RainbowNetwork(nn.Module):
    """Nature DQN torso and dueling heads: log-probabilities (batch, actions, atoms)."""

    def __init__(self, num_actions, n_atoms, noisy=True):
        super().__init__()
        self.n_atoms = n_atoms
        self.torso = nn.Sequential(
            nn.Conv2d(4, 32, 8, stride=4),
            nn.ReLU(),
            nn.Conv2d(32, 64, 4, stride=2),
            nn.ReLU(),
            nn.Conv2d(64, 64, 3, stride=1),
            nn.ReLU(),
            nn.Flatten(),
        ).to(memory_format=torch.channels_last)
        linear = NoisyLinear if noisy else nn.Linear
        self.value = nn.Sequential(linear(3136, 512), nn.ReLU(), linear(512, n_atoms))
        self.advantage = nn.Sequential(linear(3136, 512), nn.ReLU(), linear(512, num_actions * n_atoms))

    def forward(self, obs):
        hidden = self.torso(obs.contiguous(memory_format=torch.channels_last) / 255.0)
        value = self.value(hidden)[:, None]
        advantage = self.advantage(hidden).unflatten(1, (-1, self.n_atoms))
        # exact for tiny probabilities, unlike a clamped softmax's log
        return (value + advantage - advantage.mean(1, keepdim=True)).log_softmax(-1)


class SumTree:
    """Proportional priorities on the device: leaves in blocks of about sqrt(capacity), and block sums; a batch's
    draw or write is a few kernels, not a walk per item."""

    def __init__(self, capacity, device):
        self.capacity = capacity
        self.block = 2 ** math.ceil(math.log2(capacity) / 2)
        self.leaves = torch.zeros((math.ceil(capacity / self.block), self.block), device=device)
        self.sums = torch.zeros(len(self.leaves), device=device)

    def set(self, index, priority):
        """Leaves `index` (duplicates only with equal priorities) take `priority`."""
        self.leaves.view(-1)[index] = priority
        blocks = index // self.block
        self.sums[blocks] = self.leaves[blocks].sum(1)

    def sample(self, fractions):
        """Leaves whose running sum first passes `fractions` of the total, and their probabilities; priority 0 is
        never drawn."""
        below_one = 1 - 2**-20  # rounding must stop short of trailing zero priorities
        block_ends = self.sums.cumsum(0)
        total = block_ends[-1]
        target = torch.minimum(fractions * total, total * below_one)
        # clamped for non-finite priorities: no index error
        block = torch.searchsorted(block_ends, target, right=True).clamp(max=len(self.sums) - 1)
        leaf_ends = self.leaves[block].cumsum(1)
        within = (target - block_ends[block] + self.sums[block]).clamp(min=0)
        within = torch.minimum(within, leaf_ends[:, -1] * below_one)
        leaf = torch.searchsorted(leaf_ends, within[:, None], right=True)[:, 0]
        index = (block * self.block + leaf).clamp(max=self.capacity - 1)
        return index, self.leaves.view(-1)[index] / total


class FrameReplay:
    """Replay storing each frame once, as dqn_atari.py's; a row is drawn by priority once its n steps are stored,
    until the ring overwrites its frames."""

    def __init__(self, buffer_size, num_envs, device, n_step=3, gamma=0.99, alpha=0.5, eps=1e-6, stack=4):
        self.buffer_rows = math.ceil(buffer_size / num_envs)
        self.stack, self.n_step, self.gamma, self.alpha, self.eps = stack, n_step, gamma, alpha, eps
        rows = self.buffer_rows + stack + n_step - 1  # + rows awaiting n steps or overwritten
        self.frames = torch.empty((rows, num_envs, 84, 84), dtype=torch.uint8, device=device)
        self.actions = torch.zeros((rows, num_envs), dtype=torch.long, device=device)
        self.rewards, self.terminations = (torch.zeros((rows, num_envs), device=device) for _ in range(2))
        self.valid, self.first = (torch.zeros((rows, num_envs), dtype=torch.bool, device=device) for _ in range(2))
        self.tree = SumTree(rows * num_envs, device)
        self.max_priority = torch.ones((), device=device)  # before ** alpha
        self.lanes = torch.arange(num_envs, device=device)
        self.discounts = gamma ** torch.arange(n_step, device=device)
        self.next_valid = np.ones(num_envs, dtype=bool)
        self.next_first = np.ones(num_envs, dtype=bool)
        self.restarting = np.zeros(num_envs, dtype=bool)  # a restart shows one row late

    def add(self, step, obs, actions, rewards, terminations, reset, restart):
        """`reset`: envs whose next step resets; `restart`: those whose frame stack restarts after it."""
        rows = len(self.frames)
        row = step % rows
        flags = (self.next_valid, self.next_first)
        self.next_valid, self.next_first, self.restarting = ~reset, self.restarting, restart
        columns = (self.frames, self.actions, self.rewards, self.terminations, self.valid, self.first)
        for column, value in zip(columns, (obs[:, -1], actions, rewards, terminations, *flags)):
            column[row] = torch.as_tensor(value).to(column.device, column.dtype, non_blocking=True)
        # row - n_step is ready; row + stack - 1 loses its oldest frame to this row
        ready, overwritten = (row - self.n_step) % rows, (row + self.stack - 1) % rows
        new = self.valid[ready] * self.max_priority**self.alpha
        leaves = torch.cat([ready * len(self.lanes) + self.lanes, overwritten * len(self.lanes) + self.lanes])
        self.tree.set(leaves, torch.cat([new, torch.zeros_like(new)]))

    def new_games(self, step):
        self.valid[(step - 1) % len(self.frames)] = False  # lost its next frame
        self.next_valid[:], self.next_first[:], self.restarting[:] = True, True, False

    def sample(self, batch_size, beta):
        """A stratified batch by priority, with importance weights over the largest."""
        strata = torch.arange(batch_size, device=self.frames.device)
        leaf, probability = self.tree.sample((strata + torch.rand(batch_size, device=strata.device)) / batch_size)
        weights = (probability / probability.min()) ** -beta
        return leaf, weights, *self.transitions(leaf // len(self.lanes), leaf % len(self.lanes))

    def transitions(self, row, lane):
        """n-step transitions; an episode's end stops the sum (a truncation bootstraps from the reset step's row)."""
        rows = len(self.frames)
        ahead = (row[:, None] + torch.arange(self.n_step, device=row.device)) % rows  # (batch, n_step)
        lanes = lane[:, None]
        ended = (self.terminations[ahead, lanes] > 0) | ~self.valid[(ahead + 1) % rows, lanes]
        # step j counts while no earlier step ended the episode
        counts = F.pad((~ended[:, :-1]).float().cumprod(1), (1, 0), value=1.0)
        returns = (counts * self.discounts * self.rewards[ahead, lanes]).sum(1)
        terminated = (counts * self.terminations[ahead, lanes]).sum(1)
        steps = counts.sum(1)
        discount = self.gamma**steps * (1 - terminated)
        next_obs = self.stack_at((row + steps.long()) % rows, lane)
        return self.stack_at(row, lane), self.actions[row, lane], returns, discount, next_obs

    def stack_at(self, row, lane):
        """Frame stacks ending at `row`, held at the row where the stack restarts."""
        rows = len(self.frames)
        chain = [row]
        for _ in range(self.stack - 1):
            chain.append(torch.where(self.first[chain[-1], lane], chain[-1], (chain[-1] - 1) % rows))
        return self.frames[torch.stack(chain[::-1], 1), lane[:, None]]

    def update_priorities(self, leaf, losses):
        """New priorities for the drawn leaves."""
        priority = losses.clamp(min=0) + self.eps  # a divergence rounded below 0
        torch.maximum(self.max_priority, priority.max(), out=self.max_priority)
        self.tree.set(leaf, priority**self.alpha)


def expected_q(log_probs, support):
    return (log_probs.exp() * support).sum(-1)


def policy(obs, *, q_network, support):
    """Greedy actions by expected return."""
    return expected_q(q_network(obs), support).argmax(-1)


def project(atoms, probs, support):
    """The C51 projection as one product with a triangle kernel, where a scatter would collide."""
    delta = support[1] - support[0]
    atoms = atoms.clamp(support[0], support[-1])
    nearness = (1 - (atoms[:, None, :] - support[None, :, None]).abs() / delta).clamp(min=0)  # (batch, z, atom)
    return (nearness * probs[:, None, :]).sum(-1)


def rainbow_loss(obs, actions, returns, discounts, next_obs, weights, *, q_network, target_network, support):
    """The distributional n-step double-Q loss: per-item KL divergences (the paper's priorities), weighted by
    importance. Each forward pass draws its own noise, as in the paper."""
    with torch.no_grad():
        next_actions = expected_q(q_network(next_obs), support).argmax(-1)
        next_log_probs = torch.take_along_dim(target_network(next_obs), next_actions[:, None, None], 1)[:, 0]
        atoms = returns[:, None] + discounts[:, None] * support
        target = project(atoms, next_log_probs.exp(), support)
    log_probs = torch.take_along_dim(q_network(obs), actions[:, None, None], 1)[:, 0]
    divergence = (torch.special.xlogy(target, target) - target * log_probs).sum(-1)
    loss = (weights * divergence).mean()
    q_values = (log_probs.detach().exp() * support).sum(-1).mean()
    return loss, divergence.detach(), {"td_loss": loss.detach(), "q_values": q_values}


def update(beta, *, sample_fn, batch_size, loss_fn, q_network, target_network, support, optimizer, replay):
    """One update on the device: draw, loss, Adam, priorities."""
    leaf, weights, *batch = sample_fn(batch_size, beta)
    loss, divergences, metrics = loss_fn(
        *batch, weights, q_network=q_network, target_network=target_network, support=support
    )
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    replay.update_priorities(leaf, divergences)
    return metrics


def epsilon_at(step, args):
    """0 with noisy layers (their noise explores), else linear from start_e to end_e."""
    if args.noisy:
        return 0.0
    slope = (args.end_e - args.start_e) / (args.exploration_fraction * args.total_timesteps)
    return max(slope * step + args.start_e, args.end_e)


def epsilon_greedy(policy_step, obs, epsilon, rng, num_actions, device):
    """One coin per env from a host RNG: the network runs only when some env exploits."""
    exploit = rng.random(len(obs)) >= epsilon
    if not exploit.any():
        return rng.integers(num_actions, size=len(obs))
    greedy = policy_step(torch.from_numpy(obs).to(device, non_blocking=True)).cpu().numpy()
    return greedy if exploit.all() else np.where(exploit, greedy, rng.integers(num_actions, size=len(obs)))


def beta_at(step, args):
    return min(1.0, args.prioritized_replay_beta + step * (1.0 - args.prioritized_replay_beta) / args.total_timesteps)


def first_screen(envs):
    return envs.envs[0].render() if isinstance(envs, gym.vector.SyncVectorEnv) else envs.render()[0]


def evaluate(q_network, support, args, device, video_folder=None):
    """True score of one game per env at epsilon 0.05, the noise off."""
    q_network.eval()
    envs = make_envs(
        args.env_id, args.eval_episodes, args.seed + 10_000, args.env_backend, render=video_folder is not None
    )
    obs, _ = envs.reset()
    video = game_mp4(video_folder, first_screen(envs)) if video_folder else None
    rng = np.random.default_rng(args.seed)
    num_actions = int(getattr(envs, "single_action_space", envs.action_space).n)
    returns = np.zeros(envs.num_envs)
    finished = np.zeros(envs.num_envs, dtype=bool)
    while not finished.all():
        stop_if_signalled()
        actions = epsilon_greedy(
            partial(policy, q_network=q_network, support=support), obs, 0.05, rng, num_actions, device
        )
        obs, _, _, truncations, infos = envs.step(actions.astype(np.int32))
        if video and not finished[0]:
            video.write_frame(first_screen(envs))
        returns += infos["reward"] * ~finished
        finished |= infos["terminated"].astype(bool) | truncations
    if video:
        video.close()
    envs.close()
    return returns.tolist()


if __name__ == "__main__":
    args = tyro.cli(Args)
    args.env_id = args.env_id.replace("NoFrameskip-v4", "-v5")  # CleanRL's Atari ids: the same game and settings
    run = Run(args)
    if args.buffer_size < args.batch_size:
        fail(f"--buffer-size {args.buffer_size} must hold at least one batch (--batch-size {args.batch_size})")
    first_ready = (args.n_step + 1) * args.num_envs  # steps before the first drawable transition
    if args.learning_starts < max(args.batch_size, first_ready):
        fail(
            f"--learning-starts {args.learning_starts} must be at least --batch-size {args.batch_size} and "
            f"(--n-step + 1) x --num-envs ({first_ready})"
        )
    if args.n_atoms < 2 or not args.v_min < args.v_max:
        fail(f"the support needs --n-atoms of 2 or more (not {args.n_atoms}) and --v-min below --v-max")
    device = run.device
    # every usable core: envs and network take turns
    run.tune_cpu(threads=usable_cores())

    envs = make_envs(args.env_id, args.num_envs, args.seed, args.env_backend)
    num_actions = int(getattr(envs, "single_action_space", envs.action_space).n)
    run.check_fits(args.buffer_size * (84 * 84 + 22), "--buffer-size")  # bytes per transition
    network = partial(RainbowNetwork, num_actions, args.n_atoms, args.noisy)
    q_network = network().to(device)
    target_network = network().to(device).requires_grad_(False)
    q_view = network().to("meta")  # the learner's weights, shared, no grad
    from_module(q_network).data.to_module(q_view)
    q_view.requires_grad_(False)
    support = torch.linspace(args.v_min, args.v_max, args.n_atoms, device=device)
    # tensor lr, capturable Adam: CUDA graphs replay its step; eps is the paper's
    learning_rate = torch.tensor(args.learning_rate, device=device)
    optimizer = torch.optim.Adam(
        q_network.parameters(), lr=learning_rate, eps=1.5e-4, fused=True, capturable=run.cudagraphs
    )
    run.save_and_load({"q_network": q_network, "optimizer": optimizer}, num_actions=num_actions, n_atoms=args.n_atoms)
    target_network.load_state_dict(q_network.state_dict())
    target_params = from_module(target_network)
    online_params = from_module(q_network).data

    rb = FrameReplay(
        args.buffer_size,
        args.num_envs,
        device,
        args.n_step,
        args.gamma,
        args.prioritized_replay_alpha,
        args.prioritized_replay_eps,
    )
    # compiled before its arguments are bound: dynamo sees one function, one cache
    maybe_compile = partial(torch.compile, disable=not args.compile)
    policy_step = partial(maybe_compile(policy), q_network=q_view, support=support)
    update_step = partial(
        update,
        sample_fn=maybe_compile(rb.sample),
        batch_size=args.batch_size,
        loss_fn=maybe_compile(rainbow_loss),
        optimizer=optimizer,
        replay=rb,
        q_network=q_network,
        target_network=target_network,
        support=support,
    )
    if run.cudagraphs:  # captured after the first calls (compilation, Adam's state)
        policy_step, update_step = CudaGraphModule(policy_step, warmup=5), CudaGraphModule(update_step, warmup=5)

    rng = np.random.default_rng(args.seed)  # --no-noisy's coins, on the host
    beta = torch.tensor(args.prioritized_replay_beta, device=device)  # filled in place: a graph reads its address
    target_every = max(1, args.target_network_frequency // args.train_frequency)  # in updates
    scores = np.zeros(args.num_envs)
    lengths = np.zeros(args.num_envs, int)
    num_updates, first_iteration = 0, 0
    metrics = {}
    global_step = 0
    obs, _ = envs.reset()
    kept = dict(envs=envs) if args.env_backend == "gymnasium" else {}  # envpool's games cannot be saved
    if resumed := run.resumable(target_network=target_network, rb=rb, rng=rng, **kept):
        first_iteration, num_updates, obs, scores, lengths = resumed.values()
        if not kept:
            envs = make_envs(args.env_id, args.num_envs, args.seed + first_iteration, args.env_backend)
            obs, _ = envs.reset()
            scores[:] = lengths[:] = 0
            rb.new_games(first_iteration)
    run.start()
    with run.stoppable():
        for iteration in range(first_iteration, args.total_timesteps // args.num_envs):
            global_step = iteration * args.num_envs
            run.checkpoint_if_due(
                global_step, iteration=iteration, num_updates=num_updates, obs=obs, scores=scores, lengths=lengths
            )
            stop_if_signalled()
            actions = epsilon_greedy(policy_step, obs, epsilon_at(global_step, args), rng, num_actions, device)
            next_obs, rewards, terminations, truncations, infos = run.timed_env_call(
                envs.step, actions.astype(np.int32)
            )
            game_over = infos["terminated"].astype(bool) | truncations
            reset = terminations | truncations  # the next step resets, after a lost life too
            restart = game_over if args.env_backend == "envpool" else reset  # envpool keeps its stack past a lost life
            rb.add(iteration, obs, actions, rewards, terminations, reset, restart)
            obs, global_step = next_obs, global_step + args.num_envs
            scores, lengths = scores + infos["reward"], lengths + 1  # info["reward"] is unclipped
            for score, length in zip(scores[game_over], lengths[game_over]):
                run.record_episode(global_step, score, length)
            scores[game_over] = 0
            lengths[game_over] = 0

            # the updates these steps owe, as in CleanRL
            while num_updates < (global_step - args.learning_starts) // args.train_frequency:
                if num_updates == args.measure_burnin:
                    run.start_speed_measure(global_step)
                beta.fill_(beta_at(global_step, args))
                metrics = update_step(beta)
                num_updates += 1
                if num_updates % target_every == 0:
                    target_params.lerp_(online_params, args.tau)
                if num_updates % LOG_EVERY == 0:
                    replay_ratio = num_updates * args.batch_size / (global_step - args.learning_starts)
                    charts = dict(beta=beta_at(global_step, args), replay_ratio=replay_ratio)
                    if not args.noisy:
                        charts["epsilon"] = epsilon_at(global_step, args)
                    run.log(global_step, metrics, charts=charts)
    run.end_training(global_step, metrics)
    envs.close()

    summary = {
        "env_backend": args.env_backend,
        "num_updates": num_updates,
        "compiled_pieces": ["policy", "rainbow_loss", "sample"] if args.compile else [],
        "replay_ratio_target": args.batch_size / args.train_frequency,
        "replay_ratio_achieved": num_updates * args.batch_size / max(1, global_step - args.learning_starts),
    }
    sys.exit(run.write_and_evaluate(partial(evaluate, q_view, support, args, device, run.video_folder), summary))
