"""Proximal Policy Optimization (PPO, Schulman et al. 2017) for continuous actions, one file.

Speed: GAE is a log-depth parallel scan (11 elementwise rounds for 2048 steps instead of a 2048-step loop, so
it compiles in seconds), the rollout lives in preallocated device tensors, the learning rate is a tensor
annealed in place, and the policy step, GAE and the minibatch update can be wrapped in torch.compile and CUDA
graphs. Layers this small cost per op, not per FLOP: the parameters share one flat tensor (one for Adam and the
clipping, not 13), and the env wrappers' statistics skip the moments of a single sample. Cost: the scan does
T log T work instead of T, nothing next to the update.
    python leanrl_scripts/ppo_continuous_action.py --env-id HalfCheetah-v5 --compile --cudagraphs
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
from typing import NamedTuple

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
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
    env_id: str = "HalfCheetah-v5"
    """the id of the gymnasium environment (continuous actions)"""
    total_timesteps: int = 1_000_000
    """total environment steps, all envs together (0 only with --load-model: evaluate it)"""
    learning_rate: float = 3e-4
    """the learning rate of the optimizer"""
    num_envs: int = 1
    """the number of parallel environments"""
    num_steps: int = 2048
    """the number of steps to run in each environment per policy rollout"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to 0 over the run"""
    gamma: float = 0.99
    """the discount factor gamma"""
    gae_lambda: float = 0.95
    """the lambda for the general advantage estimation"""
    num_minibatches: int = 32
    """the number of mini-batches"""
    update_epochs: int = 10
    """the K epochs to update the policy"""
    norm_adv: bool = True
    """normalize the advantages (per minibatch)"""
    clip_coef: float = 0.2
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """use a clipped loss for the value function, as in the paper"""
    ent_coef: float = 0.0
    """coefficient of the entropy"""
    vf_coef: float = 0.5
    """coefficient of the value function"""
    max_grad_norm: float = 0.5
    """the maximum norm for the gradient clipping"""
    target_kl: float | None = None
    """stop an iteration's epochs once the approximate KL exceeds this (checked once per epoch)"""
    torch_threads: int = 0
    """torch's CPU threads (0: one, see the comment where it is set; OMP_NUM_THREADS also sets it)"""
    compile: bool = False
    """wrap the policy step, GAE and the update in torch.compile"""
    cudagraphs: bool = False
    """wrap the policy step, GAE and the update in CUDA graphs (tensordict's CudaGraphModule)"""
    measure_burnin: int = 1
    """iterations (rollout and update) that the speed figure leaves out (compilation, graph capture)"""
    eval_episodes: int = 10
    """deterministic evaluation episodes at the end of the run"""
    save_model: bool = False
    """save a checkpoint to runs/<run_name>/model.pt at the end"""
    load_model: str = ""
    """a checkpoint to start from (evaluate it with --total-timesteps 0, or continue training)"""
    capture_video: bool = False
    """record the evaluation episodes to runs/<run_name>/videos"""


LOG_STD_NORMAL = 0.5 * math.log(2 * math.pi)


class OneSampleRunningMeanStd(gym.wrappers.utils.RunningMeanStd):
    """gymnasium's running mean and variance, which its per-env wrappers feed one sample at a time: the mean and the
    variance of one sample are the sample and 0, so np.mean and np.var are skipped. They took 23 of the 83 us of a
    HalfCheetah step through CleanRL's wrappers (1.10x the SPS on a 2-core CPU); the statistics are bit for bit the
    same."""

    def update(self, x):
        if len(x) != 1:
            return super().update(x)
        self.update_from_moments(x[0], 0.0, 1)


def make_env(env_id, gamma, training, video_folder=None):
    """CleanRL's wrappers. Episode statistics come first, so they see the true rewards; evaluation envs
    normalize observations with the training statistics and leave rewards alone."""

    def thunk():
        env = gym.make(env_id, render_mode="rgb_array" if video_folder else None)
        if not isinstance(env.action_space, gym.spaces.Box):  # before ClipAction, which asserts it
            fail(f"{env_id} has {env.action_space}: this script needs continuous (Box) actions")
        if video_folder:
            env = gym.wrappers.RecordVideo(env, video_folder, episode_trigger=lambda episode: episode == 0)
        env = gym.wrappers.FlattenObservation(env)
        env = gym.wrappers.RecordEpisodeStatistics(env)
        env = gym.wrappers.ClipAction(env)
        env = gym.wrappers.NormalizeObservation(env)
        env.obs_rms = OneSampleRunningMeanStd(shape=env.observation_space.shape, dtype=env.observation_space.dtype)
        env = gym.wrappers.TransformObservation(env, lambda obs: np.clip(obs, -10, 10), env.observation_space)
        if training:
            env = gym.wrappers.NormalizeReward(env, gamma=gamma)
            env.return_rms = OneSampleRunningMeanStd(shape=())
            env = gym.wrappers.TransformReward(env, lambda reward: np.clip(reward, -10, 10))
        return env

    return thunk


