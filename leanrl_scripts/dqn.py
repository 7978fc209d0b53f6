"""Deep Q-Network (DQN, Mnih et al. 2015) for discrete-action classic control, one file.

Speed: the replay memory is one preallocated device tensor (a step is one host-to-device copy, a batch one
gather), the acting network reads the learner's weights through a detached view (no copies), the exploration coins
are drawn on the host (the network runs only when some env exploits), and the action step and the update take
torch.compile and CUDA graphs. dqn_atari_async.py (which also takes classic control) plays in a second process,
behind a rate limiter.
    python leanrl_scripts/dqn.py --env-id CartPole-v1 --compile
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
    env_id: str = "CartPole-v1"
    """the id of the gymnasium environment (discrete actions, flat observations)"""
    total_timesteps: int = 500_000
    """total environment steps, all envs together (0 only with --load-model: evaluate it)"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer"""
    num_envs: int = 1
    """the number of parallel environments"""
    buffer_size: int = 10_000
    """the replay memory buffer size (transitions)"""
    gamma: float = 0.99
    """the discount factor gamma"""
    tau: float = 1.0
    """the target network update rate (1.0: a hard copy)"""
    target_network_frequency: int = 500
    """environment steps between target network updates"""
    batch_size: int = 128
    """the batch size of samples from the replay memory"""
    start_e: float = 1.0
    """the starting epsilon for exploration"""
    end_e: float = 0.05
    """the ending epsilon for exploration"""
    exploration_fraction: float = 0.5
    """the fraction of `total_timesteps` it takes from start_e to end_e"""
    learning_starts: int = 10_000
    """environment steps before learning starts"""
    train_frequency: int = 10
    """environment steps (all envs together) per update: batch_size / train_frequency samples per transition"""
    torch_threads: int = 0
    """torch's CPU threads (0: one, see the comment where it is set; OMP_NUM_THREADS also sets it)"""
    compile: bool = False
    """wrap the action step and the update in torch.compile (on a CUDA device: on a CPU both ran slower compiled)"""
    cudagraphs: bool = False
    """wrap the action step and the update in CUDA graphs (tensordict's CudaGraphModule)"""
    measure_burnin: int = 50
    """updates after learning starts that the speed figure leaves out (compilation, graph capture)"""
    eval_episodes: int = 10
    """greedy evaluation episodes at the end of the run"""
    capture_video: bool = False
    """record the first evaluation episode to runs/<run_name>/videos (needs .[video])"""
    save_model: bool = False
    """save a checkpoint to runs/<run_name>/model.pt at the end"""
    load_model: str = ""
    """a checkpoint to start from (evaluate it with --total-timesteps 0, or continue training)"""


LOG_EVERY = 100  # updates between metric reads: each read is one host sync


def make_envs(env_id, num_envs, seed=0, video_folder=None):
    """Vector env whose step returns the reset observation and the true final one (info["final_obs"]); with
    `video_folder`, the first env's first episode is recorded there."""

    def make_env(record):
        if not record:
            return gym.make(env_id)
        env = gym.make(env_id, render_mode="rgb_array")
        return gym.wrappers.RecordVideo(env, video_folder, episode_trigger=lambda episode: episode == 0)

    try:
        envs = gym.vector.SyncVectorEnv(
            [partial(make_env, video_folder and i == 0) for i in range(num_envs)],
            autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
        )
    except gym.error.UnregisteredEnv:
        fail(f"unknown env id '{env_id}': ids come from gymnasium's registry (gymnasium.pprint_registry())")
    except Exception as error:  # any other failure to make it (a missing package, an old version): say what it was
        fail(f"{env_id}: {error}")
    if not isinstance(envs.single_action_space, gym.spaces.Discrete):
        fail(f"{env_id} has {envs.single_action_space}: DQN needs discrete actions (continuous ones: sac, td3, ppo)")
    if not isinstance(envs.single_observation_space, gym.spaces.Box) or len(envs.single_observation_space.shape) != 1:
        fail(f"{env_id} has observations {envs.single_observation_space}: this script needs a flat (1-D Box) one")
    envs.action_space.seed(seed)
    return envs


