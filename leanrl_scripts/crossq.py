"""CrossQ (Bhatt et al. 2024): SAC without target networks, Batch Renormalization in a wide critic, one file.

The critics see (s, a) and (s', pi(s')) in one pass, both halves normalized by one batch's statistics: no target
copy to keep, for a critic batch twice as long. The actions and the actor's loss read the networks in eval mode
(running statistics) through detached views; the pieces take torch.compile and CUDA graphs.
    python leanrl_scripts/crossq.py --env-id HalfCheetah-v5 --compile --cudagraphs
"""

import copy
import math
import sys
from dataclasses import dataclass
from functools import partial

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import tyro
from tensordict import from_module
from tensordict.nn import CudaGraphModule

from run_bookkeeping import Flag, Run, RunArgs, check_spaces, fail, stop_if_signalled


@dataclass
class Args(RunArgs):
    env_id: str = "HalfCheetah-v5"
    """the id of the gymnasium environment (continuous actions)"""
    total_timesteps: int = 1_000_000
    """total environment steps (0 only with --load-model: evaluate it)"""
    num_envs: Flag.Count = 1
    """the number of parallel environments"""
    buffer_size: Flag.Count = 1_000_000
    """the replay memory buffer size"""
    gamma: Flag.Fraction = 0.99
    """the discount factor gamma"""
    batch_size: Flag.Count = 256
    """the batch size of samples from the replay memory"""
    learning_starts: Flag.BeforeTheEnd = 5_000
    """environment steps of random actions before learning starts"""
    learning_rate: Flag.Positive = 1e-3
    """the learning rate of the actor, critic and entropy coefficient optimizers"""
    policy_delay: Flag.Count = 3
    """the actor is trained once every `policy_delay` critic updates"""
    critic_hidden_dim: Flag.Count = 2048
    """the width of the critic's two hidden layers"""
    batch_renorm_momentum: Flag.PositiveFraction = 0.01
    """the momentum of Batch Renormalization's running statistics"""
    batch_renorm_warmup: Flag.CountFrom0 = 100_000
    """Batch Renormalization's steps as plain batch norm (r=1, d=0) before r and d are clipped"""
    actor_batch_norm: bool = True
    """Batch Renormalization in the actor too (SB3-contrib's default)"""
    alpha: Flag.Positive = 0.2
    """the entropy coefficient with --no-autotune"""
    autotune: bool = True
    """automatic tuning of the entropy coefficient"""
    measure_burnin: Flag.CountFrom0 = 50
    """updates the speed figure leaves out (compilation, graph capture)"""


LOG_EVERY = 100  # iterations between metric reads (a host sync each)
LOG_STD_MIN = -20.0  # clamped, as SB3-contrib's (CleanRL's SAC squashes into [-5, 2]: a less random first policy)
LOG_STD_MAX = 2.0
ADAM_BETAS = (0.5, 0.999)  # the actor's and critic's, as in SB3-contrib's CrossQ; alpha's Adam keeps (0.9, 0.999)


def make_env(env_id, video_folder=None):
    def thunk():
        env = gym.make(env_id, render_mode="rgb_array" if video_folder else None)
        if isinstance(env.observation_space, gym.spaces.Dict):  # dm_control's named observations
            env = gym.wrappers.FlattenObservation(env)
        if video_folder:
            env = gym.wrappers.RecordVideo(env, video_folder, episode_trigger=lambda episode: episode == 0)
        return gym.wrappers.RecordEpisodeStatistics(env)

    return thunk


def make_envs(env_id, num_envs, video_folder=None):
    """A vector env that records episodes; a step that ends one returns the reset observation, the final in infos."""
    if env_id.startswith("dm_control/"):  # through shimmy, as CleanRL runs it
        try:
            import shimmy  # noqa: F401  (registers the ids)
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
    except Exception as error:
        fail(f"{env_id}: {error}")
    check_spaces(env_id, envs.single_action_space, gym.spaces.Box, envs.single_observation_space, gym.spaces.Box)
    return envs