def make_envs(env_id, num_envs, gamma=0.99, training=True, video_folder=None):
    if env_id.startswith("dm_control/"):  # DeepMind's control suite through shimmy, as CleanRL runs it
        try:
            import shimmy  # noqa: F401  (it registers the dm_control/ ids)
        except ModuleNotFoundError:
            fail('dm_control tasks need shimmy and dm_control: pip install ".[dm-control]"')
    try:
        thunks = [make_env(env_id, gamma, training, video_folder if i == 0 else None) for i in range(num_envs)]
        envs = gym.vector.SyncVectorEnv(thunks, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    except gym.error.DependencyNotInstalled as error:
        fail(
            f"{env_id}: a package is missing ({error}); MuJoCo: pip install '.[mujoco]', videos: pip install '.[video]'"
        )
    except gym.error.UnregisteredEnv:
        fail(
            f"unknown env id '{env_id}': ids come from gymnasium's registry (gymnasium.pprint_registry()); "
            "Atari games on envpool run with ppo_atari_envpool.py"
        )
    except Exception as error:  # an old version, an id moved to another package, any other failure to make it
        fail(f"{env_id}: {error}")
    return envs


def obs_normalizers(envs):
    """Each env's NormalizeObservation wrapper: its running statistics go into checkpoints and evaluation."""
    found = []
    for env in envs.envs:
        while not isinstance(env, gym.wrappers.NormalizeObservation):
            env = env.env
        found.append(env)
    return found


def layer_init(layer, std=math.sqrt(2), bias_const=0.0):
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self, obs_dim, act_dim):
        super().__init__()
        self.critic = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 1), std=1.0),
        )
        self.actor_mean = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, act_dim), std=0.01),
        )
        self.actor_logstd = nn.Parameter(torch.zeros(1, act_dim))

    def get_value(self, obs):
        return self.critic(obs).squeeze(-1)

    def get_action_and_value(self, obs, action=None):
        """Gaussian policy written out: torch.distributions checks its arguments with host syncs."""
        mean = self.actor_mean(obs)
        log_std = self.actor_logstd.expand_as(mean)
        if action is None:  # a sampled action, standardized, is its noise: three ops fewer per step
            standardized = torch.randn_like(mean)
            action = mean + log_std.exp() * standardized
        else:
            standardized = (action - mean) / log_std.exp()
        log_prob = (-0.5 * standardized.pow(2) - log_std - LOG_STD_NORMAL).sum(-1)
        entropy = (0.5 + LOG_STD_NORMAL + log_std).sum(-1)
        return action, log_prob, entropy, self.get_value(obs)


def flatten_parameters(module):
    """Makes the module's parameters views into one flat tensor and their gradients views into another, and returns
    the flat parameter: Adam, the clipping and the zeroing then handle one tensor instead of 13. At these sizes they
    cost per tensor, not per element: 190 of the update's 670 us on a CPU, 120 flat (1.03-1.04x the SPS)."""
    params = list(module.parameters())
    flat = nn.Parameter(torch.cat([param.detach().flatten() for param in params]))
    flat.grad = torch.zeros_like(flat)
    offset = 0
    for param in params:
        param.data = flat.data[offset : offset + param.numel()].view_as(param)
        param.grad = flat.grad[offset : offset + param.numel()].view_as(param)
        offset += param.numel()
    return flat


def policy(obs, *, agent):
    """Sampled actions, their log-probabilities and the values; `agent` is a detached view of the learner."""
    action, log_prob, _, value = agent.get_action_and_value(obs)
    return action, log_prob, value


def gae(rewards, values, dones, next_value, next_done, *, gamma, gae_lambda):
    """Advantages A_t = delta_t + c_t A_{t+1} with c_t = gamma lambda (1 - done_{t+1}), as a parallel scan:
    after the round with offset s, A_t sums the next 2s deltas, so log2(T) rounds cover the rollout.
    Shapes (T, num_envs); `dones[t]` says obs t started a new episode. Returns advantages and returns."""
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


class Batch(NamedTuple):
    """Rollout tensors flattened over (step, env); a minibatch is the same with fewer rows."""

    obs: torch.Tensor
    actions: torch.Tensor
    logprobs: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    values: torch.Tensor


