"""Deep Q-Network (DQN, Mnih et al. 2015) on Atari, with envpool or with ALE through gymnasium, one file.

Speed: `--async-actor` plays in its own process while the learner trains; a rate limiter in the style of
Reverb's SampleToInsertRatio keeps gradient samples per inserted transition at the synchronous run's value.
Memory: each frame is stored once and the 4-frame stacks are rebuilt at sample time (7 GB instead of 28 GB
for 1e6 steps; the cost is five gathers per batch). The action step and the update take torch.compile and
CUDA graphs.
    python leanrl_scripts/dqn_atari.py --env-id Breakout-v5 --async-actor --compile
"""

import json
import math
import os
import random
import resource
import signal
import sys
import time
import traceback
from collections import deque
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from functools import partial

# Idle OpenMP threads sleep instead of spinning: a spinning pool takes the cores that the envs, the actor (or
# other programs) need. Set before torch loads OpenMP; it costs a wake-up (tens of microseconds) per parallel kernel.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import cv2
import gymnasium as gym
import numpy as np
import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import tyro
from tensordict import from_module
from tensordict.nn import CudaGraphModule
from torch.utils.tensorboard import SummaryWriter


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    cuda: bool = True
    """use CUDA when it is available"""
    env_id: str = "Breakout-v5"
    """the Atari game, as envpool names it (Breakout-v5, Pong-v5, ...) for both back-ends"""
    env_backend: str = "envpool"
    """envpool (its own Atari preprocessing) or gymnasium (ALE with this script's wrappers)"""
    total_timesteps: int = 10_000_000
    """total environment steps, all envs together"""
    learning_rate: float = 1e-4
    """the learning rate of the optimizer"""
    num_envs: int = 1
    """the number of parallel environments"""
    buffer_size: int = 1_000_000
    """the replay memory buffer size (transitions)"""
    gamma: float = 0.99
    """the discount factor gamma"""
    tau: float = 1.0
    """the target network update rate (1.0: a hard copy)"""
    target_network_frequency: int = 1000
    """environment steps between target network updates"""
    batch_size: int = 32
    """the batch size of samples from the replay memory"""
    start_e: float = 1.0
    """the starting epsilon for exploration"""
    end_e: float = 0.01
    """the ending epsilon for exploration"""
    exploration_fraction: float = 0.10
    """the fraction of `total_timesteps` it takes from start_e to end_e"""
    learning_starts: int = 80_000
    """environment steps before learning starts"""
    train_frequency: int = 4
    """environment steps (all envs together) per update: the replay ratio is batch_size / train_frequency"""
    steps_per_update: int = 1
    """vector steps played between rounds of updates; each round does the updates those steps owe"""
    async_actor: bool = False
    """play in a separate process that feeds the replay storage through a rate limiter"""
    actor_sync_every: int = 10
    """(async) updates between copies of the learner's weights to the actor"""
    replay_tolerance: float = 0.1
    """(async) how far the replay ratio may drift, as a fraction of learning_starts x replay ratio samples"""
    torch_threads: int = 0
    """the learner's torch CPU threads (0: one on CUDA, else the usable cores less the actor's; OMP_NUM_THREADS
    also sets it)"""
    compile: bool = False
    """wrap the learner's action step and update in torch.compile (the async actor acts eagerly)"""
    cudagraphs: bool = False
    """wrap the action step and the update in CUDA graphs (tensordict's CudaGraphModule)"""
    measure_burnin: int = 50
    """updates after learning starts that the speed figure leaves out (compilation, graph capture)"""
    eval_episodes: int = 10
    """evaluation games at the end of the run (whole games, true score, epsilon 0.05)"""
    save_model: bool = False
    """save a checkpoint to runs/<run_name>/model.pt at the end"""


LOG_EVERY = 100  # updates between metric reads: each read is one host sync


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


class NoopReset(gym.Wrapper):
    """1 to `noop_max` no-op actions after each reset: varied starts on a deterministic emulator."""

    def __init__(self, env, noop_max=30):
        super().__init__(env)
        self.noop_max = noop_max

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        for _ in range(self.unwrapped.np_random.integers(1, self.noop_max + 1)):
            obs, _, terminated, truncated, info = self.env.step(0)
            if terminated or truncated:
                obs, info = self.env.reset()
        return obs, info