def true_next_obs(next_obs, infos):
    """The observations the step led to: the final one where an episode ended (a truncated one bootstraps from it)."""
    if "final_obs" not in infos:
        return next_obs
    ended = infos["_final_obs"]
    real_next_obs = next_obs.copy()
    real_next_obs[ended] = np.stack(infos["final_obs"][ended])
    return real_next_obs


class BatchRenorm(nn.Module):
    """Batch Renormalization (Ioffe 2017) over a batch's rows: in training, the batch normalized by its statistics
    corrected towards the running ones (r, d), which follow the batches; in eval mode, the running statistics."""

    def __init__(self, num_features, momentum, warmup_steps, eps=1e-3, r_max=3.0, d_max=5.0):
        super().__init__()
        self.momentum, self.warmup_steps, self.eps, self.r_max, self.d_max = momentum, warmup_steps, eps, r_max, d_max
        self.scale = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        # buffers: a checkpoint holds them, and a detached view reads them as they are updated
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))
        self.register_buffer("steps", torch.tensor(0))

    def forward(self, x):
        if self.training:
            mean = x.mean(0)
            # unbiased, as a sum: x.var(0) reduces across rows ten times slower on a CPU
            var = (x - mean).square().sum(0) / (len(x) - 1)
            running_std = (self.running_var + self.eps).sqrt()
            # a tensor condition, not a branch: no host sync; in warm-up r=1, d=0 is plain batch norm
            renorm = self.steps > self.warmup_steps
            r = torch.where(renorm, ((var + self.eps).sqrt() / running_std).clamp(1 / self.r_max, self.r_max), 1.0)
            d = torch.where(renorm, ((mean - self.running_mean) / running_std).clamp(-self.d_max, self.d_max), 0.0)
            r, d = r.detach(), d.detach()
            with torch.no_grad():
                self.running_mean.lerp_(mean, self.momentum)
                self.running_var.lerp_(var, self.momentum)
                self.steps.add_(1)
            mean, var = mean - d * var.sqrt() / r, var / r.pow(2)
        else:
            mean, var = self.running_mean, self.running_var
        return (x - mean) / (var + self.eps).sqrt() * self.scale + self.bias


