"""Deep Q-Network (DQN, Mnih et al. 2015) on Atari, with envpool or with ALE through gymnasium, one file.

Memory: each frame is stored once and the 4-frame stacks are rebuilt at sample time (7 GB instead of 28 GB for 1e6
steps; the cost is five gathers per batch), in preallocated device tensors. Speed: the acting network reads the
learner's weights through a detached view, the exploration coins are drawn on the host, and the action step and the
update take torch.compile and CUDA graphs. dqn_atari_async.py acts in a second process, behind a rate limiter.
    python leanrl_scripts/dqn_atari.py --env-id Breakout-v5 --compile
"""

import ctypes
import io
import json
import math
import os
import random
import resource
import signal
import sys
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from typing import Literal

# Idle OpenMP threads sleep instead of spinning: a spinning pool takes the cores that the envs (or other programs)
# need. Set before torch loads OpenMP; it costs a wake-up (tens of microseconds) per parallel kernel.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

try:
    import cv2
except ModuleNotFoundError:  # only the gymnasium back-end needs it; --help works without it
    cv2 = None
import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro
from tensordict import from_module
from tensordict.nn import CudaGraphModule
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm


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
    track: bool = False
    """log the run to Weights & Biases (pip install ".[wandb]"; WANDB_MODE=offline keeps it on this machine)"""
    wandb_project_name: str = "leanrl-scripts"
    """the W&B project of --track"""
    wandb_entity: str | None = None
    """the W&B team or user of --track (None: your own)"""
    env_id: str = "Breakout-v5"
    """the Atari game, as envpool names it (Breakout-v5, Pong-v5, ...) for both back-ends"""
    env_backend: Literal["envpool", "gymnasium"] = "envpool"
    """envpool (its own Atari preprocessing) or gymnasium (ALE with this script's wrappers)"""
    total_timesteps: int = 10_000_000
    """total environment steps, all envs together (0 only with --load-model: evaluate it)"""
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
    """environment steps (all envs together) per update: batch_size / train_frequency samples per transition"""
    torch_threads: int = 0
    """torch's CPU threads (0: one on CUDA, else the cores this process may use; OMP_NUM_THREADS also sets it)"""
    compile: bool = False
    """wrap the action step and the update in torch.compile (on a CPU the update only: see the summary)"""
    cudagraphs: bool = False
    """wrap the action step and the update in CUDA graphs (tensordict's CudaGraphModule)"""
    measure_burnin: int = 50
    """updates after learning starts that the speed figure leaves out (compilation, graph capture)"""
    eval_episodes: int = 10
    """evaluation games at the end of the run (whole games, true score, epsilon 0.05)"""
    capture_video: bool = False
    """record the first evaluation game to runs/<run_name>/videos (needs .[video])"""
    save_model: bool = False
    """save a checkpoint to runs/<run_name>/model.pt at the end"""
    load_model: str = ""
    """a checkpoint to start from (evaluate it with --total-timesteps 0, or continue training)"""


LOG_EVERY = 100  # updates between metric reads: each read is one host sync


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


class WarpFrame(gym.ObservationWrapper):
    """RGB to 84x84 greyscale with OpenCV (area interpolation)."""

    def __init__(self, env):
        super().__init__(env)
        self.observation_space = gym.spaces.Box(0, 255, (84, 84), np.uint8)

    def observation(self, obs):
        return cv2.resize(cv2.cvtColor(obs, cv2.COLOR_RGB2GRAY), (84, 84), interpolation=cv2.INTER_AREA)


def make_gym_env(env_id, render=False):
    """The classic DQN stack on ALE, with envpool's v5 settings: no sticky actions, 108k-frame time limit."""
    env = gym.make(
        f"ALE/{env_id}",
        frameskip=1,
        repeat_action_probability=0.0,
        max_num_frames_per_episode=108_000,
        render_mode="rgb_array" if render else None,
    )
    env = EpisodicLife(MaxAndSkip(NoopReset(env)))
    if "FIRE" in env.unwrapped.get_action_meanings():
        env = FireReset(env)
    env = gym.wrappers.TransformReward(env, np.sign)  # one learning rate fits every game's score scale
    return gym.wrappers.FrameStackObservation(WarpFrame(env), 4, padding_type="reset")  # a reset fills all 4


