"""The reference scripts (CleanRL's and LeanRL's), read from a user's clone at pinned commits and patched at run
time, never copied into this repository: what benchmarks/learning.py (learning curves) and benchmarks/compare.py
(speed) both run. A run's record keeps the commit and the reasons of every patch.

They were written for gymnasium 0.29 (and LeanRL's for tensordict of 2024): a shim put before each script makes
gymnasium 1.x hand out what 0.29 did, and REFERENCE_PATCHES lists the few lines changed beyond it, each with its
reason. LeanRL's scripts import torchrl (0.14 imports with tensordict 0.15, its C++ extension aside, which these
scripts do not use) and its plain SAC, TD3 and DQN import stable-baselines3's replay buffer.
"""

import functools
import os
import subprocess

# The reference scripts run on the same tasks with the same flags (less our --eval-episodes), at fixed commits:
# side: (repository, commit, folder of its scripts, the repository's files they import, put beside them).
REFERENCE_REPOS = {
    "CleanRL": (
        "vwxyzjn/cleanrl",
        "fe8d8a03c41a7ef5b523e2e354bd01c363e786bb",
        "cleanrl",
        ["cleanrl_utils/__init__.py", "cleanrl_utils/buffers.py", "cleanrl_utils/atari_wrappers.py"],
    ),
    "LeanRL": ("pytorch-labs/LeanRL", "8dbb6336b7f6cc65cdbbeb2e86637c38867e2677", "leanrl", []),
    # its training script imports its modules from its own folder: they go beside it
    "FastTD3": (
        "younggyoseo/FastTD3",
        "229ed59bbf43ea2f7a2d5d90d1076314839944d7",
        "fast_td3",
        ["fast_td3/fast_td3.py", "fast_td3/fast_td3_utils.py", "fast_td3/hyperparams.py"],
    ),
    # a library, not a script: a driver of ours (DRIVERS) trains its class with our flags, its package beside it
    "SB3-contrib": (
        "Stable-Baselines-Team/stable-baselines3-contrib",
        "0ca7fdd8d1150bd3a48b86016a85db036efc3b6d",
        "",
        ["sb3_contrib"],
    ),
}
# Prepended to every reference script: gymnasium 1.x's vector env made to hand out what 0.29's did, for which these
# scripts were written (the final step's observation and episode statistics in the same step, `final_observation`
# and `final_info` as one entry per env, None where no episode ended). The scripts' own lines stay as they are.
GYMNASIUM_029_SHIM = """\
import gymnasium as _gym
import numpy as _np


def _entry(info, i):
    return {key: _entry(value, i) if isinstance(value, dict) else value[i]
            for key, value in info.items() if not key.startswith("_")}


class _SyncVectorEnv029(_gym.vector.SyncVectorEnv):
    def __init__(self, env_fns, **kwargs):
        super().__init__(env_fns, autoreset_mode=_gym.vector.AutoresetMode.SAME_STEP, **kwargs)

    def step(self, actions):
        obs, rewards, terminations, truncations, infos = super().step(actions)
        if "final_obs" in infos:
            infos["final_observation"] = infos.pop("final_obs")
            final, ended = infos.pop("final_info"), infos.pop("_final_info")
            per_env = _np.full(self.num_envs, None, dtype=object)
            for i in _np.flatnonzero(ended):
                per_env[i] = _entry(final, i)
            infos["final_info"] = per_env
        return obs, rewards, terminations, truncations, infos


_gym.vector.SyncVectorEnv = _SyncVectorEnv029
# (end of the shim; the script follows unchanged but for the lines benchmarks/learning.py lists)
"""
# Line patches a script needs beyond the shim: (old, new, why).
CLIP_OBS_SPACE = (
    "gym.wrappers.TransformObservation(env, lambda obs: np.clip(obs, -10, 10))",
    "gym.wrappers.TransformObservation(env, lambda obs: np.clip(obs, -10, 10), env.observation_space)",
    "gymnasium 1.x's TransformObservation takes the observation space",
)
DETACHED_ACTOR_NO_GRAD = (
    "    from_module(actor).data.to_module(actor_detach)\n",
    "    from_module(actor).data.to_module(actor_detach)\n    actor_detach.requires_grad_(False)\n",
    "tensordict 0.14's to_module puts the copied weights back as parameters that require grad",
)
REFERENCE_PATCHES = {
    "sac_continuous_action_torchcompile": [
        DETACHED_ACTOR_NO_GRAD,
        (
            'TensorDictModule(actor_detach.get_action, in_keys=["observation"], out_keys=["action"])',
            "TensorDictModule(lambda obs: actor_detach.get_action(obs)[0], "
            'in_keys=["observation"], out_keys=["action"])',
            "tensordict since 0.7 refuses more outputs than out_keys (it had dropped the other two)",
        ),
    ],
    "td3_continuous_action_torchcompile": [DETACHED_ACTOR_NO_GRAD],
    "ppo_continuous_action": [CLIP_OBS_SPACE],
    "ppo_continuous_action_torchcompile": [
        CLIP_OBS_SPACE,
        (
            "    agent_inference_p.to_module(agent_inference)\n",
            "    agent_inference_p.to_module(agent_inference)\n    agent_inference.requires_grad_(False)\n",
            DETACHED_ACTOR_NO_GRAD[2],
        ),
    ],
    "ppo_atari_envpool": [
        ("import gym\n", "import gymnasium as gym\n", "gym 0.x is not installed; envpool 1.2 speaks gymnasium"),
        ('env_type="gym",', 'env_type="gymnasium",', "envpool's gymnasium API"),
        (
            "        observations = super().reset(**kwargs)\n",
            "        observations, _ = super().reset(**kwargs)\n",
            "gymnasium's reset returns (observations, infos)",
        ),
        (
            "        observations, rewards, dones, infos = super().step(action)\n",
            "        observations, rewards, terminations, truncations, infos = super().step(action)\n"
            "        dones = terminations | truncations\n",
            "gymnasium's step returns terminations and truncations",
        ),
        (
            "    envs.num_envs = args.num_envs\n    envs.single_action_space = envs.action_space\n"
            "    envs.single_observation_space = envs.observation_space\n    envs = RecordEpisodeStatistics(envs)\n",
            "    envs = RecordEpisodeStatistics(envs)\n    envs.single_action_space = envs.action_space\n"
            "    envs.single_observation_space = envs.observation_space\n",
            "envpool's gymnasium env has num_envs and takes no new attributes; the wrapper does",
        ),
    ],
}


