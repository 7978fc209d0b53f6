"""Run bookkeeping for the scripts beside it: what every script needs and no reader of its algorithm comes for; no
algorithm (networks, losses, env wrappers, replay). Bad input: one line, exit code 2, before any work. Ctrl-C, SIGTERM:
a clean stop, exit code 128 + signal. A non-finite value: exit code 1, no model. A stopped run writes its summary."""

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
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

SIGNALS_RECEIVED = []  # Ctrl-C and SIGTERM as the handler notes them (Run.open); check_signals raises at safe points


def _script_name():  # the script being run, without .py
    return os.path.basename(getattr(sys.modules["__main__"], "__file__", "script.py")).removesuffix(".py")


@dataclass
class RunArgs:
    """The flags every script shares (each script's Args extends it); a field's comment is its --help text."""

    exp_name: str = field(default_factory=_script_name)  # the name of this experiment
    seed: int = 1  # seed of the experiment
    torch_deterministic: bool = True  # if toggled, `torch.backends.cudnn.deterministic=True`
    cuda: bool = True  # use CUDA when it is available
    track: bool = False  # log the run to Weights & Biases (pip install ".[wandb]"; WANDB_MODE=offline keeps it local)
    wandb_project_name: str = "leanrl-scripts"  # the W&B project of --track
    wandb_entity: str | None = None  # the W&B team or user of --track (None: your own)
    torch_threads: int = 0  # torch's CPU threads (0: one on CUDA, else the script's choice; OMP_NUM_THREADS too)
    compile: bool = False  # wrap the script's pieces in torch.compile (the summary lists those that ran compiled)
    cudagraphs: bool = False  # wrap them in CUDA graphs (tensordict's CudaGraphModule); without CUDA, run eagerly
    eval_episodes: int = 10  # evaluation episodes at the end of the run (on Atari whole games, the game's score)
    capture_video: bool = False  # record the first evaluation episode to runs/<run_name>/videos (needs .[video])
    save_model: bool = False  # save a checkpoint to runs/<run_name>/model.pt at the end
    load_model: str = ""  # a checkpoint to start from (evaluate it with --total-timesteps 0, or continue training)


def fail(message):
    """Bad input: one line on stderr, exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def check_fits(num_bytes, device, flag):
    """A buffer larger than the device's memory fails now (exit code 2), not hours later as its pages fill."""
    cuda = device.type == "cuda"
    total = torch.cuda.mem_get_info(device)[1] if cuda else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if num_bytes > total:
        fail(f"{flag} needs {num_bytes / 2**30:.1f} GiB, more than the {total / 2**30:.1f} GiB of {device.type} memory")


def _cpu_quota():  # a container's CPU limit in cores (cgroup v2), None without one
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()
        return int(quota) / int(period)
    except (OSError, ValueError):  # no cgroup v2 file, or no quota ("max")
        return None


def usable_cores():
    """The cores this process may run on: its CPU affinity, capped by a container's quota."""
    cores, quota = len(os.sched_getaffinity(0)), _cpu_quota()
    return cores if quota is None else max(1, min(cores, int(quota)))


def _jiffies():  # per core: idle (with iowait) and total
    with open("/proc/stat") as f:
        rows = [line.split() for line in f if line.startswith("cpu") and line[3].isdigit()]
    return {int(row[0][3:]): (int(row[4]) + int(row[5]), sum(map(int, row[1:9]))) for row in rows}


def _idle_cores(seconds=0.2):  # the usable cores' idle shares over `seconds`, summed; None where /proc does not say
    try:
        cores, before = os.sched_getaffinity(0), _jiffies()
        time.sleep(seconds)
        after = _jiffies()
    except (OSError, AttributeError, ValueError):
        return None
    cores &= before.keys() & after.keys()
    idle, quota = sum((after[c][0] - before[c][0]) / max(1, after[c][1] - before[c][1]) for c in cores), _cpu_quota()
    return idle if quota is None else min(idle, quota)


def tune_cpu(requested, device, threads, keep_freed_memory=False):
    """Sets torch's CPU threads once, before any tensor work, and returns them: --torch-threads, else OMP_NUM_THREADS,
    else one on CUDA (idle pool threads would compete with the envs), else `threads`: a count, or "idle", the cores
    at least 75% idle at start (a second thread buys small layers 1.2-1.5x on an idle machine and costs 3-4x beside
    busy processes). `keep_freed_memory`: glibc gives large blocks back to the OS, so each minibatch's activations
    (tens of MB) were faulted in again; fixed thresholds keep them (1.03-1.13x the SPS on 2 cores, docs/speed.md)."""
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


