"""Deep Q-Network (DQN, Mnih et al. 2015) with an actor process, on Atari (envpool or ALE) or classic control, one file.

Speed: the actor plays in its own process (its own envs, a copy of the Q-network on the learner's device) while the
learner trains; a rate limiter in the style of Reverb's SampleToInsertRatio holds gradient samples per inserted
transition at batch_size / train_frequency, the synchronous scripts' rate (dqn_atari.py, dqn.py). Cost: shared-memory
storage with a band of extra rows, and on CUDA a copy of it in device memory that the learner samples; runs are not
bit-reproducible. The learner's update takes torch.compile and CUDA graphs.
    python leanrl_scripts/dqn_atari_async.py --env-id Breakout-v5 --compile
"""

import copy
import ctypes
import math
import os
import signal
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from fractions import Fraction
from functools import partial
from typing import Literal

# Idle OpenMP threads sleep instead of spinning: a spinning pool takes the cores that the envs, the actor (or
# other programs) need. Set before torch loads OpenMP; it costs a wake-up (tens of microseconds) per parallel kernel.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

try:
    import cv2
except ModuleNotFoundError:  # only the gymnasium back-end needs it; --help works without it
    cv2 = None
import gymnasium as gym
import numpy as np
import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import tyro
from tensordict import from_module
from tensordict.nn import CudaGraphModule

from run_bookkeeping import Ranges, Run, RunArgs, check_fits, fail, game_mp4, stop_if_signalled, tune_cpu, usable_cores


@dataclass
class Args(RunArgs):
    env_id: str = "Breakout-v5"
    """an Atari game as envpool names it (Breakout-v5, for both back-ends), or a gymnasium id with flat observations
    (CartPole-v1: an MLP; pass CleanRL's dqn.py settings, these defaults are its dqn_atari.py's)"""
    env_backend: Literal["envpool", "gymnasium"] = "envpool"
    """Atari: envpool (its own preprocessing) or gymnasium (ALE with this script's wrappers)"""
    total_timesteps: int = 10_000_000
    """total environment steps (0 only with --load-model: evaluate it)"""
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
    """the frequency of training (environment steps per update)"""
    actor_sync_every: int = 10
    """updates between copies of the learner's weights to the actor"""
    replay_tolerance: float = 0.1
    """how far the replay ratio may drift, as a fraction of learning_starts x replay ratio samples"""
    measure_burnin: int = 50
    """updates the speed figure leaves out (compilation, graph capture)"""


RANGES = Ranges(
    counts=("num_envs", "batch_size", "buffer_size", "train_frequency", "target_network_frequency", "actor_sync_every"),
    rates=("learning_rate", "tau", "exploration_fraction", "replay_tolerance"),
    fractions=("gamma", "tau", "exploration_fraction", "start_e", "end_e"),
    at_least_0=("measure_burnin",),
    before_the_end=("learning_starts",),
)

LOG_EVERY = 100  # updates between metric reads (a host sync each)


class EpisodicLife(gym.Wrapper):
    """A lost life ends the episode for the learner (no bootstrap past it) but not the game: reset() after a
    lost life takes one no-op step instead of restarting. info gets the raw reward and the true end of the game,
    as envpool's."""

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
    """For games that wait for FIRE: press it (then action 2) after each reset."""

    def reset(self, **kwargs):
        self.env.reset(**kwargs)
        for action in (1, 2):
            obs, _, terminated, truncated, info = self.env.step(action)
            if terminated or truncated:
                obs, info = self.env.reset(**kwargs)
        return obs, info


def make_gym_env(env_id, render=False):
    """The classic DQN stack on ALE, with envpool's v5 settings: no sticky actions, v5's 108k-frame time limit."""
    env = gym.make(
        f"ALE/{env_id}", frameskip=1, repeat_action_probability=0.0, render_mode="rgb_array" if render else None
    )
    # 1 to 30 no-ops after a reset (varied starts), each action held 4 frames with the rewards summed and the last
    # two frames max-pooled (sprites flicker), 84x84 greyscale
    env = EpisodicLife(gym.wrappers.AtariPreprocessing(env, noop_max=30, frame_skip=4, screen_size=84))
    if "FIRE" in env.unwrapped.get_action_meanings():
        env = FireReset(env)
    env = gym.wrappers.TransformReward(env, np.sign)  # one learning rate fits every game's score scale
    return gym.wrappers.FrameStackObservation(env, 4, padding_type="reset")  # a reset fills all 4