def envpool_xla_patches(indent, num_envs):
    """The JAX PPO scripts' envpool lines (XLA interface) for envpool's gymnasium API: `indent` and the name of the
    env count differ between the scripts."""
    return [
        ("import gym\n", "import gymnasium as gym\n", REFERENCE_PATCHES["ppo_atari_envpool"][0][2]),
        ('env_type="gym",', 'env_type="gymnasium",', "envpool's gymnasium API"),
        (
            f"{indent}envs.num_envs = {num_envs}\n{indent}envs.single_action_space = envs.action_space\n"
            f"{indent}envs.single_observation_space = envs.observation_space\n{indent}envs.is_vector_env = True\n",
            "",
            "envpool's gymnasium env has these properties and takes no new values",
        ),
        (
            "        handle, (next_obs, reward, next_done, info) = step_env(handle, action)\n",
            "        handle, (next_obs, reward, terminated, truncated, info) = step_env(handle, action)\n"
            '        next_done, info["TimeLimit.truncated"] = terminated | truncated, truncated\n',
            "gymnasium's step returns terminations and truncations (gym's info had the truncations)",
        ),
        (
            "    next_obs = envs.reset()\n",
            "    next_obs, _ = envs.reset()\n",
            "gymnasium's reset returns (observations, infos)",
        ),
        (
            "    critic_params: flax.core.FrozenDict\n",
            "    critic_params: flax.core.FrozenDict\n\n    def __contains__(self, key):\n        return False\n",
            "flax 0.12's TrainState asks whether the parameters hold an overwrite-with-gradient entry",
        ),
    ]