class Stopped(Exception):
    """Ends `with run.stoppable()`: the run keeps it as its reason, exits with `exit_code` and saves the model as it
    stood (--save-model) unless `keep_model` is False (a diverged one)."""

    def __init__(self, message, exit_code, keep_model=True):
        super().__init__(message)
        self.exit_code, self.keep_model = exit_code, keep_model


def check_signals():
    """For the loop's safe points: Stopped after Ctrl-C or SIGTERM (the handler only notes the signal: Run.open)."""
    if SIGNALS_RECEIVED:
        raise Stopped(f"stopped by {signal.Signals(SIGNALS_RECEIVED[0]).name}", 128 + SIGNALS_RECEIVED[0])


def _write_atomic(path, data):  # a failed write (a full disk) leaves neither a partial file nor the temporary one
    try:
        with open(path + ".tmp", "wb") as f:
            f.write(data)
        os.replace(path + ".tmp", path)
    except OSError as error:
        if os.path.exists(path + ".tmp"):
            os.remove(path + ".tmp")
        print(f"error: could not write {path}: {error.strerror or error}", file=sys.stderr)
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


def _graph_counts():  # torch.compile's graphs and graph breaks so far in this process
    if "torch._dynamo" not in sys.modules:
        return 0, 0
    counters = sys.modules["torch._dynamo"].utils.counters
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