def make_envs(env_id, num_envs, seed=0, backend="envpool", render=False):
    """Training envs of either back-end: 4 stacked 84x84 frames, rewards clipped, a lost life ends an episode;
    info["reward"] is the unclipped reward and info["terminated"] the end of the game. After the step that ends an
    episode, the next step resets that env and is not a transition: with envpool after a lost life too (its action
    ignored, no-ops and FIRE played, the frame stack kept), where CleanRL's wrappers reset within the step."""
    if backend == "envpool":
        try:
            import envpool  # imported here: the gymnasium back-end runs without it
        except ModuleNotFoundError:
            fail('envpool is not installed: pip install ".[envpool]" (or run with --env-backend gymnasium)')
        if env_id not in envpool.list_all_envs():
            fail(f"unknown env id '{env_id}': ids come from envpool.list_all_envs(), Atari games look like Breakout-v5")
        if type(envpool.make_spec(env_id)).__name__ != "AtariEnvSpec":
            fail(f"{env_id} is not an Atari game (continuous control: sac_continuous_action.py, classic: dqn.py)")
        # one worker per env up to the usable cores: envpool's default counts the host's cores, quota or not
        return envpool.make(
            env_id,
            env_type="gymnasium",
            num_envs=num_envs,
            num_threads=min(num_envs, usable_cores()),
            episodic_life=True,
            reward_clip=True,
            seed=seed,
            render_mode="rgb_array" if render else None,
        )
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
    except Exception as error:  # an unknown game, a missing ROM or package, an old version
        fail(f"unknown env id '{env_id}' on ALE, or it cannot be made (games look like Breakout-v5): {error}")
    envs.reset(seed=seed)
    return envs


