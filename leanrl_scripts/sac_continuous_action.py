"""Soft Actor-Critic (Haarnoja et al. 2018) for continuous actions, one file.

Speed: the twin critics are one ensemble over stacked weights (one batched matmul per layer), the replay
buffer is one preallocated device tensor, and the update, the policy step and the actor step can be
wrapped in torch.compile and CUDA graphs. Cost: plain tensors in and out of the pieces, no TensorDicts.
    python leanrl_scripts/sac_continuous_action.py --env-id HalfCheetah-v5 --compile --cudagraphs
"""

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
    learning_starts: int = 5_000
    """environment steps of random actions before learning starts"""
    policy_lr: float = 3e-4
    """the learning rate of the policy network optimizer"""
    q_lr: float = 1e-3
    """the learning rate of the Q network optimizer"""
    policy_frequency: int = 2
    """the policy is trained every `policy_frequency` updates, that many times (delayed, as in TD3)"""
    target_network_frequency: int = 1
    """the target critics are updated every `target_network_frequency` updates"""
    alpha: float = 0.2
    """entropy regularization coefficient (the initial one when autotuned)"""
    autotune: bool = True
    """automatic tuning of the entropy coefficient"""
    torch_threads: int = 0
    """torch's CPU threads (0: one, see the comment where it is set; OMP_NUM_THREADS also sets it)"""
    compile: bool = False
    """wrap the policy step and the updates in torch.compile"""
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
LINE_EVERY = 10.0  # seconds between progress lines when stderr is not a terminal (a file, nohup, CI)
LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0


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


def make_env(env_id, video_folder=None):
    def thunk():
        env = gym.make(env_id, render_mode="rgb_array" if video_folder else None)
        if video_folder:
            env = gym.wrappers.RecordVideo(env, video_folder, episode_trigger=lambda episode: episode == 0)
        return env

    return thunk


