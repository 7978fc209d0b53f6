"""Run bookkeeping for the scripts beside it: what every script needs and no reader of its algorithm comes for; no
algorithm (networks, losses, env wrappers, replay). A script uses it in this order:

    run = Run(args)  # check_flags: one line, exit code 2, for a value its flag's type (Flag) refuses; seeds; the device
    run.tune_cpu(threads=...)  # torch's CPU threads, before any tensor work
    run.save_and_load({"agent": agent, "optimizer": optimizer}, num_actions=n)  # the Checkpoint's contents
    resumed = run.resumable(rb=rb, envs=envs)  # the Snapshot's others; with --resume, all restored, the loop's counters
    run.start()  # the Sinks (the run folder, TensorBoard, W&B, the progress line), the SignalWatcher
    with run.stoppable():  # a signal at a safe point, a non-finite loss or an exception ends the block
        for ...:
            run.checkpoint_if_due(step, iteration=iteration)  # --checkpoint-every: the Snapshot, the loop's counters
            stop_if_signalled()  # the safe point a first Ctrl-C or SIGTERM stops at
            next_obs, ... = run.timed_env_call(envs.step, actions)
            run.start_speed_measure(step)  # the first call starts the Clock's figure: warm-up left out
            run.record_gymnasium_episodes(step, infos)  # or run.record_episode(step, score, length)
            run.log(step, metrics, charts=dict(learning_rate=lr))  # losses/ and charts/ in TensorBoard
    run.end_training(step, metrics)
    sys.exit(run.write_and_evaluate(evaluate, summary))  # summary.json and model.pt, then the evaluation; the exit code

Run hands each job to the part that owns it, defined above it in this order: check_flags, Checkpoint, Snapshot, Clock,
SilentSinks and Sinks, SignalWatcher; each part's private helpers stand right above it, Run's own (the run folder, the
held warnings, the CPU threads, the memory check, the summary, the processes it started) right above Run. A script calls
a part's other jobs on the part itself, run.clock and run.sinks: an actor's env time (run.clock.add_env_seconds), a rate
over the steady phase (run.clock.per_steady_second), the recent training return (run.sinks.recent_return).

Exit codes: 2 bad input, before any work; 1 a non-finite value or an exception in the training (no model saved: it
may be half updated) or in the evaluation (the training's summary and model kept); 128 + the signal after Ctrl-C
(130) or SIGTERM (143), the summary of the steps done written in every case. A run killed at once (SIGKILL, the OOM
killer, a lost machine) keeps its last snapshot, with --checkpoint-every; --resume goes on from it."""

import copy
import ctypes
import json
import math
import os
import pickle
import random
import resource
import signal
import sys
import threading
import time
import traceback
import typing
import warnings
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Annotated

import numpy as np
import torch
from torch.utils._pytree import tree_map
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

# What every run's summary.json holds at least (its SPEED line repeats it), whatever the script: the tests and the
# benchmark tools read these keys
SUMMARY_KEYS = (
    "script",
    "env_id",
    "seed",
    "num_envs",
    "total_timesteps",
    "mode",
    "compile",
    "cudagraphs_requested",
    "cudagraphs_active",
    "device",
    "torch_version",
    "sps",
    "steady_steps",
    "steady_seconds",
    "warmup_seconds",
    "total_seconds",
    "return_mean",
    "eval_return_mean",
    "peak_memory_mb",
    "env_seconds",
)
SIGNALS_RECEIVED = []  # Ctrl-C and SIGTERM as they came (the SignalWatcher notes them); read at the safe points


@dataclass(frozen=True)
class Allowed:
    """The values a flag may take, put in its type (Flag's kinds): `valid(value)`, or `valid(value, bound)` where the
    flag named `other` sets the bound; `refusal` ends the line that refuses a value outside them."""

    valid: Callable
    refusal: str
    other: str | None = None


class Flag:
    """The kinds of numeric flag, each with the values it may take, given as the flag's type in Args
    (`gamma: Flag.Fraction = 0.99`): a flag is declared in one place. Run refuses any other value in one line, exit
    code 2, before any work; a flag at None (a feature switched off) is not checked."""

    Count = Annotated[int, Allowed(lambda value: value > 0, "must be positive, not {value}")]
    CountFrom0 = Annotated[int, Allowed(lambda value: value >= 0, "must be 0 or more, not {value}")]
    Positive = Annotated[float, Allowed(lambda value: 0 < value < math.inf, "must be a positive number, not {value}")]
    AtLeast0 = Annotated[float, Allowed(lambda value: 0 <= value < math.inf, "must be 0 or more, not {value}")]
    Fraction = Annotated[float, Allowed(lambda value: 0 <= value <= 1, "must be in [0, 1], not {value}")]
    PositiveFraction = Annotated[float, Allowed(lambda value: 0 < value <= 1, "must be in (0, 1], not {value}")]
    # steps before learning starts: below --total-timesteps, or no update would run (0: --load-model evaluates)
    BeforeTheEnd = Annotated[
        int,
        Allowed(
            lambda value, end: end == 0 or value < end,
            "{value} leaves no update: it must be below {bound}",
            "total_timesteps",
        ),
    ]


def _script_name():  # the script being run, without .py
    return os.path.basename(getattr(sys.modules["__main__"], "__file__", "script.py")).removesuffix(".py")


@dataclass
class RunArgs:
    """The flags every script shares (each script's Args extends it and sets its own env_id and total_timesteps);
    a field's comment is its --help text. These are all the fields the module reads."""

    exp_name: str = field(default_factory=_script_name)  # the name of this experiment
    env_id: str = ""  # the environment id
    total_timesteps: int = 0  # total environment steps, all envs together (0 only with --load-model: evaluate it)
    seed: int = 1  # seed of the experiment
    torch_deterministic: bool = True  # if toggled, `torch.backends.cudnn.deterministic=True`
    cuda: bool = True  # use CUDA when it is available
    track: bool = False  # log the run to Weights & Biases (pip install ".[wandb]"; WANDB_MODE=offline keeps it local)
    wandb_project_name: str = "leanrl-scripts"  # the W&B project of --track
    wandb_entity: str | None = None  # the W&B team or user of --track (None: your own)
    torch_threads: Flag.CountFrom0 = 0  # CPU threads for torch (0: one on CUDA, else the script's; OMP_NUM_THREADS too)
    compile: bool = False  # wrap the script's pieces in torch.compile (the summary lists those that ran compiled)
    cudagraphs: bool = False  # wrap them in CUDA graphs (tensordict's CudaGraphModule); without CUDA, run eagerly
    eval_episodes: Flag.CountFrom0 = 10  # evaluation episodes at the end (on Atari whole games, the game's score)
    capture_video: bool = False  # record the first evaluation episode to runs/<run_name>/videos (needs .[video])
    save_model: bool = False  # save a checkpoint to runs/<run_name>/model.pt at the end
    load_model: str = ""  # a checkpoint to start from (evaluate it with --total-timesteps 0, or continue training)
    checkpoint_every: Flag.CountFrom0 = 0  # write the run's whole state to its folder every N env steps (0: never)
    checkpoint_minutes: Flag.AtLeast0 = 0.0  # and every M minutes (0: never), whichever comes first
    resume: str = ""  # a run folder: continue that run from its last state (--checkpoint-every), as if never stopped


