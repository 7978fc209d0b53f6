"""PPO on Atari (envpool) on several processes, one per GPU, started by torchrun; one file.

Each process steps its own envs and keeps a whole copy of the network. The gradients live in one flat buffer (every
parameter's .grad is a view into it), so after each minibatch's backward one all-reduce averages all of them and
every copy takes the same step. Cost: one all-reduce of the whole gradient (1.7M floats) per minibatch.
    torchrun --standalone --nproc-per-node 2 leanrl_scripts/ppo_atari_multigpu.py --env-id Breakout-v5 --compile
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
from contextlib import contextmanager, redirect_stderr
from dataclasses import asdict, dataclass
from datetime import timedelta
from functools import partial
from typing import Literal, NamedTuple

# Idle OpenMP threads sleep instead of spinning: a spinning pool takes the cores that envpool's workers (or other
# programs) need. Set before torch loads OpenMP; it costs a wake-up (tens of microseconds) per parallel kernel.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

try:
    import envpool
except ModuleNotFoundError:  # --help works without it; a run stops with the line that installs it
    envpool = None
import numpy as np
import torch
import torch.distributed as dist
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
    """use CUDA when it is available (process k of a machine on its GPU k, modulo the GPUs it has)"""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """how the processes average gradients (auto: nccl when each process of a machine has its own GPU, else gloo)"""
    track: bool = False
    """log the run to Weights & Biases (pip install ".[wandb]"; WANDB_MODE=offline keeps it on this machine)"""
    wandb_project_name: str = "leanrl-scripts"
    """the W&B project of --track"""
    wandb_entity: str | None = None
    """the W&B team or user of --track (None: your own)"""
    env_id: str = "Breakout-v5"
    """the id of the envpool Atari game"""
    total_timesteps: int = 10_000_000
    """total environment steps, all processes' envs together (0 only with --load-model: evaluate it)"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer"""
    local_num_envs: int = 8
    """the number of game environments of each process"""
    num_steps: int = 128
    """the number of steps to run in each environment per policy rollout"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to 0 over the run"""
    gamma: float = 0.99
    """the discount factor gamma"""
    gae_lambda: float = 0.95
    """the lambda for the general advantage estimation"""
    num_minibatches: int = 4
    """the number of mini-batches (each process takes its share of each from its own rollout)"""
    update_epochs: int = 4
    """the K epochs to update the policy"""
    norm_adv: bool = True
    """normalize the advantages (per minibatch, over all processes' shares)"""
    clip_coef: float = 0.1
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """use a clipped loss for the value function, as in the paper"""
    ent_coef: float = 0.01
    """coefficient of the entropy"""
    vf_coef: float = 0.5
    """coefficient of the value function"""
    max_grad_norm: float = 0.5
    """the maximum norm for the gradient clipping"""
    target_kl: float | None = None
    """stop an iteration's epochs once the approximate KL exceeds this (checked once per epoch)"""
    torch_threads: int = 0
    """torch's CPU threads per process (0: one on CUDA, else the usable cores shared out among a machine's processes)"""
    compile: bool = False
    """wrap the policy step, GAE and the update in torch.compile (on a CUDA device: on a CPU none gained compiled)"""
    cudagraphs: bool = False
    """wrap the policy step, GAE and the update's two halves in CUDA graphs (tensordict's CudaGraphModule)"""
    measure_burnin: int = 1
    """iterations (rollout and update) that the speed figure leaves out (compilation, graph capture)"""
    eval_episodes: int = 10
    """evaluation games at the end of the run, played by the first process (whole games, true score)"""
    capture_video: bool = False
    """record the first evaluation game to runs/<run_name>/videos (needs .[video])"""
    save_model: bool = False
    """save a checkpoint to runs/<run_name>/model.pt at the end"""
    load_model: str = ""
    """a checkpoint to start from (evaluate it with --total-timesteps 0, or continue training)"""
    world_size: tyro.conf.Suppress[int] = 1
    """(derived) the number of processes, from torchrun"""
    num_envs: tyro.conf.Suppress[int] = 0
    """(derived) all processes' envs: local_num_envs x world_size"""


