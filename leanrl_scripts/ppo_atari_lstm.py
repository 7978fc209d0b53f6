"""PPO with an LSTM policy on Atari (envpool), one file.

Speed: the update runs the LSTM once per minibatch, not once per time step. Each env's rollout is cut at its
episode starts into segments, the segments are padded into one [num_steps, segments] batch, and each starts
from the stored rollout state or from zeros, so one LSTM call gives exactly the per-step loop's numbers
(`--lstm-impl loop` keeps that loop as the reference). Cost: the padded steps, reported in the summary.
    python leanrl_scripts/ppo_atari_lstm.py --env-id Breakout-v5 --compile
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
from collections import defaultdict, deque, namedtuple
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from typing import Literal


def cores_all_idle(seconds=0.2):
    """Whether every core this process may use was at least 75% idle over `seconds` (their idle share in
    /proc/stat); False where the system does not say (not Linux)."""

    def idle_and_total_jiffies():
        with open("/proc/stat") as f:
            rows = [line.split() for line in f if line.startswith("cpu") and line[3].isdigit()]
        return {int(row[0][3:]): (int(row[4]) + int(row[5]), sum(map(int, row[1:9]))) for row in rows}

    try:
        cores, before = os.sched_getaffinity(0), idle_and_total_jiffies()
        time.sleep(seconds)
        after = idle_and_total_jiffies()
    except (OSError, AttributeError, ValueError):
        return False
    shares = [(after[c][0] - before[c][0]) / max(1, after[c][1] - before[c][1]) for c in cores if c in before]
    return bool(shares) and min(shares) >= 0.75


# Idle OpenMP threads sleep instead of spinning: a spinning pool takes the cores that envpool's workers (or other
# programs) need. It costs a wake-up (tens of microseconds) per parallel kernel, and the LSTM runs its small kernels
# back to back, so on an idle machine libgomp's threads first spin 30,000 rounds (microseconds) and catch the next
# one: 1.2x the SPS padded (medians) and 1.7x with the loop on a 2-core CPU. Beside busy programs that spin takes
# their time slices instead: 0.55x (docs/ppo_lstm.md), so not when a core is busy. libgomp reads both once, when
# torch loads it: they are set here, not in tune_cpu() with the other machine settings.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if "GOMP_SPINCOUNT" not in os.environ and cores_all_idle():
    os.environ["GOMP_SPINCOUNT"] = "30000"

try:
    import envpool
except ModuleNotFoundError:  # --help works without it; a run stops with the line that installs it
    envpool = None
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
    env_id: str = "Breakout-v5"
    """the id of the envpool Atari game"""
    total_timesteps: int = 10_000_000
    """total environment steps, all envs together (0 only with --load-model: evaluate it)"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer"""
    num_envs: int = 8
    """the number of parallel game environments"""
    num_steps: int = 128
    """the number of steps to run in each environment per policy rollout"""
    lstm_impl: Literal["padded", "loop"] = "padded"
    """padded: one LSTM call over the episode segments of a minibatch; loop: one call per time step"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to 0 over the run"""
    gamma: float = 0.99
    """the discount factor gamma"""
    gae_lambda: float = 0.95
    """the lambda for the general advantage estimation"""
    num_minibatches: int = 4
    """the number of mini-batches (each holds num_envs / num_minibatches whole env rows)"""
    update_epochs: int = 4
    """the K epochs to update the policy"""
    norm_adv: bool = True
    """normalize the advantages (per minibatch)"""
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
    torch_threads: int = 0
    """torch's CPU threads (0: one on CUDA, else the cores this process may use; OMP_NUM_THREADS also sets it)"""
    compile: bool = False
    """wrap the policy step, GAE and the update in torch.compile (on a CUDA device: on a CPU none gained compiled)"""
    cudagraphs: bool = False
    """wrap the policy step, GAE and the update in CUDA graphs (tensordict's CudaGraphModule)"""
    measure_burnin: int = 1
    """iterations (rollout and update) that the speed figure leaves out (compilation, graph capture)"""
    eval_episodes: int = 10
    """evaluation games at the end of the run (whole games, true score, sampled actions)"""
    capture_video: bool = False
    """record the first evaluation game to runs/<run_name>/videos (needs .[video])"""
    save_model: bool = False
    """save a checkpoint to runs/<run_name>/model.pt at the end"""
    load_model: str = ""
    """a checkpoint to start from (evaluate it with --total-timesteps 0, or continue training)"""