def fail(message):
    """Bad input: one line on stderr, exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def check_spaces(env_id, actions, needs, observations=None, flat=None, hint="this script needs a flat (1-D Box) one"):
    """Spaces the script cannot take are one line, exit code 2: actions not of the space class `needs`, observations
    (where given) not a flat (1-D) `flat`. The script passes gymnasium's classes (Discrete, Box): the module imports no
    env library."""
    if not isinstance(actions, needs):
        kind = "continuous (Box) actions"
        if needs.__name__ == "Discrete":
            kind = "discrete actions (continuous ones: sac, td3, ppo)"
        fail(f"{env_id} has {actions}: {_script_name()}.py needs {kind}")
    if observations is not None and (not isinstance(observations, flat) or len(observations.shape) != 1):
        fail(f"{env_id} has observations {observations}: {hint}")


class Stopped(Exception):
    """Ends `with run.stoppable()`: the run keeps it as its reason, exits with `exit_code` and saves the model as it
    stood (--save-model) unless `keep_model` is False (a diverged one)."""

    def __init__(self, message, exit_code, keep_model=True):
        super().__init__(message)
        self.exit_code = exit_code
        self.keep_model = keep_model


def stop_if_signalled(agree=None):
    """The loop's safe point: raises Stopped once a Ctrl-C or SIGTERM came, so the run ends between two steps.
    Processes that must stop at the same step pass `agree`: it maps this process's signal (0: none) to the one they
    agreed on, which alone decides (one that comes while they agree waits for the next safe point)."""
    own = SIGNALS_RECEIVED[0] if SIGNALS_RECEIVED else 0
    agreed = agree(own) if agree else own
    if agreed:
        signum = own or agreed  # the line names this process's own signal, else the one the others got
        raise Stopped(f"stopped by {signal.Signals(signum).name}", 128 + signum)


def game_mp4(folder, first_frame, fps=15):
    """--capture-video's mp4 writer for one evaluation game, its first screen written (15 fps: an Atari game's agent
    steps, 60 Hz with frame skip 4). Frames go to ffmpeg as they come, so memory stays flat however long the game (a
    stalled Atari game lasts 108k frames)."""
    from moviepy.video.io.ffmpeg_writer import FFMPEG_VideoWriter

    os.makedirs(folder, exist_ok=True)
    writer = FFMPEG_VideoWriter(os.path.join(folder, "eval-game-0.mp4"), first_frame.shape[1::-1], fps)
    writer.write_frame(first_frame)
    return writer


def _check_allowed(args):
    """Each flag's value against the Allowed in its type (`Flag.X | None` too): one line, exit code 2, outside it."""
    for name, hint in typing.get_type_hints(type(args), include_extras=True).items():
        metadata = [meta for part in (hint, *typing.get_args(hint)) for meta in getattr(part, "__metadata__", ())]
        for allowed in [meta for meta in metadata if isinstance(meta, Allowed)]:  # tyro's markers are left to tyro
            flag, value, bound = "--" + name.replace("_", "-"), getattr(args, name), ()
            if allowed.other is not None:
                other = "--" + allowed.other.replace("_", "-")
                if not hasattr(args, allowed.other):
                    fail(f"{flag} is checked against {other}, which {_script_name()}.py lacks")
                bound = (getattr(args, allowed.other),)
            if value is not None and not allowed.valid(value, *bound):  # nan fails every comparison: refused too
                fail(f"{flag} " + allowed.refusal.format(value=value, bound=f"{other} {bound[0]}" if bound else ""))


def check_flags(args):
    """The flag checks: values outside what each flag's type allows (Flag), a seed the generators cannot take, a
    checkpoint that is not there, an extra that --track or --capture-video needs and is not installed. Each is one
    line on stderr and exit code 2, before any work."""
    if args.total_timesteps < 0 or (args.total_timesteps == 0 and not args.load_model):
        fail("--total-timesteps must be positive (0 only with --load-model)")
    _check_allowed(args)
    if not 0 <= args.seed <= 2**30:  # envpool takes 31-bit seeds, NumPy 32; the scripts add offsets to theirs
        fail(f"--seed must be from 0 to 2**30, not {args.seed}")
    if args.load_model and not os.path.isfile(args.load_model):
        fail(f"--load-model: no checkpoint at {args.load_model}")
    if args.load_model and args.resume:
        fail("--resume continues a run, --load-model starts one from a model: give one of them")
    if args.track:
        try:
            import wandb  # noqa: F401
        except ModuleNotFoundError:
            fail('--track logs to Weights & Biases, which is not installed: pip install ".[wandb]"')
    if args.capture_video:  # the videos are made at the end: a missing package must show before the training
        if args.eval_episodes == 0:
            fail("--capture-video records the evaluation: it needs --eval-episodes 1 or more")
        try:
            import moviepy  # noqa: F401  (gymnasium's RecordVideo and the scripts' frame writers use it)
        except ModuleNotFoundError:
            fail('--capture-video writes mp4 files with moviepy, which is not installed: pip install ".[video]"')
        os.environ.setdefault("SDL_VIDEODRIVER", "dummy")  # pygame draws off-screen: no display needed


