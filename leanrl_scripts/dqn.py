"""Deep Q-Network (DQN, Mnih et al. 2015) for discrete-action classic control, one file.

Speed: `--async-actor` plays in its own process (its own env, a CPU copy of the Q-network) while the learner
trains; a rate limiter in the style of Reverb's SampleToInsertRatio keeps gradient samples per inserted
transition at the synchronous run's value, so the algorithm is unchanged. Cost: storage in shared memory and
a tolerance band of extra rows. The action step and the update can be wrapped in torch.compile and CUDA graphs.
    python leanrl_scripts/dqn.py --env-id CartPole-v1 --async-actor --compile
"""

import copy
import ctypes
import io
import json
import math
import os
import queue
import random
import resource
import signal
import sys
import time
import traceback
from collections import deque
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from fractions import Fraction
from functools import partial

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
    """the learner's torch CPU threads (0: one, see the comment where it is set; OMP_NUM_THREADS also sets it)"""
    compile: bool = False
    """wrap the learner's action step and update in torch.compile (the async actor acts eagerly)"""
    cudagraphs: bool = False
    """wrap the action step and the update in CUDA graphs (tensordict's CudaGraphModule)"""
    measure_burnin: int = 50
    """updates after learning starts that the speed figure leaves out (compilation, graph capture)"""
    eval_episodes: int = 10
    """greedy evaluation episodes at the end of the run"""
    save_model: bool = False
    """save a checkpoint to runs/<run_name>/model.pt at the end"""
    load_model: str = ""
    """a checkpoint to start from (evaluate it with --total-timesteps 0, or continue training)"""


LOG_EVERY = 100  # updates between metric reads: each read is one host sync
LINE_EVERY = 10.0  # seconds between progress lines when stderr is not a terminal (a file, nohup, CI)


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def check_fits(num_bytes, device, flag):
    """A buffer larger than the device's memory fails now, not hours later (a CPU tensor's pages are only
    touched as it fills)."""
    cuda = device.type == "cuda"
    total = torch.cuda.mem_get_info(device)[1] if cuda else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if num_bytes > total:
        fail(f"{flag} needs {num_bytes / 2**30:.1f} GiB, more than the {total / 2**30:.1f} GiB of {device.type} memory")


class Stopped(Exception):
    """Ends the run early (Ctrl-C, SIGTERM, a non-finite loss); the summary of the steps done, and the model
    with --save-model, are still written. Exit code 1 marks a diverged run, whose model is not kept."""

    def __init__(self, message, exit_code):
        super().__init__(message)
        self.exit_code = exit_code


SIGNALS_RECEIVED = []  # by note_signal; the loop reads them at safe points through check_signals


def note_signal(signum, frame):
    """Only notes the signal. Raising from the handler instead could interrupt a library mid-way (TensorBoard's
    writer queue, left with a lock taken, then hangs the exit)."""
    SIGNALS_RECEIVED.append(signum)


def check_signals():
    if SIGNALS_RECEIVED:
        raise Stopped(f"stopped by {signal.Signals(SIGNALS_RECEIVED[0]).name}", 128 + SIGNALS_RECEIVED[0])


def check_finite(values, step):
    """Stops the run at the first non-finite value among those read for logging (no sync of its own)."""
    for name, value in values.items():
        if not math.isfinite(value):
            raise Stopped(f"step {step}: {name} is {value}, training diverged (a lower learning rate may help)", 1)


