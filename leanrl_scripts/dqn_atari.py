"""DQN (Mnih et al. 2015) on Atari (envpool, or ALE through gymnasium), one file.

Frames are stored once and stacked at sample time (a quarter of the memory); the acting network is a detached view
of the learner; the action step and the update take torch.compile and CUDA graphs.
    python leanrl_scripts/dqn_atari.py --env-id Breakout-v5 --compile
"""

import math
import os
import sys
from dataclasses import dataclass
from functools import partial
from typing import Literal

# Before torch loads: idle OpenMP threads sleep, not spin on the envs' cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

try:
    import cv2
except ModuleNotFoundError:  # for the gymnasium back-end only
    cv2 = None
import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro
from tensordict import from_module
from tensordict.nn import CudaGraphModule

from run_bookkeeping import Flag, Run, RunArgs, fail, game_mp4, stop_if_signalled, usable_cores


@dataclass
class Args(RunArgs):
    env_id: str = "Breakout-v5"
    """the Atari game as envpool names it (Breakout-v5), either back-end"""
    env_backend: Literal["envpool", "gymnasium"] = "envpool"
    """envpool, or gymnasium (ALE with this script's wrappers)"""
    total_timesteps: int = 10_000_000
    """total environment steps (0 with --load-model: evaluate only)"""
    learning_rate: Flag.Positive = 1e-4
    """the learning rate of the optimizer"""
    num_envs: Flag.Count = 1
    """the number of parallel environments"""
    buffer_size: Flag.Count = 1_000_000
    """the replay memory buffer size (transitions)"""
    gamma: Flag.Fraction = 0.99
    """the discount factor gamma"""
    tau: Flag.PositiveFraction = 1.0
    """the target network update rate (1.0: a hard copy)"""
    target_network_frequency: Flag.Count = 1000
    """environment steps between target network updates"""
    batch_size: Flag.Count = 32
    """the batch size of samples from the replay memory"""
    start_e: Flag.Fraction = 1.0
    """the starting epsilon for exploration"""
    end_e: Flag.Fraction = 0.01
    """the ending epsilon for exploration"""
    exploration_fraction: Flag.PositiveFraction = 0.10
    """the fraction of `total_timesteps` it takes from start_e to end_e"""
    learning_starts: Flag.BeforeTheEnd = 80_000
    """environment steps before learning starts"""
    train_frequency: Flag.Count = 4
    """the frequency of training (environment steps per update)"""
    measure_burnin: Flag.CountFrom0 = 50
    """updates the speed figure leaves out (compilation, graph capture)"""


LOG_EVERY = 100  # a host sync each


class EpisodicLife(gym.Wrapper):
    """Lost lives end episodes, not the game; info keeps the raw reward and game end."""

    def __init__(self, env):
        super().__init__(env)
        self.lives = 0
        self.game_over = True

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.game_over = terminated or truncated
        lives = self.unwrapped.ale.lives()
        info = {**info, "reward": reward, "terminated": terminated}
        terminated = terminated or 0 < lives < self.lives
        self.lives = lives
        return obs, reward, terminated, truncated, info

    def reset(self, **kwargs):
        if self.game_over:
            obs, info = self.env.reset(**kwargs)
        else:
            obs, _, _, _, info = self.env.step(0)
        self.lives = self.unwrapped.ale.lives()
        return obs, {**info, "reward": 0.0, "terminated": False}


class FireReset(gym.Wrapper):
    """Presses FIRE after a reset (games that need it)."""

    def reset(self, **kwargs):
        self.env.reset(**kwargs)
        for action in (1, 2):
            obs, _, terminated, truncated, info = self.env.step(action)
            if terminated or truncated:
                obs, info = self.env.reset(**kwargs)
        return obs, info