def _write_atomic(path, write):
    """`write(file)` streams into a temporary file beside `path`, on disk (fsync) before it takes `path`'s name: a
    failed write (a full disk) leaves neither a partial file nor the temporary one, and is one line, exit code 1."""
    try:
        with open(path + ".tmp", "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)
    except (OSError, RuntimeError) as error:  # torch.save's RuntimeError (unexpected pos ...) hides the file's OSError
        error = error if isinstance(error, OSError) else error.__context__ or error
        if os.path.exists(path + ".tmp"):
            os.remove(path + ".tmp")
        print(f"error: could not write {path}: {getattr(error, 'strerror', None) or error}", file=sys.stderr)
        sys.exit(1)


def _load_keeping_settings(optimizer, saved):  # the optimizer's state from a checkpoint, its settings the script's
    # Optimizer.load_state_dict brings back the saved param groups: their lr (the checkpoint's tensor, so the script's
    # in-place schedule would no longer reach the optimizer) and capturable (an eager run's checkpoint would then fail
    # Adam's capture check under --cudagraphs). The saved groups get the script's settings before loading (they place
    # Adam's step counts: on the device when capturable or fused), and the script's own lr tensor is put back after.
    settings = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    groups = [{**group, **own, "params": group["params"]} for group, own in zip(saved["param_groups"], settings)]
    optimizer.load_state_dict({**saved, "param_groups": groups})
    for group, own in zip(optimizer.param_groups, settings):
        group.update(own)


def _state_of(state):  # what a checkpoint keeps of one of save_and_load's states
    return state.detach().clone() if isinstance(state, torch.Tensor) else state.state_dict()


class Checkpoint:
    """What --save-model writes and --load-model reads: the `states` a script names once (modules, optimizers, tensors,
    anything with a state_dict) and the `sizes` they were made for. Loaded as it is made, from a checkpoint of the same
    script, env and sizes; saved by the run at its end."""

    def __init__(self, args, device, states, sizes):
        self.env_id, self.states, self.sizes = args.env_id, states, sizes
        self.loaded = self._load(args.load_model, device) if args.load_model else None

    def _load(self, path, device):
        try:
            checkpoint = torch.load(path, map_location=device, weights_only=True)
            made_for, trained_env = {key: checkpoint[key] for key in self.sizes}, checkpoint["env_id"]
            for name, state in self.states.items() if (made_for, trained_env) == (self.sizes, self.env_id) else ():
                if hasattr(state, "param_groups"):  # an optimizer
                    _load_keeping_settings(state, checkpoint[name])
                elif isinstance(state, torch.Tensor):  # in place: the pieces that hold it see the loaded value
                    with torch.no_grad():
                        state.copy_(checkpoint[name])
                else:
                    state.load_state_dict(checkpoint[name])
        except Exception as error:  # empty, truncated, not a torch file, another script's checkpoint
            fail(f"--load-model: {path} is not a checkpoint of this script ({type(error).__name__})")
        if made_for != self.sizes:
            trained = ", ".join(f"{name} {size}" for name, size in made_for.items())
            asked = ", ".join(f"{name} {size}" for name, size in self.sizes.items())
            fail(f"--load-model: {path} was trained on {trained_env} ({trained}); {self.env_id} has {asked}")
        if trained_env != self.env_id:  # the same sizes (HalfCheetah-v5's and Walker2d-v5's), another task
            fail(f"--load-model: {path} was trained on {trained_env}, not {self.env_id}")
        return checkpoint

    def save(self, path, args):
        """The states as they stand, with the env id, the flags and the sizes, written atomically."""
        states = {name: _state_of(state) for name, state in self.states.items()}
        _write_atomic(
            path, lambda f: torch.save({"env_id": args.env_id, "args": asdict(args), **self.sizes, **states}, f)
        )


# Flags a resumed run may change: they change how it runs or ends, not what it learns
_RESUME_MAY_CHANGE = {"resume", "checkpoint_every", "checkpoint_minutes", "total_timesteps", "torch_threads", "cuda"}
_RESUME_MAY_CHANGE |= {"compile", "cudagraphs", "eval_episodes", "capture_video", "save_model", "track"}
_RESUME_MAY_CHANGE |= {"wandb_project_name", "wandb_entity"}


def _game_state(game):  # what pickling leaves out of a game gymnasium pickles as a new one (EzPickle: its arguments)
    if hasattr(game, "clone_state"):  # ALE: its emulator
        return game.clone_state(include_rng=True), game.np_random
    if _mujoco() and isinstance(getattr(game, "data", None), _mujoco().MjData):  # MuJoCo: its physics
        return game.data, game.np_random
    return None


def _snapshot_of(value):  # what a snapshot keeps of one of the run's states: no copy, it is written at once
    if isinstance(value, np.random.Generator):
        return value.bit_generator.state
    if isinstance(value, torch.Tensor):
        return value.detach()
    if hasattr(value, "state_dict"):
        return value.state_dict()
    if hasattr(value, "envs"):  # a gymnasium vector env: its envs, wrappers and all, those to reset at the next step
        import cloudpickle  # gymnasium's own: wrappers hold lambdas, which pickle refuses

        games = [_game_state(env.unwrapped) for env in value.envs]
        return cloudpickle.dumps((value.envs, value._autoreset_envs, value.action_space, games))
    # a buffer: its tensors and parts (a sum tree) as they stand, its counters and arrays
    return {key: _snapshot_of(item) if hasattr(item, "__dict__") else item for key, item in vars(value).items()}


def _restore(value, saved):  # in place: the pieces bound to a state (compiled, graphed) see the restored one
    if isinstance(value, np.random.Generator):
        value.bit_generator.state = saved
    elif isinstance(value, torch.Tensor):
        with torch.no_grad():
            value.copy_(saved)
    elif hasattr(value, "param_groups"):  # copied: an optimizer keeps the tensors it loads, here views of state.pt
        _load_keeping_settings(value, copy.deepcopy(saved))
    elif hasattr(value, "state_dict"):
        value.load_state_dict(saved)
    elif hasattr(value, "envs"):
        envs, value._autoreset_envs, value.action_space, games = pickle.loads(saved)
        for env, saved_env in zip(value.envs, envs):  # each wrapper in place: a script may hold one (a normaliser)
            while saved_env is not None:
                vars(env).update({key: item for key, item in vars(saved_env).items() if key != "env"})
                env, saved_env = getattr(env, "env", None), getattr(saved_env, "env", None)
        for game, state in zip((env.unwrapped for env in value.envs), games):
            if hasattr(game, "restore_state"):
                game.restore_state(state[0])
            elif state:
                _mujoco().mj_copyData(game.data, game.model, state[0])
            if state:
                game.np_random = state[1]
    else:  # a buffer: its tensors and parts refilled, its counters and arrays set
        for key, item in saved.items():
            if hasattr(getattr(value, key), "__dict__"):
                _restore(getattr(value, key), item)
            else:
                setattr(value, key, item)


class Snapshot:
    """What --checkpoint-every writes and --resume reads: the run's whole state (the Checkpoint's states and the
    script's others: its replay, generators and envs; the loop's counters; every random generator; the clock and the
    recent returns), in the run folder's state.pt. A new one is written atomically, the one before it kept as
    state.prev.pt until then: a run killed at any moment leaves one whole snapshot."""

    def __init__(self, args):
        self.every, self.next_step = args.checkpoint_every, None
        self.seconds = args.checkpoint_minutes * 60
        self.next_time = time.monotonic() + self.seconds
        self.on = bool(self.every or self.seconds)
        self.saved = self._load(args) if args.resume else None

    def _load(self, args):
        folder = args.resume
        paths = [os.path.join(folder, name) for name in ("state.pt", "state.prev.pt")]
        if not any(map(os.path.isfile, paths)):
            fail(f"--resume: no state.pt in {folder} (a run writes it with --checkpoint-every N)")
        if not os.access(folder, os.W_OK):
            fail(f"--resume: the run folder {folder} is read-only; a resumed run writes there")
        problems = [] if os.path.isfile(paths[0]) else ["no state.pt (its write was cut short)"]
        for path in filter(os.path.isfile, paths):
            try:  # not weights_only: the envs' state is pickled, and the file is this run's own
                # mapped, not read: a replay of GBs is copied into the run's own storage as it is restored
                saved = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
                break
            except Exception as error:  # truncated, empty, not a torch file
                problems.append(f"{os.path.basename(path)} is damaged ({type(error).__name__})")
        else:
            fail(f"--resume: {'; '.join(problems)}: nothing to resume from in {folder}")
        if problems:
            print(f"warning: --resume: {problems[0]}; resuming from state.prev.pt", file=sys.stderr)
        if (saved["args"]["exp_name"], saved["args"]["env_id"]) != (args.exp_name, args.env_id):
            theirs = f"{saved['args']['exp_name']} on {saved['args']['env_id']}"
            fail(f"--resume: {folder} is a run of {theirs}, not {args.exp_name} on {args.env_id}")
        given = asdict(args)
        for name, value in saved["args"].items():
            if name not in _RESUME_MAY_CHANGE and given.get(name) != value:
                flag = "--" + name.replace("_", "-")
                fail(f"--resume: the run was trained with {flag} {value}, not {given.get(name)}: give its own value")
        return saved

    def due(self, step):
        """Whether a snapshot is due at `step`: every --checkpoint-every steps from the run's start or its resume, or
        --checkpoint-minutes after the last one."""
        if self.seconds and time.monotonic() >= self.next_time:
            return True
        if self.every == 0:
            return False
        if self.next_step is None:
            self.next_step = step + self.every
        return step >= self.next_step

    def save(self, folder, step, args, states, loop, clock, sinks):
        """The `states`, the `loop`'s counters, the clock, the recent returns and every random generator, as
        state.pt, atomically."""
        generators = dict(python=random.getstate(), numpy=np.random.get_state(), torch=torch.get_rng_state())
        if torch.cuda.is_available():
            generators["cuda"] = torch.cuda.get_rng_state_all()
        everything = dict(
            args=asdict(args),
            states={name: _snapshot_of(state) for name, state in states.items()},
            loop=loop,
            clock=clock.elapsed(),
            step=step,
            last_written=sinks.last_written,
            recent_returns=list(sinks.recent_returns),
            generators=generators,
        )
        path = os.path.join(folder, "state.pt")
        if os.path.exists(path):
            os.replace(path, os.path.join(folder, "state.prev.pt"))
        _write_atomic(path, lambda f: torch.save(everything, f))  # streamed: no copy of the replay in memory
        self.next_step = step + self.every
        self.next_time = time.monotonic() + self.seconds

    def restore(self, states, clock, device):
        """With --resume: the `states` in place, every random generator and the clock as saved; the loop's counters,
        its tensors on `device` (None without --resume)."""
        if self.saved is None:
            return None
        saved = self.saved.pop("states")  # the mapped file let go once restored (its disk space too)
        for name, state in states.items():
            _restore(state, saved[name])
        clock.go_on_from(self.saved["clock"])
        generators = self.saved.pop("generators")
        random.setstate(generators["python"])
        np.random.set_state(generators["numpy"])
        torch.set_rng_state(generators["torch"])
        if "cuda" in generators and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(generators["cuda"])
        # the loop's tensors copied onto the run's device (a tensor kept as mapped holds on to the whole file)
        return tree_map(lambda item: item.to(device, copy=True) if torch.is_tensor(item) else item, self.saved["loop"])


def _graph_counts():  # torch.compile's graphs and graph breaks so far in this process
    if "torch._dynamo" not in sys.modules:
        return 0, 0
    counters = sys.modules["torch._dynamo"].utils.counters
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


class Clock:
    """The speed figure: steps per second from the first steady step (warm-up and compilation left out) to the end of
    the training, the envs' seconds within it, and the graphs torch.compile made before and after it."""

    def __init__(self, device):
        self.device = device
        self.start_time = time.perf_counter()
        self.graphs_at_start = _graph_counts()  # what this run compiles, not what the process did before it
        self.steady_time = None
        self.env_seconds = 0.0
        self.steps_done = None

    def add_env_seconds(self, seconds):
        """Env time measured outside run.timed_env_call (an actor process's), counted into the summary's env_seconds."""
        self.env_seconds += seconds

    def start(self, step):
        """Starts the steady phase at the first call; later calls do nothing."""
        if self.steady_time is None:
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            self._start(step)

    def _start(self, step):
        self.steady_time = time.perf_counter()
        self.steady_step = step
        self.env_seconds = 0.0
        self.graphs_at_steady = _graph_counts()[0] - self.graphs_at_start[0]

    def sps(self, step):
        """Steps per second of the steady phase so far, None before it."""
        if self.steady_time is None or step <= self.steady_step:
            return None
        return (step - self.steady_step) / (time.perf_counter() - self.steady_time)

    def stop(self, step):
        """Ends the steady phase at `step`, the training's last (a run that ends before its steady phase has none)."""
        if self.steady_time is None:
            self._start(step)
        self.steps_done = step
        self.steady_steps = step - self.steady_step
        self.steady_seconds = time.perf_counter() - self.steady_time

    def elapsed(self):
        """Its readings as durations, for a snapshot: a resumed run's clock goes on from them (the time it lay
        stopped left out)."""
        now = time.perf_counter()
        steady = None if self.steady_time is None else (now - self.steady_time, self.steady_step)
        return dict(total=now - self.start_time, steady=steady, env_seconds=self.env_seconds)

    def go_on_from(self, saved):
        now = time.perf_counter()
        self.start_time, self.env_seconds = now - saved["total"], saved["env_seconds"]
        if saved["steady"] is not None:
            seconds, self.steady_step = saved["steady"]
            self.steady_time, self.graphs_at_steady = now - seconds, 0

    def per_steady_second(self, count):
        """`count`, what the steady phase did (updates, say), per second of it; None for a run without one."""
        return count / self.steady_seconds if self.steady_steps > 0 else None

    def figures(self):
        """The summary's timings and compile counts."""
        now = time.perf_counter()
        graphs, breaks = (now_count - before for now_count, before in zip(_graph_counts(), self.graphs_at_start))
        return {
            "compile_graphs": graphs,
            "graph_breaks": breaks,
            "graphs_after_warmup": graphs - self.graphs_at_steady,  # recompilations, paid in the steady phase
            "sps": self.per_steady_second(self.steady_steps),
            "steady_steps": self.steady_steps,
            "steady_seconds": self.steady_seconds,
            "env_seconds": self.env_seconds,
            "warmup_seconds": self.steady_time - self.start_time,
            "total_seconds": now - self.start_time,
            "steps_done": self.steps_done,
        }


class SilentSinks:
    """The sinks of a process that writes nothing (start(write=False), the processes of a run but its first): the
    returns of the last 20 training episodes and the non-finite check, which stops it where the first stops."""

    writes = False

    def __init__(self):
        self.recent_returns = deque(maxlen=20)
        self.last_step = 0  # the last step logged: what a run stopped at once reports as done

    def record_episode(self, step, episode_return, length=None):
        self.recent_returns.append(float(episode_return))

    def record_gymnasium_episodes(self, step, infos):
        """The episodes a gymnasium vector step ended, from each env's RecordEpisodeStatistics: under the same-step
        autoreset they are in infos["final_info"], under the next-step one in infos itself."""
        ended = infos.get("final_info", infos).get("episode")
        if ended is not None:
            for episode_return, length in zip(ended["r"][ended["_r"]], ended["l"][ended["_l"]]):
                self.record_episode(step, episode_return, length)

    def recent_return(self):
        """The mean return of the last 20 training episodes (the summary's return_mean), nan before the first."""
        return float(np.mean(self.recent_returns)) if self.recent_returns else math.nan

    def figures(self, eval_returns):
        """The summary's returns: the last 20 training episodes' mean, the evaluation's."""
        mean = lambda values: float(np.mean(values)) if values else None  # noqa: E731
        return {
            "return_mean": mean(self.recent_returns),
            "eval_return_mean": mean(eval_returns),
            "eval_returns": list(eval_returns),
        }

    def log(self, step, losses, charts=None):
        """Reads `losses` (scalar device tensors) in one sync; a non-finite one stops the run with exit code 1."""
        values = dict(zip(losses, torch.stack(list(losses.values())).tolist())) if losses else {}
        for name, value in values.items():
            if not math.isfinite(value):
                diverged = f"step {step}: {name} is {value}, training diverged (a lower learning rate may help)"
                raise Stopped(diverged, 1, keep_model=False)
        self.last_step = step
        return values

    def evaluation(self, step, eval_returns):
        pass

    def end_progress(self):
        pass

    def close(self):
        pass


class Sinks(SilentSinks):
    """Where a run's numbers go: W&B (--track), TensorBoard's events in the run folder, the progress bar (a line every
    10 s where stderr is not a terminal: a file, nohup, CI), and what SilentSinks keeps and checks."""

    writes = True

    def __init__(self, args, folder, clock, resumed=None):
        super().__init__()
        self.total_timesteps, self.clock = args.total_timesteps, clock
        if args.track:  # before the SummaryWriter: sync_tensorboard follows the writers made after it
            import wandb

            # W&B's files go to ./wandb: in the run folder it would follow its own copies of the events
            names = dict(project=args.wandb_project_name, entity=args.wandb_entity, name=os.path.basename(folder))
            try:
                wandb.init(**names, config=asdict(args), save_code=True, sync_tensorboard=True)
            except Exception as error:  # no API key, no network
                reason = (str(error).strip() or type(error).__name__).splitlines()[0]
                fail(f"--track: W&B did not start ({reason}); WANDB_MODE=offline needs no account and no network")
        step = resumed["step"] if resumed else 0
        self.last_written = resumed["last_written"] if resumed else 0  # the step of the last event written
        try:
            if not resumed:
                os.makedirs(folder)  # not exist_ok: a run started at the same moment elsewhere keeps its folder
            # a resumed run's scalars go on from its snapshot: the events written after it are dropped, one curve
            self.writer = SummaryWriter(folder, purge_step=self.last_written + 1 if resumed else None)
        except OSError as error:  # `runs` is a file, no permission, a read-only disk
            fail(f"cannot make the run folder {folder}: {error.strerror or error}")
        table = "".join(f"\n|{name}|{value}|" for name, value in asdict(args).items())
        self.writer.add_text("hyperparameters", "|param|value|\n|-|-|" + table)
        self.bar = tqdm(total=args.total_timesteps, initial=step, mininterval=1, disable=not sys.stderr.isatty())
        if resumed:
            self.recent_returns.extend(resumed["recent_returns"])
            self.last_step = step
        self.next_line = time.perf_counter()

    def record_episode(self, step, episode_return, length=None):
        super().record_episode(step, episode_return)
        self.last_written = step
        self.writer.add_scalar("charts/episodic_return", episode_return, step)
        if length is not None:
            self.writer.add_scalar("charts/episodic_length", length, step)

    def log(self, step, losses, charts=None):
        """`losses` under losses/ once checked, `charts` (host numbers) under charts/, the SPS and the progress."""
        values = super().log(step, losses)
        self.last_written = step
        for kind, scalars in (("losses", values), ("charts", charts or {})):
            for name, value in scalars.items():
                self.writer.add_scalar(f"{kind}/{name}", value, step)
        self.bar.update(step - self.bar.n)
        sps = self.clock.sps(step)
        if sps is not None:
            self.writer.add_scalar("charts/SPS", sps, step)
            recent = f"{np.mean(self.recent_returns):.1f}" if self.recent_returns else "none yet"
            self.bar.set_postfix(sps=f"{sps:.0f}", ret=recent, refresh=False)
            if self.bar.disable and time.perf_counter() >= self.next_line:
                print(f"step {step}/{self.total_timesteps}: {sps:.0f} SPS, return {recent}", file=sys.stderr)
                self.next_line = time.perf_counter() + 10
        return values

    def evaluation(self, step, eval_returns):
        self.writer.add_scalar("eval/episodic_return", np.mean(eval_returns), step)

    def end_progress(self):
        self.bar.close()

    def flush(self):
        self.writer.flush()

    def close(self):
        self.writer.close()

    def finish_wandb(self, exit_code, video_folder):
        """The evaluation videos (--capture-video) to W&B, then its end (a stopped run as failed)."""
        import wandb

        found = os.listdir(video_folder) if video_folder and os.path.isdir(video_folder) else []
        for name in sorted(name for name in found if name.endswith(".mp4")):
            wandb.log({"videos/eval": wandb.Video(os.path.join(video_folder, name))})
        wandb.finish(exit_code=exit_code)


class SignalWatcher:
    """Ctrl-C and SIGTERM. The first stops the run at the next safe point (stop_if_signalled); a second, or one that
    comes while the main thread waits where no safe point comes (an env call, a compile, W&B's upload) and still
    waits a second later, calls `stop_at_once` from the watcher's own thread."""

    def __init__(self, compiles):
        self.waiting = []  # the waits the main thread is in
        self.waits = 0  # the waits begun so far: a wait that ended and a new one are two
        if compiles:  # --compile: torch.compile's work is a wait too
            from torch._dynamo.callback import on_compile_end, on_compile_start

            on_compile_start(lambda _: self.enter("a compile"))
            on_compile_end(lambda _: self.leave("a compile"))

    def enter(self, reason):
        self.waiting.append(reason)
        self.waits += 1

    def leave(self, reason):
        self.waiting.remove(reason)

    def start(self, stop_at_once):
        # The signals reach a thread of their own through a pipe: the main thread may sit for minutes where no Python
        # code runs (an env call blocked in C), and a Python handler runs only there. The handler does nothing itself:
        # raising in it could interrupt a library mid-way (TensorBoard's writer queue, left with a lock taken, then
        # hangs the exit). A SIGINT the shell ignores (a background job) stays ignored.
        for signum in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(signum) is not signal.SIG_IGN:
                signal.signal(signum, lambda signum, frame: None)
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        signal.set_wakeup_fd(write_end)
        threading.Thread(target=self._watch, args=(read_end, stop_at_once), daemon=True).start()

    def _watch(self, read_end, stop_at_once):
        count = 0
        while True:
            signum = os.read(read_end, 1)[0]
            if signum in (signal.SIGINT, signal.SIGTERM):
                count += 1
                SIGNALS_RECEIVED.append(signum)
                if count > 1 or self._still_waiting():
                    stop_at_once(SIGNALS_RECEIVED[0])

    def _still_waiting(self):  # whether the main thread is in the same wait a second later: an env step takes ms
        waits = self.waits
        time.sleep(1 if self.waiting else 0)
        return bool(self.waiting) and self.waits == waits


def _run_folder(args, mode):  # runs/<env>__<script>__<seed>__<mode>__<time>, made by Sinks
    env_name = args.env_id.replace("/", "-")  # dm_control/cartpole-balance-v0: one folder, not two
    name = os.path.join("runs", f"{env_name}__{args.exp_name}__{args.seed}__{mode}__{int(time.time())}")
    # a run started in the same second with the same settings gets a folder of its own: name-2, name-3, ...
    return next(path for path in (name, *(f"{name}-{n}" for n in range(2, 1000))) if not os.path.exists(path))


def _mujoco():  # MuJoCo's module where it is installed (its envs print their compiler's warnings themselves)
    try:
        import mujoco
    except ImportError:
        return None
    return mujoco


def _hold_warnings():
    """Holds the warnings raised while the envs are made and a checkpoint checked (gymnasium's deprecated ids, and
    MuJoCo's compiler warnings, which MuJoCo prints itself): a refusal before the run starts is its one line alone.
    Returns the function that shows them."""
    holding = warnings.catch_warnings(record=True)
    held = holding.__enter__()
    mujoco, printed = _mujoco(), []
    if mujoco:
        mujoco.set_mju_user_warning(printed.append)

    def show():
        holding.__exit__(None, None, None)
        if mujoco:
            mujoco.set_mju_user_warning(None)  # MuJoCo's own printing again
            for text in printed:
                print(f"WARNING: {text}", file=sys.stderr)
        for warning in held:
            warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)

    return show