def make_envs(env_id, num_envs, video_folder=None):
    """Vector env whose step returns the reset observation and the true final one (info["final_obs"])."""
    try:
        thunks = [make_env(env_id, video_folder if i == 0 else None) for i in range(num_envs)]
        envs = gym.vector.SyncVectorEnv(thunks, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    except gym.error.DependencyNotInstalled as error:
        fail(f"{env_id}: a package is missing ({error}); MuJoCo: pip install '.[mujoco]', videos: pip install '.[video]'")
    except gym.error.UnregisteredEnv:
        fail(f"unknown env id '{env_id}': ids come from gymnasium's registry (gymnasium.pprint_registry())")
    except gym.error.Error as error:  # e.g. a deprecated version, with the one to use instead
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
    """Gaussian policy squashed by tanh into the action bounds."""

    def __init__(self, obs_dim, action_space):
        super().__init__()
        act_dim = math.prod(action_space.shape)
        self.trunk = nn.Sequential(nn.Linear(obs_dim, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU())
        self.mean = nn.Linear(256, act_dim)
        self.log_std = nn.Linear(256, act_dim)
        high, low = torch.tensor(action_space.high), torch.tensor(action_space.low)
        self.register_buffer("action_scale", ((high - low) / 2).float())
        self.register_buffer("action_bias", ((high + low) / 2).float())

    def forward(self, obs):
        """A sampled action, its log-probability, and the deterministic (mean) action."""
        hidden = self.trunk(obs)
        mean = self.mean(hidden)
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (torch.tanh(self.log_std(hidden)) + 1)
        noise = torch.randn_like(mean)
        pre_tanh = mean + log_std.exp() * noise
        # Gaussian log-density minus log|d action / d pre_tanh|; log(1 - tanh(u)^2) in its stable form
        # 2 (log 2 - u - softplus(-2u)) needs no epsilon and no torch.distributions argument checks (host syncs).
        log_prob = -0.5 * noise.pow(2) - log_std - 0.5 * math.log(2 * math.pi)
        log_prob = log_prob - 2 * (math.log(2) - pre_tanh - F.softplus(-2 * pre_tanh)) - self.action_scale.log()
        action = torch.tanh(pre_tanh) * self.action_scale + self.action_bias
        return action, log_prob.sum(-1), torch.tanh(mean) * self.action_scale + self.action_bias


class QEnsemble(nn.Module):
    """`num_q` critics Q(s, a) with their weights stacked on a leading dim: every layer is one batched
    matmul for all critics (what torch.vmap over the nets computes, without vmap's compile cost on CPU)."""

    def __init__(self, obs_dim, act_dim, num_q=2, hidden=256):
        super().__init__()
        sizes = [obs_dim + act_dim, hidden, hidden, 1]
        layers = [[nn.Linear(n_in, n_out) for n_in, n_out in zip(sizes, sizes[1:])] for _ in range(num_q)]
        self.weights = nn.ParameterList(torch.stack([net[i].weight.T for net in layers]) for i in range(3))
        self.biases = nn.ParameterList(torch.stack([net[i].bias[None] for net in layers]) for i in range(3))

    def forward(self, obs, actions):
        """Q-values of shape (num_q, batch)."""
        x = torch.cat([obs, actions], -1).expand(len(self.weights[0]), -1, -1)
        for i, (weight, bias) in enumerate(zip(self.weights, self.biases)):
            x = torch.baddbmm(bias, F.relu(x) if i else x, weight)
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


def policy(obs, *, actor):
    """Sampled actions for acting; `actor` is a detached view of the learner, so no graph is recorded."""
    return actor(obs)[0]


def update_critic(obs, actions, rewards, next_obs, terminations, *, actor, qnet, target_qnet, q_optimizer, alpha, gamma):
    with torch.no_grad():
        next_actions, next_log_prob, _ = actor(next_obs)
        next_q = target_qnet(next_obs, next_actions).min(0).values - alpha * next_log_prob
        q_target = rewards + gamma * (1 - terminations) * next_q  # a terminal step does not bootstrap
    q_values = qnet(obs, actions)
    q_loss = (q_values - q_target).pow(2).mean(1).sum()  # summed over critics, as two separate losses
    q_optimizer.zero_grad()
    q_loss.backward()
    q_optimizer.step()
    return {"qf_loss": q_loss.detach(), "qf1_values": q_values[0].mean().detach(), "qf2_values": q_values[1].mean().detach()}


def update_actor(obs, *, actor, qnet_view, actor_optimizer, alpha, log_alpha, alpha_optimizer, target_entropy):
    """`qnet_view` reads the critics' weights detached: no weight gradients are computed for them here."""
    actions, log_prob, _ = actor(obs)
    actor_loss = (alpha * log_prob - qnet_view(obs, actions).min(0).values).mean()
    actor_optimizer.zero_grad()
    actor_loss.backward()
    actor_optimizer.step()
    metrics = {"actor_loss": actor_loss.detach()}
    if alpha_optimizer is not None:  # autotuned: keep the policy's entropy near target_entropy
        alpha_loss = -(log_alpha.exp() * (log_prob.detach() + target_entropy)).mean()
        alpha_optimizer.zero_grad()
        alpha_loss.backward()
        alpha_optimizer.step()
        alpha.copy_(log_alpha.detach().exp())
        metrics["alpha_loss"] = alpha_loss.detach()
    return metrics


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


def evaluate(actor, envs, device, seed):
    """Undiscounted return of the first episode in each env, with the deterministic action."""
    obs, _ = envs.reset(seed=seed)
    returns, finished = np.zeros(envs.num_envs), np.zeros(envs.num_envs, dtype=bool)
    while not finished.all():
        check_signals()
        with torch.no_grad():
            actions = actor(torch.as_tensor(obs, dtype=torch.float32, device=device))[2]
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
    for name in ("num_envs", "batch_size", "buffer_size", "policy_frequency", "target_network_frequency"):
        if getattr(args, name) <= 0:
            fail(f"--{name.replace('_', '-')} must be positive")
    for name in ("policy_lr", "q_lr", "alpha"):
        if not 0 < getattr(args, name) < math.inf:  # also refuses nan
            fail(f"--{name.replace('_', '-')} must be a positive number")
    if not 0 <= args.gamma <= 1 or not 0 < args.tau <= 1 or args.eval_episodes < 0:
        fail("--gamma must be in [0, 1], --tau in (0, 1], --eval-episodes at least 0")
    if args.buffer_size < args.batch_size:
        fail(f"--buffer-size {args.buffer_size} must hold at least one batch (--batch-size {args.batch_size})")
    if args.torch_threads < 0:
        fail("--torch-threads must be 0 (one thread) or positive")
    if args.load_model and not os.path.isfile(args.load_model):
        fail(f"--load-model: no checkpoint at {args.load_model}")
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    # One CPU thread unless told otherwise: layers this small gain at most 1.5x from a second core on an idle
    # 2-core machine and lose 3-4x beside busy processes (a descheduled thread stalls the others at each barrier).
    torch.set_num_threads(args.torch_threads or (torch.get_num_threads() if os.environ.get("OMP_NUM_THREADS") else 1))
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

    envs = make_envs(args.env_id, args.num_envs)
    envs.action_space.seed(args.seed)
    obs_dim = math.prod(envs.single_observation_space.shape)
    act_dim = math.prod(envs.single_action_space.shape)
    check_fits(args.buffer_size * (2 * obs_dim + act_dim + 2) * 4, device, "--buffer-size")

    actor = Actor(obs_dim, envs.single_action_space).to(device)
    qnet = QEnsemble(obs_dim, act_dim).to(device)
    target_qnet = QEnsemble(obs_dim, act_dim).to(device).requires_grad_(False)
    log_alpha = torch.tensor(math.log(args.alpha), device=device, requires_grad=args.autotune)
    loaded = {}
    if args.load_model:
        try:
            loaded = torch.load(args.load_model, map_location=device, weights_only=True)
            if loaded["obs_dim"] != obs_dim or loaded["act_dim"] != act_dim:
                fail(f"--load-model: {args.load_model} was trained on {loaded['env_id']}, whose spaces differ from {args.env_id}'s")
            actor.load_state_dict(loaded["actor"])
            qnet.load_state_dict(loaded["qnet"])
            target_qnet.load_state_dict(loaded["target_qnet"])
            if args.autotune:
                log_alpha.data.copy_(loaded["log_alpha"])
        except Exception as error:  # empty, truncated, not a torch file, another script's checkpoint
            fail(f"--load-model: {args.load_model} is not a checkpoint of this script ({type(error).__name__})")
    else:
        target_qnet.load_state_dict(qnet.state_dict())
    target_params, online_params = from_module(target_qnet), from_module(qnet).data
    actor_view = detached_view(actor, Actor(obs_dim, envs.single_action_space).to("meta"))
    qnet_view = detached_view(qnet, QEnsemble(obs_dim, act_dim).to("meta"))
    alpha = log_alpha.detach().exp()  # updated in place by the alpha step when autotuned
    # Tensor learning rates and capturable state let CUDA graphs replay the optimizer step.
    adam = partial(torch.optim.Adam, fused=True, capturable=cudagraphs_active)
    q_optimizer = adam(qnet.parameters(), lr=torch.tensor(args.q_lr, device=device))
    actor_optimizer = adam(actor.parameters(), lr=torch.tensor(args.policy_lr, device=device))
    alpha_optimizer = adam([log_alpha], lr=torch.tensor(args.q_lr, device=device)) if args.autotune else None
    if loaded:  # its keys were read above: a checkpoint of this script has them
        q_optimizer.load_state_dict(loaded["q_optimizer"])
        actor_optimizer.load_state_dict(loaded["actor_optimizer"])
        if alpha_optimizer and loaded.get("alpha_optimizer"):
            alpha_optimizer.load_state_dict(loaded["alpha_optimizer"])

    policy_step = partial(policy, actor=actor_view)
    critic_step = partial(update_critic, actor=actor, qnet=qnet, target_qnet=target_qnet, q_optimizer=q_optimizer,
                          alpha=alpha, gamma=args.gamma)
    actor_step = partial(update_actor, actor=actor, qnet_view=qnet_view, actor_optimizer=actor_optimizer, alpha=alpha,
                         log_alpha=log_alpha, alpha_optimizer=alpha_optimizer, target_entropy=-float(act_dim))
    policy_step, critic_step, actor_step = (speed_up(f, args.compile, cudagraphs_active)
                                            for f in (policy_step, critic_step, actor_step))

    writer = SummaryWriter(run_dir)
    writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in asdict(args).items()))
    rb = ReplayBuffer(args.buffer_size, obs_dim, act_dim, args.num_envs, device)
    episode_returns, recent_returns = np.zeros(args.num_envs), deque(maxlen=20)
    num_updates, env_seconds, metrics, global_step, stopped = 0, 0.0, {}, 0, None
    steady_start_time = steady_start_step = None
    next_line_time = time.perf_counter()
    obs, _ = envs.reset(seed=args.seed)
    num_iterations = args.total_timesteps // args.num_envs
    progress = tqdm(range(num_iterations), mininterval=2, disable=not sys.stderr.isatty())
    for signum in (signal.SIGINT, signal.SIGTERM):  # a SIGINT ignored by the shell (a background job) stays so
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, note_signal)
    try:
        for iteration in progress:
            check_signals()
            global_step = iteration * args.num_envs  # steps done
            if steady_start_time is None and global_step >= args.learning_starts and num_updates >= args.measure_burnin:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                steady_start_time, steady_start_step, env_seconds = time.perf_counter(), global_step, 0.0
            if global_step < args.learning_starts and not loaded:
                actions = envs.action_space.sample()
            else:
                actions = policy_step(torch.as_tensor(obs, dtype=torch.float32, device=device)).cpu().numpy()
            env_start = time.perf_counter()
            next_obs, rewards, terminations, truncations, infos = envs.step(actions)
            env_seconds += time.perf_counter() - env_start

            done = terminations | truncations
            episode_returns += rewards
            for episode_return in episode_returns[done]:
                recent_returns.append(episode_return)
                writer.add_scalar("charts/episodic_return", episode_return, global_step)
            episode_returns[done] = 0
            rb.add(obs, actions, rewards, true_next_obs(next_obs, infos), terminations)
            obs = next_obs

            if global_step + args.num_envs > args.learning_starts:
                batch = rb.sample(args.batch_size)
                metrics.update(critic_step(*batch))
                num_updates += 1
                if num_updates % args.policy_frequency == 0:
                    for _ in range(args.policy_frequency):
                        metrics.update(actor_step(batch[0]))
                if num_updates % args.target_network_frequency == 0:
                    target_params.lerp_(online_params, args.tau)

            if iteration % LOG_EVERY == 0 and metrics:
                logged = dict(zip(metrics, torch.stack(list(metrics.values())).tolist()))  # one sync
                check_finite(logged, global_step)
                for name, value in logged.items():
                    writer.add_scalar(f"losses/{name}", value, global_step)
                writer.add_scalar("losses/alpha", alpha.item(), global_step)
                if steady_start_time is not None and global_step > steady_start_step:
                    sps = (global_step - steady_start_step) / (time.perf_counter() - steady_start_time)
                    writer.add_scalar("charts/SPS", sps, global_step)
                    recent = f"{np.mean(recent_returns):.1f}" if recent_returns else "none yet"
                    progress.set_postfix(sps=f"{sps:.0f}", ret=recent)
                    if progress.disable and time.perf_counter() >= next_line_time:
                        print(f"step {global_step}/{args.total_timesteps}: {sps:.0f} SPS, return {recent}",
                              file=sys.stderr, flush=True)
                        next_line_time = time.perf_counter() + LINE_EVERY
        global_step = num_iterations * args.num_envs
        check_finite({name: value.item() for name, value in metrics.items()}, global_step)
    except Stopped as stop:
        stopped = stop
    progress.close()

    if device.type == "cuda":
        torch.cuda.synchronize()
    end_time, end_step = time.perf_counter(), global_step
    envs.close()
    if steady_start_time is None:  # the run ended before the steady phase began
        steady_start_time, steady_start_step, env_seconds = end_time, end_step, 0.0
    steady_steps, steady_seconds = end_step - steady_start_step, end_time - steady_start_time

    eval_returns = []
    if args.eval_episodes > 0 and not stopped:
        video_folder = os.path.join(run_dir, "videos") if args.capture_video else None
        eval_envs = make_envs(args.env_id, args.eval_episodes, video_folder)
        try:
            eval_returns = evaluate(actor_view, eval_envs, device, seed=args.seed + 10_000)
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
        "torch_version": torch.__version__, "torch_threads": torch.get_num_threads(),
        "sps": steady_steps / steady_seconds if steady_steps > 0 else None,
        "steady_steps": steady_steps, "steady_seconds": steady_seconds,
        "warmup_seconds": steady_start_time - start_time, "total_seconds": time.perf_counter() - start_time,
        "return_mean": float(np.mean(recent_returns)) if recent_returns else None,
        "eval_return_mean": float(np.mean(eval_returns)) if eval_returns else None, "eval_returns": eval_returns,
        "peak_memory_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "env_seconds": env_seconds,
        "num_updates": num_updates, "final_metrics": {k: v.item() for k, v in metrics.items()}, "alpha": alpha.item(),
        "steps_done": end_step, "stopped": str(stopped) if stopped else None,
    }
    if device.type == "cuda":
        summary["peak_cuda_memory_mb"] = torch.cuda.max_memory_allocated() / 2**20
    summary = json.loads(json.dumps(summary), parse_constant=lambda constant: None)  # strict JSON: NaN -> null
    writer.close()
    write_atomic(os.path.join(run_dir, "summary.json"), json.dumps(summary, indent=1).encode())
    diverged = stopped is not None and stopped.exit_code == 1
    if args.save_model and not diverged:  # the model as it stood, also after Ctrl-C or SIGTERM
        checkpoint = {
            "env_id": args.env_id, "obs_dim": obs_dim, "act_dim": act_dim, "args": asdict(args),
            "actor": actor.state_dict(), "qnet": qnet.state_dict(), "target_qnet": target_qnet.state_dict(),
            "q_optimizer": q_optimizer.state_dict(), "actor_optimizer": actor_optimizer.state_dict(),
            "log_alpha": log_alpha.detach(), "alpha_optimizer": alpha_optimizer.state_dict() if alpha_optimizer else None,
        }
        buffer = io.BytesIO()  # torch.save's own file errors are opaque (RuntimeError: unexpected pos ...)
        torch.save(checkpoint, buffer)
        write_atomic(os.path.join(run_dir, "model.pt"), buffer.getvalue())
    evaluation = f"eval return {summary['eval_return_mean']:.1f}" if eval_returns else "no evaluation"
    print(f"{end_step} steps, {summary['sps'] or 0:.0f} SPS, {evaluation}; written to {run_dir}")
    print("SPEED " + json.dumps(summary))
    if stopped:
        print(f"error: {stopped}" if diverged else f"{stopped}: the steps done are in {run_dir}", file=sys.stderr)
        sys.exit(stopped.exit_code)
