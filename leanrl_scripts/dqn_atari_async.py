"""DQN with an actor process playing into shared-memory replay while the learner trains, a rate limiter holding
the replay ratio; Atari or classic control (docs/dqn.md).
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

# before torch loads: idle OpenMP threads sleep, not spin on the actor's core
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

try:
    import cv2
except ModuleNotFoundError:  # for the gymnasium back-end only
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

from run_bookkeeping import Flag, Run, RunArgs, Stopped, check_spaces, fail, game_mp4, stop_if_signalled, usable_cores


@dataclass
class Args(RunArgs):
    env_id: str = "Breakout-v5"
    """an envpool Atari id (Breakout-v5) or a flat-observation gymnasium id (CartPole-v1)"""
    env_backend: Literal["envpool", "gymnasium"] = "envpool"
    """Atari: envpool, or gymnasium (ALE with this script's wrappers)"""
    total_timesteps: int = 10_000_000
    """total environment steps (0 with --load-model: evaluate only)"""
    learning_rate: Flag.Positive = 1e-4
    """the learning rate of the optimizer"""
    num_envs: Flag.Count = 1
    """the number of parallel environments"""
    buffer_size: Flag.Count = 1_000_000
    """the replay memory buffer size (transitions)"""
    gamma: Flag.Fraction = 0.99
    """the discount factor gamma"""
    tau: Flag.PositiveFraction = 1.0
    """the target network update rate (1.0: a hard copy)"""
    target_network_frequency: Flag.Count = 1000
    """environment steps between target network updates"""
    batch_size: Flag.Count = 32
    """the batch size of samples from the replay memory"""
    start_e: Flag.Fraction = 1.0
    """the starting epsilon for exploration"""
    end_e: Flag.Fraction = 0.01
    """the ending epsilon for exploration"""
    exploration_fraction: Flag.PositiveFraction = 0.10
    """the fraction of `total_timesteps` it takes from start_e to end_e"""
    learning_starts: Flag.BeforeTheEnd = 80_000
    """environment steps before learning starts"""
    train_frequency: Flag.Count = 4
    """the frequency of training (environment steps per update)"""
    actor_sync_every: Flag.Count = 10
    """updates between copies of the learner's weights to the actor"""
    replay_tolerance: Flag.Positive = 0.1
    """the replay ratio's band, a fraction of learning_starts x ratio samples"""
    measure_burnin: Flag.CountFrom0 = 50
    """updates the speed figure leaves out (compilation, graph capture)"""


LOG_EVERY = 100  # updates between metric reads (a host sync each)


class EpisodicLife(gym.Wrapper):
    """Lost lives end episodes; info keeps the raw reward and the game's end."""

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
    """Presses FIRE after a reset, for games that need it."""

    def reset(self, **kwargs):
        self.env.reset(**kwargs)
        for action in (1, 2):
            obs, _, terminated, truncated, info = self.env.step(action)
            if terminated or truncated:
                obs, info = self.env.reset(**kwargs)
        return obs, info


def make_gym_env(env_id, render=False):
    """DQN preprocessing on ALE, at envpool's v5 settings."""
    env = gym.make(
        f"ALE/{env_id}", frameskip=1, repeat_action_probability=0.0, render_mode="rgb_array" if render else None
    )
    env = EpisodicLife(gym.wrappers.AtariPreprocessing(env, noop_max=30, frame_skip=4, screen_size=84))
    if "FIRE" in env.unwrapped.get_action_meanings():
        env = FireReset(env)
    env = gym.wrappers.TransformReward(env, np.sign)
    return gym.wrappers.FrameStackObservation(env, 4, padding_type="reset")


def make_classic_env(env_id, render=False):
    """A flat-observation env, given a stack dimension of one."""
    env = gym.make(env_id, render_mode="rgb_array" if render else None)
    hint = "give Atari games by their envpool id (Breakout-v5)"
    check_spaces(env_id, env.action_space, gym.spaces.Discrete, env.observation_space, gym.spaces.Box, hint)
    return gym.wrappers.ReshapeObservation(env, (1, *env.observation_space.shape))


def make_envs(env_id, num_envs, seed=0, backend="envpool", render=False):
    """Atari or classic control envs; after an episode's end comes a reset step."""
    classic = env_id in gym.registry
    if not classic and backend == "envpool":
        try:
            import envpool
        except ModuleNotFoundError:
            fail('envpool is not installed: pip install ".[envpool]" (or run with --env-backend gymnasium)')
        if env_id not in envpool.list_all_envs():
            fail(f"unknown env id '{env_id}': an envpool Atari game (Breakout-v5) or a gymnasium id (CartPole-v1)")
        if type(envpool.make_spec(env_id)).__name__ != "AtariEnvSpec":
            fail(f"{env_id} is not an Atari game (continuous control: sac_continuous_action.py)")
        threads = min(num_envs, usable_cores())
        game = dict(episodic_life=True, reward_clip=True, render_mode="rgb_array" if render else None)
        return envpool.make(env_id, env_type="gymnasium", num_envs=num_envs, num_threads=threads, seed=seed, **game)
    if not classic:
        try:
            import ale_py
        except ModuleNotFoundError:
            ale_py = None
        if ale_py is None or cv2 is None:
            fail('the gymnasium back-end needs ale-py and OpenCV: pip install ".[atari]"')
        gym.register_envs(ale_py)
    try:
        make_env = partial(make_classic_env if classic else make_gym_env, env_id, render)
        envs = gym.vector.SyncVectorEnv([make_env] * num_envs, autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP)
    except Exception as error:
        fail(f"unknown env id '{env_id}', or it cannot be made: {error}")
    envs.reset(seed=seed)
    return envs


def game_over(infos, terminations, truncations):
    """A whole game's end: info["terminated"] on Atari, else the episode's."""
    return np.asarray(infos.get("terminated", terminations), dtype=bool) | truncations


class QNetwork(nn.Module):
    """The Nature DQN network (channels-last) or CleanRL's MLP."""

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
    """Replay in shared memory, each frame once (row t, lane e: env e's t-th step); `extra_rows` take the actor's
    writes during a sample."""

    columns = ("frames", "actions", "rewards", "terminations", "valid", "first")

    def __init__(self, buffer_size, num_envs, obs_shape, frame_dtype, extra_rows):
        self.buffer_rows = math.ceil(buffer_size / num_envs)
        self.stack = obs_shape[0]
        rows = self.buffer_rows + extra_rows + self.stack
        self.frames = torch.empty((rows, num_envs, *obs_shape[1:]), dtype=frame_dtype)
        self.actions = torch.zeros((rows, num_envs), dtype=torch.long)
        self.rewards, self.terminations = (torch.zeros((rows, num_envs)) for _ in range(2))
        self.valid, self.first = (torch.zeros((rows, num_envs), dtype=torch.bool) for _ in range(2))
        self.next_valid = np.ones(num_envs, dtype=bool)
        self.next_first = np.ones(num_envs, dtype=bool)
        self.restarting = np.zeros(num_envs, dtype=bool)
        for name in self.columns:
            getattr(self, name).share_memory_()

    def add(self, step, obs, actions, rewards, terminations, reset, restart):
        """`reset`: envs whose next step resets; `restart`: whose stack restarts."""
        row = step % len(self.frames)
        flags = (self.next_valid, self.next_first)
        self.next_valid, self.next_first, self.restarting = ~reset, self.restarting, restart
        for name, value in zip(self.columns, (obs[:, -1], actions, rewards, terminations, *flags)):
            getattr(self, name).numpy()[row] = value  # numpy's assignment is cheaper per call

    def mirror(self, device):
        """An empty copy on `device`, which catch_up fills."""
        mirror = copy.copy(self)
        for name in self.columns:
            setattr(mirror, name, torch.zeros_like(getattr(self, name), device=device))
        mirror.copied = 0
        return mirror

    def catch_up(self, source, steps):
        """Copies in `source`'s rows since the last call."""
        rows = len(self.frames)
        start = max(self.copied, steps - len(self.frames))
        while start < steps:
            row = start % rows
            block = slice(row, row + min(steps - start, rows - row))
            for name in self.columns:  # pinned: a pageable copy would wait for the GPU
                new_rows = getattr(source, name)[block]
                new_rows = new_rows.pin_memory() if self.frames.is_cuda else new_rows
                getattr(self, name)[block].copy_(new_rows, non_blocking=True)
            start += block.stop - block.start
        self.copied = steps

    def sample(self, steps, batch_size):
        """Uniform valid transitions: twice the batch drawn, the first valid kept."""
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
        rows = len(self.frames)
        chain = [(row + 1) % rows]
        for _ in range(self.stack):
            chain.append(torch.where(self.first[chain[-1], lane], chain[-1], (chain[-1] - 1) % rows))
        frames = self.frames[torch.stack(chain[::-1], 1), lane[:, None]]
        return frames[:, :-1], frames[:, 1:]


@contextmanager
def hold_lock(lock, other_alive):
    """`lock`, while the other process lives."""
    while not lock.acquire(timeout=1.0):
        if not other_alive():
            raise ChildProcessError("the other side of the replay storage stopped")
    try:
        yield
    finally:
        lock.release()


class Counts(ctypes.Structure):
    _fields_ = [("inserts", ctypes.c_int64), ("samples", ctypes.c_int64), ("closed", ctypes.c_bool)]


class RateLimiter:
    """Reverb's SampleToInsertRatio in shared memory: inserts x spi - samples stays within min_size x spi +-
    error_buffer."""

    def __init__(self, samples_per_insert, min_size, error_buffer, ctx):
        ratio = Fraction(samples_per_insert)
        self.p = ratio.numerator
        self.q = ratio.denominator
        self.min_size = min_size
        self.min_scaled = min_size * self.p - error_buffer * self.q
        self.max_scaled = min_size * self.p + error_buffer * self.q
        self.counts = ctx.RawValue(Counts)
        self.insert_posted = ctx.Semaphore(0)
        self.sample_posted = ctx.Semaphore(0)

    inserts = property(lambda self: self.counts.inserts)
    samples = property(lambda self: self.counts.samples)

    def await_insert(self, n, other_alive=lambda: True):
        return self._wait(
            lambda: not self.counts.closed and (self.inserts + n) * self.p - self.samples * self.q <= self.max_scaled,
            self.sample_posted,
            other_alive,
        )

    def await_sample(self, n, other_alive=lambda: True, safe_point=stop_if_signalled):
        return self._wait(
            lambda: (
                self.inserts >= self.min_size and self.inserts * self.p - (self.samples + n) * self.q >= self.min_scaled
            ),
            self.insert_posted,
            other_alive,
            safe_point,
        )

    def _wait(self, ready, posted, other_alive, safe_point=stop_if_signalled):
        """True once `ready()`, False if closed first."""
        while not ready():
            if self.counts.closed:
                return False
            if not posted.acquire(timeout=1.0) and not other_alive():
                raise ChildProcessError("the other side of the replay storage stopped")
            safe_point()
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
    return q_network(obs).argmax(-1)


def td_loss(obs, actions, rewards, next_obs, terminations, *, q_network, target_network, gamma):
    with torch.no_grad():
        target_max = target_network(next_obs).max(-1).values
        td_target = rewards + gamma * target_max * (1 - terminations)
    old_val = q_network(obs).gather(1, actions[:, None]).squeeze(1)
    loss = F.mse_loss(td_target, old_val)
    return loss, {"td_loss": loss.detach(), "q_values": old_val.mean().detach()}


def update(*batch, loss_fn, q_network, target_network, optimizer, gamma):
    """One TD step (backward and Adam outside `loss_fn`)."""
    loss, metrics = loss_fn(*batch, q_network=q_network, target_network=target_network, gamma=gamma)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return metrics


def epsilon_at(step, args):
    """CleanRL's linear_schedule."""
    slope = (args.end_e - args.start_e) / (args.exploration_fraction * args.total_timesteps)
    return max(slope * step + args.start_e, args.end_e)


def epsilon_greedy(policy_step, obs, epsilon, rng, num_actions, device):
    """The network runs only when some env exploits."""
    exploit = rng.random(len(obs)) >= epsilon
    if not exploit.any():
        return rng.integers(num_actions, size=len(obs))
    greedy = policy_step(torch.from_numpy(obs).to(device, non_blocking=True)).cpu().numpy()
    return greedy if exploit.all() else np.where(exploit, greedy, rng.integers(num_actions, size=len(obs)))


class DeviceCopy:
    """The actor's GPU network, refreshed from the `shared` CPU copy."""

    def __init__(self, shared, version, device):
        self.network = copy.deepcopy(shared).to(device)
        self.version = version
        self.seen = version.value
        self.params, self.shared_params = from_module(self.network), from_module(shared)

    def refresh(self):
        if self.version.value != self.seen:
            self.seen = self.version.value
            self.params.update_(self.shared_params)


def run_actor(args, rb, limiter, q_network, version, weights_lock, reports, device):
    """The actor process: epsilon-greedy steps as the limiter allows."""
    if sys.platform == "linux":  # PR_SET_PDEATHSIG: dies with its learner
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)
    parent_alive = mp.parent_process().is_alive
    try:
        torch.set_num_threads(1)
        envs = make_envs(args.env_id, args.num_envs, args.seed, args.env_backend)
        # eager: on one thread compiled was no faster, and would hold the learner up
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
        for step in range(limiter.inserts // args.num_envs, args.total_timesteps // args.num_envs):
            if not limiter.await_insert(args.num_envs, parent_alive):
                break
            with hold_lock(weights_lock, parent_alive):
                if device_copy:
                    device_copy.refresh()
                epsilon = epsilon_at(step * args.num_envs, args)
                actions = epsilon_greedy(policy_step, obs, epsilon, rng, num_actions, acting_device)
            env_start = time.perf_counter()
            next_obs, rewards, terminations, truncations, infos = envs.step(actions.astype(np.int32))
            env_seconds += time.perf_counter() - env_start
            ended = game_over(infos, terminations, truncations)
            reset = terminations | truncations
            restart = ended if args.env_backend == "envpool" else reset  # envpool keeps its stack past a lost life
            rb.add(step, obs, actions, rewards, terminations, reset, restart)
            limiter.add_inserts(args.num_envs)
            scores, lengths = scores + infos.get("reward", rewards), lengths + 1  # info["reward"] is unclipped
            if ended.any():
                games = [((step + 1) * args.num_envs, *game) for game in zip(scores[ended], lengths[ended])]
                reports.put(("games", games, env_seconds))
                env_seconds = 0.0
                scores[ended] = 0
                lengths[ended] = 0
            obs = next_obs
        reports.put(("games", [], env_seconds))
    except BaseException:
        reports.put(("error", traceback.format_exc()))
        sys.exit(1)
    finally:
        limiter.close()


class ActorProcess:
    """The actor, spawned (fork would copy the learner's threads and locks)."""

    def __init__(self, ctx, args, rb, limiter, q_network, device):
        self.limiter = limiter
        self.reports = ctx.Queue()
        self.error = None
        self.q_network = copy.deepcopy(q_network).cpu().requires_grad_(False).share_memory()
        self.params, self.weights_lock = from_module(self.q_network), ctx.Lock()
        self.version = ctx.Value("Q", 0, lock=False)
        self.process = ctx.Process(
            target=run_actor,
            daemon=True,
            args=(args, rb, limiter, self.q_network, self.version, self.weights_lock, self.reports, device),
        )
        # the actor ignores Ctrl-C; the learner stops it
        sigint = signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.process.start()
        signal.signal(signal.SIGINT, sigint)

    def alive(self):
        return self.process.exitcode in (None, 0)

    def load_weights(self, params):
        if not self.alive():
            raise ChildProcessError("the actor stopped")
        with hold_lock(self.weights_lock, self.alive):
            self.params.update_(params)
            self.version.value += 1

    def drain(self, run):
        while not self.reports.empty():
            kind, *content = self.reports.get()
            if kind == "error":
                self.error = content[0]
                continue
            games, env_seconds = content
            for step, score, length in games:
                run.record_episode(step, score, length)
            run.clock.add_env_seconds(env_seconds)

    def stop(self, run, timeout=5):
        """Ends the actor, draining its queue (unread data blocks an exit)."""
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
        code = self.process.exitcode
        if self.error:
            return self.error.strip().splitlines()[-1]
        return f"killed by {signal.Signals(-code).name}" if code and code < 0 else f"exit code {code}"


def first_screen(envs):
    return envs.envs[0].render() if isinstance(envs, gym.vector.SyncVectorEnv) else envs.render()[0]


@torch.no_grad()
def evaluate(q_network, args, device, video_folder=None):
    """Scores of whole games, at epsilon 0.05 on Atari (a greedy agent can stall)."""
    envs = make_envs(
        args.env_id, args.eval_episodes, args.seed + 10_000, args.env_backend, render=video_folder is not None
    )
    obs, _ = envs.reset()
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
    args.env_id = args.env_id.replace("NoFrameskip-v4", "-v5")  # CleanRL's Atari ids
    run = Run(args)
    if args.buffer_size < args.batch_size:
        fail(f"--buffer-size {args.buffer_size} must hold at least one batch (--batch-size {args.batch_size})")
    if args.learning_starts < args.batch_size:
        fail(f"--learning-starts {args.learning_starts} must be at least --batch-size {args.batch_size}")
    device = run.device

    envs = make_envs(args.env_id, 1, args.seed, args.env_backend)  # for its spaces
    obs_space = getattr(envs, "single_observation_space", envs.observation_space)
    num_actions = int(getattr(envs, "single_action_space", envs.action_space).n)
    envs.close()
    q_network = QNetwork(obs_space.shape, num_actions).to(device)
    run.tune_cpu(threads=usable_cores() - 1 if q_network.pixels else 1)
    frame_dtype = torch.uint8 if q_network.pixels else torch.float32
    frame_bytes = math.prod(obs_space.shape[1:]) * frame_dtype.itemsize
    for storage_device in {torch.device("cpu"), device}:
        run.check_fits(args.buffer_size * (frame_bytes + 18), "--buffer-size", storage_device)
    target_network = QNetwork(obs_space.shape, num_actions).to(device).requires_grad_(False)
    learning_rate = torch.tensor(args.learning_rate, device=device)
    optimizer = torch.optim.Adam(q_network.parameters(), lr=learning_rate, fused=True, capturable=run.cudagraphs)
    run.save_and_load(
        {"q_network": q_network, "optimizer": optimizer}, obs_shape=[*obs_space.shape], num_actions=num_actions
    )
    target_network.load_state_dict(q_network.state_dict())
    target_params = from_module(target_network)
    online_params = from_module(q_network).data

    loss_fn = torch.compile(td_loss) if args.compile else td_loss
    update_step = partial(
        update,
        loss_fn=loss_fn,
        optimizer=optimizer,
        q_network=q_network,
        target_network=target_network,
        gamma=args.gamma,
    )
    if run.cudagraphs:
        update_step = CudaGraphModule(update_step, warmup=5)

    ctx = mp.get_context("spawn")
    # a band too narrow for one actor step and one batch would deadlock
    replay_ratio = Fraction(args.batch_size, args.train_frequency)
    tolerance = args.replay_tolerance * args.learning_starts * replay_ratio
    error_buffer = float(max(tolerance, args.num_envs * replay_ratio + args.batch_size))
    limiter = RateLimiter(replay_ratio, args.learning_starts, error_buffer, ctx)
    # the actor's most rows during a sample
    extra_rows = math.ceil(2 * error_buffer / replay_ratio / args.num_envs) + 1
    rb = FrameReplay(args.buffer_size, args.num_envs, obs_space.shape, frame_dtype, extra_rows)
    played = args.total_timesteps // args.num_envs * args.num_envs
    total_updates = max(0, played - args.learning_starts) // args.train_frequency
    target_every = max(1, args.target_network_frequency // args.train_frequency)
    num_updates = 0
    metrics = {}
    wait_seconds = 0.0
    # --resume: the learner restored; the actor restarts at its step, in new episodes
    if resumed := run.resumable(target_network=target_network, rb=rb):
        num_updates, wait_seconds = resumed["num_updates"], resumed["wait_seconds"]
        limiter.add_inserts(resumed["inserts"])
        limiter.add_samples(num_updates * args.batch_size)
        rb.valid[(limiter.inserts // args.num_envs - 1) % len(rb.frames)] = False  # a new episode follows

    # between updates and in waits: a snapshot past the games drained (the actor writes past it), then a stop
    def safe_point():
        actor.drain(run)
        run.checkpoint_if_due(
            limiter.inserts, inserts=limiter.inserts, num_updates=num_updates, wait_seconds=wait_seconds
        )
        stop_if_signalled()

    run.start()
    actor = ActorProcess(ctx, args, rb, limiter, q_network, device)
    sampled = rb.mirror(device) if device.type == "cuda" else rb
    with run.stoppable():
        try:
            while num_updates < total_updates:
                safe_point()
                wait_start = time.perf_counter()
                if not limiter.await_sample(args.batch_size, actor.alive, safe_point):
                    raise ChildProcessError("the actor stopped")
                wait_seconds += time.perf_counter() - wait_start
                if num_updates == args.measure_burnin:
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
                    step = limiter.inserts
                    replay_ratio_now = num_updates * args.batch_size / max(1, step - args.learning_starts)
                    run.log(step, metrics, charts=dict(epsilon=epsilon_at(step, args), replay_ratio=replay_ratio_now))
            actor.stop(run, timeout=60)
        except ChildProcessError:
            raise Stopped(f"the actor process died ({actor.failure()}); the learner stops", 1) from None
    actor.stop(run)
    run.end_training(limiter.inserts, metrics)

    summary = {"async_actor": True, "env_backend": args.env_backend, "num_updates": num_updates}
    summary["compiled_pieces"] = ["td_loss"] if args.compile else []
    summary.update(learner_wait_seconds=wait_seconds, replay_ratio_target=float(replay_ratio))
    summary["replay_ratio_achieved"] = num_updates * args.batch_size / max(1, limiter.inserts - args.learning_starts)
    sys.exit(run.write_and_evaluate(partial(evaluate, q_network, args, device, run.video_folder), summary))