def _cpu_quota():  # a container's CPU limit in cores (cgroup v2), None without one
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()
        return int(quota) / int(period)
    except (OSError, ValueError):  # no cgroup v2 file, or no quota ("max")
        return None


def usable_cores():
    """The cores this process may run on: its CPU affinity, capped by a container's quota."""
    cores = len(os.sched_getaffinity(0))
    quota = _cpu_quota()
    return cores if quota is None else max(1, min(cores, int(quota)))


def _jiffies():  # per core: idle (with iowait) and total
    with open("/proc/stat") as f:
        rows = [line.split() for line in f if line.startswith("cpu") and line[3].isdigit()]
    return {int(row[0][3:]): (int(row[4]) + int(row[5]), sum(map(int, row[1:9]))) for row in rows}


def _idle_cores(seconds=0.2):  # the usable cores' idle shares over `seconds`, summed; None where /proc does not say
    try:
        cores = os.sched_getaffinity(0)
        before = _jiffies()
        time.sleep(seconds)
        after = _jiffies()
    except (OSError, AttributeError, ValueError):
        return None
    cores &= before.keys() & after.keys()
    idle = sum((after[c][0] - before[c][0]) / max(1, after[c][1] - before[c][1]) for c in cores)
    quota = _cpu_quota()
    return idle if quota is None else min(idle, quota)