class MaxAndSkip(gym.Wrapper):
    """Each action repeated `skip` frames, rewards summed, the pixel-wise max of the last two frames returned
    (Atari sprites flicker between frames). info gets the raw reward and the true end of the game, as envpool's."""

    def __init__(self, env, skip=4):
        super().__init__(env)
        self.skip = skip

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        return obs, {**info, "reward": 0.0, "terminated": False}

    def step(self, action):
        total_reward, last_frames = 0.0, deque(maxlen=2)
        for _ in range(self.skip):
            obs, reward, terminated, truncated, info = self.env.step(action)
            total_reward += reward
            last_frames.append(obs)
            if terminated or truncated:
                break
        obs = np.max(np.stack(last_frames), axis=0)
        return obs, total_reward, terminated, truncated, {**info, "reward": total_reward, "terminated": terminated}


class EpisodicLife(gym.Wrapper):
    """A lost life ends the episode for the learner (no bootstrap past it) but not the game: reset() after a
    lost life takes one no-op step instead of restarting."""

    def __init__(self, env):
        super().__init__(env)
        self.lives, self.game_over = 0, True

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.game_over = terminated or truncated
        lives = self.unwrapped.ale.lives()
        terminated = terminated or 0 < lives < self.lives
        self.lives = lives
        return obs, reward, terminated, truncated, info

    def reset(self, **kwargs):
        if self.game_over:
            obs, info = self.env.reset(**kwargs)
        else:
            obs, _, _, _, info = self.env.step(0)
        self.lives = self.unwrapped.ale.lives()
        return obs, info


class FireReset(gym.Wrapper):
    """For games that wait for FIRE: press it (then action 2) after each reset."""

    def reset(self, **kwargs):
        self.env.reset(**kwargs)
        for action in (1, 2):
            obs, _, terminated, truncated, info = self.env.step(action)
            if terminated or truncated:
                obs, info = self.env.reset(**kwargs)
        return obs, info


class ClipReward(gym.RewardWrapper):
    """Rewards clipped to their sign: one learning rate fits every game's score scale."""

    def reward(self, reward):
        return float(np.sign(reward))


class WarpFrame(gym.ObservationWrapper):
    """RGB to 84x84 greyscale with OpenCV (area interpolation)."""

    def __init__(self, env):
        super().__init__(env)
        self.observation_space = gym.spaces.Box(0, 255, (84, 84), np.uint8)

    def observation(self, obs):
        return cv2.resize(cv2.cvtColor(obs, cv2.COLOR_RGB2GRAY), (84, 84), interpolation=cv2.INTER_AREA)


class FrameStack(gym.Wrapper):
    """The last `k` frames as one (k, 84, 84) observation; a reset fills it with k copies of the first frame."""

    def __init__(self, env, k=4):
        super().__init__(env)
        self.frames = deque(maxlen=k)
        self.observation_space = gym.spaces.Box(0, 255, (k, 84, 84), np.uint8)

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        self.frames.extend([obs] * self.frames.maxlen)
        return np.stack(self.frames), info

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.frames.append(obs)
        return np.stack(self.frames), reward, terminated, truncated, info