def update(minibatch, *, agent, params, optimizer, args):
    """One clipped-surrogate step on a minibatch (a Batch); `params` are those the optimizer steps. Metrics stay on
    the device."""
    _, new_logprob, entropy, new_value = agent.get_action_and_value(minibatch.obs, minibatch.actions)
    advantages, returns, values = minibatch.advantages, minibatch.returns, minibatch.values
    logratio = new_logprob - minibatch.logprobs
    ratio = logratio.exp()
    with torch.no_grad():
        approx_kl = ((ratio - 1) - logratio).mean()  # the low-variance estimator of KL(old || new)
        clipfrac = ((ratio - 1.0).abs() > args.clip_coef).float().mean()
    if args.norm_adv:
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    pg_loss = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef)).mean()
    if args.clip_vloss:
        clipped_value = values + (new_value - values).clamp(-args.clip_coef, args.clip_coef)
        v_loss = 0.5 * torch.max((new_value - returns).pow(2), (clipped_value - returns).pow(2)).mean()
    else:
        v_loss = 0.5 * (new_value - returns).pow(2).mean()
    entropy_loss = entropy.mean()
    loss = pg_loss - args.ent_coef * entropy_loss + args.vf_coef * v_loss
    optimizer.zero_grad(set_to_none=False)  # in place: gradients set to None would leave their flat buffer
    loss.backward()
    grad_norm = nn.utils.clip_grad_norm_(params, args.max_grad_norm)
    optimizer.step()
    return {
        "policy_loss": pg_loss.detach(),
        "value_loss": v_loss.detach(),
        "entropy": entropy_loss.detach(),
        "approx_kl": approx_kl,
        "clipfrac": clipfrac,
        "grad_norm": grad_norm.detach(),
    }


def speed_up(fn, compile, cudagraphs):
    """torch.compile fuses the piece's kernels; a CUDA graph then replays all its launches at once (inputs are
    copied into static buffers, outputs cloned). The pieces take and return plain tensors: no TensorDicts."""
    if compile:
        fn = torch.compile(fn)
    if cudagraphs:
        fn = CudaGraphModule(fn, warmup=5)  # the first calls compile and initialise Adam's state, then capture
    return fn


