"""Deep Q-Network (DQN, Mnih et al. 2015) for discrete-action classic control, one file.

Speed: the replay memory is one device tensor, the acting network is a detached view of the learner, the
exploration coins are drawn on the host (the network runs only when some env exploits), and the action step and the
update take torch.compile and CUDA graphs. dqn_atari_async.py plays in a second process.
    python leanrl_scripts/dqn.py --env-id CartPole-v1 --compile
"""

import math
import sys
from dataclasses import dataclass
from functools import partial

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro
from tensordict import from_module
from tensordict.nn import CudaGraphModule

from run_bookkeeping import Flag, Run, RunArgs, check_spaces, fail, stop_if_signalled


@dataclass
class Args(RunArgs):
    env_id: str = "CartPole-v1"
    """the id of the gymnasium environment (discrete actions, flat observations)"""
    total_timesteps: int = 500_000
    """total environment steps (0 only with --load-model: evaluate it)"""
    learning_rate: Flag.Positive = 2.5e-4
    """the learning rate of the optimizer"""
    num_envs: Flag.Count = 1
    """the number of parallel environments"""
    buffer_size: Flag.Count = 10_000
    """the replay memory buffer size (transitions)"""
    gamma: Flag.Fraction = 0.99
    """the discount factor gamma"""
    tau: Flag.PositiveFraction = 1.0
    """the target network update rate (1.0: a hard copy)"""
    target_network_frequency: Flag.Count = 500
    """environment steps between target network updates"""
    batch_size: Flag.Count = 128
    """the batch size of samples from the replay memory"""
    start_e: Flag.Fraction = 1.0
    """the starting epsilon for exploration"""
    end_e: Flag.Fraction = 0.05
    """the ending epsilon for exploration"""
    exploration_fraction: Flag.PositiveFraction = 0.5
    """the fraction of `total_timesteps` it takes from start_e to end_e"""
    learning_starts: Flag.BeforeTheEnd = 10_000
    """environment steps before learning starts"""
    train_frequency: Flag.Count = 10
    """the frequency of training (environment steps per update)"""
    measure_burnin: Flag.CountFrom0 = 50
    """updates the speed figure leaves out (compilation, graph capture)"""


LOG_EVERY = 100  # updates between metric reads (a host sync each)