def make_envs(env_id, num_envs, seed=0, training=True, render=False, threads=None):
    """envpool's Atari preprocessing (noop starts, frame skip 4, 84x84 grey, 4 stacked frames). Training envs end
    an episode at each lost life and clip rewards to their sign; info["reward"] keeps the true score. envpool seeds
    env i with seed + i. One worker thread per env, up to `threads` (default: the usable cores)."""
    if env_id not in envpool.list_all_envs():
        fail(f"unknown env id '{env_id}': ids come from envpool.list_all_envs(), Atari games look like Breakout-v5")
    if type(envpool.make_spec(env_id)).__name__ != "AtariEnvSpec":
        fail(f"{env_id} is not an Atari game: continuous control runs with ppo_continuous_action.py")
    return envpool.make(
        env_id,
        env_type="gymnasium",
        num_envs=num_envs,
        num_threads=min(num_envs, threads or usable_cores()),
        episodic_life=training,
        reward_clip=training,
        seed=seed,
        render_mode="rgb_array" if render else None,
    )


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    """The Nature DQN network (Mnih et al. 2015) with a policy head and a value head."""

    def __init__(self, num_actions):
        super().__init__()
        self.network = nn.Sequential(
            layer_init(nn.Conv2d(4, 32, 8, stride=4)),
            nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2)),
            nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1)),
            nn.ReLU(),
            nn.Flatten(),
            layer_init(nn.Linear(64 * 7 * 7, 512)),
            nn.ReLU(),
        ).to(memory_format=torch.channels_last)
        self.actor = layer_init(nn.Linear(512, num_actions), std=0.01)
        self.critic = layer_init(nn.Linear(512, 1), std=1.0)

    def hidden(self, obs):
        # Channels-last on uint8 costs 4x less than on floats; a no-op for the rollout storage, kept that way.
        return self.network(obs.contiguous(memory_format=torch.channels_last) / 255.0)

    def get_value(self, obs):
        return self.critic(self.hidden(obs)).squeeze(-1)

    def get_action_and_value(self, obs, action=None):
        """Categorical policy written out: torch.distributions checks its arguments with host syncs."""
        hidden = self.hidden(obs)
        log_probs = self.actor(hidden).log_softmax(-1)
        if action is None:  # Gumbel-max sampling: argmax(log p - log E), E ~ Exp(1)
            action = (log_probs - torch.empty_like(log_probs).exponential_().log()).argmax(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        return action, log_probs.gather(-1, action[:, None]).squeeze(-1), entropy, self.critic(hidden).squeeze(-1)


def policy(obs, *, agent):
    """Sampled actions, their log-probabilities and the values; `agent` is a detached view of the learner."""
    action, log_prob, _, value = agent.get_action_and_value(obs)
    return action, log_prob, value


def gae(rewards, values, dones, next_value, next_done, *, gamma, gae_lambda):
    """Advantages A_t = delta_t + c_t A_{t+1} with c_t = gamma lambda (1 - done_{t+1}), as a parallel scan:
    after the round with offset s, A_t sums the next 2s deltas, so log2(T) rounds cover the rollout.
    Shapes (T, num_envs); `dones[t]` says the step into obs t ended an episode. Returns advantages and returns."""
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


def gradients_in_one_buffer(agent):
    """Makes every parameter's .grad a view into one flat buffer, with the parameter's strides (channels-last
    convolutions), and returns the buffer: backward writes what one all-reduce averages, with no copy in or out."""
    params = list(agent.parameters())
    flat_grads = torch.zeros(sum(param.numel() for param in params), device=params[0].device)
    offset = 0
    for param in params:
        param.grad = flat_grads.as_strided(param.shape, param.stride(), offset)
        offset += param.numel()
    return flat_grads


def loss_and_gradients(minibatch, advantage_mean, advantage_std, *, agent, flat_grads, args):
    """This process's share of a minibatch (a Batch): the clipped PPO loss, its gradients written into `flat_grads`.
    The advantages are normalised with the mean and standard deviation of the whole minibatch, every process's share,
    so the mean of the processes' gradients is the gradient one process would get from all the shares."""
    _, new_logprob, entropy, new_value = agent.get_action_and_value(minibatch.obs, minibatch.actions)
    advantages, returns, values = minibatch.advantages, minibatch.returns, minibatch.values
    logratio = new_logprob - minibatch.logprobs
    ratio = logratio.exp()
    with torch.no_grad():
        approx_kl = ((ratio - 1) - logratio).mean()  # the low-variance estimator of KL(old || new)
        clipfrac = ((ratio - 1.0).abs() > args.clip_coef).float().mean()
    if args.norm_adv:
        advantages = (advantages - advantage_mean) / (advantage_std + 1e-8)
    pg_loss = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef)).mean()
    if args.clip_vloss:
        clipped_value = values + (new_value - values).clamp(-args.clip_coef, args.clip_coef)
        v_loss = 0.5 * torch.max((new_value - returns).pow(2), (clipped_value - returns).pow(2)).mean()
    else:
        v_loss = 0.5 * (new_value - returns).pow(2).mean()
    entropy_loss = entropy.mean()
    loss = pg_loss - args.ent_coef * entropy_loss + args.vf_coef * v_loss
    flat_grads.zero_()
    loss.backward()
    return {
        "policy_loss": pg_loss.detach(),
        "value_loss": v_loss.detach(),
        "entropy": entropy_loss.detach(),
        "approx_kl": approx_kl,
        "clipfrac": clipfrac,
    }