def make_classic_env(env_id, render=False):
    """A gymnasium env with flat observations, given a stack dimension of one: the frame storage serves it as is."""
    env = gym.make(env_id, render_mode="rgb_array" if render else None)
    if not isinstance(env.action_space, gym.spaces.Discrete):
        fail(f"{env_id} has {env.action_space}: DQN needs discrete actions (continuous ones: sac, td3, ppo)")
    if not isinstance(env.observation_space, gym.spaces.Box) or len(env.observation_space.shape) != 1:
        fail(f"{env_id} has observations {env.observation_space}: give Atari games by their envpool id (Breakout-v5)")
    return gym.wrappers.ReshapeObservation(env, (1, *env.observation_space.shape))


def make_envs(env_id, num_envs, seed=0, backend="envpool", render=False):
    """Atari, either back-end: 4 stacked 84x84 frames, rewards clipped, a lost life ends an episode; info["reward"]
    is the unclipped reward and info["terminated"] the end of the game. A gymnasium id: classic control, one frame.
    After the step that ends an episode the next step resets that env and is not a transition: with envpool after a
    lost life too (its action ignored, no-ops and FIRE played, the frame stack kept)."""
    classic = env_id in gym.registry
    if not classic and backend == "envpool":
        try:
            import envpool  # imported here: the other envs run without it
        except ModuleNotFoundError:
            fail('envpool is not installed: pip install ".[envpool]" (or run with --env-backend gymnasium)')
        if env_id not in envpool.list_all_envs():
            fail(f"unknown env id '{env_id}': an envpool Atari game (Breakout-v5) or a gymnasium id (CartPole-v1)")
        if type(envpool.make_spec(env_id)).__name__ != "AtariEnvSpec":
            fail(f"{env_id} is not an Atari game (continuous control: sac_continuous_action.py)")
        threads = min(num_envs, usable_cores())  # one per env up to those: envpool's default counts the host's cores
        game = dict(episodic_life=True, reward_clip=True, render_mode="rgb_array" if render else None)
        return envpool.make(env_id, env_type="gymnasium", num_envs=num_envs, num_threads=threads, seed=seed, **game)
    if not classic:
        try:
            import ale_py  # registers the ALE/ ids
        except ModuleNotFoundError:
            ale_py = None
        if ale_py is None or cv2 is None:
            fail('the gymnasium back-end needs ale-py and OpenCV: pip install ".[atari]"')
        gym.register_envs(ale_py)
    try:
        make_env = partial(make_classic_env if classic else make_gym_env, env_id, render)
        envs = gym.vector.SyncVectorEnv([make_env] * num_envs, autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP)
    except Exception as error:  # an unknown ALE game, a missing ROM or package, an old version
        fail(f"unknown env id '{env_id}', or it cannot be made: {error}")
    envs.reset(seed=seed)
    return envs


def game_over(infos, terminations, truncations):
    """The end of a whole game: on Atari info["terminated"] (an episode ends at each lost life), else the episode's."""
    return np.asarray(infos.get("terminated", terminations), dtype=bool) | truncations


class QNetwork(nn.Module):
    """The Nature DQN network on Atari frames (channels-last: mkldnn's NHWC kernels are the fast ones on CPU), or
    CleanRL's MLP 120-84 on a stack of one flat observation."""

    def __init__(self, obs_shape, num_actions):
        super().__init__()
        self.pixels = len(obs_shape) == 3
        if self.pixels:
            self.network = nn.Sequential(
                nn.Conv2d(obs_shape[0], 32, 8, stride=4),
                nn.ReLU(),
                nn.Conv2d(32, 64, 4, stride=2),
                nn.ReLU(),
                nn.Conv2d(64, 64, 3, stride=1),
                nn.ReLU(),
                nn.Flatten(),
                nn.Linear(3136, 512),
                nn.ReLU(),
                nn.Linear(512, num_actions),
            ).to(memory_format=torch.channels_last)
        else:
            self.network = nn.Sequential(
                nn.Flatten(),
                nn.Linear(obs_shape[-1], 120),
                nn.ReLU(),
                nn.Linear(120, 84),
                nn.ReLU(),
                nn.Linear(84, num_actions),
            )

    def forward(self, obs):
        if self.pixels:
            obs = obs.contiguous(memory_format=torch.channels_last) / 255.0
        return self.network(obs)