def _tune_cpu(requested, device, threads, keep_freed_memory=False):
    """Sets torch's CPU threads once, before any tensor work, and returns them: --torch-threads, else OMP_NUM_THREADS,
    else one on CUDA (idle pool threads would compete with the envs), else `threads`: a count, or "idle", the cores
    at least 75% idle at start (a second thread buys small layers 1.2-1.5x on an idle machine and costs 3-4x beside
    busy processes). The summary records the count: --torch-threads repeats a run as it ran. `keep_freed_memory`:
    glibc gives large blocks back to the OS, so each minibatch's activations (tens of MB) were faulted in again;
    fixed thresholds keep them (1.03-1.13x the SPS on 2 cores, docs/speed.md)."""
    if requested or os.environ.get("OMP_NUM_THREADS"):
        threads = requested or torch.get_num_threads()
    elif device.type == "cuda":
        threads = 1
    elif threads == "idle":
        idle = _idle_cores()
        threads = 1 if idle is None else int(idle + 0.25)
    torch.set_num_threads(max(1, threads))
    if keep_freed_memory:
        try:
            mallopt = ctypes.CDLL("libc.so.6").mallopt
            mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: blocks up to 32 MB (glibc's largest setting) come from the heap
            mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: the heap keeps up to 1 GB of free memory
        except (OSError, AttributeError):  # macOS, musl: other C libraries are left alone
            pass
    return torch.get_num_threads()


def _check_fits(num_bytes, device, flag):
    """A buffer larger than the device's memory fails now (exit code 2), not hours later as its pages fill."""
    cuda = device.type == "cuda"
    total = torch.cuda.mem_get_info(device)[1] if cuda else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if num_bytes > total:
        fail(f"{flag} needs {num_bytes / 2**30:.1f} GiB, more than the {total / 2**30:.1f} GiB of {device.type} memory")


def _write_summary(folder, record, announce=True):  # summary.json, then its line of figures and the SPEED line
    record = json.loads(json.dumps(record), parse_constant=lambda constant: None)  # NaN -> null
    _write_atomic(os.path.join(folder, "summary.json"), lambda f: f.write(json.dumps(record, indent=1).encode()))
    if not announce:
        return
    evaluation = f"eval return {record['eval_return_mean']:.1f}" if record["eval_returns"] else "no evaluation"
    print(f"{record['steps_done']} steps, {record['sps'] or 0:.0f} SPS, {evaluation}; written to {folder}")
    print("SPEED " + json.dumps(record), flush=True)


def _descendants(pid):  # the processes `pid` started (an actor process, Ray's), theirs too
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(child) for child in f.read().split()]
    except OSError:
        return []
    return children + [grandchild for child in children for grandchild in _descendants(child)]