def make_envs(env_id, num_envs, seed=0):
    """Vector env whose step returns the reset observation and the true final one (info["final_obs"])."""
    try:
        envs = gym.vector.SyncVectorEnv([partial(gym.make, env_id)] * num_envs,
                                        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    except gym.error.UnregisteredEnv:
        fail(f"unknown env id '{env_id}': ids come from gymnasium's registry (gymnasium.pprint_registry())")
    except gym.error.Error as error:  # a missing package, a deprecated version, with what to do instead
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
        self.network = nn.Sequential(nn.Linear(obs_dim, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(),
                                     nn.Linear(84, num_actions))

    def forward(self, obs):
        return self.network(obs)


class ReplayBuffer:
    """Transitions as rows [obs | action | reward | next_obs | termination] of one preallocated tensor, row
    `i % capacity` for the i-th insert. In async mode it lives in shared memory and has `extra_rows` beyond
    buffer_size: rows the actor may write while the learner gathers a batch, so none is read half-written."""

    def __init__(self, buffer_size, obs_dim, num_envs, device, extra_rows=0, shared=False):
        self.columns = [obs_dim, 1, 1, obs_dim, 1]
        rows = math.ceil((buffer_size + extra_rows) / num_envs) * num_envs  # a step's rows never wrap around
        self.rows = torch.zeros(rows, sum(self.columns), device=device)
        if shared:
            self.rows.share_memory_()
        self.buffer_size = buffer_size

    def add(self, inserted, obs, actions, rewards, next_obs, terminations):
        step = np.concatenate([obs, actions[:, None], rewards[:, None], next_obs, terminations[:, None]], 1)
        start = inserted % len(self.rows)
        self.rows[start : start + len(step)] = torch.from_numpy(step).to(self.rows, non_blocking=True)

    def sample(self, inserted, batch_size, device):
        """A uniform batch of the newest min(inserted, buffer_size) transitions: obs, actions, rewards,
        next_obs, terminations (actions int64, the rest float32)."""
        newest = torch.randint(0, min(inserted, self.buffer_size), (batch_size,), device=self.rows.device)
        batch = self.rows[(inserted - 1 - newest) % len(self.rows)].to(device, non_blocking=True)
        obs, actions, rewards, next_obs, terminations = batch.split(self.columns, dim=1)
        return obs, actions.long().squeeze(1), rewards.squeeze(1), next_obs, terminations.squeeze(1)


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
    fraction p / q and diff scaled by q, so a whole ratio's arithmetic is exact integers: with no error buffer, a
    sample is allowed exactly when the inserts owe an update. Without `ctx` (no actor process) nothing waits:
    inserts always go in, a sample is allowed or not at once. With one, each counter has one writer (inserts: the
    actor, samples: the learner), so no mutex guards them: a waiting side sleeps on a semaphore that the other
    side posts after each step and re-checks its condition (a condition variable without the mutex: a process
    killed mid-step leaves no lock held); the one-second timeout only checks that the other side lives."""

    def __init__(self, samples_per_insert, min_size, error_buffer=0, ctx=None):
        ratio = Fraction(samples_per_insert)
        self.p, self.q, self.min_size = ratio.numerator, ratio.denominator, min_size
        self.min_scaled = min_size * self.p - error_buffer * self.q  # (min_size x spi - error_buffer) x q
        self.max_scaled = min_size * self.p + error_buffer * self.q if ctx else math.inf
        self.counts = ctx.RawValue(Counts) if ctx else Counts()
        self.insert_posted, self.sample_posted = (ctx.Semaphore(0), ctx.Semaphore(0)) if ctx else (None, None)

    inserts = property(lambda self: self.counts.inserts)
    samples = property(lambda self: self.counts.samples)
    min_diff = property(lambda self: self.min_scaled / self.q)
    max_diff = property(lambda self: self.max_scaled / self.q)

    def await_insert(self, n, other_alive=lambda: True):
        return self._wait(lambda: not self.counts.closed
                          and (self.inserts + n) * self.p - self.samples * self.q <= self.max_scaled,
                          self.sample_posted, other_alive)

    def await_sample(self, n, other_alive=lambda: True):
        return self._wait(lambda: self.inserts >= self.min_size
                          and self.inserts * self.p - (self.samples + n) * self.q >= self.min_scaled,
                          self.insert_posted, other_alive)

    def _wait(self, ready, posted, other_alive):
        """True once `ready()`; False if it is not and there is no other side to wait for, or the limiter is
        closed first (the run ends or the other side failed)."""
        while not ready():
            if posted is None or self.counts.closed:
                return False
            if not posted.acquire(timeout=1.0) and not other_alive():
                raise ChildProcessError("the other side of the replay storage stopped")
        return True

    def add_inserts(self, n):
        self.counts.inserts += n
        if self.insert_posted:
            self.insert_posted.release()

    def add_samples(self, n):
        self.counts.samples += n
        if self.sample_posted:
            self.sample_posted.release()

    def close(self):
        self.counts.closed = True
        if self.insert_posted:
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


def epsilon_greedy(policy_step, obs, epsilon, rng, num_actions, device):
    """One coin per env from a host RNG (no device sync decides anything): the network runs only when some env
    exploits (early in training most steps skip it), random actions are drawn only when some env explores."""
    exploit = rng.random(len(obs)) >= epsilon
    if not exploit.any():
        return rng.integers(num_actions, size=len(obs))
    greedy = policy_step(torch.from_numpy(obs).to(device, torch.float32, non_blocking=True)).cpu().numpy()
    return greedy if exploit.all() else np.where(exploit, greedy, rng.integers(num_actions, size=len(obs)))


def epsilon_at(step, args):
    """The linear schedule from start_e to end_e over exploration_fraction of the run, then end_e."""
    slope = (args.end_e - args.start_e) / (args.exploration_fraction * args.total_timesteps)
    return max(slope * step + args.start_e, args.end_e)


class Player:
    """Plays epsilon-greedy vector steps into the replay storage: step() one, play() several, each when the
    limiter lets it, putting the finished episodes ((global_step, return) pairs) with its env time so far on
    `reports`. The learner plays with one in its own process, the actor process with another: the same steps,
    limiter calls and reports."""

    def __init__(self, args, envs, policy_step, rb, device, limiter=None, reports=None, hold_weights=nullcontext,
                 other_alive=lambda: True):
        self.args, self.envs, self.policy_step, self.rb, self.device = args, envs, policy_step, rb, device
        self.limiter, self.reports, self.hold_weights, self.other_alive = limiter, reports, hold_weights, other_alive
        self.obs, _ = envs.reset(seed=args.seed)
        self.rng = np.random.default_rng(args.seed)
        self.num_actions = int(envs.single_action_space.n)
        self.episode_returns, self.finished = np.zeros(args.num_envs), []
        self.inserted, self.env_seconds = 0, 0.0
        self.total_vector_steps = args.total_timesteps // args.num_envs

    def alive(self):
        return True

    def load_weights(self, params):
        """Nothing to copy: this player acts with a view of the learner's weights."""

    def play(self, vector_steps):
        """Up to `vector_steps` steps, fewer if the run's steps are done or the limiter is closed."""
        for _ in range(min(vector_steps, self.total_vector_steps - self.inserted // self.args.num_envs)):
            if not self.limiter.await_insert(self.args.num_envs, self.other_alive):
                break
            self.step()
            self.limiter.add_inserts(self.args.num_envs)
            if self.finished:
                self.reports.put(("episodes", self.finished, self.env_seconds))
                self.finished = []
        self.reports.put(("episodes", [], self.env_seconds))

    def step(self):
        epsilon = epsilon_at(self.inserted, self.args)
        with self.hold_weights():  # the actor process's lock: the learner writes new weights under it
            actions = epsilon_greedy(self.policy_step, self.obs, epsilon, self.rng, self.num_actions, self.device)
        env_start = time.perf_counter()
        next_obs, rewards, terminations, truncations, infos = self.envs.step(actions)
        self.env_seconds += time.perf_counter() - env_start
        real_next_obs = next_obs.copy()  # truncated episodes bootstrap from their true final observation
        if "final_obs" in infos:
            real_next_obs[infos["_final_obs"]] = np.stack(infos["final_obs"][infos["_final_obs"]])
        self.rb.add(self.inserted, self.obs, actions, rewards, real_next_obs, terminations)
        self.inserted += self.args.num_envs
        self.episode_returns += rewards
        done = terminations | truncations
        self.finished += [(self.inserted, episode_return) for episode_return in self.episode_returns[done]]
        self.episode_returns[done] = 0
        self.obs = next_obs

    def finish(self):
        """The steps after the last update (they owe none), then the envs close."""
        self.play(self.total_vector_steps)
        self.envs.close()

    def stop(self):
        self.envs.close()


def run_actor(args, rb, limiter, actor_q, weights_lock, reports):
    """The actor process: a Player on the CPU with `actor_q` (shared memory, refreshed by the learner under
    `weights_lock`); any error goes to `reports` as text. It starts with Ctrl-C ignored (see ActorProcess)."""
    try:
        torch.set_num_threads(1)  # one core plays, the others train
        envs = make_envs(args.env_id, args.num_envs, args.seed)
        # Eager even with --compile: compiled, this MLP's CPU forward is slower (see the README), and compiling
        # here would hold the learner at learning_starts for a cold compile.
        parent = os.getppid()
        parent_alive = lambda: os.getppid() == parent  # noqa: E731
        player = Player(args, envs, partial(policy, q_network=actor_q), rb, torch.device("cpu"), limiter, reports,
                        partial(hold_lock, weights_lock, parent_alive), parent_alive)
        player.play(player.total_vector_steps)
    except BaseException:
        reports.put(("error", traceback.format_exc()))
        sys.exit(1)
    finally:
        limiter.close()  # wakes a learner waiting for transitions that will not come


class ActorProcess:
    """A Player in its own process (spawned: fork would copy the learner's threads and locks mid-flight), seen
    by the learner through the Player's interface: it plays on its own, so play() only checks it still lives;
    load_weights() copies the learner's weights to its shared CPU copy; finish() and stop() wait for it to exit,
    reading its reports meanwhile (a process with unread queue data cannot exit), then end it if it has not:
    no process outlives the run."""

    def __init__(self, ctx, args, rb, limiter, q_network, progress):
        self.limiter, self.progress = limiter, progress
        self.q_network = copy.deepcopy(q_network).cpu().requires_grad_(False).share_memory()
        self.params, self.weights_lock = from_module(self.q_network), ctx.Lock()
        self.process = ctx.Process(target=run_actor, daemon=True,
                                   args=(args, rb, limiter, self.q_network, self.weights_lock, progress.reports))
        # Ctrl-C reaches the whole process group; the actor ignores it (from its start: an interrupt while it
        # still imports would print the import's traceback) and the learner stops it.
        sigint = signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.process.start()
        signal.signal(signal.SIGINT, sigint)

    def alive(self):
        return self.process.exitcode in (None, 0)  # 0: it has played all its steps, the updates it is owed remain

    def play(self, vector_steps):
        if self.limiter.counts.closed:  # the actor has stopped, and updates are still owed
            raise ChildProcessError("the actor stopped")

    def load_weights(self, params):
        if not self.alive():
            raise ChildProcessError("the actor stopped")
        with hold_lock(self.weights_lock, self.alive):
            self.params.update_(params)

    def finish(self):
        """Every update is done: the actor plays its last steps (the band lets it) and exits."""
        self.stop(timeout=60)

    def stop(self, timeout=5):
        deadline = time.monotonic() + timeout
        while self.process.is_alive() and time.monotonic() < deadline:
            self.progress.drain()
            self.process.join(timeout=0.1)
        self.limiter.close()
        if self.process.is_alive():
            self.process.terminate()
            self.process.join()
        self.progress.drain()

    def failure(self):
        """Why the actor stopped: the last line of its error, else its exit code or signal."""
        code, error = self.process.exitcode, self.progress.error
        if error:
            return error.strip().splitlines()[-1]
        return f"killed by {signal.Signals(-code).name}" if code and code < 0 else f"exit code {code}"


class Progress:
    """The learner's end of the reports: finished episodes go to TensorBoard and the last 20 returns, the player's
    env time and an actor's error are kept."""

    def __init__(self, reports, writer):
        self.reports, self.writer = reports, writer
        self.recent_returns, self.env_seconds, self.error = deque(maxlen=20), 0.0, None

    def drain(self):
        while not self.reports.empty():
            kind, *content = self.reports.get()
            if kind == "error":
                self.error = content[0]
                continue
            episodes, self.env_seconds = content
            for step, episode_return in episodes:
                self.recent_returns.append(episode_return)
                self.writer.add_scalar("charts/episodic_return", episode_return, step)


def evaluate(q_network, envs, device, seed):
    """Undiscounted return of the first episode in each env, acting greedily."""
    obs, _ = envs.reset(seed=seed)
    returns, finished = np.zeros(envs.num_envs), np.zeros(envs.num_envs, dtype=bool)
    while not finished.all():
        check_signals()
        with torch.no_grad():
            actions = q_network(torch.as_tensor(obs, dtype=torch.float32, device=device)).argmax(-1)
        obs, rewards, terminations, truncations, _ = envs.step(actions.cpu().numpy())
        returns += rewards * ~finished
        finished |= terminations | truncations
    return returns.tolist()


def write_atomic(path, data):
    """Write `data` (bytes) through a temporary file, then rename it: a reader never sees a half-written file.
    A failed write (a full disk) leaves no temporary file and ends the run with one line, exit code 1."""
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


if __name__ == "__main__":
    args = tyro.cli(Args)
    start_time = time.perf_counter()
    if args.total_timesteps < 0 or (args.total_timesteps == 0 and not args.load_model):
        fail("--total-timesteps must be positive (0 only with --load-model, to evaluate a checkpoint)")
    for name in ("num_envs", "batch_size", "buffer_size", "train_frequency", "steps_per_update",
                 "actor_sync_every", "target_network_frequency"):
        if getattr(args, name) <= 0:
            fail(f"--{name.replace('_', '-')} must be positive")
    if args.torch_threads < 0:
        fail("--torch-threads must be 0 (chosen for this machine) or positive")
    if not 0 < args.exploration_fraction <= 1 or not 0 < args.tau <= 1:
        fail("--exploration-fraction and --tau must be in (0, 1]")
    if not 0 < args.learning_rate < math.inf:  # also refuses nan
        fail("--learning-rate must be a positive number")
    if not 0 <= args.gamma <= 1 or args.eval_episodes < 0:
        fail("--gamma must be in [0, 1], --eval-episodes at least 0")
    if args.buffer_size < args.batch_size:
        fail(f"--buffer-size {args.buffer_size} must hold at least one batch (--batch-size {args.batch_size})")
    if args.load_model and not os.path.isfile(args.load_model):
        fail(f"--load-model: no checkpoint at {args.load_model}")
    if args.learning_starts < args.batch_size:
        fail(f"--learning-starts {args.learning_starts} must be at least --batch-size {args.batch_size}")
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
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
    # One CPU thread unless told otherwise: a 120-84 MLP gains nothing from intra-op threads (waking them costs
    # more than the math), and a thread descheduled mid-kernel on a busy machine stalls the others.
    torch.set_num_threads(args.torch_threads or (torch.get_num_threads() if os.environ.get("OMP_NUM_THREADS") else 1))

    envs = make_envs(args.env_id, args.num_envs, args.seed)
    obs_dim, num_actions = envs.single_observation_space.shape[0], int(envs.single_action_space.n)
    check_fits(args.buffer_size * (2 * obs_dim + 3) * 4, device if not args.async_actor else torch.device("cpu"),
               "--buffer-size")
    q_network = QNetwork(obs_dim, num_actions).to(device)
    loaded = {}
    if args.load_model:
        try:
            loaded = torch.load(args.load_model, map_location=device, weights_only=True)
            if loaded["obs_dim"] != obs_dim or loaded["num_actions"] != num_actions:
                fail(f"--load-model: {args.load_model} was trained on {loaded['env_id']}, whose spaces differ from {args.env_id}'s")
            q_network.load_state_dict(loaded["q_network"])
        except Exception as error:  # empty, truncated, not a torch file, another script's checkpoint
            fail(f"--load-model: {args.load_model} is not a checkpoint of this script ({type(error).__name__})")
    target_network = QNetwork(obs_dim, num_actions).to(device).requires_grad_(False)
    target_network.load_state_dict(q_network.state_dict())
    target_params, online_params = from_module(target_network), from_module(q_network).data
    q_view = QNetwork(obs_dim, num_actions).to("meta")  # acts with the learner's weights, shared and without grad
    from_module(q_network).data.to_module(q_view)
    q_view.requires_grad_(False)
    # Tensor learning rate and capturable state let CUDA graphs replay the optimizer step.
    optimizer = torch.optim.Adam(q_network.parameters(), lr=torch.tensor(args.learning_rate, device=device),
                                 fused=True, capturable=cudagraphs_active)
    if loaded:
        optimizer.load_state_dict(loaded["optimizer"])

    policy_step = partial(policy, q_network=q_view)
    update_step = partial(update, q_network=q_network, target_network=target_network, optimizer=optimizer,
                          gamma=args.gamma)
    if args.compile:
        policy_step, update_step = torch.compile(policy_step), torch.compile(update_step)
    if cudagraphs_active:  # the first calls compile and initialise Adam's state, then the graphs are captured
        policy_step, update_step = CudaGraphModule(policy_step, warmup=5), CudaGraphModule(update_step, warmup=5)

    # Updates are owed at batch_size / train_frequency gradient samples per transition after learning_starts.
    replay_ratio = Fraction(args.batch_size, args.train_frequency)
    played = args.total_timesteps // args.num_envs * args.num_envs  # whole vector steps
    total_updates = max(0, played - args.learning_starts) // args.train_frequency
    target_every = max(1, args.target_network_frequency // args.train_frequency)  # in updates

    writer = SummaryWriter(run_dir)
    writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in asdict(args).items()))
    if args.async_actor:
        envs.close()
        ctx = mp.get_context("spawn")
        # The band must fit one actor step and one batch, or each side could wait on the other forever.
        error_buffer = float(max(args.replay_tolerance * args.learning_starts * replay_ratio,
                                 args.num_envs * replay_ratio + args.batch_size))
        limiter = RateLimiter(replay_ratio, args.learning_starts, error_buffer, ctx)
        # While the learner gathers a batch the actor can insert at most this many transitions (then the band
        # stops it): rows beyond buffer_size keep them from overwriting anything the batch may read.
        extra_rows = math.ceil(2 * error_buffer / replay_ratio) + args.num_envs
        rb = ReplayBuffer(args.buffer_size, obs_dim, args.num_envs, "cpu", extra_rows, shared=True)
        progress = Progress(ctx.Queue(), writer)
        player = ActorProcess(ctx, args, rb, limiter, q_network, progress)
    else:
        limiter = RateLimiter(replay_ratio, args.learning_starts)
        rb = ReplayBuffer(args.buffer_size, obs_dim, args.num_envs, device)
        progress = Progress(queue.SimpleQueue(), writer)
        player = Player(args, envs, policy_step, rb, device, limiter, progress.reports)

    num_updates, loss, wait_seconds, stopped = 0, None, 0.0, None
    steady_start_time = steady_start_step = None
    next_line_time = time.perf_counter()
    for signum in (signal.SIGINT, signal.SIGTERM):  # a SIGINT ignored by the shell (a background job) stays so
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, note_signal)
    try:
        while num_updates < total_updates:  # the updates owed end the run; the player may play a few steps after
            check_signals()
            player.play(args.steps_per_update)  # here; the actor process plays on its own
            wait_start = time.perf_counter()  # the learner waits only for an actor process
            while num_updates < total_updates and limiter.await_sample(args.batch_size, player.alive):
                wait_seconds += time.perf_counter() - wait_start
                check_signals()
                if num_updates == args.measure_burnin:  # the steady phase starts: compilation and capture are done
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    progress.drain()
                    steady_start_time, steady_start_step = time.perf_counter(), limiter.inserts
                    steady_env_seconds, wait_seconds = progress.env_seconds, 0.0
                batch = rb.sample(limiter.inserts, args.batch_size, device)
                limiter.add_samples(args.batch_size)
                loss, q_values = update_step(*batch)
                num_updates += 1
                if num_updates % target_every == 0:
                    target_params.lerp_(online_params, args.tau)
                if num_updates % args.actor_sync_every == 0:
                    player.load_weights(online_params)
                if num_updates % LOG_EVERY == 0:
                    loss_value, q_value = torch.stack([loss, q_values]).tolist()  # one sync per LOG_EVERY updates
                    step = limiter.inserts
                    check_finite({"td_loss": loss_value, "q_values": q_value}, step)
                    writer.add_scalar("losses/td_loss", loss_value, step)
                    writer.add_scalar("losses/q_values", q_value, step)
                    writer.add_scalar("charts/epsilon", epsilon_at(step, args), step)
                    replay_ratio_now = num_updates * args.batch_size / max(1, step - args.learning_starts)
                    writer.add_scalar("charts/replay_ratio", replay_ratio_now, step)
                    if steady_start_time is not None and step > steady_start_step:
                        sps = (step - steady_start_step) / (time.perf_counter() - steady_start_time)
                        writer.add_scalar("charts/SPS", sps, step)
                        if time.perf_counter() >= next_line_time:  # no bar to update: a line, also on a terminal
                            recent = f"{np.mean(progress.recent_returns):.1f}" if progress.recent_returns else "none yet"
                            print(f"step {step}/{played}: {sps:.0f} SPS, return {recent}", file=sys.stderr, flush=True)
                            next_line_time = time.perf_counter() + LINE_EVERY
                    progress.drain()
                wait_start = time.perf_counter()
            progress.drain()
        player.finish()
        check_finite({"td_loss": loss.item() if loss is not None else 0.0}, limiter.inserts)
    except ChildProcessError:
        limiter.close()
        player.stop()
        print(f"error: the actor process died ({player.failure()}); the learner stops", file=sys.stderr)
        sys.exit(1)
    except Stopped as stop:
        stopped = stop
        limiter.close()  # an actor process leaves its loop at its next step
        player.stop()
    progress.drain()

    if device.type == "cuda":
        torch.cuda.synchronize()
    end_time, end_step = time.perf_counter(), limiter.inserts
    if steady_start_time is None:  # the run ended before the steady phase began
        steady_start_time, steady_start_step, steady_env_seconds = end_time, end_step, progress.env_seconds
    env_seconds = progress.env_seconds - steady_env_seconds  # the actor's, in async mode
    steady_steps, steady_seconds = end_step - steady_start_step, end_time - steady_start_time

    eval_returns = []
    if args.eval_episodes > 0 and not stopped:
        eval_envs = make_envs(args.env_id, args.eval_episodes, args.seed + 10_000)
        try:
            eval_returns = evaluate(q_view, eval_envs, device, seed=args.seed + 10_000)
            writer.add_scalar("eval/episodic_return", np.mean(eval_returns), end_step)
        except Stopped as stop:
            stopped = stop
        eval_envs.close()
    # What remains writes two files in about a second: a signal now would leave them half done.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    summary = {
        "script": os.path.basename(__file__), "env_id": args.env_id, "seed": args.seed, "num_envs": args.num_envs,
        "total_timesteps": args.total_timesteps, "mode": mode, "compile": args.compile,
        "cudagraphs_requested": args.cudagraphs, "cudagraphs_active": cudagraphs_active, "device": str(device),
        "torch_version": torch.__version__, "torch_threads": torch.get_num_threads(), "async_actor": args.async_actor,
        "sps": steady_steps / steady_seconds if steady_steps > 0 else None,
        "steady_steps": steady_steps, "steady_seconds": steady_seconds,
        "warmup_seconds": steady_start_time - start_time, "total_seconds": time.perf_counter() - start_time,
        "return_mean": float(np.mean(progress.recent_returns)) if progress.recent_returns else None,
        "eval_return_mean": float(np.mean(eval_returns)) if eval_returns else None, "eval_returns": eval_returns,
        "peak_memory_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "env_seconds": env_seconds,
        "learner_wait_seconds": wait_seconds, "num_updates": num_updates, "inserted": end_step,
        "final_td_loss": loss.item() if loss is not None else None,
        "replay_ratio_target": float(replay_ratio),
        "replay_ratio_achieved": num_updates * args.batch_size / max(1, end_step - args.learning_starts),
        "steps_done": end_step, "stopped": str(stopped) if stopped else None,
    }
    if device.type == "cuda":
        summary["peak_cuda_memory_mb"] = torch.cuda.max_memory_allocated() / 2**20
    summary = json.loads(json.dumps(summary), parse_constant=lambda constant: None)  # strict JSON: NaN -> null
    writer.close()
    write_atomic(os.path.join(run_dir, "summary.json"), json.dumps(summary, indent=1).encode())
    diverged = stopped is not None and stopped.exit_code == 1
    if args.save_model and not diverged:  # the model as it stood, also after Ctrl-C or SIGTERM
        checkpoint = {"env_id": args.env_id, "obs_dim": obs_dim, "num_actions": num_actions, "args": asdict(args),
                      "q_network": q_network.state_dict(), "optimizer": optimizer.state_dict()}
        buffer = io.BytesIO()  # torch.save's own file errors are opaque (RuntimeError: unexpected pos ...)
        torch.save(checkpoint, buffer)
        write_atomic(os.path.join(run_dir, "model.pt"), buffer.getvalue())
    evaluation = f"eval return {summary['eval_return_mean']:.1f}" if eval_returns else "no evaluation"
    print(f"{end_step} steps, {summary['sps'] or 0:.0f} SPS, {evaluation}; written to {run_dir}")
    print("SPEED " + json.dumps(summary))
    if stopped:
        print(f"error: {stopped}" if diverged else f"{stopped}: the steps done are in {run_dir}", file=sys.stderr)
        sys.exit(stopped.exit_code)