class FrameReplay:
    """Replay storage with each frame once, in shared memory. Row t of env lane e holds the newest frame of that env's
    t-th observation, the action, clipped reward and termination of its step, and two flags: `valid` (the step is a
    transition, not the reset step after an episode's end) and `first` (the frame stack restarts here). The stacks of
    obs t and obs t+1 are the frames of rows t+1, t, t-1, ... walked back and held at the first row: exactly what the
    env returned, for 1/4 of the memory on Atari. Rows are used round-robin, with `extra_rows` beyond buffer_size that
    the actor may write while the learner gathers a batch, so that none is read half-written."""

    columns = ("frames", "actions", "rewards", "terminations", "valid", "first")

    def __init__(self, buffer_size, num_envs, obs_shape, frame_dtype, extra_rows):
        self.buffer_rows = math.ceil(buffer_size / num_envs)
        self.stack = obs_shape[0]
        rows = self.buffer_rows + extra_rows + self.stack  # + stack: the oldest sampled row still has its frames
        # empty, not zeros: pages are touched as the rows fill, and only written rows are ever read
        self.frames = torch.empty((rows, num_envs, *obs_shape[1:]), dtype=frame_dtype)
        self.actions = torch.zeros((rows, num_envs), dtype=torch.long)
        self.rewards, self.terminations = (torch.zeros((rows, num_envs)) for _ in range(2))
        self.valid, self.first = (torch.zeros((rows, num_envs), dtype=torch.bool) for _ in range(2))
        self.next_valid = np.ones(num_envs, dtype=bool)
        self.next_first = np.ones(num_envs, dtype=bool)
        self.restarting = np.zeros(num_envs, dtype=bool)  # a restart shows one row late: after the reset step
        for name in self.columns:
            getattr(self, name).share_memory_()

    def add(self, step, obs, actions, rewards, terminations, reset, restart):
        """Vector step `step`; `reset`: the envs whose next step is a reset, not a transition; `restart`: those of
        them whose frame stack restarts after it (envpool keeps its stack across a lost life)."""
        row = step % len(self.frames)
        flags = (self.next_valid, self.next_first)
        self.next_valid, self.next_first, self.restarting = ~reset, self.restarting, restart
        for name, value in zip(self.columns, (obs[:, -1], actions, rewards, terminations, *flags)):
            getattr(self, name).numpy()[row] = value  # numpy's assignment: a third of torch's per-call cost

    def mirror(self, device):
        """An empty copy of this storage on `device`, which the learner samples once catch_up has filled it: on CUDA,
        gathering each batch's stacks on the host and copying them over (1.8 MB on Atari) had taken 3.5 ms an update,
        twice dqn_atari.py's update and env step with its storage on the GPU (4 envs, an H200 machine)."""
        mirror = copy.copy(self)
        for name in self.columns:
            setattr(mirror, name, torch.zeros_like(getattr(self, name), device=device))
        mirror.copied = 0  # vector steps copied in so far
        return mirror

    def catch_up(self, source, steps):
        """Copy from `source` (the shared storage) the rows of vector steps self.copied to steps - 1, the whole
        rows the actor has counted as inserted. Rows that wrap are copied in two blocks."""
        rows = len(self.frames)
        start = max(self.copied, steps - len(self.frames))
        while start < steps:
            row = start % rows
            block = slice(row, row + min(steps - start, rows - row))
            for name in self.columns:  # pinned on CUDA: a copy from pageable memory first waits for the GPU's queue
                new_rows = getattr(source, name)[block]
                new_rows = new_rows.pin_memory() if self.frames.is_cuda else new_rows
                getattr(self, name)[block].copy_(new_rows, non_blocking=True)
            start += block.stop - block.start
        self.copied = steps

    def sample(self, steps, batch_size):
        """A uniform batch of the valid transitions among the newest min(steps - 1, buffer_rows) rows of every
        lane (`steps` rows written; the newest has no next frame yet), on the storage's device: obs, actions,
        rewards, next_obs, terminations. Twice the batch is drawn and the first valid ones kept: rejection
        sampling, exact unless more than half the draws hit reset steps (about one row per episode)."""
        rows = len(self.frames)
        lanes = self.frames.shape[1]
        age = torch.randint(0, min(steps - 1, self.buffer_rows), (2 * batch_size,), device=self.frames.device)
        row = (steps - 2 - age) % rows
        lane = torch.randint_like(age, lanes)
        keep = torch.argsort((~self.valid[row, lane]).byte(), stable=True)[:batch_size]
        row, lane = row[keep], lane[keep]
        obs, next_obs = self.stacks(row, lane)
        return obs, self.actions[row, lane], self.rewards[row, lane], next_obs, self.terminations[row, lane]

    def stacks(self, row, lane):
        """The observation stacks of rows `row` and `row + 1` in lanes `lane`: (batch, stack, *frame) each."""
        rows = len(self.frames)
        chain = [(row + 1) % rows]
        for _ in range(self.stack):
            chain.append(torch.where(self.first[chain[-1], lane], chain[-1], (chain[-1] - 1) % rows))
        frames = self.frames[torch.stack(chain[::-1], 1), lane[:, None]]  # (batch, stack + 1, *frame)
        return frames[:, :-1], frames[:, 1:]