def apply_gradients(*, agent, optimizer, flat_grads, args):
    """The step after the all-reduce summed the processes' gradients: the same mean, clipping and Adam step in every
    process, so the copies of the network stay equal."""
    flat_grads.div_(args.world_size)
    grad_norm = nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
    optimizer.step()
    return grad_norm.detach()


def all_reduce(tensor, group, op=dist.ReduceOp.SUM):
    """dist.all_reduce in place (group None: one process, nothing to do). A process that ended (killed, crashed)
    fails its peers' next collective: they stop with one line, not a traceback, and the first process keeps the
    summary of the steps done."""
    if group is None:  # one process
        return
    try:
        dist.all_reduce(tensor, op=op, group=group)
    except RuntimeError as error:  # gloo's is a RuntimeError, NCCL's a DistBackendError (one too)
        reason = (str(error).strip() or type(error).__name__).splitlines()[0].split(". ")[0]
        raise Stopped(f"another process of this run ended ({reason})", 1) from None


def minibatch_statistics(advantages, order, num_minibatches, group):
    """The mean and standard deviation of each minibatch's advantages over every process's share: the counts, sums
    and sums of squares (in float64, against cancellation) of this process's shares, summed by one all-reduce."""
    shares = advantages[order].view(num_minibatches, -1).double()
    sums = torch.stack([torch.full_like(shares[:, 0], shares.shape[1]), shares.sum(1), shares.pow(2).sum(1)])
    all_reduce(sums, group)
    count, total, squares = sums
    mean = total / count
    return mean.float(), ((squares - count * mean**2) / (count - 1)).clamp(min=0).sqrt().float()


def update_epoch(batch, order, *, loss_step, apply_step, flat_grads, args, group):
    """One pass over this process's rollout in `order`. The all-reduce sits between the two compiled (and captured)
    halves of each update: gloo's collectives cannot be captured in a CUDA graph, and one code path serves both
    back-ends; it costs one eager call per minibatch. Returns the last minibatch's metrics."""
    means, stds = minibatch_statistics(batch.advantages, order, args.num_minibatches, group)
    for index, rows in enumerate(order.view(args.num_minibatches, -1)):
        metrics = loss_step(Batch._make(t[rows] for t in batch), means[index], stds[index])
        all_reduce(flat_grads, group)
        metrics["grad_norm"] = apply_step()
    return metrics