def make_envs(env_id, num_envs, seed=0, video_folder=None):
    """A vector env that records episodes (and with `video_folder` the first env's first one as a video); a step
    that ends one returns the reset observation, the final in infos."""

    def make_env(record):
        env = gym.make(env_id, render_mode="rgb_array" if record else None)
        if record:
            env = gym.wrappers.RecordVideo(env, video_folder, episode_trigger=lambda episode: episode == 0)
        return gym.wrappers.RecordEpisodeStatistics(env)

    try:
        thunks = [partial(make_env, video_folder and i == 0) for i in range(num_envs)]
        envs = gym.vector.SyncVectorEnv(thunks, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    except gym.error.UnregisteredEnv:
        fail(f"unknown env id '{env_id}': ids come from gymnasium's registry (gymnasium.pprint_registry())")
    except Exception as error:
        fail(f"{env_id}: {error}")
    check_spaces(env_id, envs.single_action_space, gym.spaces.Discrete, envs.single_observation_space, gym.spaces.Box)
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
    is sampled: one copy per update, not per step (docs/dqn.md)."""

    def __init__(self, buffer_size, obs_dim, num_envs, device, staged_steps=64):
        self.columns = [obs_dim, 1, 1, obs_dim, 1]
        rows = math.ceil(buffer_size / num_envs) * num_envs  # a step's rows never wrap around
        self.rows = torch.zeros(rows, sum(self.columns), device=device)
        self.staged = np.zeros((min(staged_steps * num_envs, rows), sum(self.columns)), np.float32)  # one wrap at most
        self.buffer_size = buffer_size
        self.num_staged = 0
        self.inserted = 0

    def add(self, obs, actions, rewards, next_obs, terminations):
        if self.num_staged == len(self.staged):
            self.flush()
        step = np.concatenate([obs, actions[:, None], rewards[:, None], next_obs, terminations[:, None]], 1)
        self.staged[self.num_staged : self.num_staged + len(step)] = step
        self.num_staged += len(step)

    def flush(self):
        """The staged steps into their rows. On CUDA through pinned memory: a copy from pageable memory would wait
        for the updates queued before it."""
        start = self.inserted % len(self.rows)
        staged = torch.from_numpy(self.staged[: self.num_staged])
        staged = staged.pin_memory() if self.rows.is_cuda else staged  # reused only once the copy is done
        first = min(self.num_staged, len(self.rows) - start)
        self.rows[start : start + first] = staged[:first].to(self.rows.device, non_blocking=True)
        self.rows[: self.num_staged - first] = staged[first:].to(self.rows.device, non_blocking=True)
        self.inserted, self.num_staged = self.inserted + self.num_staged, 0

    def sample(self, batch_size):
        """A uniform batch of the newest min(inserted, buffer_size) transitions."""
        self.flush()
        newest = torch.randint(0, min(self.inserted, self.buffer_size), (batch_size,), device=self.rows.device)
        batch = self.rows[(self.inserted - 1 - newest) % len(self.rows)]
        obs, actions, rewards, next_obs, terminations = batch.split(self.columns, dim=1)
        return obs, actions.long().squeeze(1), rewards.squeeze(1), next_obs, terminations.squeeze(1)


def policy(obs, *, q_network):
    """Greedy actions."""
    return q_network(obs).argmax(-1)


def td_loss(obs, actions, rewards, next_obs, terminations, *, q_network, target_network, gamma):
    """The TD loss and its metrics."""
    with torch.no_grad():
        target_max = target_network(next_obs).max(-1).values
        td_target = rewards + gamma * target_max * (1 - terminations)
    old_val = q_network(obs).gather(1, actions[:, None]).squeeze(1)
    loss = F.mse_loss(td_target, old_val)
    return loss, {"td_loss": loss.detach(), "q_values": old_val.mean().detach()}


def update(*batch, loss_fn, q_network, target_network, optimizer, gamma):
    """One TD step; backward and Adam run outside the compiled `loss_fn`."""
    loss, metrics = loss_fn(*batch, q_network=q_network, target_network=target_network, gamma=gamma)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return metrics


def epsilon_at(step, args):
    """CleanRL's linear_schedule of epsilon."""
    slope = (args.end_e - args.start_e) / (args.exploration_fraction * args.total_timesteps)
    return max(slope * step + args.start_e, args.end_e)


def epsilon_greedy(policy_step, obs, epsilon, rng, num_actions, device):
    """Host coins: the network runs only when some env exploits."""
    exploit = rng.random(len(obs)) >= epsilon
    if not exploit.any():
        return rng.integers(num_actions, size=len(obs))
    greedy = policy_step(torch.from_numpy(obs).to(device, torch.float32, non_blocking=True)).cpu().numpy()
    return greedy if exploit.all() else np.where(exploit, greedy, rng.integers(num_actions, size=len(obs)))


def evaluate(q_network, args, device, video_folder=None):
    """The return of one episode in each of --eval-episodes envs, acting greedily."""
    envs = make_envs(args.env_id, args.eval_episodes, args.seed + 10_000, video_folder)
    obs, _ = envs.reset(seed=args.seed + 10_000)
    returns = np.zeros(envs.num_envs)
    finished = np.zeros(envs.num_envs, dtype=bool)
    while not finished.all():
        stop_if_signalled()
        with torch.no_grad():
            actions = policy(torch.as_tensor(obs, dtype=torch.float32, device=device), q_network=q_network)
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
    if args.learning_starts < args.batch_size:
        fail(f"--learning-starts {args.learning_starts} must be at least --batch-size {args.batch_size}")
    device = run.device
    # One CPU thread: waking more costs a small MLP more than its math
    run.tune_cpu(threads=1)

    envs = make_envs(args.env_id, args.num_envs, args.seed)
    obs_dim = envs.single_observation_space.shape[0]
    num_actions = int(envs.single_action_space.n)
    run.check_fits(args.buffer_size * (2 * obs_dim + 3) * 4, "--buffer-size")
    q_network = QNetwork(obs_dim, num_actions).to(device)
    target_network = QNetwork(obs_dim, num_actions).to(device).requires_grad_(False)
    q_view = QNetwork(obs_dim, num_actions).to("meta")  # the learner's weights, shared, without grad
    from_module(q_network).data.to_module(q_view)
    q_view.requires_grad_(False)
    # tensor lr, capturable Adam: CUDA graphs can replay the step
    learning_rate = torch.tensor(args.learning_rate, device=device)
    optimizer = torch.optim.Adam(q_network.parameters(), lr=learning_rate, fused=True, capturable=run.cudagraphs)
    run.save_and_load({"q_network": q_network, "optimizer": optimizer}, obs_dim=obs_dim, num_actions=num_actions)
    target_network.load_state_dict(q_network.state_dict())
    target_params = from_module(target_network)
    online_params = from_module(q_network).data

    # compiled, then bound: one wrapper, one dynamo cache per function
    maybe_compile = partial(torch.compile, disable=not args.compile)
    policy_step = partial(maybe_compile(policy), q_network=q_view)
    update_step = partial(
        update,
        loss_fn=maybe_compile(td_loss),
        optimizer=optimizer,
        q_network=q_network,
        target_network=target_network,
        gamma=args.gamma,
    )
    if run.cudagraphs:  # captured after warm-up calls (compilation, Adam's state)
        policy_step, update_step = CudaGraphModule(policy_step, warmup=5), CudaGraphModule(update_step, warmup=5)

    rb = ReplayBuffer(args.buffer_size, obs_dim, args.num_envs, device)
    rng = np.random.default_rng(args.seed)
    target_every = max(1, args.target_network_frequency // args.train_frequency)  # in updates
    num_updates, first_iteration = 0, 0
    metrics = {}
    global_step = 0
    obs, _ = envs.reset(seed=args.seed)
    # with --resume: every state and random generator as its last checkpoint left them, and the loop's counters
    if resumed := run.resumable(target_network=target_network, rb=rb, rng=rng, envs=envs):
        first_iteration, num_updates, obs = resumed["iteration"], resumed["num_updates"], resumed["obs"]
    run.start()
    with run.stoppable():
        for iteration in range(first_iteration, args.total_timesteps // args.num_envs):
            global_step = iteration * args.num_envs
            run.checkpoint_if_due(global_step, iteration=iteration, num_updates=num_updates, obs=obs)
            stop_if_signalled()
            actions = epsilon_greedy(policy_step, obs, epsilon_at(global_step, args), rng, num_actions, device)
            next_obs, rewards, terminations, truncations, infos = run.timed_env_call(envs.step, actions)
            real_next_obs = next_obs.copy()  # truncated episodes bootstrap from their true final observation
            if "final_obs" in infos:
                real_next_obs[infos["_final_obs"]] = np.stack(infos["final_obs"][infos["_final_obs"]])
            rb.add(obs, actions, rewards, real_next_obs, terminations)
            obs, global_step = next_obs, global_step + args.num_envs
            run.record_gymnasium_episodes(global_step, infos)

            # the updates these steps owe, at CleanRL's rate
            while num_updates < (global_step - args.learning_starts) // args.train_frequency:
                if num_updates == args.measure_burnin:
                    run.start_speed_measure(global_step)
                metrics = update_step(*rb.sample(args.batch_size))
                num_updates += 1
                if num_updates % target_every == 0:
                    target_params.lerp_(online_params, args.tau)
                if num_updates % LOG_EVERY == 0:
                    replay_ratio = num_updates * args.batch_size / (global_step - args.learning_starts)
                    run.log(
                        global_step,
                        metrics,
                        charts=dict(epsilon=epsilon_at(global_step, args), replay_ratio=replay_ratio),
                    )
    run.end_training(global_step, metrics)
    envs.close()

    summary = {
        "num_updates": num_updates,
        "compiled_pieces": ["policy", "td_loss"] if args.compile else [],
        "replay_ratio_target": args.batch_size / args.train_frequency,
        "replay_ratio_achieved": num_updates * args.batch_size / max(1, global_step - args.learning_starts),
    }
    sys.exit(run.write_and_evaluate(partial(evaluate, q_view, args, device, run.video_folder), summary))