@contextmanager
def hold_lock(lock, other_alive):
    """`lock` (the actor's weights), checking every second while waiting for it that the other process lives:
    a process killed while holding a lock never releases it."""
    while not lock.acquire(timeout=1.0):
        if not other_alive():
            raise ChildProcessError("the other side of the replay storage stopped")
    try:
        yield
    finally:
        lock.release()


class Counts(ctypes.Structure):
    """The limiter's state; in shared memory between the learner and the actor process."""

    _fields_ = [("inserts", ctypes.c_int64), ("samples", ctypes.c_int64), ("closed", ctypes.c_bool)]


class RateLimiter:
    """Reverb's SampleToInsertRatio. With diff = inserts x samples_per_insert - samples, an insert waits while it
    would push diff above min_size x samples_per_insert + error_buffer; a sample waits until min_size transitions
    are in and while it would pull diff below min_size x samples_per_insert - error_buffer. The ratio is kept as a
    fraction p / q and diff scaled by q, so the arithmetic is exact integers. Each counter has one writer (inserts:
    the actor, samples: the learner), so no mutex guards them: a waiting side sleeps on a semaphore that the other
    side posts after each step and re-checks its condition (a condition variable without the mutex: a process killed
    mid-step leaves no lock held); the one-second timeout checks that the other side lives, and for a signal."""

    def __init__(self, samples_per_insert, min_size, error_buffer, ctx):
        ratio = Fraction(samples_per_insert)
        self.p = ratio.numerator
        self.q = ratio.denominator
        self.min_size = min_size
        self.min_scaled = min_size * self.p - error_buffer * self.q  # (min_size x spi - error_buffer) x q
        self.max_scaled = min_size * self.p + error_buffer * self.q
        self.counts = ctx.RawValue(Counts)
        self.insert_posted = ctx.Semaphore(0)
        self.sample_posted = ctx.Semaphore(0)

    inserts = property(lambda self: self.counts.inserts)
    samples = property(lambda self: self.counts.samples)
    min_diff = property(lambda self: self.min_scaled / self.q)
    max_diff = property(lambda self: self.max_scaled / self.q)

    def await_insert(self, n, other_alive=lambda: True):
        return self._wait(
            lambda: not self.counts.closed and (self.inserts + n) * self.p - self.samples * self.q <= self.max_scaled,
            self.sample_posted,
            other_alive,
        )

    def await_sample(self, n, other_alive=lambda: True):
        return self._wait(
            lambda: (
                self.inserts >= self.min_size and self.inserts * self.p - (self.samples + n) * self.q >= self.min_scaled
            ),
            self.insert_posted,
            other_alive,
        )

    def _wait(self, ready, posted, other_alive):
        """True once `ready()`; False if the limiter is closed first (the run ends, or the other side failed)."""
        while not ready():
            if self.counts.closed:
                return False
            if not posted.acquire(timeout=1.0) and not other_alive():
                raise ChildProcessError("the other side of the replay storage stopped")
            stop_if_signalled()  # Ctrl-C in the learner while it waits (the actor process ignores it)
        return True

    def add_inserts(self, n):
        self.counts.inserts += n
        self.insert_posted.release()

    def add_samples(self, n):
        self.counts.samples += n
        self.sample_posted.release()

    def close(self):
        self.counts.closed = True
        self.insert_posted.release()
        self.sample_posted.release()