def evaluate(agent, obs_stats, args, device, video_folder):
    """Undiscounted return of the first episode in each of --eval-episodes envs, with the mean action; observations
    are normalized with the training statistics `obs_stats`, frozen."""
    envs = make_envs(args.env_id, args.eval_episodes, args.gamma, training=False, video_folder=video_folder)
    for normalizer in obs_normalizers(envs):
        normalizer.update_running_mean = False
        normalizer.obs_rms.mean, normalizer.obs_rms.var = obs_stats.mean.copy(), obs_stats.var.copy()
    obs, _ = envs.reset(seed=args.seed + 10_000)
    returns, finished = np.zeros(envs.num_envs), np.zeros(envs.num_envs, dtype=bool)
    while not finished.all():
        check_signals()
        with torch.no_grad():
            actions = agent.actor_mean(torch.as_tensor(obs, dtype=torch.float32, device=device))
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
        counts=("num_envs", "num_steps", "num_minibatches", "update_epochs"),
        rates=("learning_rate",),
        fractions=("gae_lambda",),
    )
    batch_size = args.num_envs * args.num_steps
    if batch_size % args.num_minibatches:
        fail(f"--num-minibatches {args.num_minibatches} must divide num_envs x num_steps = {batch_size}")
    if 0 < args.total_timesteps < batch_size:
        fail(f"--total-timesteps {args.total_timesteps} is less than one rollout (num_envs x num_steps = {batch_size})")
    minibatch_size = batch_size // args.num_minibatches
    num_iterations = args.total_timesteps // batch_size
    device = run.device
    # One CPU thread: layers this small gain at most 1.5x from a second core on an idle 2-core machine
    tune_cpu(args.torch_threads, device, threads=1)

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    envs = make_envs(args.env_id, args.num_envs, args.gamma)
    normalizers = obs_normalizers(envs)
    obs_dim = math.prod(envs.single_observation_space.shape)
    act_dim = math.prod(envs.single_action_space.shape)
    agent = Agent(obs_dim, act_dim).to(device)
    flat_params = flatten_parameters(agent)
    # Tensor learning rate and capturable state: annealing writes into the tensor, so graphs never recapture.
    learning_rate = torch.tensor(args.learning_rate, device=device)
    optimizer = torch.optim.Adam([flat_params], lr=learning_rate, eps=1e-5, fused=True, capturable=run.cudagraphs)
    loaded = args.load_model and run.load_checkpoint(
        {"agent": agent, "optimizer": optimizer}, obs_dim=obs_dim, act_dim=act_dim
    )
    for normalizer in normalizers if loaded else ():  # the statistics the checkpoint's agent was trained with
        normalizer.obs_rms.mean, normalizer.obs_rms.var = loaded["obs_mean"].numpy(), loaded["obs_var"].numpy()
        normalizer.obs_rms.count = loaded["obs_count"]
    agent_view = Agent(obs_dim, act_dim).to("meta")  # acts with the learner's weights, shared and without grad
    from_module(agent).data.to_module(agent_view)
    agent_view.requires_grad_(False)

    policy_step = speed_up(partial(policy, agent=agent_view), args.compile, run.cudagraphs)
    gae_step = speed_up(partial(gae, gamma=args.gamma, gae_lambda=args.gae_lambda), args.compile, run.cudagraphs)
    update_step = partial(update, agent=agent, params=[flat_params], optimizer=optimizer, args=args)
    update_step = speed_up(update_step, args.compile, run.cudagraphs)

    obs = torch.zeros(args.num_steps, args.num_envs, obs_dim, device=device)
    actions = torch.zeros(args.num_steps, args.num_envs, act_dim, device=device)
    logprobs, rewards, dones, values = (torch.zeros(args.num_steps, args.num_envs, device=device) for _ in range(4))
    metrics, num_updates, global_step = {}, 0, 0
    for normalizer in normalizers:  # a checkpoint's statistics are not moved by the reset observation
        normalizer.update_running_mean = not loaded
    next_obs_np, _ = envs.reset(seed=args.seed)
    for normalizer in normalizers:
        normalizer.update_running_mean = True
    next_obs = torch.as_tensor(next_obs_np, dtype=torch.float32, device=device)
    next_done = torch.zeros(args.num_envs, device=device)
    run.open()
    with run.stoppable():
        for iteration in range(num_iterations):
            if iteration == args.measure_burnin:
                run.mark_steady(global_step)
            lr_now = (1.0 - iteration / num_iterations) * args.learning_rate if args.anneal_lr else args.learning_rate
            learning_rate.fill_(lr_now)

            for step in range(args.num_steps):
                check_signals()
                obs[step], dones[step] = next_obs, next_done
                actions[step], logprobs[step], values[step] = policy_step(next_obs)
                next_obs_np, reward, terminations, truncations, infos = run.in_env(
                    envs.step, actions[step].cpu().numpy()
                )
                global_step += args.num_envs
                # one host-to-device copy for observations, rewards and dones together
                step_data = np.concatenate([next_obs_np, reward[:, None], (terminations | truncations)[:, None]], 1)
                step_data = torch.from_numpy(step_data).to(device, torch.float32)
                next_obs, rewards[step], next_done = (
                    step_data[:, :obs_dim],
                    step_data[:, obs_dim],
                    step_data[:, obs_dim + 1],
                )
                if "final_info" in infos and "episode" in infos["final_info"]:
                    episodes = infos["final_info"]["episode"]
                    for episode_return in episodes["r"][episodes["_r"]]:
                        run.episode(global_step, episode_return)

            advantages, returns = gae_step(rewards, values, dones, agent_view.get_value(next_obs), next_done)
            batch = Batch._make(t.flatten(0, 1) for t in (obs, actions, logprobs, advantages, returns, values))
            for _ in range(args.update_epochs):
                order = torch.randperm(batch_size, device=device)
                for start in range(0, batch_size, minibatch_size):
                    indices = order[start : start + minibatch_size]
                    metrics = update_step(Batch._make(t[indices] for t in batch))
                    num_updates += 1
                if args.target_kl is not None and metrics["approx_kl"].item() > args.target_kl:  # one sync per epoch
                    break
            run.log(global_step, metrics, learning_rate=lr_now)
    run.end(global_step, metrics)
    envs.close()

    obs_stats = normalizers[0].obs_rms  # env 0's statistics stand for all (each env keeps its own)
    checkpoint = {
        "obs_dim": obs_dim,
        "act_dim": act_dim,
        "agent": agent.state_dict(),
        "optimizer": optimizer.state_dict(),
        "obs_mean": torch.as_tensor(obs_stats.mean),
        "obs_var": torch.as_tensor(obs_stats.var),
        "obs_count": float(obs_stats.count),
    }
    run.finish(
        partial(evaluate, agent_view, obs_stats, args, device, run.video_folder),
        {"num_updates": num_updates},
        checkpoint,
    )