def mean_over_processes(values, group):
    """The same numbers in every process (once per epoch or iteration), so all of them decide alike."""
    values = values.clone()
    if group is not None:
        all_reduce(values, group)
        values /= dist.get_world_size(group)
    return values


def stop_together(group):
    """Every process stops at the same step, so none is left waiting in a collective: a signal any of them got
    (torchrun hands Ctrl-C and SIGTERM to all) is agreed on by one all-reduce of one number per env step."""
    if group is not None:
        signum = torch.tensor(SIGNALS_RECEIVED[:1] or [0])
        all_reduce(signum, group, dist.ReduceOp.MAX)
        if signum.item() and not SIGNALS_RECEIVED:
            SIGNALS_RECEIVED.append(int(signum.item()))
    check_signals()


def speed_up(fn, compile, cudagraphs):
    """torch.compile fuses the piece's kernels; a CUDA graph then replays all its launches at once (inputs are
    copied into static buffers, outputs cloned). The pieces take and return plain tensors: no TensorDicts."""
    if compile:
        fn = torch.compile(fn)
    if cudagraphs:
        fn = CudaGraphModule(fn, warmup=5)  # the first calls compile and initialise Adam's state, then capture
    return fn


def game_video(folder, first_frame, fps=15):
    """An mp4 writer for one game's screens, one per agent step (60 Hz with frame skip 4: 15 fps). Frames go to
    ffmpeg as they come, so memory stays flat however long the game (a stalled one lasts 27k steps)."""
    from moviepy.video.io.ffmpeg_writer import FFMPEG_VideoWriter

    os.makedirs(folder, exist_ok=True)
    writer = FFMPEG_VideoWriter(os.path.join(folder, "eval-game-0.mp4"), first_frame.shape[1::-1], fps)
    writer.write_frame(first_frame)
    return writer