def policy(obs, *, q_network):
    """Greedy actions; `q_network` is the actor's copy, or the learner's network at evaluation."""
    return q_network(obs).argmax(-1)


def td_loss(obs, actions, rewards, next_obs, terminations, *, q_network, target_network, gamma):
    """The TD loss of a batch, and its metrics."""
    with torch.no_grad():
        target_max = target_network(next_obs).max(-1).values
        td_target = rewards + gamma * target_max * (1 - terminations)
    old_val = q_network(obs).gather(1, actions[:, None]).squeeze(1)
    loss = F.mse_loss(td_target, old_val)
    return loss, {"td_loss": loss.detach(), "q_values": old_val.mean().detach()}


def update(*batch, loss_fn, optimizer):
    """One TD step on `loss_fn` (the compiled piece; backward and Adam run outside it)."""
    loss, metrics = loss_fn(*batch)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return metrics


def epsilon_at(step, args):
    """The linear schedule from start_e to end_e over exploration_fraction of the run, then end_e."""
    slope = (args.end_e - args.start_e) / (args.exploration_fraction * args.total_timesteps)
    return max(slope * step + args.start_e, args.end_e)


def epsilon_greedy(policy_step, obs, epsilon, rng, num_actions, device):
    """One coin per env from a host RNG (no device sync decides anything): the network runs only when some env
    exploits."""
    exploit = rng.random(len(obs)) >= epsilon
    if not exploit.any():
        return rng.integers(num_actions, size=len(obs))
    greedy = policy_step(torch.from_numpy(obs).to(device, non_blocking=True)).cpu().numpy()
    return greedy if exploit.all() else np.where(exploit, greedy, rng.integers(num_actions, size=len(obs)))


class DeviceCopy:
    """The actor's network on a GPU, copied from the shared CPU copy (`shared`) when the learner has written new
    weights there (`version` counts the writes): 6.7 MB host to device every --actor-sync-every updates on Atari."""

    def __init__(self, shared, version, device):
        self.network = copy.deepcopy(shared).to(device)
        self.version = version
        self.seen = version.value
        self.params, self.shared_params = from_module(self.network), from_module(shared)

    def refresh(self):
        """Call under the weights lock: the shared copy is whole there."""
        if self.version.value != self.seen:
            self.seen = self.version.value
            self.params.update_(self.shared_params)