def make_envs(env_id, num_envs, seed=0, training=True, render=False):
    """envpool's Atari preprocessing with one frame per observation (memory is the LSTM's job, as in CleanRL).
    Training envs end an episode at each lost life and clip rewards to their sign; info["reward"] keeps the
    true score. One worker thread per env, up to the usable cores: envpool's default counts every core of the
    host, quota or not."""
    if env_id not in envpool.list_all_envs():
        fail(f"unknown env id '{env_id}': ids come from envpool.list_all_envs(), Atari games look like Breakout-v5")
    if type(envpool.make_spec(env_id)).__name__ != "AtariEnvSpec":
        fail(f"{env_id} is not an Atari game: continuous control runs with ppo_continuous_action.py")
    return envpool.make(
        env_id,
        env_type="gymnasium",
        num_envs=num_envs,
        stack_num=1,
        num_threads=min(num_envs, usable_cores()),
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
    """The Nature DQN network on one frame, an LSTM(512, 128), and a policy head and a value head on its output."""

    def __init__(self, num_actions):
        super().__init__()
        self.network = nn.Sequential(
            layer_init(nn.Conv2d(1, 32, 8, stride=4)),
            nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2)),
            nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1)),
            nn.ReLU(),
            nn.Flatten(),
            layer_init(nn.Linear(64 * 7 * 7, 512)),
            nn.ReLU(),
        ).to(memory_format=torch.channels_last)  # on CPU, mkldnn's NHWC kernels halve the convolutions' backward
        self.lstm = nn.LSTM(512, 128)
        for name, param in self.lstm.named_parameters():
            if "bias" in name:
                nn.init.constant_(param, 0)
            else:
                nn.init.orthogonal_(param, 1.0)
        self.actor = layer_init(nn.Linear(128, num_actions), std=0.01)
        self.critic = layer_init(nn.Linear(128, 1), std=1.0)

    def features(self, obs):
        """(T, B, 1, 84, 84) uint8 frames -> (T, B, 512)."""
        frames = obs.flatten(0, 1).contiguous(memory_format=torch.channels_last) / 255.0
        return self.network(frames).view(*obs.shape[:2], -1)

    def heads(self, hidden, action=None):
        """Categorical policy written out (torch.distributions checks its arguments with host syncs)."""
        log_probs = self.actor(hidden).log_softmax(-1)
        if action is None:  # Gumbel-max sampling: argmax(log p - log E), E ~ Exp(1)
            action = (log_probs - torch.empty_like(log_probs).exponential_().log()).argmax(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        return action, log_probs.gather(-1, action[..., None]).squeeze(-1), entropy, self.critic(hidden).squeeze(-1)


def lstm_loop(lstm, features, h, c, starts):
    """CleanRL's per-step LSTM: the state is zeroed before each step whose observation starts an episode.
    features (T, B, 512), starts (T, B), states (1, B, 128). Returns the outputs (T, B, 128) and the last state."""
    outputs = []
    for feature, start in zip(features, starts):
        keep = (1.0 - start).view(1, -1, 1)
        output, (h, c) = lstm(feature[None], (keep * h, keep * c))
        outputs.append(output)
    return torch.cat(outputs), (h, c)


def lstm_padded(lstm, features, h, c, frame_index, state_index, output_index):
    """The same outputs from one LSTM call over left-aligned episode segments (see `segment_layout`).
    Row T*B of the flattened features and row B of the states are the zeros that padding reads."""
    num_steps, batch = features.shape[:2]
    flat_features = torch.cat([features.flatten(0, 1), features.new_zeros(1, features.shape[-1])])
    initial_h = torch.cat([h[0], h.new_zeros(1, h.shape[-1])])[state_index]
    initial_c = torch.cat([c[0], c.new_zeros(1, c.shape[-1])])[state_index]
    outputs, _ = lstm(flat_features[frame_index], (initial_h[None], initial_c[None]))
    return outputs.flatten(0, 1)[output_index].view(num_steps, batch, -1)


def segment_layout(starts):
    """Host-side plan for `lstm_padded`, from the episode starts (T, B) of the minibatch's env rows. Every column
    is cut where an episode starts; segment s is padded column s of a (T, S_pad) batch, S_pad the next power of
    two of the segment count, so compiled code and CUDA graphs see few shapes. Padding costs
    (S_pad - B) x T x (512 inputs + the LSTM's activations) floats per minibatch.
    Returns frame_index (T, S_pad) into the flattened (t * B + b) features, T*B for padding; state_index
    (S_pad,): the env whose stored state starts the segment, B for zeros; output_index (T*B,) into the
    flattened (position * S_pad + segment) outputs."""
    num_steps, batch = starts.shape
    cuts = starts.astype(bool)
    cuts[0] = True  # every column opens a segment at t=0, from the stored state unless starts[0] says zeros
    segment = np.cumsum(cuts.T.ravel()).reshape(batch, num_steps).T - 1  # (T, B): segment of each step
    num_segments = segment[-1, -1] + 1
    padded_segments = max(batch, 1 << int(num_segments - 1).bit_length())
    start_time = np.zeros(num_segments, dtype=np.int64)
    times, envs = np.nonzero(cuts)
    start_time[segment[times, envs]] = times
    position = np.arange(num_steps)[:, None] - start_time[segment]  # (T, B): step within its segment
    frame_index = np.full((num_steps, padded_segments), num_steps * batch, dtype=np.int64)
    frame_index[position, segment] = np.arange(num_steps * batch).reshape(num_steps, batch)
    state_index = np.full(padded_segments, batch, dtype=np.int64)
    first = ~starts[0].astype(bool)  # columns whose first segment continues the stored state
    state_index[segment[0, first]] = np.nonzero(first)[0]
    output_index = (position * padded_segments + segment).ravel()
    return frame_index, state_index, output_index


def policy(obs, h, c, start, *, agent):
    """One step for every env: sampled actions, their log-probabilities, the values and the next LSTM state.
    `agent` is a detached view of the learner."""
    hidden, (h, c) = lstm_loop(agent.lstm, agent.features(obs[None]), h, c, start[None])
    action, log_prob, _, value = agent.heads(hidden[0])
    return action, log_prob, value, h, c


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


# Whole env rows of the rollout: tensors (T, B, ...), the LSTM states they started from (1, B, 128), and their
# segment layout (`segment_layout`; empty tensors for the loop). dones[t]: obs t ends an episode (the step from it is
# envpool's reset step); starts[t]: obs t starts one.
Minibatch = namedtuple(
    "Minibatch",
    "obs dones starts initial_h initial_c frame_index state_index output_index "
    "actions logprobs advantages returns values",
)


def ppo_loss(minibatch, *, agent, args):
    """The clipped PPO loss of a Minibatch over its steps but envpool's reset steps (after an episode's last frame,
    the action ignored): they teach nothing, and CleanRL's wrappers, which reset within the ending step, never store
    them. The padded LSTM's outputs are gathered back to (T, B), so padding never reaches a loss term."""
    features, h, c = agent.features(minibatch.obs), minibatch.initial_h, minibatch.initial_c
    if args.lstm_impl == "loop":
        hidden, _ = lstm_loop(agent.lstm, features, h, c, minibatch.starts)
    else:
        hidden = lstm_padded(
            agent.lstm, features, h, c, minibatch.frame_index, minibatch.state_index, minibatch.output_index
        )
    _, new_logprob, entropy, new_value = agent.heads(hidden, minibatch.actions)
    advantages, returns, values = minibatch.advantages, minibatch.returns, minibatch.values
    kept = 1.0 - minibatch.dones  # 0 at the reset steps
    weights = kept / kept.sum()  # means over the kept steps are (x * weights).sum()
    logratio = new_logprob - minibatch.logprobs
    ratio = logratio.exp()
    with torch.no_grad():
        approx_kl = (((ratio - 1) - logratio) * weights).sum()  # the low-variance estimator of KL(old || new)
        clipfrac = (((ratio - 1.0).abs() > args.clip_coef) * weights).sum()
    if args.norm_adv:
        centered = advantages - (advantages * weights).sum()
        advantages = centered / (((centered.pow(2) * kept).sum() / (kept.sum() - 1)).sqrt() + 1e-8)
    pg_loss = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef))
    if args.clip_vloss:
        clipped_value = values + (new_value - values).clamp(-args.clip_coef, args.clip_coef)
        v_loss = 0.5 * torch.max((new_value - returns).pow(2), (clipped_value - returns).pow(2))
    else:
        v_loss = 0.5 * (new_value - returns).pow(2)
    pg_loss, v_loss, entropy_loss = ((term * weights).sum() for term in (pg_loss, v_loss, entropy))
    loss = pg_loss - args.ent_coef * entropy_loss + args.vf_coef * v_loss
    return loss, {
        "policy_loss": pg_loss.detach(),
        "value_loss": v_loss.detach(),
        "entropy": entropy_loss.detach(),
        "approx_kl": approx_kl,
        "clipfrac": clipfrac,
    }