def evaluate(agent, args, device, video_folder=None):
    """True score of the first whole game in each of --eval-episodes envs; with `video_folder`, the first env's game
    recorded there. Actions are sampled: a greedy Atari policy can stall (in Breakout, by never firing a new ball)
    until the 27k-step time limit."""
    envs = make_envs(
        args.env_id, args.eval_episodes, seed=args.seed + 10_000, training=False, render=video_folder is not None
    )
    torch.manual_seed(args.seed)  # a checkpoint evaluates to the score its run reported
    obs, _ = envs.reset()
    video = game_video(video_folder, envs.render()[0]) if video_folder else None  # envpool renders env 0
    returns, finished = np.zeros(envs.num_envs), np.zeros(envs.num_envs, dtype=bool)
    while not finished.all():
        check_signals()
        with torch.no_grad():
            actions = policy(torch.from_numpy(obs).to(device), agent=agent)[0]
        obs, rewards, terminations, truncations, _ = envs.step(actions.cpu().numpy())
        if video and not finished[0]:
            video.write_frame(envs.render()[0])
        returns += rewards * ~finished
        finished |= terminations | truncations
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
    # torchrun sets these; without it this is the only process
    rank, args.world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank, local_world_size = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    args.num_envs = args.local_num_envs * args.world_size
    if args.cuda and torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())  # "cuda" below means this process's GPU
    # Bad input stops every process before any work, and only the first says why.
    with redirect_stderr(sys.stderr if rank == 0 else io.StringIO()):
        if envpool is None:
            fail('envpool is not installed: pip install ".[envpool]"')
        run = Run(
            args,
            counts=("local_num_envs", "num_steps", "num_minibatches", "update_epochs"),
            rates=("learning_rate",),
            fractions=("gae_lambda",),
        )
        local_batch_size = args.local_num_envs * args.num_steps
        if local_batch_size % args.num_minibatches:
            fail(
                f"--num-minibatches {args.num_minibatches} must divide local_num_envs x num_steps = {local_batch_size}"
            )
        batch_size = local_batch_size * args.world_size
        if 0 < args.total_timesteps < batch_size:
            fail(f"--total-timesteps {args.total_timesteps} is less than one rollout of every process ({batch_size})")
        device = run.device
        gpu_each = device.type == "cuda" and local_world_size <= torch.cuda.device_count()
        backend = ("nccl" if gpu_each else "gloo") if args.backend == "auto" else args.backend
        if backend == "nccl" and not gpu_each and args.world_size > 1:
            fail("--backend nccl needs a CUDA GPU for each process of a machine (processes sharing one use gloo)")
        threads = max(1, usable_cores() // local_world_size)  # a machine's processes share out its cores
        tune_cpu(args.torch_threads, device, threads=threads, keep_freed_memory=True)

        random.seed(args.seed)
        np.random.seed(args.seed)
        torch.manual_seed(args.seed)  # the same initial weights in every process
        torch.backends.cudnn.deterministic = args.torch_deterministic
        # Process k's envs are envs k x local_num_envs, ... of one process given all of them (envpool: seed + i).
        envs = make_envs(args.env_id, args.local_num_envs, seed=args.seed + rank * args.local_num_envs, threads=threads)
        num_actions = int(envs.action_space.n)
        agent = Agent(num_actions).to(device)
        learning_rate = torch.tensor(args.learning_rate, device=device)  # annealed in place: graphs never recapture
        optimizer = torch.optim.Adam(
            agent.parameters(), lr=learning_rate, eps=1e-5, fused=True, capturable=run.cudagraphs
        )
        if args.load_model:
            run.load_checkpoint({"agent": agent, "optimizer": optimizer}, num_actions=num_actions)

    group = stop_group = None  # the collectives of gradients and statistics, and of one number per env step
    if args.world_size > 1:
        dist.init_process_group(backend, timeout=timedelta(minutes=5))  # torchrun's rendezvous, from its variables
        group = dist.group.WORLD
        stop_group = dist.new_group(backend="gloo") if backend == "nccl" else group  # on the CPU: no device sync
        for tensor in agent.state_dict().values():
            dist.broadcast(tensor, src=0)  # every copy starts from the first process's weights
    else:
        print("one process: torchrun starts several (torchrun --nproc-per-node N ppo_atari_multigpu.py ...)")
    torch.manual_seed(args.seed + 1_000_003 * rank)  # each process samples its own actions and minibatches
    flat_grads = gradients_in_one_buffer(agent)
    agent_view = Agent(num_actions).to("meta")  # acts with the learner's weights, shared and without grad
    from_module(agent).data.to_module(agent_view)
    agent_view.requires_grad_(False)

    # On a CPU --compile leaves the pieces eager, as PPO Atari's does (docs/ppo_atari.md).
    pieces = ["gae", "policy", "update"]
    compiled = pieces if args.compile and device.type != "cpu" else []
    policy_step = speed_up(partial(policy, agent=agent_view), bool(compiled), run.cudagraphs)
    gae_step = speed_up(partial(gae, gamma=args.gamma, gae_lambda=args.gae_lambda), bool(compiled), run.cudagraphs)
    loss_step = speed_up(
        partial(loss_and_gradients, agent=agent, flat_grads=flat_grads, args=args), bool(compiled), run.cudagraphs
    )
    apply_step = speed_up(
        partial(apply_gradients, agent=agent, optimizer=optimizer, flat_grads=flat_grads, args=args),
        bool(compiled),
        run.cudagraphs,
    )
    epoch = partial(update_epoch, loss_step=loss_step, apply_step=apply_step, flat_grads=flat_grads, args=args)

    T, E = args.num_steps, args.local_num_envs
    obs = torch.zeros((T, E, *envs.observation_space.shape), dtype=torch.uint8, device=device)
    actions = torch.zeros((T, E), dtype=torch.long, device=device)
    logprobs, rewards, dones, values = (torch.zeros((T, E), device=device) for _ in range(4))
    episode_returns, episode_lengths = np.zeros(E), np.zeros(E, dtype=np.int64)
    metrics, num_updates, global_step = {}, 0, 0
    num_iterations = args.total_timesteps // batch_size
    next_obs = torch.from_numpy(envs.reset()[0]).to(device)
    next_done = torch.zeros(E, device=device)
    if rank == 0:
        run.open()
    else:  # the others only note a signal (Run.open says why); stop_together makes it everyone's
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda signum, frame: SIGNALS_RECEIVED.append(signum))
    with run.stoppable():
        for iteration in range(num_iterations):
            if iteration == args.measure_burnin:
                run.mark_steady(global_step)
            lr_now = (1.0 - iteration / num_iterations) * args.learning_rate if args.anneal_lr else args.learning_rate
            learning_rate.fill_(lr_now)

            for step in range(T):
                stop_together(stop_group)
                obs[step], dones[step] = next_obs, next_done
                actions[step], logprobs[step], values[step] = policy_step(next_obs)
                next_obs_np, reward, terminations, truncations, infos = run.in_env(
                    envs.step, actions[step].cpu().numpy()
                )
                global_step += args.num_envs  # every process steps its envs once per step, in lockstep
                step_data = np.stack([reward, terminations | truncations]).astype(np.float32)
                step_data = torch.from_numpy(step_data).to(device, non_blocking=True)
                next_obs = torch.from_numpy(next_obs_np).to(device, non_blocking=True)
                rewards[step], next_done = step_data[0], step_data[1]
                # the true score: info["reward"] is unclipped, info["terminated"] is the end of the game, not of a life
                episode_returns += infos["reward"]
                episode_lengths += 1
                for env_id in np.nonzero(infos["terminated"].astype(bool) | truncations)[0] if rank == 0 else ():
                    run.episode(global_step, episode_returns[env_id], episode_lengths[env_id])  # the first's envs
                    episode_returns[env_id], episode_lengths[env_id] = 0.0, 0

            # As CleanRL's: the bootstrap observation is the next rollout's first, which the updated policy acts on.
            next_value = policy_step(next_obs)[2]
            advantages, returns = gae_step(rewards, values, dones, next_value, next_done)
            batch = Batch(*(t.flatten(0, 1) for t in (obs, actions, logprobs, advantages, returns, values)))
            for _ in range(args.update_epochs):
                metrics = epoch(batch, torch.randperm(local_batch_size, device=device), group=group)
                num_updates += args.num_minibatches
                if args.target_kl is not None and mean_over_processes(metrics["approx_kl"], group) > args.target_kl:
                    break  # one sync per epoch, the same decision in every process
            averaged = mean_over_processes(torch.stack(list(metrics.values())), group)
            metrics = dict(zip(metrics, averaged))
            if rank == 0:
                run.log(global_step, metrics, learning_rate=lr_now)
            elif not averaged.isfinite().all():  # the first process stops on the same numbers, with the line
                raise Stopped("training diverged", 1)
    envs.close()
    if group is not None and not (run.stopped and run.stopped.exit_code == 1):  # not after a failed collective
        dist.destroy_process_group()
    if rank != 0:
        sys.exit(run.stopped.exit_code if run.stopped else 0)
    run.end(global_step, metrics)

    checkpoint = {"num_actions": num_actions, "agent": agent.state_dict(), "optimizer": optimizer.state_dict()}
    run.finish(
        partial(evaluate, agent_view, args, device, run.video_folder),
        {
            "world_size": args.world_size,
            "local_num_envs": args.local_num_envs,
            "backend": backend if args.world_size > 1 else None,
            "num_updates": num_updates,
            "compiled_pieces": compiled,
            "left_eager": pieces if args.compile and not compiled else [],
        },
        checkpoint,
    )
