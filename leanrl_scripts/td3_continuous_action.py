"""Twin Delayed DDPG (TD3, Fujimoto et al. 2018) for continuous actions, one file.

Speed: the twin critics are one ensemble over stacked weights (one batched matmul per layer), the replay
buffer is one preallocated device tensor, both target networks move in one in-place lerp, and the update,
the policy step and the actor step can be wrapped in torch.compile and CUDA graphs. Cost: plain tensors
in and out of the pieces, no TensorDicts.
    python leanrl_scripts/td3_continuous_action.py --env-id HalfCheetah-v5 --compile --cudagraphs
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
from tensordict import TensorDict, from_module
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
    env_id: str = "HalfCheetah-v5"
    """the id of the gymnasium environment (continuous actions)"""
    total_timesteps: int = 1_000_000
    """total environment steps, all envs together (0 only with --load-model: evaluate it)"""
    num_envs: int = 1
    """the number of parallel environments"""
    buffer_size: int = 1_000_000
    """the replay memory buffer size"""
    gamma: float = 0.99
    """the discount factor gamma"""
    tau: float = 0.005
    """target smoothing coefficient"""
    batch_size: int = 256
    """the batch size of samples from the replay memory"""
    learning_starts: int = 25_000
    """environment steps of random actions before learning starts"""
    learning_rate: float = 3e-4
    """the learning rate of both optimizers"""
    exploration_noise: float = 0.1
    """the scale of the Gaussian exploration noise (fraction of the action range's half-width)"""
    policy_noise: float = 0.2
    """the scale of the target policy smoothing noise"""
    noise_clip: float = 0.5
    """the target policy smoothing noise is clipped to this"""
    policy_frequency: int = 2
    """the actor and the targets are updated every `policy_frequency` critic updates (delayed)"""
    torch_threads: int = 0
    """torch's CPU threads (0: the cores idle at start on a CPU, one on CUDA; OMP_NUM_THREADS also sets it)"""
    compile: bool = False
    """wrap the policy step and the updates in torch.compile (on a CUDA device: on a CPU none gained reliably)"""
    cudagraphs: bool = False
    """wrap the policy step and the updates in CUDA graphs (tensordict's CudaGraphModule)"""
    measure_burnin: int = 50
    """updates after learning starts that the speed figure leaves out (compilation, graph capture)"""
    eval_episodes: int = 10
    """deterministic evaluation episodes at the end of the run"""
    save_model: bool = False
    """save a checkpoint to runs/<run_name>/model.pt at the end"""
    load_model: str = ""
    """a checkpoint to start from (evaluate it with --total-timesteps 0, or continue training)"""
    capture_video: bool = False
    """record the evaluation episodes to runs/<run_name>/videos"""


LOG_EVERY = 100  # iterations between metric reads: each read is one host sync


def make_env(env_id, video_folder=None):
    def thunk():
        env = gym.make(env_id, render_mode="rgb_array" if video_folder else None)
        if isinstance(env.observation_space, gym.spaces.Dict):  # dm_control's named observations, as one vector
            env = gym.wrappers.FlattenObservation(env)
        if video_folder:
            env = gym.wrappers.RecordVideo(env, video_folder, episode_trigger=lambda episode: episode == 0)
        return env

    return thunk


def make_envs(env_id, num_envs, video_folder=None):
    """Vector env whose step returns the reset observation and the true final one (info["final_obs"])."""
    if env_id.startswith("dm_control/"):  # DeepMind's control suite through shimmy, as CleanRL runs it
        try:
            import shimmy  # noqa: F401  (it registers the dm_control/ ids)
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
    except Exception as error:  # an old version, an id moved to another package, any other failure to make it
        fail(f"{env_id}: {error}")
    if not isinstance(envs.single_action_space, gym.spaces.Box):
        fail(f"{env_id} has {envs.single_action_space}: this script needs continuous (Box) actions")
    if not isinstance(envs.single_observation_space, gym.spaces.Box) or len(envs.single_observation_space.shape) != 1:
        fail(f"{env_id} has observations {envs.single_observation_space}: this script needs a flat (1-D Box) one")
    return envs


def true_next_obs(next_obs, infos):
    """The observations the step led to. For an env whose episode just ended, `next_obs` already holds the
    reset observation and the vector env puts the final one in infos: truncated episodes bootstrap from it."""
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
        high, low = torch.tensor(action_space.high), torch.tensor(action_space.low)
        self.register_buffer("action_scale", ((high - low) / 2).float())
        self.register_buffer("action_bias", ((high + low) / 2).float())

    def forward(self, obs):
        return torch.tanh(self.net(obs)) * self.action_scale + self.action_bias

    def add_noise(self, actions, scale, clip=math.inf):
        """Gaussian noise of std `scale` (in half-ranges, clipped to `clip`), then back into the bounds."""
        noise = (torch.randn_like(actions) * scale).clamp(-clip, clip) * self.action_scale
        return (actions + noise).clamp(self.action_bias - self.action_scale, self.action_bias + self.action_scale)


class QEnsemble(nn.Module):
    """`num_q` critics Q(s, a) with their weights stacked on a leading dim: every layer is one batched
    matmul for all critics (what torch.vmap over the nets computes, without vmap's compile cost on CPU)."""

    def __init__(self, obs_dim, act_dim, num_q=2, hidden=256):
        super().__init__()
        sizes = [obs_dim + act_dim, hidden, hidden, 1]
        layers = [[nn.Linear(n_in, n_out) for n_in, n_out in zip(sizes, sizes[1:])] for _ in range(num_q)]
        self.weights = nn.ParameterList(torch.stack([net[i].weight.T for net in layers]) for i in range(3))
        self.biases = nn.ParameterList(torch.stack([net[i].bias[None] for net in layers]) for i in range(3))

    def forward(self, obs, actions, num_critics=None):
        """Q-values of shape (num_critics, batch), of the first `num_critics` critics (default: all)."""
        x = torch.cat([obs, actions], -1).expand(len(self.weights[0][:num_critics]), -1, -1)
        for i, (weight, bias) in enumerate(zip(self.weights, self.biases)):
            x = torch.baddbmm(bias[:num_critics], F.relu(x) if i else x, weight[:num_critics])
        return x.squeeze(-1)


class ReplayBuffer:
    """Transitions as rows [obs | action | reward | next_obs | termination] of one preallocated device
    tensor: adding a step is one host-to-device copy, sampling a batch is one gather."""

    def __init__(self, size, obs_dim, act_dim, num_envs, device):
        self.columns = [obs_dim, act_dim, 1, obs_dim, 1]
        self.rows = torch.zeros(size, sum(self.columns), device=device)
        self.env_offsets = torch.arange(num_envs, device=device)
        self.size, self.pos, self.count = size, 0, 0

    def add(self, obs, actions, rewards, next_obs, terminations):
        step = np.concatenate([obs, actions, rewards[:, None], next_obs, terminations[:, None]], 1)
        self.rows[(self.pos + self.env_offsets) % self.size] = torch.from_numpy(step).to(self.rows)
        self.pos = (self.pos + len(step)) % self.size
        self.count = min(self.count + len(step), self.size)

    def sample(self, batch_size):
        """obs, actions, rewards, next_obs, terminations: rewards and terminations of shape (batch,)."""
        batch = self.rows[torch.randint(0, self.count, (batch_size,), device=self.rows.device)]
        obs, actions, rewards, next_obs, terminations = batch.split(self.columns, dim=1)
        return obs, actions, rewards.squeeze(1), next_obs, terminations.squeeze(1)


def policy(obs, *, actor, exploration_noise):
    """Noisy actions for acting; `actor` is a detached view of the learner, so no graph is recorded."""
    return actor.add_noise(actor(obs), exploration_noise)


def update_critic(
    obs,
    actions,
    rewards,
    next_obs,
    terminations,
    *,
    target_actor,
    qnet,
    target_qnet,
    q_optimizer,
    gamma,
    policy_noise,
    noise_clip,
):
    with torch.no_grad():
        # target policy smoothing: the target is averaged over nearby actions, not a sharp peak of Q
        next_actions = target_actor.add_noise(target_actor(next_obs), policy_noise, noise_clip)
        next_q = target_qnet(next_obs, next_actions).min(0).values
        q_target = rewards + gamma * (1 - terminations) * next_q  # a terminal step does not bootstrap
    q_values = qnet(obs, actions)
    q_loss = (q_values - q_target).pow(2).mean(1).sum()  # summed over critics, as two separate losses
    q_optimizer.zero_grad()
    q_loss.backward()
    q_optimizer.step()
    return {
        "qf_loss": q_loss.detach(),
        "qf1_values": q_values[0].mean().detach(),
        "qf2_values": q_values[1].mean().detach(),
    }


def update_actor(obs, *, actor, qnet_view, actor_optimizer):
    """Deterministic policy gradient through the first critic; `qnet_view` reads the critics' weights
    detached, so no weight gradients are computed for them here."""
    actor_loss = -qnet_view(obs, actor(obs), num_critics=1).mean()
    actor_optimizer.zero_grad()
    actor_loss.backward()
    actor_optimizer.step()
    return {"actor_loss": actor_loss.detach()}


def speed_up(fn, compile, cudagraphs):
    """torch.compile fuses the piece's kernels; a CUDA graph then replays all its launches at once (inputs are
    copied into static buffers, outputs cloned). The pieces take and return plain tensors: no TensorDicts."""
    if compile:
        fn = torch.compile(fn)
    if cudagraphs:
        fn = CudaGraphModule(fn, warmup=5)  # the first calls compile and initialise Adam's state, then capture
    return fn


def detached_view(module, like):
    """`like` (built on the meta device) reads `module`'s weights, shared and without grad: no copies."""
    from_module(module).data.to_module(like)
    return like.requires_grad_(False)


def evaluate(actor, args, device, video_folder):
    """Undiscounted return of the first episode in each of --eval-episodes envs, with the deterministic action."""
    envs = make_envs(args.env_id, args.eval_episodes, video_folder)
    obs, _ = envs.reset(seed=args.seed + 10_000)
    returns, finished = np.zeros(envs.num_envs), np.zeros(envs.num_envs, dtype=bool)
    while not finished.all():
        check_signals()
        with torch.no_grad():
            actions = actor(torch.as_tensor(obs, dtype=torch.float32, device=device))
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
        counts=("num_envs", "batch_size", "buffer_size", "policy_frequency"),
        rates=("learning_rate", "tau"),
        fractions=("tau",),
    )
    if args.buffer_size < args.batch_size:
        fail(f"--buffer-size {args.buffer_size} must hold at least one batch (--batch-size {args.batch_size})")
    device = run.device
    tune_cpu(args.torch_threads, device, threads="idle")

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    envs = make_envs(args.env_id, args.num_envs)
    envs.action_space.seed(args.seed)
    obs_dim = math.prod(envs.single_observation_space.shape)
    act_dim = math.prod(envs.single_action_space.shape)
    check_fits(args.buffer_size * (2 * obs_dim + act_dim + 2) * 4, device, "--buffer-size")

    actor = Actor(obs_dim, envs.single_action_space).to(device)
    target_actor = Actor(obs_dim, envs.single_action_space).to(device).requires_grad_(False)
    qnet = QEnsemble(obs_dim, act_dim).to(device)
    target_qnet = QEnsemble(obs_dim, act_dim).to(device).requires_grad_(False)
    target_actor.load_state_dict(actor.state_dict())
    target_qnet.load_state_dict(qnet.state_dict())
    target_params = TensorDict(actor=from_module(target_actor), qnet=from_module(target_qnet))
    online_params = TensorDict(actor=from_module(actor), qnet=from_module(qnet)).data
    actor_view = detached_view(actor, Actor(obs_dim, envs.single_action_space).to("meta"))
    qnet_view = detached_view(qnet, QEnsemble(obs_dim, act_dim).to("meta"))
    # Tensor learning rates and capturable state let CUDA graphs replay the optimizer step.
    adam = partial(torch.optim.Adam, fused=True, capturable=run.cudagraphs)
    q_optimizer = adam(qnet.parameters(), lr=torch.tensor(args.learning_rate, device=device))
    actor_optimizer = adam(actor.parameters(), lr=torch.tensor(args.learning_rate, device=device))
    states = dict(
        actor=actor,
        qnet=qnet,
        target_actor=target_actor,
        target_qnet=target_qnet,
        q_optimizer=q_optimizer,
        actor_optimizer=actor_optimizer,
    )
    loaded = args.load_model and run.load_checkpoint(states, obs_dim=obs_dim, act_dim=act_dim)

    policy_step = partial(policy, actor=actor_view, exploration_noise=args.exploration_noise)
    critic_step = partial(
        update_critic,
        target_actor=target_actor,
        qnet=qnet,
        target_qnet=target_qnet,
        q_optimizer=q_optimizer,
        gamma=args.gamma,
        policy_noise=args.policy_noise,
        noise_clip=args.noise_clip,
    )
    actor_step = partial(update_actor, actor=actor, qnet_view=qnet_view, actor_optimizer=actor_optimizer)
    # On a CPU --compile leaves every piece eager: the policy step and the actor update (through the critics' detached
    # view) ran 1.1-1.65x slower compiled there, the critic update 0.95-0.98x on one CPU and 1.05-1.10x on a faster
    # one (docs/speed.md): no piece gains reliably.
    pieces = {"policy": policy_step, "update_critic": critic_step, "update_actor": actor_step}
    compiled = [name for name in pieces if args.compile and device.type != "cpu"]
    policy_step, critic_step, actor_step = (speed_up(f, name in compiled, run.cudagraphs) for name, f in pieces.items())

    rb = ReplayBuffer(args.buffer_size, obs_dim, act_dim, args.num_envs, device)
    episode_returns, num_updates, metrics, global_step = np.zeros(args.num_envs), 0, {}, 0
    num_iterations = args.total_timesteps // args.num_envs
    obs, _ = envs.reset(seed=args.seed)
    run.open()
    with run.stoppable():
        for iteration in range(num_iterations):
            check_signals()
            global_step = iteration * args.num_envs  # steps done
            if global_step >= args.learning_starts and num_updates >= args.measure_burnin:
                run.mark_steady(global_step)
            if global_step < args.learning_starts and not loaded:
                actions = envs.action_space.sample()
            else:
                actions = policy_step(torch.as_tensor(obs, dtype=torch.float32, device=device)).cpu().numpy()
            next_obs, rewards, terminations, truncations, infos = run.in_env(envs.step, actions)

            done = terminations | truncations
            episode_returns += rewards
            for episode_return in episode_returns[done]:
                run.episode(global_step, episode_return)
            episode_returns[done] = 0
            rb.add(obs, actions, rewards, true_next_obs(next_obs, infos), terminations)
            obs = next_obs

            if global_step + args.num_envs > args.learning_starts:
                batch = rb.sample(args.batch_size)
                metrics.update(critic_step(*batch))
                num_updates += 1
                if num_updates % args.policy_frequency == 0:
                    metrics.update(actor_step(batch[0]))
                    target_params.lerp_(online_params, args.tau)
            if iteration % LOG_EVERY == 0:
                run.log(global_step, metrics)
        global_step = num_iterations * args.num_envs
    run.end(global_step, metrics)
    envs.close()

    checkpoint = {
        "obs_dim": obs_dim,
        "act_dim": act_dim,
        **{name: state.state_dict() for name, state in states.items()},
    }
    summary = {
        "num_updates": num_updates,
        "compiled_pieces": compiled,
        "left_eager": sorted(pieces.keys() - compiled) if args.compile else [],
    }
    run.finish(partial(evaluate, actor_view, args, device, run.video_folder), summary, checkpoint)