def make_gym_env(env_id, render=False):
    """DQN preprocessing on ALE, at envpool's v5 settings."""
    env = gym.make(
        f"ALE/{env_id}", frameskip=1, repeat_action_probability=0.0, render_mode="rgb_array" if render else None
    )
    env = EpisodicLife(gym.wrappers.AtariPreprocessing(env, noop_max=30, frame_skip=4, screen_size=84))
    if "FIRE" in env.unwrapped.get_action_meanings():
        env = FireReset(env)
    env = gym.wrappers.TransformReward(env, np.sign)
    return gym.wrappers.FrameStackObservation(env, 4, padding_type="reset")


def make_envs(env_id, num_envs, seed=0, backend="envpool", render=False):
    """Training envs, a lost life ending an episode; the step after an episode's end is a reset, not a transition
    (CleanRL's wrappers reset within the step)."""
    if backend == "envpool":
        try:
            import envpool  # the gymnasium back-end runs without it
        except ModuleNotFoundError:
            fail('envpool is not installed: pip install ".[envpool]" (or run with --env-backend gymnasium)')
        if env_id not in envpool.list_all_envs():
            fail(f"unknown env id '{env_id}': ids come from envpool.list_all_envs(), Atari games look like Breakout-v5")
        if type(envpool.make_spec(env_id)).__name__ != "AtariEnvSpec":
            fail(f"{env_id} is not an Atari game (continuous control: sac_continuous_action.py, classic: dqn.py)")
        threads = min(num_envs, usable_cores())  # envpool's default counts the host's cores
        game = dict(episodic_life=True, reward_clip=True, render_mode="rgb_array" if render else None)
        return envpool.make(env_id, env_type="gymnasium", num_envs=num_envs, num_threads=threads, seed=seed, **game)
    try:
        import ale_py  # registers the ALE/ ids
    except ModuleNotFoundError:
        ale_py = None
    if ale_py is None or cv2 is None:
        fail('the gymnasium back-end needs ale-py and OpenCV: pip install ".[atari]"')
    gym.register_envs(ale_py)
    try:
        envs = gym.vector.SyncVectorEnv(
            [partial(make_gym_env, env_id, render)] * num_envs, autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP
        )
    except Exception as error:
        fail(f"unknown env id '{env_id}' on ALE, or it cannot be made (games look like Breakout-v5): {error}")
    envs.reset(seed=seed)
    return envs


class QNetwork(nn.Module):
    """The Nature DQN network, channels-last (mkldnn's fast CPU kernels)."""

    def __init__(self, num_actions):
        super().__init__()
        self.network = nn.Sequential(
            nn.Conv2d(4, 32, 8, stride=4),
            nn.ReLU(),
            nn.Conv2d(32, 64, 4, stride=2),
            nn.ReLU(),
            nn.Conv2d(64, 64, 3, stride=1),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(3136, 512),
            nn.ReLU(),
            nn.Linear(512, num_actions),
        ).to(memory_format=torch.channels_last)

    def forward(self, obs):
        return self.network(obs.contiguous(memory_format=torch.channels_last) / 255.0)