def run_actor(args, rb, limiter, q_network, version, weights_lock, reports, device):
    """The actor process: epsilon-greedy vector steps into the storage, each when the limiter lets it, acting with
    `q_network` (a CPU copy in shared memory the learner refreshes under `weights_lock`), or on CUDA with its own
    copy on the GPU; finished games' true scores and lengths, its env time so far and any error go to `reports`. It
    starts with Ctrl-C ignored (see ActorProcess)."""
    parent_alive = mp.parent_process().is_alive  # the learner: also right when it died while this process started
    try:
        torch.set_num_threads(1)  # one core plays, the others train
        envs = make_envs(args.env_id, args.num_envs, args.seed, args.env_backend)
        # With a CPU copy the actor played 409 SPS on Breakout on an H200 machine's slower cores (1.1 ms of its 2.4
        # ms a step in the env), below the 556 of the synchronous loop that acts on the GPU (docs/dqn.md): with CUDA
        # it acts on the GPU too, at the cost of a CUDA context of its own. Eager even with --compile: on one CPU
        # thread the compiled forward measured no faster, and compiling here would hold the learner for a cold compile.
        device_copy = DeviceCopy(q_network, version, device) if device.type == "cuda" else None
        acting_device = device if device_copy else torch.device("cpu")
        acting = device_copy.network if device_copy else q_network
        policy_step = partial(policy, q_network=acting)
        rng = np.random.default_rng(args.seed)
        num_actions = int(getattr(envs, "single_action_space", envs.action_space).n)
        obs, _ = envs.reset()
        scores = np.zeros(args.num_envs)
        lengths = np.zeros(args.num_envs, int)
        env_seconds = 0.0
        for step in range(args.total_timesteps // args.num_envs):
            if not limiter.await_insert(args.num_envs, parent_alive):  # closed: the learner is done
                break
            with hold_lock(weights_lock, parent_alive):  # the learner writes new weights under it
                if device_copy:
                    device_copy.refresh()
                epsilon = epsilon_at(step * args.num_envs, args)
                actions = epsilon_greedy(policy_step, obs, epsilon, rng, num_actions, acting_device)
            env_start = time.perf_counter()
            next_obs, rewards, terminations, truncations, infos = envs.step(actions.astype(np.int32))
            env_seconds += time.perf_counter() - env_start
            ended = game_over(infos, terminations, truncations)
            reset = terminations | truncations  # see make_envs: the next step resets, after a lost life too
            restart = ended if args.env_backend == "envpool" else reset  # envpool keeps its stack past a lost life
            rb.add(step, obs, actions, rewards, terminations, reset, restart)
            limiter.add_inserts(args.num_envs)  # after the row is written: the learner may sample it now
            scores, lengths = scores + infos.get("reward", rewards), lengths + 1  # info["reward"]: the unclipped score
            if ended.any():
                games = [((step + 1) * args.num_envs, *game) for game in zip(scores[ended], lengths[ended])]
                reports.put(("games", games, env_seconds))
                scores[ended] = 0
                lengths[ended] = 0
            obs = next_obs
        reports.put(("games", [], env_seconds))
    except BaseException:
        reports.put(("error", traceback.format_exc()))
        sys.exit(1)
    finally:
        limiter.close()  # wakes a learner waiting for transitions that will not come


class ActorProcess:
    """The actor in its own process (spawned: fork would copy the learner's threads and locks mid-flight).
    load_weights() copies the learner's weights to its shared CPU copy (the actor copies them on to its GPU copy on
    CUDA); drain() passes its reports to the run;
    stop() waits for it to exit, draining meanwhile (a process with unread queue data cannot exit), then ends it if
    it has not: no process outlives the run."""

    def __init__(self, ctx, args, rb, limiter, q_network, device):
        self.limiter = limiter
        self.reports = ctx.Queue()
        self.env_seconds = 0.0
        self.error = None
        self.q_network = copy.deepcopy(q_network).cpu().requires_grad_(False).share_memory()
        self.params, self.weights_lock = from_module(self.q_network), ctx.Lock()
        self.version = ctx.Value("Q", 0, lock=False)  # weight writes so far, read and written under weights_lock
        self.process = ctx.Process(
            target=run_actor,
            daemon=True,
            args=(args, rb, limiter, self.q_network, self.version, self.weights_lock, self.reports, device),
        )
        # Ctrl-C reaches the whole process group; the actor ignores it (from its start: an interrupt while it
        # still imports would print the import's traceback) and the learner stops it.
        sigint = signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.process.start()
        signal.signal(signal.SIGINT, sigint)

    def alive(self):
        return self.process.exitcode in (None, 0)  # 0: it has played all its steps, the updates it is owed remain

    def load_weights(self, params):
        if not self.alive():
            raise ChildProcessError("the actor stopped")
        with hold_lock(self.weights_lock, self.alive):
            self.params.update_(params)
            self.version.value += 1

    def drain(self, run):
        """Finished games to the run, and the actor's env time since the last drain to the run's env time."""
        while not self.reports.empty():
            kind, *content = self.reports.get()
            if kind == "error":
                self.error = content[0]
                continue
            games, env_seconds = content
            for step, score, length in games:
                run.record_episode(step, score, length)
            run.add_env_seconds(env_seconds - self.env_seconds)  # the actor reports its total
            self.env_seconds = env_seconds

    def stop(self, run, timeout=5):
        deadline = time.monotonic() + timeout
        while self.process.is_alive() and time.monotonic() < deadline:
            self.drain(run)
            self.process.join(timeout=0.1)
        self.limiter.close()
        if self.process.is_alive():
            self.process.terminate()
            self.process.join()
        self.drain(run)

    def failure(self):
        """Why the actor stopped: the last line of its error, else its exit code or signal."""
        code = self.process.exitcode
        if self.error:
            return self.error.strip().splitlines()[-1]
        return f"killed by {signal.Signals(-code).name}" if code and code < 0 else f"exit code {code}"


def first_screen(envs):
    """The first env's screen: envpool renders env 0 by its id, a gymnasium vector env through its first env."""
    return envs.envs[0].render() if isinstance(envs, gym.vector.SyncVectorEnv) else envs.render()[0]


@torch.no_grad()
def evaluate(q_network, args, device, video_folder=None):
    """Score of the first whole game in each of --eval-episodes envs: greedy on classic control; on Atari the true
    score at epsilon 0.05, the DQN paper's protocol (a greedy agent can stall, in Breakout by never firing a new
    ball, until the time limit). With `video_folder`, the first env's game is recorded there."""
    envs = make_envs(
        args.env_id, args.eval_episodes, args.seed + 10_000, args.env_backend, render=video_folder is not None
    )
    obs, _ = envs.reset()
    # one frame per agent step: an Atari step is 4 frames at 60 Hz (15 fps), a classic one its env's render_fps
    fps = 15 if q_network.pixels else envs.envs[0].metadata.get("render_fps", 30)
    video = game_mp4(video_folder, first_screen(envs), fps) if video_folder else None
    rng = np.random.default_rng(args.seed)
    num_actions = int(getattr(envs, "single_action_space", envs.action_space).n)
    policy_step = partial(policy, q_network=q_network)
    epsilon = 0.05 if q_network.pixels else 0.0
    returns = np.zeros(envs.num_envs)
    finished = np.zeros(envs.num_envs, dtype=bool)
    while not finished.all():
        stop_if_signalled()
        actions = epsilon_greedy(policy_step, obs, epsilon, rng, num_actions, device)
        obs, rewards, terminations, truncations, infos = envs.step(actions.astype(np.int32))
        if video and not finished[0]:
            video.write_frame(first_screen(envs))
        returns += infos.get("reward", rewards) * ~finished
        finished |= game_over(infos, terminations, truncations)
    if video:
        video.close()
    envs.close()
    return returns.tolist()


if __name__ == "__main__":
    args = tyro.cli(Args)
    args.env_id = args.env_id.replace("NoFrameskip-v4", "-v5")  # CleanRL's Atari ids: the same game and settings
    run = Run(args, RANGES)
    if args.buffer_size < args.batch_size:
        fail(f"--buffer-size {args.buffer_size} must hold at least one batch (--batch-size {args.batch_size})")
    if args.learning_starts < args.batch_size:
        fail(f"--learning-starts {args.learning_starts} must be at least --batch-size {args.batch_size}")
    device = run.device

    envs = make_envs(args.env_id, 1, args.seed, args.env_backend)  # its spaces; the actor makes its own envs
    obs_space = getattr(envs, "single_observation_space", envs.observation_space)
    num_actions = int(getattr(envs, "single_action_space", envs.action_space).n)
    envs.close()
    q_network = QNetwork(obs_space.shape, num_actions).to(device)
    # the usable cores less the actor process's; one for an MLP (waking threads costs it more than the math)
    tune_cpu(args.torch_threads, device, threads=usable_cores() - 1 if q_network.pixels else 1)
    frame_dtype = torch.uint8 if q_network.pixels else torch.float32
    # a transition: a stored frame, its action, reward, termination and two flags, in host memory (and on CUDA's GPU)
    frame_bytes = math.prod(obs_space.shape[1:]) * frame_dtype.itemsize
    for storage_device in {torch.device("cpu"), device}:
        check_fits(args.buffer_size * (frame_bytes + 18), storage_device, "--buffer-size")
    target_network = QNetwork(obs_space.shape, num_actions).to(device).requires_grad_(False)
    # Tensor learning rate and capturable state let CUDA graphs replay the optimizer step.
    learning_rate = torch.tensor(args.learning_rate, device=device)
    optimizer = torch.optim.Adam(q_network.parameters(), lr=learning_rate, fused=True, capturable=run.cudagraphs)
    run.save_and_load(
        {"q_network": q_network, "optimizer": optimizer}, obs_shape=[*obs_space.shape], num_actions=num_actions
    )
    target_network.load_state_dict(q_network.state_dict())
    target_params = from_module(target_network)
    online_params = from_module(q_network).data

    # --compile compiles the learner's loss (the actor process acts eagerly, see run_actor): the function itself, its
    # keyword arguments bound after, so a graph break inside it resumes there
    loss_fn = torch.compile(td_loss) if args.compile else td_loss
    loss_step = partial(loss_fn, q_network=q_network, target_network=target_network, gamma=args.gamma)
    update_step = partial(update, loss_fn=loss_step, optimizer=optimizer)
    if run.cudagraphs:  # the first calls compile and initialise Adam's state, then the graph is captured
        update_step = CudaGraphModule(update_step, warmup=5)

    ctx = mp.get_context("spawn")
    # Updates are owed at batch_size / train_frequency gradient samples per transition after learning_starts; the
    # band must fit one actor step and one batch, or each side could wait on the other forever.
    replay_ratio = Fraction(args.batch_size, args.train_frequency)
    tolerance = args.replay_tolerance * args.learning_starts * replay_ratio
    error_buffer = float(max(tolerance, args.num_envs * replay_ratio + args.batch_size))
    limiter = RateLimiter(replay_ratio, args.learning_starts, error_buffer, ctx)
    # While the learner gathers a batch the actor can insert at most this many transitions (then the band stops
    # it): rows beyond buffer_size keep them from overwriting anything the batch may read.
    extra_rows = math.ceil(2 * error_buffer / replay_ratio / args.num_envs) + 1
    rb = FrameReplay(args.buffer_size, args.num_envs, obs_space.shape, frame_dtype, extra_rows)
    played = args.total_timesteps // args.num_envs * args.num_envs  # whole vector steps
    total_updates = max(0, played - args.learning_starts) // args.train_frequency
    target_every = max(1, args.target_network_frequency // args.train_frequency)  # in updates
    num_updates = 0
    metrics = {}
    wait_seconds = 0.0
    run.start()
    actor = ActorProcess(ctx, args, rb, limiter, q_network, device)
    sampled = rb.mirror(device) if device.type == "cuda" else rb  # after the actor process has taken its rb
    try:
        with run.stoppable():
            while num_updates < total_updates:  # the updates owed end the run; the actor may play a few steps after
                stop_if_signalled()
                wait_start = time.perf_counter()
                if not limiter.await_sample(args.batch_size, actor.alive):  # closed, and updates are still owed
                    raise ChildProcessError("the actor stopped")
                wait_seconds += time.perf_counter() - wait_start
                if num_updates == args.measure_burnin:  # the steady phase starts: compilation and capture are done
                    actor.drain(run)
                    run.start_speed_measure(limiter.inserts)
                    wait_seconds = 0.0
                steps = limiter.inserts // args.num_envs
                if sampled is not rb:
                    sampled.catch_up(rb, steps)
                batch = sampled.sample(steps, args.batch_size)
                limiter.add_samples(args.batch_size)
                metrics = update_step(*batch)
                num_updates += 1
                if num_updates % target_every == 0:
                    target_params.lerp_(online_params, args.tau)
                if num_updates % args.actor_sync_every == 0:
                    actor.load_weights(online_params)
                if num_updates % LOG_EVERY == 0:
                    actor.drain(run)
                    step = limiter.inserts
                    replay_ratio_now = num_updates * args.batch_size / max(1, step - args.learning_starts)
                    run.log(step, metrics, charts=dict(epsilon=epsilon_at(step, args), replay_ratio=replay_ratio_now))
            actor.stop(run, timeout=60)  # every update is done: the actor plays its last steps (the band lets it)
    except ChildProcessError:
        actor.stop(run)
        print(f"error: the actor process died ({actor.failure()}); the learner stops", file=sys.stderr)
        sys.exit(1)
    actor.stop(run)  # after a stop: the closed limiter ends the actor at its next step
    run.end_training(limiter.inserts, metrics)

    summary = {"async_actor": True, "env_backend": args.env_backend, "num_updates": num_updates}
    summary["compiled_pieces"] = ["td_loss"] if args.compile else []
    summary.update(learner_wait_seconds=wait_seconds, replay_ratio_target=float(replay_ratio))
    summary["replay_ratio_achieved"] = num_updates * args.batch_size / max(1, limiter.inserts - args.learning_starts)
    sys.exit(run.evaluate_and_write(partial(evaluate, q_network, args, device, run.video_folder), summary))