class QNetwork(nn.Module):
    def __init__(self, obs_dim, num_actions):
        super().__init__()
        self.network = nn.Sequential(
            nn.Linear(obs_dim, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, num_actions)
        )

    def forward(self, obs):
        return self.network(obs)


class ReplayBuffer:
    """Transitions as rows [obs | action | reward | next_obs | termination] of one preallocated device tensor, row
    `i % rows` for the i-th transition. Steps wait in a host array and go to the device in one block when a batch
    is sampled: a copy per step cost 14 us of CartPole's 220 per step on a CPU, and one per update costs little."""

    def __init__(self, buffer_size, obs_dim, num_envs, device, staged_steps=64):
        self.columns = [obs_dim, 1, 1, obs_dim, 1]
        rows = math.ceil(buffer_size / num_envs) * num_envs  # a step's rows never wrap around
        self.rows = torch.zeros(rows, sum(self.columns), device=device)
        self.staged = np.zeros((min(staged_steps * num_envs, rows), sum(self.columns)), np.float32)  # one wrap at most
        self.buffer_size, self.num_staged, self.inserted = buffer_size, 0, 0

    def add(self, obs, actions, rewards, next_obs, terminations):
        if self.num_staged == len(self.staged):
            self.flush()
        step = np.concatenate([obs, actions[:, None], rewards[:, None], next_obs, terminations[:, None]], 1)
        self.staged[self.num_staged : self.num_staged + len(step)] = step
        self.num_staged += len(step)

    def flush(self):
        """The staged steps into their rows, in two blocks where they wrap around the end."""
        start, staged = self.inserted % len(self.rows), torch.from_numpy(self.staged[: self.num_staged])
        first = min(self.num_staged, len(self.rows) - start)
        self.rows[start : start + first] = staged[:first].to(self.rows.device)
        self.rows[: self.num_staged - first] = staged[first:].to(self.rows.device)
        self.inserted, self.num_staged = self.inserted + self.num_staged, 0

    def sample(self, batch_size):
        """A uniform batch of the newest min(inserted, buffer_size) transitions: obs, actions, rewards,
        next_obs, terminations (actions int64, the rest float32)."""
        self.flush()
        newest = torch.randint(0, min(self.inserted, self.buffer_size), (batch_size,), device=self.rows.device)
        batch = self.rows[(self.inserted - 1 - newest) % len(self.rows)]
        obs, actions, rewards, next_obs, terminations = batch.split(self.columns, dim=1)
        return obs, actions.long().squeeze(1), rewards.squeeze(1), next_obs, terminations.squeeze(1)


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
    greedy = policy_step(torch.from_numpy(obs).to(device, torch.float32, non_blocking=True)).cpu().numpy()
    return greedy if exploit.all() else np.where(exploit, greedy, rng.integers(num_actions, size=len(obs)))