class QNetwork(nn.Module):
    """The Nature DQN network; convolutions channels-last (mkldnn's NHWC kernels are the fast ones on CPU)."""

    def __init__(self, num_actions):
        super().__init__()
        self.network = nn.Sequential(
            nn.Conv2d(4, 32, 8, stride=4),
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

    def forward(self, obs):
        return self.network(obs.contiguous(memory_format=torch.channels_last) / 255.0)


class FrameReplay:
    """Replay storage with each frame once. Row t of env lane e holds the newest frame of that env's t-th observation,
    the action, clipped reward and termination of its step, and two flags: `valid` (the step is a transition, not the
    reset step after an episode's end) and `first` (the frame stack restarts here). The stacks of obs t and obs t+1 are
    the frames of rows t+1, t, t-1, ... walked back and held at the first row: exactly what the env returned, for 1/4 of
    the memory. Rows are used round-robin."""

    def __init__(self, buffer_size, num_envs, device, stack=4):
        self.buffer_rows, self.stack = math.ceil(buffer_size / num_envs), stack
        rows = self.buffer_rows + stack  # + stack: the oldest sampled row still has its frames
        # empty, not zeros: pages are touched as the rows fill, and only written rows are ever read
        self.frames = torch.empty((rows, num_envs, 84, 84), dtype=torch.uint8, device=device)
        self.actions = torch.zeros((rows, num_envs), dtype=torch.long, device=device)
        self.rewards, self.terminations = (torch.zeros((rows, num_envs), device=device) for _ in range(2))
        self.valid, self.first = (torch.zeros((rows, num_envs), dtype=torch.bool, device=device) for _ in range(2))
        self.next_valid, self.next_first = np.ones(num_envs, dtype=bool), np.ones(num_envs, dtype=bool)
        self.restarting = np.zeros(num_envs, dtype=bool)  # a restart shows one row late: after the reset step

    def add(self, step, obs, actions, rewards, terminations, reset, restart):
        """Vector step `step`; `reset`: the envs whose next step is a reset, not a transition; `restart`: those of
        them whose frame stack restarts after it (envpool keeps its stack across a lost life)."""
        row, flags = step % len(self.frames), (self.next_valid, self.next_first)
        self.next_valid, self.next_first, self.restarting = ~reset, self.restarting, restart
        columns = (self.frames, self.actions, self.rewards, self.terminations, self.valid, self.first)
        for column, value in zip(columns, (obs[:, -1], actions, rewards, terminations, *flags)):
            column[row] = torch.as_tensor(value).to(column.device, column.dtype, non_blocking=True)

    def sample(self, steps, batch_size):
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
        return obs, self.actions[row, lane], self.rewards[row, lane], next_obs, self.terminations[row, lane]

    def stacks(self, row, lane):
        """The observation stacks of rows `row` and `row + 1` in lanes `lane`: (batch, stack, 84, 84) each."""
        rows = len(self.frames)
        chain = [(row + 1) % rows]
        for _ in range(self.stack):
            chain.append(torch.where(self.first[chain[-1], lane], chain[-1], (chain[-1] - 1) % rows))
        frames = self.frames[torch.stack(chain[::-1], 1), lane[:, None]]  # (batch, stack + 1, 84, 84)
        return frames[:, :-1], frames[:, 1:]


def policy(obs, *, q_network):
    """Greedy actions; `q_network` is a detached view of the learner."""
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
    return {"td_loss": loss.detach(), "q_values": old_val.mean().detach()}


def epsilon_at(step, args):
    """The linear schedule from start_e to end_e over exploration_fraction of the run, then end_e."""
    slope = (args.end_e - args.start_e) / (args.exploration_fraction * args.total_timesteps)
    return max(slope * step + args.start_e, args.end_e)


def epsilon_greedy(policy_step, obs, epsilon, rng, num_actions, device):
    """One coin per env from a host RNG (no device sync decides anything): the network runs only when some env
    exploits (early in training most steps skip it), random actions are drawn only when some env explores."""
    exploit = rng.random(len(obs)) >= epsilon
    if not exploit.any():
        return rng.integers(num_actions, size=len(obs))
    greedy = policy_step(torch.from_numpy(obs).to(device, non_blocking=True)).cpu().numpy()
    return greedy if exploit.all() else np.where(exploit, greedy, rng.integers(num_actions, size=len(obs)))


def first_screen(envs):
    """The first env's screen: envpool renders env 0 by its id, a gymnasium vector env through its first env."""
    return envs.envs[0].render() if isinstance(envs, gym.vector.SyncVectorEnv) else envs.render()[0]


def game_video(folder, first_frame, fps=15):
    """An mp4 writer for one game's screens, one per agent step (60 Hz with frame skip 4: 15 fps). Frames go to
    ffmpeg as they come, so memory stays flat however long the game (a stalled one lasts 108k frames)."""
    from moviepy.video.io.ffmpeg_writer import FFMPEG_VideoWriter

    os.makedirs(folder, exist_ok=True)
    writer = FFMPEG_VideoWriter(os.path.join(folder, "eval-game-0.mp4"), first_frame.shape[1::-1], fps)
    writer.write_frame(first_frame)
    return writer


def evaluate(q_network, args, device, video_folder=None):
    """True score of the first whole game in each of --eval-episodes envs at epsilon 0.05, the DQN paper's protocol:
    a greedy agent can stall (in Breakout, by never firing a new ball) until the time limit. With `video_folder`,
    the first env's game is recorded there."""
    envs = make_envs(
        args.env_id, args.eval_episodes, args.seed + 10_000, args.env_backend, render=video_folder is not None
    )
    obs, _ = envs.reset()
    video = game_video(video_folder, first_screen(envs)) if video_folder else None
    rng, num_actions = np.random.default_rng(args.seed), int(getattr(envs, "single_action_space", envs.action_space).n)
    returns, finished = np.zeros(envs.num_envs), np.zeros(envs.num_envs, dtype=bool)
    while not finished.all():
        check_signals()
        actions = epsilon_greedy(partial(policy, q_network=q_network), obs, 0.05, rng, num_actions, device)
        obs, _, _, truncations, infos = envs.step(actions.astype(np.int32))
        if video and not finished[0]:
            video.write_frame(first_screen(envs))
        returns += infos["reward"] * ~finished
        finished |= infos["terminated"].astype(bool) | truncations
    if video:
        video.close()
    envs.close()
    return returns.tolist()


# ---- run bookkeeping: the same text in every script (tests/test_run_block.py); skip it to read the algorithm ----
# Bad input: one line and exit code 2 before any work. Ctrl-C, SIGTERM: a clean stop, exit code 128 + signal. A
# non-finite value: exit code 1, no model. A stopped run still writes summary.json; every file is written atomically.
LINE_EVERY = 10.0  # seconds between progress lines when stderr is not a terminal (a file, nohup, CI)
SIGNALS_RECEIVED = []


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def check_fits(num_bytes, device, flag):  # a buffer too large fails now, not hours later as its pages fill
    cuda = device.type == "cuda"
    total = torch.cuda.mem_get_info(device)[1] if cuda else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if num_bytes > total:
        fail(f"{flag} needs {num_bytes / 2**30:.1f} GiB, more than the {total / 2**30:.1f} GiB of {device.type} memory")


def cpu_quota():  # a container's CPU limit in cores (cgroup v2), None without one
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()
        return int(quota) / int(period)
    except (OSError, ValueError):  # no cgroup v2 file, or no quota ("max")
        return None


def usable_cores():  # the cores this process may run on: its CPU affinity, capped by a container's quota
    cores, quota = len(os.sched_getaffinity(0)), cpu_quota()
    return cores if quota is None else max(1, min(cores, int(quota)))


def idle_cores(seconds=0.2):
    """How many of the cores this process may use are idle now: their idle share in /proc/stat over `seconds`,
    summed, capped by a container's quota. None where the system does not say (not Linux)."""

    def jiffies():  # per core: idle (with iowait) and total
        with open("/proc/stat") as f:
            rows = [line.split() for line in f if line.startswith("cpu") and line[3].isdigit()]
        return {int(row[0][3:]): (int(row[4]) + int(row[5]), sum(map(int, row[1:9]))) for row in rows}

    try:
        cores, before = os.sched_getaffinity(0), jiffies()
        time.sleep(seconds)
        after = jiffies()
    except (OSError, AttributeError, ValueError):
        return None
    cores &= before.keys() & after.keys()
    idle, quota = sum((after[c][0] - before[c][0]) / max(1, after[c][1] - before[c][1]) for c in cores), cpu_quota()
    return idle if quota is None else min(idle, quota)


def tune_cpu(requested, device, threads, keep_freed_memory=False):
    """Sets torch's CPU threads once, before any tensor work: --torch-threads, else OMP_NUM_THREADS (torch read it),
    else one on CUDA (the host only feeds the GPU; idle pool threads would compete with the envs), else the script's
    `threads`: a count, or "idle", the cores at least 75% idle at start (a second thread buys small layers 1.2-1.5x
    on an idle machine and costs 3-4x beside busy processes: a descheduled thread stalls the others at every
    barrier; one where /proc does not say). `keep_freed_memory`: glibc's malloc maps large blocks afresh and gives
    the free top of its heap back to the OS, so each minibatch's activations and gradients (tens of MB) were faulted
    in and zeroed again: fixed thresholds keep them (1.03-1.13x the SPS on a 2-core CPU, docs/speed.md) at the cost
    of the peak memory staying with the process; other C libraries than glibc are left alone."""
    if requested or os.environ.get("OMP_NUM_THREADS"):
        threads = requested or torch.get_num_threads()
    elif device.type == "cuda":
        threads = 1
    elif threads == "idle":
        idle = idle_cores()
        threads = 1 if idle is None else int(idle + 0.25)
    torch.set_num_threads(max(1, threads))
    if keep_freed_memory:
        try:
            mallopt = ctypes.CDLL("libc.so.6").mallopt
            mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: blocks up to 32 MB (glibc's largest setting) come from the heap
            mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: the heap keeps up to 1 GB of free memory
        except (OSError, AttributeError):  # macOS, musl
            pass
    return torch.get_num_threads()


class Stopped(Exception):
    def __init__(self, message, exit_code):
        super().__init__(message)
        self.exit_code = exit_code


def check_signals():  # called by the loop at safe points; the handler only notes the signal (Run.open says why)
    if SIGNALS_RECEIVED:
        raise Stopped(f"stopped by {signal.Signals(SIGNALS_RECEIVED[0]).name}", 128 + SIGNALS_RECEIVED[0])


def write_atomic(path, data):  # a failed write (a full disk) leaves neither a partial file nor the temporary one
    try:
        with open(path + ".tmp", "wb") as f:
            f.write(data)
        os.replace(path + ".tmp", path)
    except OSError as error:
        print(f"error: could not write {path}: {error.strerror or error}", file=sys.stderr)
        sys.exit(1)
    finally:
        if os.path.exists(path + ".tmp"):
            os.remove(path + ".tmp")


class Run:
    """Run(args, counts, rates, fractions) refuses values that are not positive, not a positive number, out of [0, 1].
    open() starts the run; inside `with run.stoppable()`, in_env() times the env calls, mark_steady() starts the speed
    measure on its first call, episode() and log() record; end() stops the clock; finish() writes the files, exits."""

    def __init__(self, args, counts=(), rates=(), fractions=()):
        self.args, self.start_time = args, time.perf_counter()
        load_model = getattr(args, "load_model", None)  # None: this script loads no checkpoint
        if args.total_timesteps < 0 or (args.total_timesteps == 0 and not load_model):
            fail("--total-timesteps must be positive" + (load_model is not None) * " (0 only with --load-model)")
        rules = [
            (counts, lambda value: value > 0, "must be positive"),
            (rates, lambda value: 0 < value < math.inf, "must be a positive number"),  # also refuses nan
            (("gamma", *fractions), lambda value: 0 <= value <= 1, "must be in [0, 1]"),
            (("eval_episodes", "torch_threads"), lambda value: value >= 0, "must be 0 or more"),
        ]
        for names, valid, rule in rules:
            for name in filter(lambda name: not valid(getattr(args, name)), names):
                fail(f"--{name.replace('_', '-')} {rule}")
        if load_model and not os.path.isfile(load_model):
            fail(f"--load-model: no checkpoint at {load_model}")
        if args.track:  # an optional extra, checked before any work
            try:
                import wandb
            except ModuleNotFoundError:
                fail('--track logs to Weights & Biases, which is not installed: pip install ".[wandb]"')
            self.wandb = wandb
        if args.capture_video:  # the videos are made at the end: a missing package must show before the training
            if args.eval_episodes == 0:
                fail("--capture-video records the evaluation: it needs --eval-episodes 1 or more")
            try:
                import moviepy  # noqa: F401  (gymnasium's RecordVideo and the scripts' frame writers use it)
            except ModuleNotFoundError:
                fail('--capture-video writes mp4 files with moviepy, which is not installed: pip install ".[video]"')
            os.environ.setdefault("SDL_VIDEODRIVER", "dummy")  # pygame draws off-screen: no display needed
        self.device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
        self.cudagraphs = args.cudagraphs and self.device.type == "cuda"  # without CUDA the same code runs eagerly
        self.mode = "+".join(flag for flag in ("compile", "cudagraphs") if getattr(args, flag)) or "eager"
        env_name = args.env_id.replace("/", "-")  # dm_control/cartpole-balance-v0: one folder, not two
        name = os.path.join("runs", f"{env_name}__{args.exp_name}__{args.seed}__{self.mode}__{int(time.time())}")
        # a run started in the same second with the same settings gets a folder of its own: name-2, name-3, ...
        self.dir = next(path for path in (name, *(f"{name}-{n}" for n in range(2, 1000))) if not os.path.exists(path))
        self.video_folder = os.path.join(self.dir, "videos") if args.capture_video else None
        self.recent_returns, self.env_seconds, self.stopped, self.steady_time = deque(maxlen=20), 0.0, None, None

    def load_checkpoint(self, states, **sizes):  # into `states` (modules, optimizers) if made for the same `sizes`
        try:
            checkpoint = torch.load(self.args.load_model, map_location=self.device, weights_only=True)
            made_for = {key: checkpoint[key] for key in sizes}
            for name, state in states.items() if made_for == sizes else ():
                state.load_state_dict(checkpoint[name])
        except Exception as error:  # empty, truncated, not a torch file, another script's checkpoint
            fail(f"--load-model: {self.args.load_model} is not a checkpoint of this script ({type(error).__name__})")
        if made_for != sizes:
            describe = lambda sizes: ", ".join(f"{name} {size}" for name, size in sizes.items())  # noqa: E731
            fail(
                f"--load-model: {self.args.load_model} was trained on {checkpoint['env_id']} ({describe(made_for)}); "
                f"{self.args.env_id} has {describe(sizes)}"
            )
        return checkpoint

    def start_wandb(self):  # before the SummaryWriter: sync_tensorboard follows the writers made after it. W&B's
        # files go to ./wandb: inside the run folder it would also follow its own copies of the TensorBoard file
        try:
            self.wandb.init(
                project=self.args.wandb_project_name,
                entity=self.args.wandb_entity,
                save_code=True,
                name=os.path.basename(self.dir),
                config=asdict(self.args),
                sync_tensorboard=True,
            )
        except Exception as error:  # no API key, no network
            reason = (str(error).strip() or type(error).__name__).splitlines()[0]
            fail(f"--track: W&B did not start ({reason}); WANDB_MODE=offline needs no account and no network")

    def open(self):
        if self.args.track:
            self.start_wandb()
        try:
            os.makedirs(self.dir)  # not exist_ok: a run started at the same moment elsewhere keeps its folder
            self.writer = SummaryWriter(self.dir)
        except OSError as error:  # `runs` is a file, no permission, a read-only disk
            fail(f"cannot make the run folder {self.dir}: {error.strerror or error}")
        table = "".join(f"\n|{name}|{value}|" for name, value in asdict(self.args).items())
        self.writer.add_text("hyperparameters", "|param|value|\n|-|-|" + table)
        if self.args.cudagraphs and not self.cudagraphs:
            print("warning: --cudagraphs needs CUDA; running the same code eagerly", file=sys.stderr)
        # The handler only notes the signal: raising in it could interrupt a library mid-way (TensorBoard's writer
        # queue, left with a lock taken, then hangs the exit). A SIGINT the shell ignores (a background job) stays so.
        for signum in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(signum) is not signal.SIG_IGN:
                signal.signal(signum, lambda signum, frame: SIGNALS_RECEIVED.append(signum))
        self.bar = tqdm(total=self.args.total_timesteps, mininterval=1, disable=not sys.stderr.isatty())
        self.next_line = time.perf_counter()

    def in_env(self, env_call, *args):
        start = time.perf_counter()
        result = env_call(*args)
        self.env_seconds += time.perf_counter() - start
        return result

    def mark_steady(self, step):
        if self.steady_time is None:
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            self.steady_time, self.steady_step, self.env_seconds = time.perf_counter(), step, 0.0

    def episode(self, step, episode_return, length=None):
        self.recent_returns.append(float(episode_return))
        self.writer.add_scalar("charts/episodic_return", episode_return, step)
        if length is not None:
            self.writer.add_scalar("charts/episodic_length", length, step)

    def log(self, step, metrics, **charts):  # metrics: scalar device tensors, read in one sync; charts: host numbers
        values = dict(zip(metrics, torch.stack(list(metrics.values())).tolist())) if metrics else {}
        for name, value in values.items():
            if not math.isfinite(value):
                raise Stopped(f"step {step}: {name} is {value}, training diverged (a lower learning rate may help)", 1)
        for kind, scalars in (("losses", values), ("charts", charts)):
            for name, value in scalars.items():
                self.writer.add_scalar(f"{kind}/{name}", value, step)
        self.bar.update(step - self.bar.n)
        if self.steady_time is not None and step > self.steady_step:
            sps = (step - self.steady_step) / (time.perf_counter() - self.steady_time)
            self.writer.add_scalar("charts/SPS", sps, step)
            recent = f"{np.mean(self.recent_returns):.1f}" if self.recent_returns else "none yet"
            self.bar.set_postfix(sps=f"{sps:.0f}", ret=recent, refresh=False)
            if self.bar.disable and time.perf_counter() >= self.next_line:
                print(
                    f"step {step}/{self.args.total_timesteps}: {sps:.0f} SPS, return {recent}",
                    file=sys.stderr,
                    flush=True,
                )
                self.next_line = time.perf_counter() + LINE_EVERY

    @contextmanager
    def stoppable(self):  # the `with` block ends at the first Stopped, which the run keeps as its reason
        try:
            yield
        except Stopped as stop:
            self.stopped = self.stopped or stop

    def end(self, step, metrics):
        self.final_metrics = {name: value.item() for name, value in metrics.items()}
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.mark_steady(step)  # a run that ends before its steady phase has none
        self.steps_done, self.steady_steps = step, step - self.steady_step
        self.steady_seconds = time.perf_counter() - self.steady_time
        with self.stoppable():
            self.log(step, metrics)  # the last values also go through the divergence check
        self.bar.close()

    def finish(self, evaluate, summary, checkpoint):
        """Unless stopped, `evaluate()` (a list of returns); then summary.json with the `summary` keys added, model.pt
        from `checkpoint` with --save-model (a diverged model is not kept), the last two lines, and the exit code."""
        args, eval_returns = self.args, []
        if args.eval_episodes > 0 and not self.stopped:
            with self.stoppable():
                eval_returns = evaluate()
                self.writer.add_scalar("eval/episodic_return", np.mean(eval_returns), self.steps_done)
        for signum in (signal.SIGINT, signal.SIGTERM):  # what remains writes two files in about a second
            signal.signal(signum, signal.SIG_IGN)
        record = {
            "script": os.path.basename(__file__),
            **{key: getattr(args, key, None) for key in ("env_id", "seed", "num_envs", "total_timesteps", "compile")},
            "mode": self.mode,
            "cudagraphs_requested": args.cudagraphs,
            "cudagraphs_active": self.cudagraphs,
            "device": str(self.device),
            "torch_version": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "sps": self.steady_steps / self.steady_seconds if self.steady_steps > 0 else None,
            "steady_steps": self.steady_steps,
            "steady_seconds": self.steady_seconds,
            "warmup_seconds": self.steady_time - self.start_time,
            "total_seconds": time.perf_counter() - self.start_time,
            "env_seconds": self.env_seconds,
            "return_mean": float(np.mean(self.recent_returns)) if self.recent_returns else None,
            "eval_return_mean": float(np.mean(eval_returns)) if eval_returns else None,
            "eval_returns": eval_returns,
            "peak_memory_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "final_metrics": self.final_metrics,
            "steps_done": self.steps_done,
            "stopped": str(self.stopped) if self.stopped else None,
            **summary,
        }
        if self.device.type == "cuda":
            record["peak_cuda_memory_mb"] = torch.cuda.max_memory_allocated() / 2**20
        record = json.loads(json.dumps(record), parse_constant=lambda constant: None)  # strict JSON: NaN -> null
        self.writer.close()
        if args.track:  # the evaluation videos (--capture-video), then W&B ends the run (a stopped one as failed)
            videos = self.video_folder
            found = os.listdir(videos) if videos and os.path.isdir(videos) else []
            for name in sorted(name for name in found if name.endswith(".mp4")):
                self.wandb.log({"videos/eval": self.wandb.Video(os.path.join(videos, name))})
            self.wandb.finish(exit_code=self.stopped.exit_code if self.stopped else 0)
        write_atomic(os.path.join(self.dir, "summary.json"), json.dumps(record, indent=1).encode())
        diverged = self.stopped is not None and self.stopped.exit_code == 1
        if args.save_model and not diverged:  # the model as it stood, also after Ctrl-C or SIGTERM
            buffer = io.BytesIO()  # torch.save's own file errors are opaque (RuntimeError: unexpected pos ...)
            torch.save({"env_id": args.env_id, "args": asdict(args), **checkpoint}, buffer)
            write_atomic(os.path.join(self.dir, "model.pt"), buffer.getvalue())
        evaluation = f"eval return {record['eval_return_mean']:.1f}" if eval_returns else "no evaluation"
        print(f"{self.steps_done} steps, {record['sps'] or 0:.0f} SPS, {evaluation}; written to {self.dir}")
        print("SPEED " + json.dumps(record))
        if self.stopped:
            print(
                f"error: {self.stopped}" if diverged else f"{self.stopped}: the steps done are in {self.dir}",
                file=sys.stderr,
            )
            sys.exit(self.stopped.exit_code)


# ---- end of the run bookkeeping ----


if __name__ == "__main__":
    args = tyro.cli(Args)
    args.env_id = args.env_id.replace("NoFrameskip-v4", "-v5")  # CleanRL's Atari ids: the same game and settings
    run = Run(
        args,
        counts=("num_envs", "batch_size", "buffer_size", "train_frequency", "target_network_frequency"),
        rates=("learning_rate", "tau", "exploration_fraction"),
        fractions=("tau", "exploration_fraction"),
    )
    if args.buffer_size < args.batch_size:
        fail(f"--buffer-size {args.buffer_size} must hold at least one batch (--batch-size {args.batch_size})")
    if args.learning_starts < args.batch_size:
        fail(f"--learning-starts {args.learning_starts} must be at least --batch-size {args.batch_size}")
    device = run.device
    # every usable core: the envs and the network take turns, and the idle OpenMP pool sleeps (see the top)
    tune_cpu(args.torch_threads, device, threads=usable_cores())

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    envs = make_envs(args.env_id, args.num_envs, args.seed, args.env_backend)
    num_actions = int(getattr(envs, "single_action_space", envs.action_space).n)
    check_fits(args.buffer_size * (84 * 84 + 18), device, "--buffer-size")  # a frame, action, reward, done, 2 flags
    q_network = QNetwork(num_actions).to(device)
    target_network = QNetwork(num_actions).to(device).requires_grad_(False)
    q_view = QNetwork(num_actions).to("meta")  # acts with the learner's weights, shared and without grad
    from_module(q_network).data.to_module(q_view)
    q_view.requires_grad_(False)
    # Tensor learning rate and capturable state let CUDA graphs replay the optimizer step.
    optimizer = torch.optim.Adam(
        q_network.parameters(),
        lr=torch.tensor(args.learning_rate, device=device),
        fused=True,
        capturable=run.cudagraphs,
    )
    if args.load_model:
        run.load_checkpoint({"q_network": q_network, "optimizer": optimizer}, num_actions=num_actions)
    target_network.load_state_dict(q_network.state_dict())
    target_params, online_params = from_module(target_network), from_module(q_network).data

    policy_step = partial(policy, q_network=q_view)
    update_step = partial(
        update, q_network=q_network, target_network=target_network, optimizer=optimizer, gamma=args.gamma
    )
    # On a CPU --compile compiles the update alone: inductor ran it in 0.94x the eager time there, and the
    # batch-of-one action step in 1.05x (docs/speed.md).
    compiled = [name for name in ("policy", "update") if args.compile and (device.type != "cpu" or name == "update")]
    if "policy" in compiled:
        policy_step = torch.compile(policy_step)
    if "update" in compiled:
        update_step = torch.compile(update_step)
    if run.cudagraphs:  # the first calls compile and initialise Adam's state, then the graphs are captured
        policy_step, update_step = CudaGraphModule(policy_step, warmup=5), CudaGraphModule(update_step, warmup=5)

    rb = FrameReplay(args.buffer_size, args.num_envs, device)
    rng = np.random.default_rng(args.seed)  # exploration: coins and random actions are drawn on the host
    target_every = max(1, args.target_network_frequency // args.train_frequency)  # in updates
    scores, num_updates, metrics, global_step = np.zeros(args.num_envs), 0, {}, 0
    obs, _ = envs.reset()
    run.open()
    with run.stoppable():
        for iteration in range(args.total_timesteps // args.num_envs):
            check_signals()
            global_step = iteration * args.num_envs
            actions = epsilon_greedy(policy_step, obs, epsilon_at(global_step, args), rng, num_actions, device)
            next_obs, rewards, terminations, truncations, infos = run.in_env(envs.step, actions.astype(np.int32))
            game_over = infos["terminated"].astype(bool) | truncations
            reset = terminations | truncations  # see make_envs: the next step resets, after a lost life too
            restart = game_over if args.env_backend == "envpool" else reset  # envpool keeps its stack past a lost life
            rb.add(iteration, obs, actions, rewards, terminations, reset, restart)
            obs, global_step = next_obs, global_step + args.num_envs
            scores += infos["reward"]  # the true score: info["reward"] is unclipped
            for score in scores[game_over]:
                run.episode(global_step, score)
            scores[game_over] = 0

            # the updates these steps owe: one per train_frequency steps after learning_starts, as in CleanRL
            while num_updates < (global_step - args.learning_starts) // args.train_frequency:
                if num_updates == args.measure_burnin:
                    run.mark_steady(global_step)
                metrics = update_step(*rb.sample(iteration + 1, args.batch_size))
                num_updates += 1
                if num_updates % target_every == 0:
                    target_params.lerp_(online_params, args.tau)
                if num_updates % LOG_EVERY == 0:
                    replay_ratio = num_updates * args.batch_size / (global_step - args.learning_starts)
                    run.log(global_step, metrics, epsilon=epsilon_at(global_step, args), replay_ratio=replay_ratio)
    run.end(global_step, metrics)
    envs.close()

    summary = {
        "env_backend": args.env_backend,
        "num_updates": num_updates,
        "compiled_pieces": compiled,
        "left_eager": sorted({"policy", "update"} - set(compiled)) if args.compile else [],
        "replay_ratio_target": args.batch_size / args.train_frequency,
        "replay_ratio_achieved": num_updates * args.batch_size / max(1, global_step - args.learning_starts),
    }
    checkpoint = {"num_actions": num_actions, "q_network": q_network.state_dict(), "optimizer": optimizer.state_dict()}
    run.finish(partial(evaluate, q_view, args, device, run.video_folder), summary, checkpoint)