class Run:
    """Run(args, counts, rates, fractions) refuses values that are not positive, not a positive number, out of [0, 1],
    and seeds Python, NumPy and torch. keep() names what a checkpoint holds (and loads one); open() starts the run;
    inside `with run.stoppable()`, in_env() times the env calls, mark_steady() starts the speed measure on its first
    call, episode(), episodes() and log() record; end() stops the clock; finish() writes the files and exits."""

    def __init__(self, args, counts=(), rates=(), fractions=()):
        self.args, self.start_time = args, time.perf_counter()
        if args.total_timesteps < 0 or (args.total_timesteps == 0 and not args.load_model):
            fail("--total-timesteps must be positive (0 only with --load-model)")
        rules = [
            (counts, lambda value: value > 0, "must be positive"),
            (rates, lambda value: 0 < value < math.inf, "must be a positive number"),  # also refuses nan
            (("gamma", *fractions), lambda value: 0 <= value <= 1, "must be in [0, 1]"),
            (("eval_episodes", "torch_threads"), lambda value: value >= 0, "must be 0 or more"),
        ]
        for names, valid, rule in rules:
            for name in filter(lambda name: not valid(getattr(args, name)), names):
                fail(f"--{name.replace('_', '-')} {rule}")
        if args.load_model and not os.path.isfile(args.load_model):
            fail(f"--load-model: no checkpoint at {args.load_model}")
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
        random.seed(args.seed)
        np.random.seed(args.seed)
        torch.manual_seed(args.seed)
        torch.backends.cudnn.deterministic = args.torch_deterministic
        self.device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
        self.cudagraphs = args.cudagraphs and self.device.type == "cuda"  # without CUDA the same code runs eagerly
        self.mode = "+".join(flag for flag in ("compile", "cudagraphs") if getattr(args, flag)) or "eager"
        env_name = args.env_id.replace("/", "-")  # dm_control/cartpole-balance-v0: one folder, not two
        name = os.path.join("runs", f"{env_name}__{args.exp_name}__{args.seed}__{self.mode}__{int(time.time())}")
        # a run started in the same second with the same settings gets a folder of its own: name-2, name-3, ...
        self.dir = next(path for path in (name, *(f"{name}-{n}" for n in range(2, 1000))) if not os.path.exists(path))
        self.video_folder = os.path.join(self.dir, "videos") if args.capture_video else None
        self.recent_returns, self.env_seconds, self.stopped, self.steady_time = deque(maxlen=20), 0.0, None, None
        self.graphs_at_start = _graph_counts()  # what this run compiles, not what the process did before it

    def keep(self, states, **sizes):
        """A checkpoint (--save-model) holds `states` (modules and optimizers) and the `sizes` they were made for. With
        --load-model, loads them from one made for the same sizes and returns it (for what else it holds)."""
        self.states, self.sizes, path = states, sizes, self.args.load_model
        if not path:
            return None
        try:
            checkpoint = torch.load(path, map_location=self.device, weights_only=True)
            made_for = {key: checkpoint[key] for key in sizes}
            for name, state in states.items() if made_for == sizes else ():
                if hasattr(state, "param_groups"):  # an optimizer
                    _load_keeping_settings(state, checkpoint[name])
                else:
                    state.load_state_dict(checkpoint[name])
        except Exception as error:  # empty, truncated, not a torch file, another script's checkpoint
            fail(f"--load-model: {path} is not a checkpoint of this script ({type(error).__name__})")
        if made_for != sizes:
            said = lambda sizes: ", ".join(f"{name} {size}" for name, size in sizes.items())  # noqa: E731
            trained, asked = f"{checkpoint['env_id']} ({said(made_for)})", f"{self.args.env_id} has {said(sizes)}"
            fail(f"--load-model: {path} was trained on {trained}; {asked}")
        return checkpoint

    def open(self, write=True):  # the folder, TensorBoard, W&B and progress (unless not `write`), the signal handlers
        args = self.args
        if write:
            if self.args.track:  # before the SummaryWriter: sync_tensorboard follows the writers made after it
                # W&B's files go to ./wandb: in the run folder it would follow its own copies of the events
                names = dict(project=args.wandb_project_name, entity=args.wandb_entity, name=os.path.basename(self.dir))
                try:
                    self.wandb.init(**names, config=asdict(args), save_code=True, sync_tensorboard=True)
                except Exception as error:  # no API key, no network
                    reason = (str(error).strip() or type(error).__name__).splitlines()[0]
                    fail(f"--track: W&B did not start ({reason}); WANDB_MODE=offline needs no account and no network")
            try:
                os.makedirs(self.dir)  # not exist_ok: a run started at the same moment elsewhere keeps its folder
                self.writer = SummaryWriter(self.dir)
            except OSError as error:  # `runs` is a file, no permission, a read-only disk
                fail(f"cannot make the run folder {self.dir}: {error.strerror or error}")
            table = "".join(f"\n|{name}|{value}|" for name, value in asdict(args).items())
            self.writer.add_text("hyperparameters", "|param|value|\n|-|-|" + table)
            if args.cudagraphs and not self.cudagraphs:
                print("warning: --cudagraphs needs CUDA; running the same code eagerly", file=sys.stderr)
            self.bar = tqdm(total=args.total_timesteps, mininterval=1, disable=not sys.stderr.isatty())
            self.next_line = time.perf_counter()
        # The handler only notes the signal: raising in it could interrupt a library mid-way (TensorBoard's writer
        # queue, left with a lock taken, then hangs the exit). A SIGINT the shell ignores (a background job) stays so.
        for signum in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(signum) is not signal.SIG_IGN:
                signal.signal(signum, lambda signum, frame: SIGNALS_RECEIVED.append(signum))

    def in_env(self, env_call, *args):  # `env_call(*args)`, its time counted as the env's
        start = time.perf_counter()
        result = env_call(*args)
        self.env_seconds += time.perf_counter() - start
        return result

    def mark_steady(self, step):  # the speed measure starts at the first call: warm-up and compilation left out
        if self.steady_time is None:
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            self.steady_time, self.steady_step, self.env_seconds = time.perf_counter(), step, 0.0
            self.graphs_at_steady = _graph_counts()[0] - self.graphs_at_start[0]

    def episode(self, step, episode_return, length=None):  # a finished training episode
        self.recent_returns.append(float(episode_return))
        self.writer.add_scalar("charts/episodic_return", episode_return, step)
        if length is not None:
            self.writer.add_scalar("charts/episodic_length", length, step)

    def episodes(self, step, infos):  # those a gymnasium vector step ended, from each env's RecordEpisodeStatistics
        if "episode" in infos.get("final_info", ()):
            ended = infos["final_info"]["episode"]
            for episode_return, length in zip(ended["r"][ended["_r"]], ended["l"][ended["_l"]]):
                self.episode(step, episode_return, length)

    def log(self, step, metrics, **charts):  # metrics: scalar device tensors, read in one sync; charts: host numbers
        values = dict(zip(metrics, torch.stack(list(metrics.values())).tolist())) if metrics else {}
        for name, value in values.items():
            if not math.isfinite(value):
                diverged = f"step {step}: {name} is {value}, training diverged (a lower learning rate may help)"
                raise Stopped(diverged, 1, keep_model=False)
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
                print(f"step {step}/{self.args.total_timesteps}: {sps:.0f} SPS, return {recent}", file=sys.stderr)
                self.next_line = time.perf_counter() + 10  # stderr is a file, nohup, CI: a line every 10 s

    @contextmanager
    def stoppable(self):  # the `with` block ends at the first Stopped, which the run keeps as its reason
        try:
            yield
        except Stopped as stop:
            self.stopped = self.stopped or stop

    def end(self, step, metrics):  # stops the clock; the last metrics also go through the divergence check
        self.final_metrics = {name: value.item() for name, value in metrics.items()}
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.mark_steady(step)  # a run that ends before its steady phase has none
        self.steps_done, self.steady_steps = step, step - self.steady_step
        self.steady_seconds = time.perf_counter() - self.steady_time
        self.sps = self.steady_steps / self.steady_seconds if self.steady_steps > 0 else None
        with self.stoppable():
            self.log(step, metrics)
        self.bar.close()

    def finish(self, evaluate, summary, extra=None):
        """Unless stopped, `evaluate()` (a list of returns); then summary.json with the `summary` keys added, model.pt
        with --save-model (keep()'s states and `extra`; not a diverged one), the last two lines, and the exit code."""
        args, eval_returns = self.args, []
        if args.eval_episodes > 0 and not self.stopped:
            with self.stoppable():
                eval_returns = evaluate()
                self.writer.add_scalar("eval/episodic_return", np.mean(eval_returns), self.steps_done)
        for signum in (signal.SIGINT, signal.SIGTERM):  # what remains writes two files in about a second
            signal.signal(signum, signal.SIG_IGN)
        mean, now = lambda values: float(np.mean(values)) if values else None, time.perf_counter()  # noqa: E731
        record = {key: getattr(args, key, None) for key in ("env_id", "seed", "num_envs", "total_timesteps", "compile")}
        record.update(script=_script_name() + ".py", mode=self.mode, cudagraphs_requested=args.cudagraphs)
        record.update(cudagraphs_active=self.cudagraphs, device=str(self.device), torch_version=torch.__version__)
        record["torch_threads"] = torch.get_num_threads()
        graphs, breaks = (now - before for now, before in zip(_graph_counts(), self.graphs_at_start))
        # a graph compiled after warm-up is a recompilation, paid in the steady phase
        record.update(compile_graphs=graphs, graph_breaks=breaks, graphs_after_warmup=graphs - self.graphs_at_steady)
        record.update({key: getattr(self, key) for key in ("sps", "steady_steps", "steady_seconds", "env_seconds")})
        record.update(warmup_seconds=self.steady_time - self.start_time, total_seconds=now - self.start_time)
        record.update(return_mean=mean(self.recent_returns), eval_return_mean=mean(eval_returns))
        memory = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        record.update(eval_returns=eval_returns, peak_memory_mb=memory, final_metrics=self.final_metrics)
        record.update(steps_done=self.steps_done, stopped=str(self.stopped) if self.stopped else None)
        if self.device.type == "cuda":
            record["peak_cuda_memory_mb"] = torch.cuda.max_memory_allocated() / 2**20
        record = json.loads(json.dumps({**record, **summary}), parse_constant=lambda constant: None)  # NaN -> null
        self.writer.close()
        if args.track:  # the evaluation videos (--capture-video), then W&B ends the run (a stopped one as failed)
            videos = self.video_folder
            found = os.listdir(videos) if videos and os.path.isdir(videos) else []
            for name in sorted(name for name in found if name.endswith(".mp4")):
                self.wandb.log({"videos/eval": self.wandb.Video(os.path.join(videos, name))})
            self.wandb.finish(exit_code=self.stopped.exit_code if self.stopped else 0)
        _write_atomic(os.path.join(self.dir, "summary.json"), json.dumps(record, indent=1).encode())
        if args.save_model and (self.stopped is None or self.stopped.keep_model):  # as it stood, also after a stop
            states = {name: state.state_dict() for name, state in self.states.items()}
            buffer = io.BytesIO()  # torch.save's own file errors are opaque (RuntimeError: unexpected pos ...)
            torch.save({"env_id": args.env_id, "args": asdict(args), **self.sizes, **states, **(extra or {})}, buffer)
            _write_atomic(os.path.join(self.dir, "model.pt"), buffer.getvalue())
        evaluation = f"eval return {record['eval_return_mean']:.1f}" if eval_returns else "no evaluation"
        print(f"{self.steps_done} steps, {record['sps'] or 0:.0f} SPS, {evaluation}; written to {self.dir}")
        print("SPEED " + json.dumps(record))
        if self.stopped:
            done = f": the steps done are in {self.dir}"
            print(f"error: {self.stopped}" if self.stopped.exit_code == 1 else f"{self.stopped}{done}", file=sys.stderr)
            sys.exit(self.stopped.exit_code)