class FrameReplay:
    """Replay storage with each frame once: row t of lane e holds env e's t-th frame, its step's action, reward,
    termination, `valid` (not a reset step) and `first` (a stack starts)."""

    def __init__(self, buffer_size, num_envs, device, stack=4):
        self.buffer_rows = math.ceil(buffer_size / num_envs)
        self.stack = stack
        rows = self.buffer_rows + stack  # the oldest sampled row keeps its stack
        # empty: pages fault in as rows fill; only written rows are read
        self.frames = torch.empty((rows, num_envs, 84, 84), dtype=torch.uint8, device=device)
        self.actions = torch.zeros((rows, num_envs), dtype=torch.long, device=device)
        self.rewards, self.terminations = (torch.zeros((rows, num_envs), device=device) for _ in range(2))
        self.valid, self.first = (torch.zeros((rows, num_envs), dtype=torch.bool, device=device) for _ in range(2))
        self.next_valid = np.ones(num_envs, dtype=bool)
        self.next_first = np.ones(num_envs, dtype=bool)
        self.restarting = np.zeros(num_envs, dtype=bool)  # a restart shows one row late

    def add(self, step, obs, actions, rewards, terminations, reset, restart):
        """`reset`: envs whose next step is a reset; `restart`: those whose stack restarts."""
        row = step % len(self.frames)
        flags = (self.next_valid, self.next_first)
        self.next_valid, self.next_first, self.restarting = ~reset, self.restarting, restart
        columns = (self.frames, self.actions, self.rewards, self.terminations, self.valid, self.first)
        for column, value in zip(columns, (obs[:, -1], actions, rewards, terminations, *flags)):
            column[row] = torch.as_tensor(value).to(column.device, column.dtype, non_blocking=True)

    def new_games(self, step):
        self.valid[(step - 1) % len(self.frames)] = False  # lost its next frame
        self.next_valid[:], self.next_first[:], self.restarting[:] = True, True, False

    def sample(self, steps, batch_size):
        """Uniform valid transitions: draw twice the batch, keep the first valid (exact unless over half are resets)."""
        rows = len(self.frames)
        lanes = self.frames.shape[1]
        age = torch.randint(0, min(steps - 1, self.buffer_rows), (2 * batch_size,), device=self.frames.device)
        row = (steps - 2 - age) % rows
        lane = torch.randint_like(age, lanes)
        keep = torch.argsort((~self.valid[row, lane]).byte(), stable=True)[:batch_size]
        row, lane = row[keep], lane[keep]
        obs, next_obs = self.stacks(row, lane)
        return obs, self.actions[row, lane], self.rewards[row, lane], next_obs, self.terminations[row, lane]

    def stacks(self, row, lane):
        """Stacks of rows `row` and `row + 1`."""
        rows = len(self.frames)
        chain = [(row + 1) % rows]
        for _ in range(self.stack):
            chain.append(torch.where(self.first[chain[-1], lane], chain[-1], (chain[-1] - 1) % rows))
        frames = self.frames[torch.stack(chain[::-1], 1), lane[:, None]]  # (batch, stack + 1, 84, 84)
        return frames[:, :-1], frames[:, 1:]


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
    greedy = policy_step(torch.from_numpy(obs).to(device, non_blocking=True)).cpu().numpy()
    return greedy if exploit.all() else np.where(exploit, greedy, rng.integers(num_actions, size=len(obs)))


def first_screen(envs):
    return envs.envs[0].render() if isinstance(envs, gym.vector.SyncVectorEnv) else envs.render()[0]


def evaluate(q_network, args, device, video_folder=None):
    """True scores at epsilon 0.05 (the DQN paper's protocol: a greedy agent can stall)."""
    envs = make_envs(
        args.env_id, args.eval_episodes, args.seed + 10_000, args.env_backend, render=video_folder is not None
    )
    obs, _ = envs.reset()
    video = game_mp4(video_folder, first_screen(envs)) if video_folder else None
    rng = np.random.default_rng(args.seed)
    num_actions = int(getattr(envs, "single_action_space", envs.action_space).n)
    returns = np.zeros(envs.num_envs)
    finished = np.zeros(envs.num_envs, dtype=bool)
    while not finished.all():
        stop_if_signalled()
        actions = epsilon_greedy(partial(policy, q_network=q_network), obs, 0.05, rng, num_actions, device)
        obs, _, _, truncations, infos = envs.step(actions.astype(np.int32))
        if video and not finished[0]:
            video.write_frame(first_screen(envs))
        returns += infos["reward"] * ~finished
        finished |= infos["terminated"].astype(bool) | truncations
    if video:
        video.close()
    envs.close()
    return returns.tolist()