def usable_cores():
    """The cores this process may run on: its CPU affinity, capped by a cgroup CPU quota (a container's limit)."""
    cores = len(os.sched_getaffinity(0))
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()
        return max(1, min(cores, int(quota) // int(period)))
    except (OSError, ValueError):  # no cgroup v2 file, or no quota ("max")
        return cores


def cpu_threads(requested, device, reserved):
    """The learner's torch CPU threads: --torch-threads, else OMP_NUM_THREADS, else one on CUDA (the host only
    gathers batches; idle pool threads would compete with the envs and the actor), else the usable cores less
    `reserved` for the actor process, which plays while the learner trains."""
    if requested:
        return requested
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    return 1 if device.type == "cuda" else max(1, usable_cores() - reserved)


def make_gym_env(env_id):
    """The classic DQN stack on ALE, with envpool's v5 settings: no sticky actions, 108k-frame time limit."""
    env = gym.make(f"ALE/{env_id}", frameskip=1, repeat_action_probability=0.0, max_num_frames_per_episode=108_000)
    env = EpisodicLife(MaxAndSkip(NoopReset(env)))
    if "FIRE" in env.unwrapped.get_action_meanings():
        env = FireReset(env)
    return FrameStack(WarpFrame(ClipReward(env)))


def make_envs(env_id, num_envs, seed=0, backend="envpool"):
    """Training envs of either back-end: 4 stacked 84x84 frames, rewards clipped, a lost life ends an episode;
    info["reward"] is the unclipped reward and info["terminated"] the end of the game. After the step that ends
    a game (with envpool) or any episode (gymnasium), the next step resets that env and is not a transition."""
    if backend == "envpool":
        import envpool  # imported here: the gymnasium back-end runs without it

        if env_id not in envpool.list_all_envs():
            fail(f"unknown env id '{env_id}': ids come from envpool.list_all_envs(), Atari games look like Breakout-v5")
        if type(envpool.make_spec(env_id)).__name__ != "AtariEnvSpec":
            fail(f"{env_id} is not an Atari game (continuous control: sac_continuous_action.py, classic: dqn.py)")
        # one worker per env up to the usable cores: envpool's default counts the host's cores, quota or not
        return envpool.make(env_id, env_type="gymnasium", num_envs=num_envs, num_threads=min(num_envs, usable_cores()),
                            episodic_life=True, reward_clip=True, seed=seed)
    if backend != "gymnasium":
        fail(f"--env-backend must be envpool or gymnasium, not '{backend}'")
    import ale_py  # registers the ALE/ ids

    gym.register_envs(ale_py)
    try:
        envs = gym.vector.SyncVectorEnv([partial(make_gym_env, env_id)] * num_envs,
                                        autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP)
    except gym.error.Error as error:
        fail(f"unknown env id '{env_id}' for ALE (Atari games look like Breakout-v5): {error}")
    envs.reset(seed=seed)
    return envs


class QNetwork(nn.Module):
    """The Nature DQN network; convolutions channels-last (mkldnn's NHWC kernels are the fast ones on CPU)."""

    def __init__(self, num_actions):
        super().__init__()
        self.network = nn.Sequential(
            nn.Conv2d(4, 32, 8, stride=4), nn.ReLU(), nn.Conv2d(32, 64, 4, stride=2), nn.ReLU(),
            nn.Conv2d(64, 64, 3, stride=1), nn.ReLU(), nn.Flatten(), nn.Linear(3136, 512), nn.ReLU(),
            nn.Linear(512, num_actions),
        ).to(memory_format=torch.channels_last)

    def forward(self, obs):
        return self.network(obs.contiguous(memory_format=torch.channels_last) / 255.0)


class FrameReplay:
    """Replay storage with each frame once. Row t of env lane e holds the newest frame of that env's t-th
    observation, the action, clipped reward and termination of its step, and two flags: `valid` (the step is
    a transition, not the reset step after an episode's end) and `first` (the frame stack restarts here).
    The stacks of obs t and obs t+1 are the frames of rows t+1, t, t-1, ... walked back and held at the
    first row: exactly what the env returned, for 1/4 of the memory. Rows are used round-robin; in async mode
    the storage is in shared memory with `extra_rows` the actor may write while the learner gathers."""

    def __init__(self, buffer_size, num_envs, device, extra_rows=0, shared=False, stack=4):
        self.buffer_rows, self.stack = math.ceil(buffer_size / num_envs), stack
        rows = self.buffer_rows + extra_rows + stack  # + stack: the oldest sampled row still has its frames
        # empty, not zeros: pages are touched as the rows fill, and only written rows are ever read
        self.frames = torch.empty((rows, num_envs, 84, 84), dtype=torch.uint8, device=device)
        self.actions = torch.zeros((rows, num_envs), dtype=torch.long, device=device)
        self.rewards, self.terminations = (torch.zeros((rows, num_envs), device=device) for _ in range(2))
        self.valid, self.first = (torch.zeros((rows, num_envs), dtype=torch.bool, device=device) for _ in range(2))
        if shared:
            for tensor in (self.frames, self.actions, self.rewards, self.terminations, self.valid, self.first):
                tensor.share_memory_()

    def add(self, step, newest_frames, actions, rewards, terminations, valid, first):
        row = step % len(self.frames)
        columns = (self.frames, self.actions, self.rewards, self.terminations, self.valid, self.first)
        for column, value in zip(columns, (newest_frames, actions, rewards, terminations, valid, first)):
            column[row] = torch.as_tensor(value).to(column.device, column.dtype, non_blocking=True)

    def sample(self, steps, batch_size, device):
        """A uniform batch of the valid transitions among the newest min(steps - 1, buffer_rows) rows of every
        lane (`steps` rows written; the newest has no next frame yet): obs, actions, rewards, next_obs,
        terminations. Twice the batch is drawn and the first valid ones kept: rejection sampling, exact unless
        more than half the draws hit reset steps (about one row per episode)."""
        rows, lanes = len(self.frames), self.frames.shape[1]
        age = torch.randint(0, min(steps - 1, self.buffer_rows), (2 * batch_size,), device=self.frames.device)
        row, lane = (steps - 2 - age) % rows, torch.randint_like(age, lanes)
        keep = torch.argsort((~self.valid[row, lane]).byte(), stable=True)[:batch_size]
        row, lane = row[keep], lane[keep]
        obs, next_obs = self.stacks(row, lane)
        batch = [obs, self.actions[row, lane], self.rewards[row, lane], next_obs, self.terminations[row, lane]]
        if device.type == "cuda" and self.frames.device.type == "cpu":  # pinned: the copies do not block
            batch = [tensor.pin_memory() for tensor in batch]
        return [tensor.to(device, non_blocking=True) for tensor in batch]

    def stacks(self, row, lane):
        """The observation stacks of rows `row` and `row + 1` in lanes `lane`: (batch, stack, 84, 84) each."""
        rows = len(self.frames)
        chain = [(row + 1) % rows]
        for _ in range(self.stack):
            chain.append(torch.where(self.first[chain[-1], lane], chain[-1], (chain[-1] - 1) % rows))
        frames = self.frames[torch.stack(chain[::-1], 1), lane[:, None]]  # (batch, stack + 1, 84, 84)
        return frames[:, :-1], frames[:, 1:]


@contextmanager
def held(lock, other_alive):
    """`lock` (the actor's weights), checking every second while waiting for it that the other process lives:
    a process killed while holding a lock never releases it."""
    while not lock.acquire(timeout=1.0):
        if not other_alive():
            raise ChildProcessError("the other side of the replay storage stopped")
    try:
        yield
    finally:
        lock.release()


class RateLimiter:
    """Reverb's SampleToInsertRatio across processes: with diff = inserts x samples_per_insert - samples, an
    insert waits while it would push diff above min_size x spi + error_buffer, a sample waits until
    min_size transitions are in and while it would pull diff below min_size x spi - error_buffer.
    Each counter has one writer (inserts: the actor, samples: the learner), so no mutex guards them: a waiting
    side sleeps on a semaphore that the other side posts after each step and re-checks its condition (a
    condition variable without the mutex, so a process killed mid-step never leaves a lock held); the
    one-second timeout only checks that the other side is alive."""

    def __init__(self, samples_per_insert, min_size, error_buffer, ctx):
        self.spi, self.min_size = samples_per_insert, min_size
        self.min_diff = min_size * samples_per_insert - error_buffer
        self.max_diff = min_size * samples_per_insert + error_buffer
        self.counts = ctx.RawArray("q", 3)  # inserts, samples, closed
        self.insert_posted, self.sample_posted = ctx.Semaphore(0), ctx.Semaphore(0)

    @property
    def inserts(self):
        return self.counts[0]

    @property
    def samples(self):
        return self.counts[1]

    def _wait(self, ready, posted, other_alive):
        """True once `ready()`; False if the limiter is closed first (the run ends or the other side failed)."""
        while not ready():
            if self.counts[2]:
                return False
            if not posted.acquire(timeout=1.0) and not other_alive():
                raise ChildProcessError("the other side of the replay storage stopped")
        return True

    def await_insert(self, n, other_alive=lambda: True):
        return self._wait(lambda: not self.counts[2] and (self.inserts + n) * self.spi - self.samples <= self.max_diff,
                          self.sample_posted, other_alive)

    def await_sample(self, n, other_alive=lambda: True):
        return self._wait(lambda: self.inserts >= self.min_size
                          and self.inserts * self.spi - self.samples - n >= self.min_diff,
                          self.insert_posted, other_alive)

    def inserted(self, n):
        self.counts[0] += n
        self.insert_posted.release()

    def sampled(self, n):
        self.counts[1] += n
        self.sample_posted.release()

    def close(self):
        self.counts[2] = 1
        self.insert_posted.release()
        self.sample_posted.release()


def policy(obs, *, q_network):
    """Greedy actions; `q_network` is a detached view of the learner or the actor's copy."""
    return q_network(obs).argmax(-1)


def update(obs, actions, rewards, next_obs, terminations, *, q_network, target_network, optimizer, gamma):
    """One TD step; the loss and the mean Q of the taken actions stay on the device."""
    with torch.no_grad():
        target_max = target_network(next_obs).max(-1).values
        td_target = rewards + gamma * target_max * (1 - terminations)
    old_val = q_network(obs).gather(1, actions[:, None]).squeeze(1)
    loss = F.mse_loss(td_target, old_val)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.detach(), old_val.mean().detach()


def speed_up(fn, compile, cudagraphs):
    """torch.compile fuses the piece's kernels; a CUDA graph then replays all its launches at once (inputs are
    copied into static buffers, outputs cloned). The pieces take and return plain tensors: no TensorDicts."""
    if compile:
        fn = torch.compile(fn)
    if cudagraphs:
        fn = CudaGraphModule(fn, warmup=5)  # the first calls compile and initialise Adam's state, then capture
    return fn


def epsilon_greedy(policy_step, obs, epsilon, rng, num_actions, device):
    """One coin per env from a host RNG (no device sync decides anything): the network runs only when some env
    exploits (early in training most steps skip it), random actions are drawn only when some env explores."""
    exploit = rng.random(len(obs)) >= epsilon
    if not exploit.any():
        return rng.integers(num_actions, size=len(obs))
    greedy = policy_step(torch.from_numpy(obs).to(device, non_blocking=True)).cpu().numpy()
    return greedy if exploit.all() else np.where(exploit, greedy, rng.integers(num_actions, size=len(obs)))


def epsilon_at(step, args):
    """The linear schedule from start_e to end_e over exploration_fraction of the run, then end_e."""
    slope = (args.end_e - args.start_e) / (args.exploration_fraction * args.total_timesteps)
    return max(slope * step + args.start_e, args.end_e)


class Player:
    """Plays epsilon-greedy vector steps into the replay storage and keeps the true game scores (a list of
    (global_step, score) for the caller to drain). The synchronous loop and the actor process both use it."""

    def __init__(self, args, envs, policy_step, rb, device):
        self.args, self.envs, self.policy_step, self.rb, self.device = args, envs, policy_step, rb, device
        self.obs, _ = envs.reset()
        self.rng = np.random.default_rng(args.seed)
        self.num_actions = int(getattr(envs, "single_action_space", envs.action_space).n)
        self.valid, self.first = np.ones(args.num_envs, dtype=bool), np.ones(args.num_envs, dtype=bool)
        self.episode_returns, self.finished = np.zeros(args.num_envs), []
        self.inserted, self.env_seconds = 0, 0.0

    def step(self, hold_weights=nullcontext):
        epsilon = epsilon_at(self.inserted, self.args)
        with hold_weights():  # the actor process's lock: the learner writes new weights under it
            actions = epsilon_greedy(self.policy_step, self.obs, epsilon, self.rng, self.num_actions, self.device)
        env_start = time.perf_counter()
        next_obs, rewards, terminations, truncations, infos = self.envs.step(actions.astype(np.int32))
        self.env_seconds += time.perf_counter() - env_start
        self.rb.add(self.inserted // self.args.num_envs, self.obs[:, -1], actions, rewards, terminations,
                    self.valid, self.first)
        self.inserted += self.args.num_envs
        game_over = infos["terminated"].astype(bool) | truncations
        restart = game_over if self.args.env_backend == "envpool" else terminations | truncations
        self.first, self.valid = ~self.valid, ~restart  # the row after a reset step starts a new stack
        self.episode_returns += infos["reward"]
        self.finished += [(self.inserted, score) for score in self.episode_returns[game_over]]
        self.episode_returns[game_over] = 0
        self.obs = next_obs


def run_actor(args, rb, limiter, actor_q, weights_lock, reports):
    """The actor process: plays on the CPU with `actor_q` (shared memory, refreshed by the learner) and sends
    its finished episodes with its env time so far through `reports`; any error goes there as text."""
    try:
        torch.set_num_threads(1)  # one core plays, the others train
        envs = make_envs(args.env_id, args.num_envs, args.seed, args.env_backend)
        # Eager even with --compile: on one CPU thread the compiled forward measured no faster (1.3 ms per
        # observation either way), and compiling here would hold the learner at learning_starts for a cold compile.
        policy_step = partial(policy, q_network=actor_q)
        player = Player(args, envs, policy_step, rb, torch.device("cpu"))
        parent = os.getppid()
        parent_alive = lambda: os.getppid() == parent  # noqa: E731
        for _ in range(args.total_timesteps // args.num_envs):
            if not limiter.await_insert(args.num_envs, parent_alive):
                break
            player.step(partial(held, weights_lock, parent_alive))
            limiter.inserted(args.num_envs)
            if player.finished:
                reports.put(("progress", player.finished, player.env_seconds))
                player.finished = []
        reports.put(("progress", [], player.env_seconds))
    except BaseException:
        reports.put(("error", traceback.format_exc()))
        sys.exit(1)
    finally:
        limiter.close()  # wakes a learner waiting for transitions that will not come


def evaluate(q_network, envs, device, seed):
    """True score of the first whole game in each env at epsilon 0.05, the DQN paper's protocol: a greedy
    agent can stall (in Breakout, by never firing a new ball) until the time limit."""
    obs, _ = envs.reset()
    rng, num_actions = np.random.default_rng(seed), int(getattr(envs, "single_action_space", envs.action_space).n)
    returns, finished = np.zeros(envs.num_envs), np.zeros(envs.num_envs, dtype=bool)
    while not finished.all():
        actions = epsilon_greedy(partial(policy, q_network=q_network), obs, 0.05, rng, num_actions, device)
        obs, _, _, truncations, infos = envs.step(actions.astype(np.int32))
        returns += infos["reward"] * ~finished
        finished |= infos["terminated"].astype(bool) | truncations
    return returns.tolist()


def write_atomic(path, write):
    """Write through a temporary file, then rename it: a reader never sees a half-written file."""
    with open(path + ".tmp", "wb") as f:
        write(f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    args = tyro.cli(Args)
    start_time = time.perf_counter()
    for name in ("total_timesteps", "num_envs", "batch_size", "buffer_size", "train_frequency", "steps_per_update",
                 "actor_sync_every", "target_network_frequency"):
        if getattr(args, name) <= 0:
            fail(f"--{name.replace('_', '-')} must be positive")
    if args.torch_threads < 0:
        fail("--torch-threads must be 0 (chosen for this machine) or positive")
    if not 0 < args.exploration_fraction <= 1 or not 0 < args.tau <= 1:
        fail("--exploration-fraction and --tau must be in (0, 1]")
    if args.learning_starts < args.batch_size:
        fail(f"--learning-starts {args.learning_starts} must be at least --batch-size {args.batch_size}")
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    torch.set_num_threads(cpu_threads(args.torch_threads, device, reserved=1 if args.async_actor else 0))
    cudagraphs_active = args.cudagraphs and device.type == "cuda"
    if args.cudagraphs and not cudagraphs_active:
        print("warning: --cudagraphs needs CUDA; running the same code eagerly", file=sys.stderr)
    mode = "+".join(name for name, on in (("compile", args.compile), ("cudagraphs", args.cudagraphs)) if on) or "eager"
    run_name = f"{args.env_id}__{args.exp_name}__{args.seed}__{mode}__{int(time.time())}"
    run_dir = os.path.join("runs", run_name)

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    envs = make_envs(args.env_id, args.num_envs, args.seed, args.env_backend)
    num_actions = int(getattr(envs, "single_action_space", envs.action_space).n)
    q_network = QNetwork(num_actions).to(device)
    target_network = QNetwork(num_actions).to(device).requires_grad_(False)
    target_network.load_state_dict(q_network.state_dict())
    target_params, online_params = from_module(target_network), from_module(q_network).data
    q_view = QNetwork(num_actions).to("meta")  # acts with the learner's weights, shared and without grad
    from_module(q_network).data.to_module(q_view)
    q_view.requires_grad_(False)
    # Tensor learning rate and capturable state let CUDA graphs replay the optimizer step.
    optimizer = torch.optim.Adam(q_network.parameters(), lr=torch.tensor(args.learning_rate, device=device),
                                 fused=True, capturable=cudagraphs_active)
    update_step = speed_up(partial(update, q_network=q_network, target_network=target_network, optimizer=optimizer,
                                   gamma=args.gamma), args.compile, cudagraphs_active)
    # Updates are owed at batch_size / train_frequency gradient samples per transition after learning_starts.
    replay_ratio = args.batch_size / args.train_frequency
    played = args.total_timesteps // args.num_envs * args.num_envs  # whole vector steps
    total_updates = max(0, played - args.learning_starts) // args.train_frequency
    target_every = max(1, args.target_network_frequency // args.train_frequency)  # in updates

    writer = SummaryWriter(run_dir)
    writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in asdict(args).items()))
    if args.async_actor:
        envs.close()
        ctx = mp.get_context("spawn")  # fork would copy the learner's threads and locks mid-flight
        # The band must fit one actor step and one batch, or each side could wait on the other forever.
        error_buffer = max(args.replay_tolerance * args.learning_starts * replay_ratio,
                           args.num_envs * replay_ratio + args.batch_size)
        limiter = RateLimiter(replay_ratio, args.learning_starts, error_buffer, ctx)
        # While the learner gathers a batch the actor can insert at most this many transitions (then the band
        # stops it): rows beyond buffer_size keep them from overwriting anything the batch may read.
        extra_rows = math.ceil(2 * error_buffer / replay_ratio / args.num_envs) + 1
        rb = FrameReplay(args.buffer_size, args.num_envs, "cpu", extra_rows, shared=True)
        actor_q = QNetwork(num_actions).requires_grad_(False).share_memory()
        actor_q.load_state_dict(q_network.state_dict())
        actor_params, weights_lock, reports = from_module(actor_q), ctx.Lock(), ctx.Queue()
        actor = ctx.Process(target=run_actor, args=(args, rb, limiter, actor_q, weights_lock, reports), daemon=True)
        # The actor ignores Ctrl-C, which reaches the whole process group: the learner stops it. Otherwise an
        # interrupt while the actor is still importing would print the import's traceback.
        sigint = signal.signal(signal.SIGINT, signal.SIG_IGN)
        actor.start()
        signal.signal(signal.SIGINT, sigint)
    else:
        rb = FrameReplay(args.buffer_size, args.num_envs, device)
        policy_step = speed_up(partial(policy, q_network=q_view), args.compile, cudagraphs_active)
        player = Player(args, envs, policy_step, rb, device)

    recent_returns, num_updates, loss = deque(maxlen=20), 0, None
    actor_env_seconds, actor_error, wait_seconds = 0.0, None, 0.0
    steady_start_time = steady_start_step = None

    def actor_ok():
        return actor.exitcode in (None, 0)  # 0: it has played all its steps, the updates it is owed remain

    def inserted():
        return limiter.inserts if args.async_actor else player.inserted

    def played_seconds():
        return actor_env_seconds if args.async_actor else player.env_seconds

    def drain_reports():
        """Log finished episodes: the player's, or those the actor sent (with its env time and any error)."""
        global actor_env_seconds, actor_error
        if not args.async_actor:
            reports_now, player.finished = [("progress", player.finished, player.env_seconds)], []
        else:
            reports_now = []
            while not reports.empty():
                reports_now.append(reports.get())
        for kind, *content in reports_now:
            if kind == "error":
                actor_error = content[0]
                continue
            for step, episode_return in content[0]:
                recent_returns.append(episode_return)
                writer.add_scalar("charts/episodic_return", episode_return, step)
            actor_env_seconds = content[1]

    def stop_actor(timeout):
        """Wait for the actor to exit, reading its reports meanwhile (a process with unread queue data cannot
        exit), then close the limiter, and terminate it if it is still there: no process outlives the run."""
        deadline = time.monotonic() + timeout
        while actor.is_alive() and time.monotonic() < deadline:
            drain_reports()
            actor.join(timeout=0.1)
        limiter.close()
        if actor.is_alive():
            actor.terminate()
            actor.join()
        drain_reports()

    def learn():
        """One update from a fresh batch, the target and actor weights when due, metrics every LOG_EVERY."""
        global num_updates, loss, steady_start_time, steady_start_step, steady_env_seconds, wait_seconds
        if num_updates == args.measure_burnin:  # the steady phase starts: compilation and capture are done
            if device.type == "cuda":
                torch.cuda.synchronize()
            drain_reports()
            steady_start_time, steady_start_step, steady_env_seconds = time.perf_counter(), inserted(), played_seconds()
            wait_seconds = 0.0
        if args.async_actor:
            wait_start = time.perf_counter()
            if not limiter.await_sample(args.batch_size, actor_ok):
                raise ChildProcessError("the actor stopped")
            wait_seconds += time.perf_counter() - wait_start
        batch = rb.sample(inserted() // args.num_envs, args.batch_size, device)
        if args.async_actor:
            limiter.sampled(args.batch_size)
        loss, q_values = update_step(*batch)
        num_updates += 1
        if num_updates % target_every == 0:
            target_params.lerp_(online_params, args.tau)
        if args.async_actor and num_updates % args.actor_sync_every == 0:
            if not actor_ok():
                raise ChildProcessError("the actor stopped")
            with held(weights_lock, actor_ok):
                actor_params.update_(online_params)
        if num_updates % LOG_EVERY == 0:
            loss_value, q_value = torch.stack([loss, q_values]).tolist()  # one sync per LOG_EVERY updates
            step = inserted()
            writer.add_scalar("losses/td_loss", loss_value, step)
            writer.add_scalar("losses/q_values", q_value, step)
            writer.add_scalar("charts/epsilon", epsilon_at(step, args), step)
            replay_ratio_now = num_updates * args.batch_size / max(1, step - args.learning_starts)
            writer.add_scalar("charts/replay_ratio", replay_ratio_now, step)
            if steady_start_time is not None and step > steady_start_step:
                sps = (step - steady_start_step) / (time.perf_counter() - steady_start_time)
                writer.add_scalar("charts/SPS", sps, step)
            drain_reports()

    try:
        if args.async_actor:  # the rate limiter paces the updates against the actor's inserts
            while num_updates < total_updates:
                learn()
        else:  # play steps_per_update vector steps, then do the updates they owe
            for iteration in range(0, args.total_timesteps // args.num_envs, args.steps_per_update):
                for _ in range(min(args.steps_per_update, args.total_timesteps // args.num_envs - iteration)):
                    player.step()
                owed = max(0, player.inserted - args.learning_starts) // args.train_frequency
                while num_updates < owed:
                    learn()
                drain_reports()
    except (ChildProcessError, KeyboardInterrupt) as error:
        if args.async_actor:
            if isinstance(error, KeyboardInterrupt):
                limiter.close()  # the actor leaves its loop at its next step
            stop_actor(timeout=5)
        if isinstance(error, KeyboardInterrupt):
            print("interrupted: the learner and the actor stopped", file=sys.stderr)
            sys.exit(130)
        cause = actor_error.strip().splitlines()[-1] if actor_error else (
            f"killed by {signal.Signals(-actor.exitcode).name}" if actor.exitcode and actor.exitcode < 0
            else f"exit code {actor.exitcode}")
        print(f"error: the actor process died ({cause}); the learner stops", file=sys.stderr)
        sys.exit(1)
    if args.async_actor:  # every update is done: the actor plays its last steps (the band lets it) and exits
        stop_actor(timeout=60)
    else:
        envs.close()

    if device.type == "cuda":
        torch.cuda.synchronize()
    end_time, end_step = time.perf_counter(), inserted()
    if steady_start_time is None:  # the run ended before the steady phase began
        steady_start_time, steady_start_step, steady_env_seconds = end_time, end_step, played_seconds()
    env_seconds = played_seconds() - steady_env_seconds  # the actor's, in async mode
    steady_steps, steady_seconds = end_step - steady_start_step, end_time - steady_start_time

    eval_returns = []
    if args.eval_episodes > 0:
        eval_envs = make_envs(args.env_id, args.eval_episodes, args.seed + 10_000, args.env_backend)
        eval_returns = evaluate(q_view, eval_envs, device, seed=args.seed)
        eval_envs.close()
        writer.add_scalar("eval/episodic_return", np.mean(eval_returns), end_step)
    if args.save_model:
        checkpoint = {"env_id": args.env_id, "num_actions": num_actions, "args": asdict(args),
                      "q_network": q_network.state_dict(), "optimizer": optimizer.state_dict()}
        write_atomic(os.path.join(run_dir, "model.pt"), partial(torch.save, checkpoint))

    summary = {
        "script": os.path.basename(__file__), "env_id": args.env_id, "seed": args.seed, "num_envs": args.num_envs,
        "total_timesteps": args.total_timesteps, "mode": mode, "compile": args.compile,
        "cudagraphs_requested": args.cudagraphs, "cudagraphs_active": cudagraphs_active, "device": str(device),
        "torch_version": torch.__version__, "torch_threads": torch.get_num_threads(), "async_actor": args.async_actor,
        "env_backend": args.env_backend,
        "sps": steady_steps / steady_seconds if steady_steps > 0 else None,
        "steady_steps": steady_steps, "steady_seconds": steady_seconds,
        "warmup_seconds": steady_start_time - start_time, "total_seconds": time.perf_counter() - start_time,
        "return_mean": float(np.mean(recent_returns)) if recent_returns else None,
        "eval_return_mean": float(np.mean(eval_returns)) if eval_returns else None, "eval_returns": eval_returns,
        "peak_memory_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "env_seconds": env_seconds,
        "learner_wait_seconds": wait_seconds, "num_updates": num_updates, "inserted": end_step,
        "final_td_loss": loss.item() if loss is not None else None,
        "replay_ratio_target": replay_ratio,
        "replay_ratio_achieved": num_updates * args.batch_size / max(1, end_step - args.learning_starts),
    }
    if device.type == "cuda":
        summary["peak_cuda_memory_mb"] = torch.cuda.max_memory_allocated() / 2**20
    writer.close()
    write_atomic(os.path.join(run_dir, "summary.json"), lambda f: f.write(json.dumps(summary, indent=1).encode()))
    print("SPEED " + json.dumps(summary))