REFERENCE_PATCHES["ppo_atari_envpool_xla_jax"] = envpool_xla_patches("    ", "args.num_envs")
REFERENCE_PATCHES["ppo_atari_envpool_xla_jax_scan"] = envpool_xla_patches("        ", "num_envs") + [
    (f"= jax.tree_map({names})", f"= jax.tree.map({names})", "jax 0.10 has no jax.tree_map: jax.tree.map is its name")
    for names in ("flatten, storage", "convert_data, flatten_storage")
]
# CleanRL's Atari DQNs (torch and JAX) play ALE through gymnasium, whose 1.x renamed two wrappers and registers ALE's
# games only when asked
ALE_DQN_PATCHES = [
    (
        "import gymnasium as gym\n",
        "import ale_py\nimport gymnasium as gym\n\ngym.register_envs(ale_py)\n",
        "gymnasium 1.x registers ALE's games (BreakoutNoFrameskip-v4, ...) only when asked",
    ),
    ("gym.wrappers.GrayScaleObservation(env)", "gym.wrappers.GrayscaleObservation(env)", "renamed in gymnasium 1.0"),
    ("gym.wrappers.FrameStack(env, 4)", "gym.wrappers.FrameStackObservation(env, 4)", "renamed in gymnasium 1.0"),
]
REFERENCE_PATCHES["dqn_atari"] = REFERENCE_PATCHES["dqn_atari_jax"] = ALE_DQN_PATCHES
# CleanRL's Rainbow has its DQN's env set-up lines: the same patches; and it stores its one env's step as arrays of
# one, which NumPy 2 no longer writes into one element
REFERENCE_PATCHES["rainbow_atari"] = ALE_DQN_PATCHES + [
    (
        "        rb.add(obs, actions, rewards, real_next_obs, terminations)\n",
        "        rb.add(obs[0], actions[0], rewards[0], real_next_obs[0], terminations[0])\n",
        "NumPy 2 refuses an array of one as one element of an array: the one env's values (the script takes one env)",
    )
]
# LeanRL's PPO Atari scripts (plain and compiled) have CleanRL's env set-up lines, so the same patches; its compiled
# one also the copy of the weights for acting (else a rollout's graph holds them and the update backs through twice)
REFERENCE_PATCHES["ppo_atari_envpool_torchcompile"] = REFERENCE_PATCHES["ppo_atari_envpool"] + [
    REFERENCE_PATCHES["ppo_continuous_action_torchcompile"][1]
]
# CleanRL's PQN Atari script has its PPO Atari script's env set-up lines: the same patches
REFERENCE_PATCHES["pqn_atari_envpool"] = REFERENCE_PATCHES["ppo_atari_envpool"]
# FastTD3's train.py steps GPU simulators (HumanoidBench, MuJoCo Playground, IsaacLab) and sends any other env id to
# MuJoCo Playground: this env, put beside it, is what its patched env branch makes of a gymnasium id. It hands out
# what train.py reads of its own wrappers (torch tensors; dones = terminated or truncated; the time-outs and the final
# observations in infos), steps gymnasium's vector env with the same-step autoreset our fast_td3.py uses, and logs
# the training episodes' running mean of the last 20 returns to the wandb stand-in (LeanRL's "episode_return").
FASTTD3_GYMNASIUM_ENV = """\
from collections import deque

import gymnasium as gym
import numpy as np
import torch
import wandb


class GymnasiumVecEnv:
    asymmetric_obs = False

    def __init__(self, env_id, num_envs, seed, device, log_episodes=True):
        self.envs = gym.vector.SyncVectorEnv(
            [lambda: gym.wrappers.RecordEpisodeStatistics(gym.make(env_id)) for _ in range(num_envs)],
            autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
        )
        space = self.envs.single_action_space
        self.low, self.high = space.low, space.high
        self.num_envs, self.num_actions = num_envs, space.shape[0]
        self.num_obs = self.envs.single_observation_space.shape[0]
        self.max_episode_steps = self.envs.envs[0].spec.max_episode_steps
        self.seed, self.device, self.log_episodes = seed, device, log_episodes
        self.steps, self.returns = 0, deque(maxlen=20)

    def tensor(self, array):
        return torch.as_tensor(np.asarray(array), dtype=torch.float32, device=self.device)

    def reset(self):
        obs, _ = self.envs.reset(seed=self.seed)
        self.seed = None  # seeded once, as our scripts seed theirs
        return self.tensor(obs)

    def step(self, actions):
        actions = actions.clamp(-1, 1).cpu().numpy()
        scaled = self.low + (actions + 1) / 2 * (self.high - self.low)
        obs, rewards, terminations, truncations, infos = self.envs.step(scaled)
        self.steps += self.num_envs
        dones = terminations | truncations
        final_obs = obs.copy()
        if "final_obs" in infos:
            final_obs[infos["_final_obs"]] = np.stack(infos["final_obs"][infos["_final_obs"]])
            if self.log_episodes:
                self.returns.extend(infos["final_info"]["episode"]["r"][infos["_final_info"]])
                wandb.log({"episode_return": float(np.mean(self.returns))}, step=self.steps)
        infos = {"time_outs": torch.as_tensor(truncations, device=self.device)}
        infos["observations"] = {"raw": {"obs": self.tensor(final_obs)}}
        return self.tensor(obs), self.tensor(rewards), torch.as_tensor(dones, device=self.device), infos
"""
FASTTD3_ENV_BRANCH = """\
    elif args.env_name in __import__("gymnasium").registry:
        from gymnasium_vec_env import GymnasiumVecEnv

        env_type = "gymnasium"
        envs = GymnasiumVecEnv(args.env_name, args.num_envs, args.seed, device)
        eval_envs = GymnasiumVecEnv(args.env_name, args.num_eval_envs, args.seed + 10_000, device, log_episodes=False)
        render_env = None
"""
REFERENCE_PATCHES["train"] = [
    (
        "    else:\n        from environments.mujoco_playground_env import make_env\n",
        FASTTD3_ENV_BRANCH + "    else:\n        from environments.mujoco_playground_env import make_env\n",
        "an env branch for gymnasium's ids (gymnasium_vec_env.py, put beside the script), before MuJoCo Playground's",
    ),
    (
        'os.environ["OMP_NUM_THREADS"] = "1"',
        'os.environ.setdefault("OMP_NUM_THREADS", "1")',
        "the thread count the benchmark gives it (torch's CPU threads) wins over its one",
    ),
    (
        '"speed": speed,',
        '"speed": speed * args.num_envs,',
        "env steps per second, as every other side counts them (it logs steps of all its envs together)",
    ),
]
# Our fast_td3.py names its recipe's flags as FastTD3's train.py does (with hyphens); these are the ones whose
# defaults differ between the two (its defaults for an id it does not know are MuJoCo Playground's) or that count
# steps (ours count env steps, all envs together; its, steps of the vector env). fasttd3_flags passes each.
FASTTD3_OUR_DEFAULTS = {
    "num_envs": "128",
    "buffer_size": "51200",
    "gamma": "0.99",
    "v_min": "-2500.0",
    "v_max": "2500.0",
    "learning_starts": "1280",
}