if __name__ == "__main__":
    args = tyro.cli(Args)
    args.env_id = args.env_id.replace("NoFrameskip-v4", "-v5")  # CleanRL's Atari ids: the same game and settings
    run = Run(args)
    if args.buffer_size < args.batch_size:
        fail(f"--buffer-size {args.buffer_size} must hold at least one batch (--batch-size {args.batch_size})")
    if args.learning_starts < args.batch_size:
        fail(f"--learning-starts {args.learning_starts} must be at least --batch-size {args.batch_size}")
    device = run.device
    # all usable cores: envs and network take turns
    run.tune_cpu(threads=usable_cores())

    envs = make_envs(args.env_id, args.num_envs, args.seed, args.env_backend)
    num_actions = int(getattr(envs, "single_action_space", envs.action_space).n)
    run.check_fits(args.buffer_size * (84 * 84 + 18), "--buffer-size")
    q_network = QNetwork(num_actions).to(device)
    target_network = QNetwork(num_actions).to(device).requires_grad_(False)
    q_view = QNetwork(num_actions).to("meta")  # the learner's weights, shared, without grad
    from_module(q_network).data.to_module(q_view)
    q_view.requires_grad_(False)
    # tensor lr, capturable Adam: CUDA graphs can replay the step
    learning_rate = torch.tensor(args.learning_rate, device=device)
    optimizer = torch.optim.Adam(q_network.parameters(), lr=learning_rate, fused=True, capturable=run.cudagraphs)
    run.save_and_load({"q_network": q_network, "optimizer": optimizer}, num_actions=num_actions)
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

    rb = FrameReplay(args.buffer_size, args.num_envs, device)
    rng = np.random.default_rng(args.seed)
    target_every = max(1, args.target_network_frequency // args.train_frequency)  # in updates
    scores = np.zeros(args.num_envs)
    lengths = np.zeros(args.num_envs, int)
    num_updates, first_iteration = 0, 0
    metrics = {}
    global_step = 0
    obs, _ = envs.reset()
    kept = dict(envs=envs) if args.env_backend == "gymnasium" else {}  # envpool's games cannot be saved
    if resumed := run.resumable(target_network=target_network, rb=rb, rng=rng, **kept):
        first_iteration, num_updates, obs, scores, lengths = resumed.values()
        if not kept:
            envs = make_envs(args.env_id, args.num_envs, args.seed + first_iteration, args.env_backend)
            obs, _ = envs.reset()
            scores[:] = lengths[:] = 0
            rb.new_games(first_iteration)
    run.start()
    with run.stoppable():
        for iteration in range(first_iteration, args.total_timesteps // args.num_envs):
            global_step = iteration * args.num_envs
            run.checkpoint_if_due(
                global_step, iteration=iteration, num_updates=num_updates, obs=obs, scores=scores, lengths=lengths
            )
            stop_if_signalled()
            actions = epsilon_greedy(policy_step, obs, epsilon_at(global_step, args), rng, num_actions, device)
            next_obs, rewards, terminations, truncations, infos = run.timed_env_call(
                envs.step, actions.astype(np.int32)
            )
            game_over = infos["terminated"].astype(bool) | truncations
            reset = terminations | truncations  # see make_envs
            restart = game_over if args.env_backend == "envpool" else reset  # envpool keeps its stack past a lost life
            rb.add(iteration, obs, actions, rewards, terminations, reset, restart)
            obs, global_step = next_obs, global_step + args.num_envs
            scores, lengths = scores + infos["reward"], lengths + 1  # info["reward"] is unclipped
            for score, length in zip(scores[game_over], lengths[game_over]):
                run.record_episode(global_step, score, length)
            scores[game_over] = 0
            lengths[game_over] = 0

            # the updates these steps owe, at CleanRL's rate
            while num_updates < (global_step - args.learning_starts) // args.train_frequency:
                if num_updates == args.measure_burnin:
                    run.start_speed_measure(global_step)
                metrics = update_step(*rb.sample(iteration + 1, args.batch_size))
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
        "env_backend": args.env_backend,
        "num_updates": num_updates,
        "compiled_pieces": ["policy", "td_loss"] if args.compile else [],
        "replay_ratio_target": args.batch_size / args.train_frequency,
        "replay_ratio_achieved": num_updates * args.batch_size / max(1, global_step - args.learning_starts),
    }
    sys.exit(run.write_and_evaluate(partial(evaluate, q_view, args, device, run.video_folder), summary))