class Run:
    """One training run, in the order of the module's docstring: the flag checks, the seeds, the device and the run
    folder's name, then its parts (the checkpoint, the clock, the sinks, the signal watcher); its summary and exit
    code at the end."""

    def __init__(self, args):
        check_flags(args)
        self.args = args
        random.seed(args.seed)
        np.random.seed(args.seed)
        torch.manual_seed(args.seed)
        torch.backends.cudnn.deterministic = args.torch_deterministic
        self.device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
        self.cudagraphs = args.cudagraphs and self.device.type == "cuda"  # without CUDA the same code runs eagerly
        self.mode = "+".join(flag for flag in ("compile", "cudagraphs") if getattr(args, flag)) or "eager"
        self.snapshot = Snapshot(args)
        self.dir = args.resume or _run_folder(args, self.mode)
        self.video_folder = os.path.join(self.dir, "videos") if args.capture_video else None
        self.checkpoint, self.clock, self.sinks = None, Clock(self.device), SilentSinks()
        self.run_states = None  # what --checkpoint-every keeps, named by resumable
        self.watcher = SignalWatcher(compiles=args.compile)
        self.stopped = None  # the Stopped that ended the run
        self.final_metrics = {}
        self.written = False  # summary.json of the training: by the run as it ends, or by a stop at once
        self.writing = threading.Lock()
        self.show_held_warnings = _hold_warnings()

    # Run's own jobs (not forwards): the rules above Run, given the run's --torch-threads and device
    def tune_cpu(self, threads, keep_freed_memory=False):
        """torch's CPU threads (_tune_cpu: --torch-threads, else one on CUDA, else `threads`), before tensor work."""
        _tune_cpu(self.args.torch_threads, self.device, threads, keep_freed_memory)

    def check_fits(self, num_bytes, flag, device=None):
        """A buffer of `num_bytes` (`flag`'s) larger than the memory of `device`, the run's by default: exit code 2."""
        _check_fits(num_bytes, device or self.device, flag)

    def save_and_load(self, states, **sizes):
        """Names what the checkpoint holds (Checkpoint); returns the one --load-model loaded, or None."""
        self.checkpoint = Checkpoint(self.args, self.device, states, sizes)
        return self.checkpoint.loaded

    def resumable(self, **states):
        """Names the run's states beyond the Checkpoint's (its replay, generators, envs: anything with a state_dict,
        tensors, NumPy generators, gymnasium vector envs, buffers of tensors and counters) that --checkpoint-every
        keeps. With --resume, restores them all and every random generator, and returns the loop's counters as
        checkpoint_if_due saved them; else None."""
        self.run_states = {**self.checkpoint.states, **states}
        return self.snapshot.restore(self.run_states, self.clock, self.device)

    def checkpoint_if_due(self, step, **loop):
        """At a point of the loop where its state is whole, every --checkpoint-every steps and once a Ctrl-C or SIGTERM
        came (before stop_if_signalled ends the run: a preempted run loses nothing): the snapshot of every state
        resumable named, with the loop's counters `loop` (what resumable returns to the resumed run)."""
        if self.sinks.writes and (self.snapshot.due(step) or (self.snapshot.on and SIGNALS_RECEIVED)):
            self.sinks.flush()  # the scalars so far on disk: a resumed run's go on from `step`
            self.snapshot.save(self.dir, step, self.args, self.run_states, loop, self.clock, self.sinks)

    def start(self, write=True):
        """Shows the held warnings; makes the run folder and the Sinks (SilentSinks unless `write`); starts the
        SignalWatcher."""
        if self.args.save_model and self.checkpoint is None:
            fail("--save-model: this script does not say what its checkpoint holds (run.save_and_load)")
        if (self.snapshot.on or self.args.resume) and self.run_states is None:
            fail("--checkpoint-every and --resume: this script does not keep its run's whole state (run.resumable)")
        self.show_held_warnings()
        if write:
            self.sinks = Sinks(self.args, self.dir, self.clock, self.snapshot.saved)
            if self.args.cudagraphs and not self.cudagraphs:
                print("warning: --cudagraphs needs CUDA; running the same code eagerly", file=sys.stderr)
        self.watcher.start(self._stop_at_once)

    def timed_env_call(self, env_call, *args):
        """`env_call(*args)`, its time counted as the env's; a signal while it blocks stops the run at once."""
        start = time.perf_counter()
        self.watcher.enter("an env call")
        result = env_call(*args)
        self.watcher.leave("an env call")
        self.clock.add_env_seconds(time.perf_counter() - start)
        return result

    # The loop's calls stay on the run: each script makes them where the module's docstring shows them, its lifecycle
    # in the run's calls (through run.clock or run.sinks, each call would cost every script two tokens more)
    def start_speed_measure(self, step):
        """Starts the speed figure at the first call (Clock.start); later calls do nothing."""
        self.clock.start(step)

    def record_episode(self, step, episode_return, length=None):
        """A finished training episode, to the sinks."""
        self.sinks.record_episode(step, episode_return, length)

    def record_gymnasium_episodes(self, step, infos):
        """A gymnasium vector step's ended episodes (SilentSinks.record_gymnasium_episodes), to the sinks."""
        self.sinks.record_gymnasium_episodes(step, infos)

    def log(self, step, losses, charts=None):
        """`losses` (scalar device tensors) and `charts` (host numbers) to the sinks; a non-finite one stops the run."""
        self.sinks.log(step, losses, charts)

    @contextmanager
    def stoppable(self, part="the training", kept="the summary of the steps done"):
        """The `with` block ends at the first Stopped, which the run keeps as its reason. Any other exception (a bug
        in a changed script, an env that crashes) prints its traceback and stops the run as failed, `kept` kept."""
        try:
            yield
        except Stopped as stop:
            self.stopped = self.stopped or stop
        except Exception as error:
            traceback.print_exc()
            failed = f"{part} raised {type(error).__name__} (the traceback above); {kept} is in {self.dir}"
            self.stopped = self.stopped or Stopped(failed, 1, keep_model=False)  # its update may be half done

    def end_training(self, step, losses):
        """Stops the clock at `step`; the last losses are logged through the non-finite check."""
        self.final_metrics = {name: value.item() for name, value in losses.items()}
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.clock.stop(step)
        with self.stoppable():  # written unless the loop logged at `step`: one point a step, resumed or not
            if step == self.sinks.last_step:
                SilentSinks.log(self.sinks, step, losses)
            else:
                self.log(step, losses)
        self.sinks.end_progress()

    def exit_code(self):
        """0, or the exit code of the stop that ended the training (1: a failure, such as a diverged loss)."""
        return self.stopped.exit_code if self.stopped else 0

    def write_and_evaluate(self, evaluate, summary):
        """summary.json, with the script's `summary` keys added, and model.pt with --save-model (not a diverged one) as
        the training left them; then, unless the run was stopped, `evaluate()` (a list of returns), whose returns the
        summary gains. An exception in the evaluation keeps both files, prints its traceback and fails the run. Then
        the last two lines and W&B's end. Returns the exit code for the script to exit with: 0, or the stop's."""
        with self.writing:  # a second signal now waits for the files, about a second, then stops the run
            self.sinks.flush()
            _write_summary(self.dir, {**self._summary(), **summary}, announce=False)
            if self.args.save_model and (self.stopped is None or self.stopped.keep_model):  # also after a stop
                self.checkpoint.save(os.path.join(self.dir, "model.pt"), self.args)
            self.written = True
        eval_returns = []
        if self.args.eval_episodes > 0 and not self.stopped:
            with self.stoppable("the evaluation", kept="the training's summary (and model, with --save-model)"):
                eval_returns = evaluate()
                self.sinks.evaluation(self.clock.steps_done, eval_returns)
        with self.writing:
            self.sinks.close()
            _write_summary(self.dir, {**self._summary(eval_returns), **summary})
        if self.args.track:
            self.watcher.enter("W&B's upload")
            self.sinks.finish_wandb(self.exit_code(), self.video_folder)
        if self.stopped:
            done = f": the steps done are in {self.dir}"
            print(f"error: {self.stopped}" if self.stopped.exit_code == 1 else f"{self.stopped}{done}", file=sys.stderr)
        return self.exit_code()

    def _stop_at_once(self, signum):
        """From the watcher's thread, while the main thread is busy: the summary of the steps done (no model: its
        update may be half done), every process the run started killed, exit code 128 + signal."""
        where = f" during {self.watcher.waiting[-1]}" if self.watcher.waiting else ""
        self.stopped = Stopped(f"stopped by {signal.Signals(signum).name}{where}", 128 + signum)
        with self.writing:
            if self.sinks.writes and not self.written:
                if self.clock.steps_done is None:  # a stop after the training's end keeps its clock
                    self.clock.stop(self.sinks.last_step)
                self.sinks.flush()
                _write_summary(self.dir, self._summary())
            print(f"{self.stopped}: the steps done are in {self.dir}", file=sys.stderr, flush=True)
            for pid in _descendants(os.getpid()):
                os.kill(pid, signal.SIGKILL)
            os._exit(self.stopped.exit_code)

    def _summary(self, eval_returns=()):  # SUMMARY_KEYS, and how the run ran
        args, cuda = self.args, self.device.type == "cuda"
        record = {key: getattr(args, key, None) for key in ("env_id", "seed", "num_envs", "total_timesteps", "compile")}
        return {
            **record,  # num_envs: a script without --num-envs gives it in its summary
            "script": _script_name() + ".py",
            "mode": self.mode,
            "cudagraphs_requested": args.cudagraphs,
            "cudagraphs_active": self.cudagraphs,
            "device": str(self.device),
            "torch_version": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            # libgomp's short spin, read when torch loaded it (PPO-LSTM sets it at import): it moves the speed
            "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
            **self.clock.figures(),
            **self.sinks.figures(eval_returns),
            "peak_memory_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "final_metrics": self.final_metrics,
            "stopped": str(self.stopped) if self.stopped else None,
            **({"peak_cuda_memory_mb": torch.cuda.max_memory_allocated() / 2**20} if cuda else {}),
        }