def fasttd3_flags(flags, cuda=False, mode="eager"):
    """Our fast_td3.py's `flags` as FastTD3's train.py takes them: the same names with underscores, its step counts
    per env, every flag whose default differs given; no evaluation, rendering or checkpoints along the way (ours
    evaluate at the end), wandb's log kept by the stand-in, CUDA where there is one, compiled in the mode "compile"
    (its own torch.compile: "reduce-overhead", CUDA graphs on CUDA)."""
    given, rest = dict(FASTTD3_OUR_DEFAULTS), [str(word) for word in flags]
    while rest:  # a switch (--no-use-cdq) takes no value
        name = rest.pop(0)[2:].replace("-", "_")
        given[name] = rest.pop(0) if rest and not rest[0].startswith("--") else None
    num_envs = int(given["num_envs"])
    for name in ("total_timesteps", "learning_starts"):
        if name in given:
            given[name] = str(int(given[name]) // num_envs)
    given["env_name"] = given.pop("env_id")
    words = [word for name, value in given.items() for word in (f"--{name}", value) if word is not None]
    off = ["--eval_interval", "0", "--render_interval", "0", "--save_interval", "0", "--num_eval_envs", "1"]
    compiled = "--compile" if mode == "compile" else "--no_compile"
    return [*words, *off, "--exp_name", "fasttd3", compiled, *([] if cuda else ["--no_cuda"])]


# SB3-contrib's CrossQ trained with our crossq.py's flags (the same names and defaults; the CPU settings' critic width
# given as its net_arch), through stable-baselines3's vector env with its Monitor, seeded as its make_vec_env seeds.
# It logs as CleanRL's scripts do: each training episode's return, and the SPS every 100 steps, whose wall times give
# the steady SPS. Its own defaults that differ from the paper's (a 1,024 critic, learning from step 100) are not
# used: every flag is given.
SB3_CONTRIB_CROSSQ = """\
import argparse
import json
import time

import torch
from sb3_contrib import CrossQ
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_vec_env
from torch.utils.tensorboard import SummaryWriter

parser = argparse.ArgumentParser()
parser.add_argument("--env-id", default="HalfCheetah-v5")
parser.add_argument("--total-timesteps", type=int, default=1_000_000)
parser.add_argument("--num-envs", type=int, default=1)
parser.add_argument("--buffer-size", type=int, default=1_000_000)
parser.add_argument("--gamma", type=float, default=0.99)
parser.add_argument("--batch-size", type=int, default=256)
parser.add_argument("--learning-starts", type=int, default=5_000)
parser.add_argument("--learning-rate", type=float, default=1e-3)
parser.add_argument("--policy-delay", type=int, default=3)
parser.add_argument("--critic-hidden-dim", type=int, default=2048)
parser.add_argument("--batch-renorm-momentum", type=float, default=0.01)
parser.add_argument("--batch-renorm-warmup", type=int, default=100_000)
parser.add_argument("--seed", type=int, default=1)
args = parser.parse_args()
writer = SummaryWriter(f"runs/sb3_contrib_crossq__{args.env_id}__{args.seed}")


class Log(BaseCallback):
    def _on_training_start(self):
        self.start, self.logged = time.time(), 0

    def _on_step(self):
        for info in self.locals["infos"]:
            if "episode" in info:
                writer.add_scalar("charts/episodic_return", info["episode"]["r"], self.num_timesteps)
        if self.num_timesteps // 100 > self.logged:
            self.logged = self.num_timesteps // 100
            writer.add_scalar("charts/SPS", self.num_timesteps / (time.time() - self.start), self.num_timesteps)
        return True


envs = make_vec_env(args.env_id, n_envs=args.num_envs, seed=args.seed)
policy = dict(
    net_arch=dict(pi=[256, 256], qf=[args.critic_hidden_dim] * 2),
    batch_norm_momentum=args.batch_renorm_momentum,
    renorm_warmup_steps=args.batch_renorm_warmup,
)
model = CrossQ(
    "MlpPolicy",
    envs,
    learning_rate=args.learning_rate,
    buffer_size=args.buffer_size,
    learning_starts=args.learning_starts,
    batch_size=args.batch_size,
    gamma=args.gamma,
    policy_delay=args.policy_delay,
    policy_kwargs=policy,
    seed=args.seed,
    device="cuda" if torch.cuda.is_available() else "cpu",
)
model.learn(args.total_timesteps, callback=Log())
writer.close()
# the settings the class ran with, read back from it
norm = model.policy.batch_norm_params
ran = dict(lr=model.learning_rate, buffer=model.buffer_size, starts=model.learning_starts, batch=model.batch_size)
ran.update(gamma=model.gamma, delay=model.policy_delay, critic=model.policy.critic_kwargs["net_arch"])
ran.update(actor=model.policy.actor_kwargs["net_arch"], betas=model.critic.optimizer.defaults["betas"])
ran.update(momentum=norm["batch_norm_momentum"], warmup=norm["renorm_warmup_steps"], envs=envs.num_envs)
print("SB3-contrib CrossQ ran with", json.dumps(ran))
"""
# the drivers of the libraries' classes, by library and name
DRIVERS = {"SB3-contrib": {"crossq": SB3_CONTRIB_CROSSQ}}


# LeanRL's scripts log to Weights & Biases only: the running mean of the last 20 episodes' returns
# ("episode_return") and the steady steps per second since its burn-in ("speed"). This stands in for wandb beside
# the script and keeps those values with their step and time.
WANDB_LOG_STUB = """\
import json
import time

_start = time.time()


def init(*args, **kwargs):
    pass


def log(data, step=None, **kwargs):
    kept = {key: float(data[key]) for key in ("episode_return", "speed") if key in data}
    if kept:
        with open("wandb_log.jsonl", "a") as f:
            step = None if step is None else int(step)  # a JAX script's step is an array
            row = {"step": step, "seconds": time.time() - _start, "time": time.time(), **kept}
            f.write(json.dumps(row) + "\\n")


def finish(*args, **kwargs):
    pass
"""


PACKAGE_VERSIONS = """\
from importlib.metadata import PackageNotFoundError, version
names = ["torch", "gymnasium", "numpy", "mujoco", "envpool", "tensordict", "torchrl", "stable-baselines3", "jax",
         "jaxlib", "flax", "optax"]
found = []
for name in names:
    try:
        found.append(f"{name} {version(name)}")
    except PackageNotFoundError:
        pass
print(", ".join(found))
"""


def git_show(repo_dir, commit, path):
    return subprocess.run(
        ["git", "-C", repo_dir, "show", f"{commit}:{path}"], capture_output=True, text=True, check=True
    ).stdout


def option(side):
    """The name of `side`'s clone option and of its key in check_clones's answer: "sb3_contrib" for SB3-contrib."""
    return side.lower().replace("-", "_")


def script_path(side, name):
    """`side`'s script `name` (no .py) as its repository names it; a library's driver by its own name."""
    return f"{REFERENCE_REPOS[side][2]}/{name}.py" if REFERENCE_REPOS[side][2] else f"{name}.py"


def support_files(side, repo_dir):
    """The repository files `side`'s script imports, a folder standing for every file under it."""
    _, commit, _, support = REFERENCE_REPOS[side]
    if not support:  # ls-tree without paths would list every file
        return []
    listed = ["git", "-C", repo_dir, "ls-tree", "-r", "--name-only", commit, "--", *support]
    return subprocess.run(listed, capture_output=True, text=True, check=True).stdout.split()


def reference_script(side, name, repo_dir):
    """(its path in the repository, the patched text, the patches' reasons) of `side`'s script `name` (no .py),
    read at the pinned commit from `repo_dir` (a clone or mirror of the repository); a library's: our driver."""
    _, commit, scripts, _ = REFERENCE_REPOS[side]
    path = script_path(side, name)
    if side in DRIVERS:
        return path, DRIVERS[side][name], [f"{name}.py: the driver in benchmarks/references.py, its package beside it"]
    text = git_show(repo_dir, commit, path)
    prelude, reasons = (
        GYMNASIUM_029_SHIM,
        [
            "prepended: gymnasium 1.x's SyncVectorEnv made to hand out 0.29's same-step autoreset, "
            "final_observation and final_info (benchmarks/references.py, GYMNASIUM_029_SHIM)"
        ],
    )
    if side == "FastTD3":  # written for gymnasium 1.x envs of its own: no shim, an env beside it
        prelude, reasons = "", ["beside it: gymnasium_vec_env.py (benchmarks/references.py, FASTTD3_GYMNASIUM_ENV)"]
    for old, new, why in REFERENCE_PATCHES.get(name, []):
        if old not in text:
            raise SystemExit(f"error: {side}'s {path} at {commit[:8]} no longer has the line patched for: {why}")
        text = text.replace(old, new, 1)
        reasons.append(f"{old.strip()!r} -> {new.strip()!r}: {why}")
    return path, prelude + text, reasons


def write_reference(side, name, repo_dir, workdir):
    """Puts `side`'s patched script `name`, the repository files it imports and the wandb stand-in into `workdir`;
    returns (the script's path there, a record: repository, commit, script, patches)."""
    repository, commit, scripts, _ = REFERENCE_REPOS[side]
    path, text, patches = reference_script(side, name, repo_dir)
    # a file of the scripts' own folder goes beside the script, which imports it by its name
    beside = [
        (os.path.relpath(file, scripts) if scripts and file.startswith(f"{scripts}/") else file, file)
        for file in support_files(side, repo_dir)
    ]
    files = [(os.path.basename(path), text), *[(name, git_show(repo_dir, commit, file)) for name, file in beside]]
    files.append(("wandb.py", WANDB_LOG_STUB))
    if side == "FastTD3":
        files.append(("gymnasium_vec_env.py", FASTTD3_GYMNASIUM_ENV))
    for file, content in files:
        os.makedirs(os.path.dirname(os.path.join(workdir, file)), exist_ok=True)
        with open(os.path.join(workdir, file), "w") as f:
            f.write(content)
    record = {"repository": repository, "commit": commit, "script": path, "patches": patches}
    return os.path.join(workdir, os.path.basename(path)), record


@functools.cache
def package_versions(python):
    """The versions `python` sees of the packages a run's speed and results depend on, as one line."""
    return subprocess.run([python, "-c", PACKAGE_VERSIONS], capture_output=True, text=True).stdout.strip()


def check_clone(side, clone):
    """None when `clone` holds `side`'s pinned commit, else the one line that says what is wrong."""
    repository, commit, _, _ = REFERENCE_REPOS[side]
    if subprocess.run(["git", "-C", clone, "cat-file", "-e", commit], capture_output=True).returncode:
        return f"--{option(side).replace('_', '-')} {clone}: not a clone of {repository} with {commit[:8]}"
    return None


def check_clones(parser, args, required):
    """{"cleanrl": clone, "leanrl": clone, ...} of the clones given, each checked (a missing one refused where its side
    is in `required`); the Pythons given as paths made absolute, as the runs start in scratch folders."""
    for name in ("reference_python", "jax_python"):
        if getattr(args, name) and os.sep in getattr(args, name):
            setattr(args, name, os.path.abspath(getattr(args, name)))
    clones = {}
    for side, (repository, _, _, _) in REFERENCE_REPOS.items():
        clone = getattr(args, option(side))
        if not clone and side in required:
            parser.error(f"--{option(side).replace('_', '-')} CLONE is needed: a clone of {repository}")
        if clone and (problem := check_clone(side, clone)):
            parser.error(problem)
        if clone:
            clones[option(side)] = clone
    return clones