def evaluate(q_network, args, device, video_folder=None):
    """Undiscounted return of the first episode in each of --eval-episodes envs, acting greedily."""
    envs = make_envs(args.env_id, args.eval_episodes, args.seed + 10_000, video_folder)
    obs, _ = envs.reset(seed=args.seed + 10_000)
    returns, finished = np.zeros(envs.num_envs), np.zeros(envs.num_envs, dtype=bool)
    while not finished.all():
        check_signals()
        with torch.no_grad():
            actions = q_network(torch.as_tensor(obs, dtype=torch.float32, device=device)).argmax(-1)
        obs, rewards, terminations, truncations, _ = envs.step(actions.cpu().numpy())
        returns += rewards * ~finished
        finished |= terminations | truncations
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

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    # One CPU thread: a 120-84 MLP gains nothing from intra-op threads (waking them costs more than the math)
    tune_cpu(args.torch_threads, device, threads=1)

    envs = make_envs(args.env_id, args.num_envs, args.seed)
    obs_dim, num_actions = envs.single_observation_space.shape[0], int(envs.single_action_space.n)
    check_fits(args.buffer_size * (2 * obs_dim + 3) * 4, device, "--buffer-size")
    q_network = QNetwork(obs_dim, num_actions).to(device)
    target_network = QNetwork(obs_dim, num_actions).to(device).requires_grad_(False)
    q_view = QNetwork(obs_dim, num_actions).to("meta")  # acts with the learner's weights, shared and without grad
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
        run.load_checkpoint({"q_network": q_network, "optimizer": optimizer}, obs_dim=obs_dim, num_actions=num_actions)
    target_network.load_state_dict(q_network.state_dict())
    target_params, online_params = from_module(target_network), from_module(q_network).data

    policy_step = partial(policy, q_network=q_view)
    update_step = partial(
        update, q_network=q_network, target_network=target_network, optimizer=optimizer, gamma=args.gamma
    )
    # On a CPU --compile leaves both eager: compiled, this small MLP's action step ran 1.65x and its update 1.2x
    # the eager time there (guards and wrappers cost more than the fused kernels save; docs/speed.md).
    compiled = ["policy", "update"] if args.compile and device.type != "cpu" else []
    if compiled:
        policy_step, update_step = torch.compile(policy_step), torch.compile(update_step)
    if run.cudagraphs:  # the first calls compile and initialise Adam's state, then the graphs are captured
        policy_step, update_step = CudaGraphModule(policy_step, warmup=5), CudaGraphModule(update_step, warmup=5)

    rb = ReplayBuffer(args.buffer_size, obs_dim, args.num_envs, device)
    rng = np.random.default_rng(args.seed)  # exploration: coins and random actions are drawn on the host
    target_every = max(1, args.target_network_frequency // args.train_frequency)  # in updates
    episode_returns, num_updates, metrics, global_step = np.zeros(args.num_envs), 0, {}, 0
    obs, _ = envs.reset(seed=args.seed)
    run.open()
    with run.stoppable():
        for iteration in range(args.total_timesteps // args.num_envs):
            check_signals()
            global_step = iteration * args.num_envs
            actions = epsilon_greedy(policy_step, obs, epsilon_at(global_step, args), rng, num_actions, device)
            next_obs, rewards, terminations, truncations, infos = run.in_env(envs.step, actions)
            real_next_obs = next_obs.copy()  # truncated episodes bootstrap from their true final observation
            if "final_obs" in infos:
                real_next_obs[infos["_final_obs"]] = np.stack(infos["final_obs"][infos["_final_obs"]])
            rb.add(obs, actions, rewards, real_next_obs, terminations)
            obs, global_step = next_obs, global_step + args.num_envs
            done = terminations | truncations
            episode_returns += rewards
            for episode_return in episode_returns[done]:
                run.episode(global_step, episode_return)
            episode_returns[done] = 0

            # the updates these steps owe: one per train_frequency steps after learning_starts, as in CleanRL
            while num_updates < (global_step - args.learning_starts) // args.train_frequency:
                if num_updates == args.measure_burnin:
                    run.mark_steady(global_step)
                metrics = update_step(*rb.sample(args.batch_size))
                num_updates += 1
                if num_updates % target_every == 0:
                    target_params.lerp_(online_params, args.tau)
                if num_updates % LOG_EVERY == 0:
                    replay_ratio = num_updates * args.batch_size / (global_step - args.learning_starts)
                    run.log(global_step, metrics, epsilon=epsilon_at(global_step, args), replay_ratio=replay_ratio)
    run.end(global_step, metrics)
    envs.close()

    summary = {
        "num_updates": num_updates,
        "compiled_pieces": compiled,
        "left_eager": ["policy", "update"] if args.compile and not compiled else [],
        "replay_ratio_target": args.batch_size / args.train_frequency,
        "replay_ratio_achieved": num_updates * args.batch_size / max(1, global_step - args.learning_starts),
    }
    checkpoint = {
        "obs_dim": obs_dim,
        "num_actions": num_actions,
        "q_network": q_network.state_dict(),
        "optimizer": optimizer.state_dict(),
    }
    run.finish(partial(evaluate, q_view, args, device, run.video_folder), summary, checkpoint)