def update(minibatch, *, agent, optimizer, args):
    """One gradient step on `ppo_loss`; metrics stay on the device."""
    loss, metrics = ppo_loss(minibatch, agent=agent, args=args)
    optimizer.zero_grad()
    loss.backward()
    metrics["grad_norm"] = nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm).detach()
    optimizer.step()
    return metrics


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
    """True score of the first whole game in each of --eval-episodes envs, with sampled actions (a greedy Atari policy
    can stall); with `video_folder`, the first env's game recorded there."""
    envs = make_envs(
        args.env_id, args.eval_episodes, seed=args.seed + 10_000, training=False, render=video_folder is not None
    )
    torch.manual_seed(args.seed)  # evaluation does not depend on what training drew
    obs, _ = envs.reset()
    video = game_video(video_folder, envs.render()[0]) if video_folder else None  # envpool renders env 0
    h = c = torch.zeros(1, envs.num_envs, agent.lstm.hidden_size, device=device)
    no_start = torch.zeros(envs.num_envs, device=device)  # each env's first game counts: its state is never reset
    returns, finished = np.zeros(envs.num_envs), np.zeros(envs.num_envs, dtype=bool)
    while not finished.all():
        check_signals()
        with torch.no_grad():
            actions, _, _, h, c = policy(torch.from_numpy(obs).to(device), h, c, no_start, agent=agent)
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
    if envpool is None:
        fail('envpool is not installed: pip install ".[envpool]"')
    run = Run(
        args,
        counts=("num_envs", "num_steps", "num_minibatches", "update_epochs"),
        rates=("learning_rate",),
        fractions=("gae_lambda",),
    )
    if args.num_envs % args.num_minibatches:
        fail(
            f"--num-minibatches {args.num_minibatches} must divide --num-envs {args.num_envs}: minibatches are "
            "whole env rows"
        )
    envs_per_batch = args.num_envs // args.num_minibatches
    batch_size = args.num_envs * args.num_steps
    if 0 < args.total_timesteps < batch_size:
        fail(f"--total-timesteps {args.total_timesteps} is less than one rollout (num_envs x num_steps = {batch_size})")
    num_iterations = args.total_timesteps // batch_size
    device = run.device
    # every usable core: the envs and the network take turns, and the idle OpenMP pool sleeps (see the top)
    tune_cpu(args.torch_threads, device, threads=usable_cores(), keep_freed_memory=True)

    random.seed(args.seed)
    rng = np.random.default_rng(args.seed)  # minibatch env groups: their segment plans are built on the host
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    envs = make_envs(args.env_id, args.num_envs, seed=args.seed)
    num_actions = int(envs.action_space.n)
    agent = Agent(num_actions).to(device)
    # Tensor learning rate and capturable state: annealing writes into the tensor, so graphs never recapture.
    learning_rate = torch.tensor(args.learning_rate, device=device)
    optimizer = torch.optim.Adam(agent.parameters(), lr=learning_rate, eps=1e-5, fused=True, capturable=run.cudagraphs)
    if args.load_model:
        run.load_checkpoint({"agent": agent, "optimizer": optimizer}, num_actions=num_actions)
    agent_view = Agent(num_actions).to("meta")  # acts with the learner's weights, shared and without grad
    from_module(agent).data.to_module(agent_view)
    agent_view.requires_grad_(False)

    # On a CPU --compile leaves the pieces eager: since the learner keeps its freed memory, inductor ran the policy
    # step in 1.05x and the updates in 1.03-1.06x the eager time there (benchmarks/compile_pieces.py; docs/speed.md).
    pieces = ["gae", "policy", "update"]
    compiled = pieces if args.compile and device.type != "cpu" else []
    policy_step = speed_up(partial(policy, agent=agent_view), bool(compiled), run.cudagraphs)
    gae_step = speed_up(partial(gae, gamma=args.gamma, gae_lambda=args.gae_lambda), bool(compiled), run.cudagraphs)
    # One update per padded segment count, made at its first use: a CUDA graph has fixed shapes (compile shares
    # its cache between them).
    update_steps = defaultdict(
        lambda: speed_up(partial(update, agent=agent, optimizer=optimizer, args=args), bool(compiled), run.cudagraphs)
    )
    no_layout = tuple(torch.zeros(0, dtype=torch.long, device=device) for _ in range(3))

    T, E = args.num_steps, args.num_envs
    obs = torch.zeros((T, E, *envs.observation_space.shape), dtype=torch.uint8, device=device)
    actions = torch.zeros((T, E), dtype=torch.long, device=device)
    logprobs, rewards, dones, starts, values = (torch.zeros((T, E), device=device) for _ in range(5))
    starts_host = np.zeros((T, E), dtype=np.float32)  # the segment plans are made from these, without a device sync
    episode_returns, episode_lengths = np.zeros(E), np.zeros(E, dtype=np.int64)
    metrics, num_updates, padded_steps, real_steps, global_step = {}, 0, 0, 0, 0
    next_obs_np, _ = envs.reset()
    next_obs = torch.from_numpy(next_obs_np).to(device)
    next_done_np, next_start_np = np.zeros(E, dtype=np.float32), np.zeros(E, dtype=np.float32)
    next_done, next_start = torch.zeros(E, device=device), torch.zeros(E, device=device)
    h = c = torch.zeros(1, E, agent.lstm.hidden_size, device=device)
    run.open()
    with run.stoppable():
        for iteration in range(num_iterations):
            if iteration == args.measure_burnin:
                run.mark_steady(global_step)
            lr_now = (1.0 - iteration / num_iterations) * args.learning_rate if args.anneal_lr else args.learning_rate
            learning_rate.fill_(lr_now)

            initial_h, initial_c = h.clone(), c.clone()  # the update replays the rollout from these states
            for step in range(T):
                check_signals()
                obs[step], dones[step], starts[step], starts_host[step] = next_obs, next_done, next_start, next_start_np
                actions[step], logprobs[step], values[step], h, c = policy_step(next_obs, h, c, next_start)
                next_obs_np, reward, terminations, truncations, infos = run.in_env(
                    envs.step, actions[step].cpu().numpy()
                )
                global_step += E
                # the step from an episode's last frame is envpool's reset step: zero the state at the frame after it
                next_start, next_start_np = next_done, next_done_np
                next_done_np = (terminations | truncations).astype(np.float32)
                step_data = torch.from_numpy(np.stack([reward.astype(np.float32), next_done_np])).to(
                    device, non_blocking=True
                )
                next_obs = torch.from_numpy(next_obs_np).to(device, non_blocking=True)
                rewards[step], next_done = step_data[0], step_data[1]
                # the true score: info["reward"] is unclipped, info["terminated"] is the end of the game, not of a life
                episode_returns += infos["reward"]
                episode_lengths += 1
                for env_id in np.nonzero(infos["terminated"].astype(bool) | truncations)[0]:
                    run.episode(global_step, episode_returns[env_id], episode_lengths[env_id])
                    episode_returns[env_id], episode_lengths[env_id] = 0.0, 0

            next_value = policy_step(next_obs, h, c, next_start)[2]
            advantages, returns = gae_step(rewards, values, dones, next_value, next_done)
            for _ in range(args.update_epochs):
                env_order = rng.permutation(E)
                for start in range(0, E, envs_per_batch):
                    env_ids = env_order[start : start + envs_per_batch]
                    real_steps += T * len(env_ids)
                    if args.lstm_impl == "padded":
                        layout = tuple(torch.from_numpy(a).to(device) for a in segment_layout(starts_host[:, env_ids]))
                        padded_steps += layout[0].numel()
                    else:
                        layout = no_layout
                        padded_steps += T * len(env_ids)
                    columns = torch.from_numpy(env_ids).to(device)
                    minibatch = Minibatch(
                        obs[:, columns],
                        dones[:, columns],
                        starts[:, columns],
                        initial_h[:, columns],
                        initial_c[:, columns],
                        *layout,
                        *(t[:, columns] for t in (actions, logprobs, advantages, returns, values)),
                    )
                    metrics = update_steps[layout[0].shape[-1]](minibatch)
                    num_updates += 1
            run.log(global_step, metrics, learning_rate=lr_now)
    run.end(global_step, metrics)
    envs.close()

    summary = {
        "lstm_impl": args.lstm_impl,
        "padded_steps": padded_steps,
        "real_steps": real_steps,
        "update_shapes": len(update_steps),
        "num_updates": num_updates,
        "compiled_pieces": compiled,
        "left_eager": pieces if args.compile and not compiled else [],
        "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
    }
    checkpoint = {"num_actions": num_actions, "agent": agent.state_dict(), "optimizer": optimizer.state_dict()}
    run.finish(partial(evaluate, agent_view, args, device, run.video_folder), summary, checkpoint)