def mlp(sizes, norm):
    """Linear layers with ReLU between, each after a `norm(width)` (the input's too), as SB3-contrib's CrossQ."""
    layers = []
    for width, out in zip(sizes, sizes[1:]):
        layers += [norm(width), nn.Linear(width, out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class Actor(nn.Module):
    """Gaussian policy squashed by tanh into the action bounds."""

    def __init__(self, obs_dim, action_space, norm):
        super().__init__()
        act_dim = math.prod(action_space.shape)
        self.trunk = nn.Sequential(mlp([obs_dim, 256, 256], norm), nn.ReLU(), norm(256))
        self.mean = nn.Linear(256, act_dim)
        self.log_std = nn.Linear(256, act_dim)
        high = torch.tensor(action_space.high)
        low = torch.tensor(action_space.low)
        self.register_buffer("action_scale", ((high - low) / 2).float())
        self.register_buffer("action_bias", ((high + low) / 2).float())

    def forward(self, obs):
        """A sampled action, its log-probability, and the deterministic (mean) action."""
        hidden = self.trunk(obs)
        mean = self.mean(hidden)
        log_std = self.log_std(hidden).clamp(LOG_STD_MIN, LOG_STD_MAX)
        noise = torch.randn_like(mean)
        pre_tanh = mean + log_std.exp() * noise
        # no torch.distributions (its argument checks sync); SB3-contrib's epsilon: a saturated action costs no entropy
        log_prob = -0.5 * noise.pow(2) - log_std - 0.5 * math.log(2 * math.pi)
        squashed = torch.tanh(pre_tanh)
        log_prob = log_prob - torch.log(1 - squashed.pow(2) + 1e-6) - self.action_scale.log()
        action = squashed * self.action_scale + self.action_bias
        return action, log_prob.sum(-1), torch.tanh(mean) * self.action_scale + self.action_bias


class SoftQNetwork(nn.Module):
    def __init__(self, obs_dim, act_dim, hidden_dim, norm):
        super().__init__()
        self.net = mlp([obs_dim + act_dim, hidden_dim, hidden_dim, 1], norm)

    def forward(self, obs, actions):
        return self.net(torch.cat([obs, actions], -1)).squeeze(-1)


class Ensemble(nn.Module):
    """Two networks from `make()`, each its own initial weights, called as one: their outputs stacked."""

    def __init__(self, make):
        super().__init__()
        self.members = nn.ModuleList(make() for _ in range(2))

    def forward(self, *inputs):
        return torch.stack([member(*inputs) for member in self.members])


class ReplayBuffer:
    """Transitions as rows [obs | action | reward | next_obs | termination] of one device tensor: a step is one
    copy in, a batch one gather."""

    def __init__(self, size, obs_dim, act_dim, num_envs, device):
        self.columns = [obs_dim, act_dim, 1, obs_dim, 1]
        self.rows = torch.zeros(size, sum(self.columns), device=device)
        self.env_offsets = torch.arange(num_envs, device=device)
        self.size = size
        self.pos = 0
        self.count = 0

    def add(self, obs, actions, rewards, next_obs, terminations):
        step = np.concatenate([obs, actions, rewards[:, None], next_obs, terminations[:, None]], 1)
        self.rows[(self.pos + self.env_offsets) % self.size] = torch.from_numpy(step).to(self.rows)
        self.pos = (self.pos + len(step)) % self.size
        self.count = min(self.count + len(step), self.size)

    def sample(self, batch_size):
        """obs, actions, rewards, next_obs, terminations."""
        batch = self.rows[torch.randint(0, self.count, (batch_size,), device=self.rows.device)]
        obs, actions, rewards, next_obs, terminations = batch.split(self.columns, dim=1)
        return obs, actions, rewards.squeeze(1), next_obs, terminations.squeeze(1)


def policy(obs, *, actor, deterministic=False):
    """Sampled actions (`deterministic`: the mean); `actor`, a detached view, records no graph."""
    return actor(obs)[2 if deterministic else 0]


def critic_loss(obs, actions, rewards, next_obs, terminations, *, actor_view, qnet, alpha, gamma):
    """The critics' TD loss, their mean as in SB3-contrib (0.5 times their sum), and CleanRL's metrics.
    No target network: (s, a) and (s', a') go through the critics in one pass, in train mode, so one batch's
    statistics normalize both halves; the s' half, detached, makes the target."""
    with torch.no_grad():
        next_actions, next_log_prob, _ = actor_view(next_obs)
    all_q = qnet(torch.cat([obs, next_obs]), torch.cat([actions, next_actions]))
    q_values, next_q = all_q.split(len(obs), dim=1)
    next_q = next_q.detach().min(0).values - alpha * next_log_prob
    q_target = rewards + gamma * (1 - terminations) * next_q
    q_losses = (q_values - q_target).pow(2).mean(1)
    losses = q_losses.detach()
    q_means = q_values.detach().mean(1)  # CleanRL's tags: qf_loss is the critics' mean
    metrics = {"qf_loss": losses.mean(), "qf1_loss": losses[0], "qf2_loss": losses[1]}
    return q_losses.mean(), {**metrics, "qf1_values": q_means[0], "qf2_values": q_means[1]}


def actor_loss(obs, *, actor, qnet_view, alpha, log_alpha, target_entropy):
    """The actor's loss plus, autotuned, alpha's (no parameter is in both); `qnet_view` reads the critics detached
    and in eval mode (running statistics), the actor is in train mode."""
    actions, log_prob, _ = actor(obs)
    loss = (alpha * log_prob - qnet_view(obs, actions).min(0).values).mean()
    metrics = {"actor_loss": loss.detach()}
    if log_alpha.requires_grad:  # autotuned: keep the policy's entropy near target_entropy
        # on log alpha, as SB3-contrib's: CleanRL's alpha * (...) shrinks alpha's steps as it falls, too slowly here
        alpha_loss = -(log_alpha * (log_prob.detach() + target_entropy)).mean()
        metrics["alpha_loss"] = alpha_loss.detach()
        loss = loss + alpha_loss
    return loss, metrics


def update_critics(*batch, loss_fn, actor_view, qnet, alpha, gamma, optimizer):
    """One step of the critics on `loss_fn`, the compiled critic_loss."""
    loss, metrics = loss_fn(*batch, actor_view=actor_view, qnet=qnet, alpha=alpha, gamma=gamma)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return metrics


def update_actor(obs, *, loss_fn, actor, qnet_view, alpha, log_alpha, target_entropy, optimizers):
    """One step of the actor (and, autotuned, of alpha) on `loss_fn`, the compiled actor_loss; alpha follows
    log_alpha in place."""
    loss, metrics = loss_fn(
        obs, actor=actor, qnet_view=qnet_view, alpha=alpha, log_alpha=log_alpha, target_entropy=target_entropy
    )
    for optimizer in optimizers:
        optimizer.zero_grad()
    loss.backward()
    for optimizer in optimizers:
        optimizer.step()
    alpha.copy_(log_alpha.detach().exp())
    return metrics


def detached_view(module):
    """`module` copied to the meta device in eval mode, reading its weights and buffers shared and without grad."""
    view = copy.deepcopy(module).to("meta")
    from_module(module).data.to_module(view)
    return view.requires_grad_(False).eval()


def evaluate(actor, args, device, video_folder):
    """The return of one episode in each of --eval-episodes envs, with the deterministic action."""
    envs = make_envs(args.env_id, args.eval_episodes, video_folder)
    obs, _ = envs.reset(seed=args.seed + 10_000)
    returns = np.zeros(envs.num_envs)
    finished = np.zeros(envs.num_envs, dtype=bool)
    while not finished.all():
        stop_if_signalled()
        actions = policy(torch.as_tensor(obs, dtype=torch.float32, device=device), actor=actor, deterministic=True)
        obs, rewards, terminations, truncations, _ = envs.step(actions.cpu().numpy())
        returns += rewards * ~finished
        finished |= terminations | truncations
    envs.close()
    return returns.tolist()


if __name__ == "__main__":
    args = tyro.cli(Args)
    run = Run(args)
    if args.buffer_size < args.batch_size:
        fail(f"--buffer-size {args.buffer_size} must hold at least one batch (--batch-size {args.batch_size})")
    device = run.device
    # the cores idle at start: a second thread pays on an idle machine, not beside busy processes; each update's
    # activations, above glibc's mmap threshold, stay in the heap instead of being faulted in anew
    run.tune_cpu(threads="idle", keep_freed_memory=True)

    envs = make_envs(args.env_id, args.num_envs)
    envs.action_space.seed(args.seed)
    obs_dim = math.prod(envs.single_observation_space.shape)
    act_dim = math.prod(envs.single_action_space.shape)
    run.check_fits(args.buffer_size * (2 * obs_dim + act_dim + 2) * 4, "--buffer-size")

    norm = partial(BatchRenorm, momentum=args.batch_renorm_momentum, warmup_steps=args.batch_renorm_warmup)
    # nn.Identity takes the width and ignores it
    actor = Actor(obs_dim, envs.single_action_space, norm if args.actor_batch_norm else nn.Identity).to(device)
    qnet = Ensemble(partial(SoftQNetwork, obs_dim, act_dim, args.critic_hidden_dim, norm)).to(device)
    # autotuned, alpha starts at 1.0, as in CleanRL's and SB3's SAC
    log_alpha = torch.tensor(0.0, device=device, requires_grad=args.autotune)
    actor_view = detached_view(actor)
    qnet_view = detached_view(qnet)
    # Tensor learning rates and capturable state let CUDA graphs replay the optimizer step.
    adam = partial(torch.optim.Adam, fused=True, capturable=run.cudagraphs)
    lr = torch.tensor(args.learning_rate, device=device)
    q_optimizer = adam(qnet.parameters(), lr=lr, betas=ADAM_BETAS)
    actor_optimizer = adam(actor.parameters(), lr=lr.clone(), betas=ADAM_BETAS)
    # alpha's optimizer steps only when autotuned; checkpoints hold it either way
    alpha_optimizer = adam([log_alpha], lr=lr.clone())
    states = dict(
        actor=actor,
        qnet=qnet,
        q_optimizer=q_optimizer,
        actor_optimizer=actor_optimizer,
        alpha_optimizer=alpha_optimizer,
        log_alpha=log_alpha,
    )
    loaded = run.save_and_load(states, obs_dim=obs_dim, act_dim=act_dim)
    if not args.autotune:  # a fixed alpha is the flag's, whatever a checkpoint held
        log_alpha.fill_(math.log(args.alpha))
    alpha = log_alpha.detach().exp()  # updated in place by the alpha step when autotuned

    # each function compiled before its arguments are bound: a compiled partial is one wrapper, one cache, to dynamo
    maybe_compile = partial(torch.compile, disable=not args.compile)
    policy_step = partial(maybe_compile(policy), actor=actor_view)
    critic_step = partial(
        update_critics,
        loss_fn=maybe_compile(critic_loss),
        optimizer=q_optimizer,
        actor_view=actor_view,
        qnet=qnet,
        alpha=alpha,
        gamma=args.gamma,
    )
    actor_optimizers = [actor_optimizer, alpha_optimizer] if args.autotune else [actor_optimizer]
    actor_step = partial(
        update_actor,
        loss_fn=maybe_compile(actor_loss),
        optimizers=actor_optimizers,
        actor=actor,
        qnet_view=qnet_view,
        alpha=alpha,
        log_alpha=log_alpha,
        target_entropy=-float(act_dim),
    )
    if run.cudagraphs:  # captured after the first calls (compilation, Adam's state)
        graphed = partial(CudaGraphModule, warmup=5)
        policy_step, critic_step, actor_step = map(graphed, (policy_step, critic_step, actor_step))

    rb = ReplayBuffer(args.buffer_size, obs_dim, act_dim, args.num_envs, device)
    num_updates, first_iteration = 0, 0
    metrics = {}
    global_step = 0
    num_iterations = args.total_timesteps // args.num_envs
    obs, _ = envs.reset(seed=args.seed)
    # with --resume: every state and random generator as its last checkpoint left them, and the loop's counters
    if resumed := run.resumable(alpha=alpha, rb=rb, envs=envs):
        first_iteration, num_updates = resumed["iteration"], resumed["num_updates"]
        obs, metrics = resumed["obs"], resumed["metrics"]
    run.start()
    with run.stoppable():
        for iteration in range(first_iteration, num_iterations):
            global_step = iteration * args.num_envs
            run.checkpoint_if_due(global_step, iteration=iteration, num_updates=num_updates, obs=obs, metrics=metrics)
            stop_if_signalled()
            if global_step >= args.learning_starts and num_updates >= args.measure_burnin:
                run.start_speed_measure(global_step)
            if global_step < args.learning_starts and not loaded:
                actions = envs.action_space.sample()
            else:
                actions = policy_step(torch.as_tensor(obs, dtype=torch.float32, device=device)).cpu().numpy()
            next_obs, rewards, terminations, truncations, infos = run.timed_env_call(envs.step, actions)
            run.record_gymnasium_episodes(global_step, infos)
            rb.add(obs, actions, rewards, true_next_obs(next_obs, infos), terminations)
            obs = next_obs

            if global_step + args.num_envs > args.learning_starts:
                batch = rb.sample(args.batch_size)
                metrics.update(critic_step(*batch))
                num_updates += 1
                if num_updates % args.policy_delay == 0:
                    metrics.update(actor_step(batch[0]))
            if iteration % LOG_EVERY == 0:
                run.log(global_step, {**metrics, "alpha": alpha} if metrics else {})
        global_step = num_iterations * args.num_envs
    run.end_training(global_step, metrics)
    envs.close()

    pieces = ["actor_loss", "critic_loss", "policy"]
    summary = {"num_updates": num_updates, "alpha": alpha.item(), "compiled_pieces": pieces if args.compile else []}
    sys.exit(run.write_and_evaluate(partial(evaluate, actor_view, args, device, run.video_folder), summary))
