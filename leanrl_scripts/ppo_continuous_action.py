"""Proximal Policy Optimization (PPO, Schulman et al. 2017) for continuous actions, one file.

Speed: GAE is a log-depth parallel scan (11 elementwise rounds for 2048 steps instead of a 2048-step loop, so
it compiles in seconds), the rollout lives in preallocated device tensors, the learning rate is a tensor
annealed in place, and the policy step, GAE and the minibatch update can be wrapped in torch.compile and CUDA
graphs. Cost: the scan does T log T work instead of T, nothing next to the update.
    python leanrl_scripts/ppo_continuous_action.py --env-id HalfCheetah-v5 --compile --cudagraphs
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
LINE_EVERY = 10.0  # seconds between progress lines when stderr is not a terminal (a file, nohup, CI)


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


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
        env = gym.wrappers.TransformObservation(env, lambda obs: np.clip(obs, -10, 10), env.observation_space)
        if training:
            env = gym.wrappers.NormalizeReward(env, gamma=gamma)
            env = gym.wrappers.TransformReward(env, lambda reward: np.clip(reward, -10, 10))
        return env

    return thunk


def make_envs(env_id, num_envs, gamma=0.99, training=True, video_folder=None):
    try:
        thunks = [make_env(env_id, gamma, training, video_folder if i == 0 else None) for i in range(num_envs)]
        envs = gym.vector.SyncVectorEnv(thunks, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    except gym.error.DependencyNotInstalled as error:
        fail(f"{env_id}: a package is missing ({error}); MuJoCo: pip install '.[mujoco]', videos: pip install '.[video]'")
    except gym.error.UnregisteredEnv:
        fail(f"unknown env id '{env_id}': ids come from gymnasium's registry (gymnasium.pprint_registry()); "
             "Atari games on envpool run with ppo_atari_envpool.py")
    except gym.error.Error as error:  # e.g. a deprecated version, with the one to use instead
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
        self.critic = nn.Sequential(layer_init(nn.Linear(obs_dim, 64)), nn.Tanh(), layer_init(nn.Linear(64, 64)),
                                    nn.Tanh(), layer_init(nn.Linear(64, 1), std=1.0))
        self.actor_mean = nn.Sequential(layer_init(nn.Linear(obs_dim, 64)), nn.Tanh(), layer_init(nn.Linear(64, 64)),
                                        nn.Tanh(), layer_init(nn.Linear(64, act_dim), std=0.01))
        self.actor_logstd = nn.Parameter(torch.zeros(1, act_dim))

    def get_value(self, obs):
        return self.critic(obs).squeeze(-1)

    def get_action_and_value(self, obs, action=None):
        """Gaussian policy written out: torch.distributions checks its arguments with host syncs."""
        mean = self.actor_mean(obs)
        log_std = self.actor_logstd.expand_as(mean)
        if action is None:
            action = mean + log_std.exp() * torch.randn_like(mean)
        log_prob = (-0.5 * ((action - mean) / log_std.exp()).pow(2) - log_std - LOG_STD_NORMAL).sum(-1)
        entropy = (0.5 + LOG_STD_NORMAL + log_std).sum(-1)
        return action, log_prob, entropy, self.get_value(obs)


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


def update(minibatch, *, agent, optimizer, args):
    """One clipped-surrogate step on a minibatch (a Batch); metrics stay on the device."""
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
    optimizer.zero_grad()
    loss.backward()
    grad_norm = nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
    optimizer.step()
    return {"policy_loss": pg_loss.detach(), "value_loss": v_loss.detach(), "entropy": entropy_loss.detach(),
            "approx_kl": approx_kl, "clipfrac": clipfrac, "grad_norm": grad_norm.detach()}


def speed_up(fn, compile, cudagraphs):
    """torch.compile fuses the piece's kernels; a CUDA graph then replays all its launches at once (inputs are
    copied into static buffers, outputs cloned). The pieces take and return plain tensors: no TensorDicts."""
    if compile:
        fn = torch.compile(fn)
    if cudagraphs:
        fn = CudaGraphModule(fn, warmup=5)  # the first calls compile and initialise Adam's state, then capture
    return fn


def evaluate(agent, envs, device, seed):
    """Undiscounted return of the first episode in each env, with the mean action."""
    obs, _ = envs.reset(seed=seed)
    returns, finished = np.zeros(envs.num_envs), np.zeros(envs.num_envs, dtype=bool)
    while not finished.all():
        check_signals()
        with torch.no_grad():
            actions = agent.actor_mean(torch.as_tensor(obs, dtype=torch.float32, device=device))
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
    for name in ("num_envs", "num_steps", "num_minibatches", "update_epochs"):
        if getattr(args, name) <= 0:
            fail(f"--{name.replace('_', '-')} must be positive")
    if args.torch_threads < 0:
        fail("--torch-threads must be 0 (one thread) or positive")
    if not 0 < args.learning_rate < math.inf:  # also refuses nan
        fail("--learning-rate must be a positive number")
    if not 0 <= args.gamma <= 1 or not 0 <= args.gae_lambda <= 1 or args.eval_episodes < 0:
        fail("--gamma and --gae-lambda must be in [0, 1], --eval-episodes at least 0")
    batch_size = args.num_envs * args.num_steps
    if batch_size % args.num_minibatches:
        fail(f"--num-minibatches {args.num_minibatches} must divide num_envs x num_steps = {batch_size}")
    if 0 < args.total_timesteps < batch_size:
        fail(f"--total-timesteps {args.total_timesteps} is less than one rollout (num_envs x num_steps = {batch_size})")
    minibatch_size = batch_size // args.num_minibatches
    num_iterations = args.total_timesteps // batch_size
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

    envs = make_envs(args.env_id, args.num_envs, args.gamma)
    normalizers = obs_normalizers(envs)
    obs_dim = math.prod(envs.single_observation_space.shape)
    act_dim = math.prod(envs.single_action_space.shape)
    agent = Agent(obs_dim, act_dim).to(device)
    # Tensor learning rate and capturable state: annealing writes into the tensor, so graphs never recapture.
    learning_rate = torch.tensor(args.learning_rate, device=device)
    optimizer = torch.optim.Adam(agent.parameters(), lr=learning_rate, eps=1e-5, fused=True, capturable=cudagraphs_active)
    loaded = {}
    if args.load_model:
        try:
            loaded = torch.load(args.load_model, map_location=device, weights_only=True)
            if loaded["obs_dim"] != obs_dim or loaded["act_dim"] != act_dim:
                fail(f"--load-model: {args.load_model} was trained on {loaded['env_id']}, whose spaces differ from {args.env_id}'s")
            agent.load_state_dict(loaded["agent"])
            optimizer.load_state_dict(loaded["optimizer"])
            for normalizer in normalizers:
                normalizer.obs_rms.mean, normalizer.obs_rms.var, normalizer.obs_rms.count = (
                    loaded["obs_mean"].numpy(), loaded["obs_var"].numpy(), loaded["obs_count"])
        except Exception as error:  # empty, truncated, not a torch file, another script's checkpoint
            fail(f"--load-model: {args.load_model} is not a checkpoint of this script ({type(error).__name__})")
    agent_view = Agent(obs_dim, act_dim).to("meta")  # acts with the learner's weights, shared and without grad
    from_module(agent).data.to_module(agent_view)
    agent_view.requires_grad_(False)

    policy_step = speed_up(partial(policy, agent=agent_view), args.compile, cudagraphs_active)
    gae_step = speed_up(partial(gae, gamma=args.gamma, gae_lambda=args.gae_lambda), args.compile, cudagraphs_active)
    update_step = speed_up(partial(update, agent=agent, optimizer=optimizer, args=args), args.compile, cudagraphs_active)

    writer = SummaryWriter(run_dir)
    writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in asdict(args).items()))
    obs = torch.zeros(args.num_steps, args.num_envs, obs_dim, device=device)
    actions = torch.zeros(args.num_steps, args.num_envs, act_dim, device=device)
    logprobs, rewards, dones, values = (torch.zeros(args.num_steps, args.num_envs, device=device) for _ in range(4))
    recent_returns, metrics, num_updates, env_seconds, stopped = deque(maxlen=20), {}, 0, 0.0, None
    steady_start_time = steady_start_step = None
    next_line_time = time.perf_counter()
    for normalizer in normalizers:  # a checkpoint's statistics are not moved by the reset observation
        normalizer.update_running_mean = not loaded
    next_obs_np, _ = envs.reset(seed=args.seed)
    for normalizer in normalizers:
        normalizer.update_running_mean = True
    next_obs = torch.as_tensor(next_obs_np, dtype=torch.float32, device=device)
    next_done = torch.zeros(args.num_envs, device=device)
    global_step = 0
    progress = tqdm(range(num_iterations), disable=not sys.stderr.isatty())
    for signum in (signal.SIGINT, signal.SIGTERM):  # a SIGINT ignored by the shell (a background job) stays so
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, note_signal)
    try:
        for iteration in progress:
            if iteration == args.measure_burnin:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                steady_start_time, steady_start_step, env_seconds = time.perf_counter(), global_step, 0.0
            lr_now = (1.0 - iteration / num_iterations) * args.learning_rate if args.anneal_lr else args.learning_rate
            learning_rate.fill_(lr_now)

            for step in range(args.num_steps):
                check_signals()
                obs[step], dones[step] = next_obs, next_done
                actions[step], logprobs[step], values[step] = policy_step(next_obs)
                env_start = time.perf_counter()
                next_obs_np, reward, terminations, truncations, infos = envs.step(actions[step].cpu().numpy())
                env_seconds += time.perf_counter() - env_start
                global_step += args.num_envs
                # one host-to-device copy for observations, rewards and dones together
                step_data = np.concatenate([next_obs_np, reward[:, None], (terminations | truncations)[:, None]], 1)
                step_data = torch.from_numpy(step_data).to(device, torch.float32)
                next_obs, rewards[step], next_done = step_data[:, :obs_dim], step_data[:, obs_dim], step_data[:, obs_dim + 1]
                if "final_info" in infos and "episode" in infos["final_info"]:
                    episodes = infos["final_info"]["episode"]
                    for episode_return in episodes["r"][episodes["_r"]]:
                        recent_returns.append(float(episode_return))
                        writer.add_scalar("charts/episodic_return", episode_return, global_step)

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

            logged = dict(zip(metrics, torch.stack(list(metrics.values())).tolist()))  # one sync per iteration
            check_finite(logged, global_step)
            for name, value in logged.items():
                writer.add_scalar(f"losses/{name}", value, global_step)
            writer.add_scalar("charts/learning_rate", lr_now, global_step)
            if steady_start_time is not None and global_step > steady_start_step:
                sps = (global_step - steady_start_step) / (time.perf_counter() - steady_start_time)
                writer.add_scalar("charts/SPS", sps, global_step)
                recent = f"{np.mean(recent_returns):.1f}" if recent_returns else "none yet"
                progress.set_postfix(sps=f"{sps:.0f}", ret=recent)
                if progress.disable and time.perf_counter() >= next_line_time:
                    print(f"step {global_step}/{args.total_timesteps}: {sps:.0f} SPS, return {recent}",
                          file=sys.stderr, flush=True)
                    next_line_time = time.perf_counter() + LINE_EVERY
    except Stopped as stop:
        stopped = stop
    progress.close()

    if device.type == "cuda":
        torch.cuda.synchronize()
    end_time = time.perf_counter()
    envs.close()
    if steady_start_time is None:  # the run ended before the steady phase began
        steady_start_time, steady_start_step, env_seconds = end_time, global_step, 0.0
    steady_steps, steady_seconds = global_step - steady_start_step, end_time - steady_start_time

    obs_stats = normalizers[0].obs_rms  # env 0's statistics stand for all (each env keeps its own)
    eval_returns = []
    if args.eval_episodes > 0 and not stopped:
        video_folder = os.path.join(run_dir, "videos") if args.capture_video else None
        eval_envs = make_envs(args.env_id, args.eval_episodes, args.gamma, training=False, video_folder=video_folder)
        for normalizer in obs_normalizers(eval_envs):
            normalizer.update_running_mean = False
            normalizer.obs_rms.mean, normalizer.obs_rms.var = obs_stats.mean.copy(), obs_stats.var.copy()
        try:
            eval_returns = evaluate(agent_view, eval_envs, device, seed=args.seed + 10_000)
            writer.add_scalar("eval/episodic_return", np.mean(eval_returns), global_step)
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
        "num_updates": num_updates, "final_metrics": {k: v.item() for k, v in metrics.items()},
        "steps_done": global_step, "stopped": str(stopped) if stopped else None,
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
            "agent": agent.state_dict(), "optimizer": optimizer.state_dict(),
            "obs_mean": torch.as_tensor(obs_stats.mean), "obs_var": torch.as_tensor(obs_stats.var),
            "obs_count": float(obs_stats.count),
        }
        buffer = io.BytesIO()  # torch.save's own file errors are opaque (RuntimeError: unexpected pos ...)
        torch.save(checkpoint, buffer)
        write_atomic(os.path.join(run_dir, "model.pt"), buffer.getvalue())

    evaluation = f"eval return {summary['eval_return_mean']:.1f}" if eval_returns else "no evaluation"
    print(f"{global_step} steps, {summary['sps'] or 0:.0f} SPS, {evaluation}; written to {run_dir}")
    print("SPEED " + json.dumps(summary))
    if stopped:
        print(f"error: {stopped}" if diverged else f"{stopped}: the steps done are in {run_dir}", file=sys.stderr)
        sys.exit(stopped.exit_code)
