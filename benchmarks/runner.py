"""What every benchmark tool shares: the settings table (settings.toml), the results folder of this machine, and one
way to run a script, stop it with its children and read the summary it wrote.

    settings()                    settings.toml, read
    flags(table, name, profile)   a row's or task's flags at a profile (None where it has no such budget)
    our_command(rows, name, ...)  a row's run of our script, relative to the repository
    run(command, workdir, ...)    start it in its own process group, time it, stop it with its children
    run_in_scratch(python, words) the same in a scratch folder, with its summary
    summary(stdout)               the run summary our scripts print last (their SPEED line)
    Logs(workdir).read()          what a run logged to TensorBoard or to the wandb stand-in, as it runs
    run_script(path, argv)        a script run (or imported) in this process, as `python path` would
    record_command(...)           a command as a record keeps it: paths relative to the repository or the
                                  reference clone, the Python named by its version, so that a stranger can rerun it
"""

import contextlib
import ctypes
import functools
import glob
import json
import math
import os
import re
import runpy
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from types import SimpleNamespace
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTINGS = os.path.join(ROOT, "benchmarks", "settings.toml")
PROFILES = ("smoke", "quick", "full")
MODES = ("eager", "compile", "cudagraphs", "compile+cudagraphs")


def settings():
    with open(SETTINGS, "rb") as f:
        return tomllib.load(f)


def flags(table, name, profile):
    """The flags of `table`'s entry `name` at `profile`: its own, then its budget's (another entry's where `budget`
    names one); None where that budget has no such profile."""
    budget = table[table[name].get("budget", name)]
    return None if profile not in budget else [*table[name].get("flags", []), *budget[profile]]


def mode_flags(mode):
    return ["--compile"] * ("compile" in mode) + ["--cudagraphs"] * ("cudagraphs" in mode)


def our_command(rows, name, profile, *extra):
    """Row `name`'s run of our script at `profile`, relative to the repository: no evaluation, seed 1, `extra`
    (a mode's flags, a thread count) before the seed."""
    script = f"leanrl_scripts/{rows[name]['script']}"
    return [
        *rows[name].get("launcher", []),
        script,
        *flags(rows, name, profile),
        "--eval-episodes",
        "0",
        *extra,
        "--seed",
        "1",
    ]


def run_in_scratch(python, words, env=None, limit=None):
    """`words` (relative to the repository) run by `python` in a scratch folder, so that the runs/ and videos/
    folders it makes go with it: how it ended, and its summary."""
    command = [python, *[os.path.join(ROOT, word) if word.endswith(".py") else word for word in words]]
    with tempfile.TemporaryDirectory() as workdir:
        ended = run(command, workdir, env, limit)
    return ended, summary(ended.stdout)


def machine_tag():
    """The results folder's name: the GPU's, else cpu-<cores>core."""
    import torch

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu-{os.cpu_count()}core"
    return re.sub("[^A-Za-z0-9]+", "-", name).strip("-").lower()


def results_folder(given, *parts):
    """`given`, else this machine's folder under benchmarks/results; made if missing."""
    folder = given or os.path.join(ROOT, "benchmarks", "results", machine_tag(), *parts)
    os.makedirs(folder, exist_ok=True)
    return folder


def add_arguments(parser):
    """The flags the comparison and the learning benchmark share."""
    parser.add_argument("--profile", choices=PROFILES, default="full")
    parser.add_argument("--only", default="", help="comma-separated names of settings.toml's entries")
    parser.add_argument("--results", help="default: benchmarks/results/<machine-tag>/<the tool's folder>")
    parser.add_argument("--leanrl", metavar="CLONE", help="a clone of pytorch-labs/LeanRL")
    parser.add_argument("--cleanrl", metavar="CLONE", help="a clone of vwxyzjn/cleanrl")
    parser.add_argument("--fasttd3", metavar="CLONE", help="a clone of younggyoseo/FastTD3")
    parser.add_argument(
        "--sb3-contrib", metavar="CLONE", help="a clone of Stable-Baselines-Team/stable-baselines3-contrib"
    )
    parser.add_argument("--reference-python", default=sys.executable, help="the Python that runs the references")
    parser.add_argument("--jax-python", help="the Python that runs the JAX scripts (requirements/requirements-jax.txt)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")


def pyplot():
    """matplotlib's pyplot drawing to files, or None with a note where it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError:
        print("note: matplotlib is not installed (pip install '.[dev]'): no chart", file=sys.stderr)
        return None
    return plt


class Ended(NamedTuple):
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    stopped: str | None  # why it was stopped before its end, None where it ended by itself


@functools.cache
def dies_with_parent():
    """What a child calls before it starts (Popen's preexec_fn) to get a SIGTERM once the process that started it is
    gone, however that went, a SIGKILL too; None off Linux. prctl is looked up here, in the parent: loading a library
    in a child forked from a process with threads can deadlock."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None).prctl
    return lambda: prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def run(command, workdir, env=None, limit=None, stop_when=None, poll_seconds=30):
    """Runs `command` in `workdir` in a process group of its own, to its end; stops it once it has run `limit`
    seconds or `stop_when()` (asked every `poll_seconds`) gives a reason: SIGTERM to its process group (ours then
    writes its summary), SIGKILL a minute later. Whatever it started dies with it: on Ctrl-C it is stopped so too
    (SIGKILL after 30 s), and where this process is killed, it gets a SIGTERM."""
    with open(os.path.join(workdir, "stdout.txt"), "w+") as out, open(os.path.join(workdir, "stderr.txt"), "w+") as err:
        started, stopped = time.time(), None
        proc = subprocess.Popen(
            command, cwd=workdir, env=env, stdout=out, stderr=err, start_new_session=True, preexec_fn=dies_with_parent()
        )
        try:
            while stopped is None:
                waits = [poll_seconds] if stop_when else []
                waits += [] if limit is None else [limit - (time.time() - started)]
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(min(waits), 0) if waits else None)
                    break
                if limit is not None and time.time() - started >= limit:
                    stopped = f"after {limit:.0f} s"
                elif stop_when:
                    stopped = stop_when() or None
            if stopped:
                os.killpg(proc.pid, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=60)
        except BaseException:  # Ctrl-C: the run stopped as above, its summary written, unless a second one comes
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
            raise
        finally:
            with contextlib.suppress(ProcessLookupError):  # the group outlives its leader while a child lives
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.seek(0), err.seek(0)
        return Ended(proc.returncode, out.read(), err.read(), time.time() - started, stopped)


def summary(stdout):
    """The summary our script printed last as `SPEED {json}`, or None."""
    lines = [line for line in stdout.splitlines() if line.startswith("SPEED ")]
    return json.loads(lines[-1][len("SPEED ") :]) if lines else None


class Logs:
    """What a run in `workdir` has logged so far, read as it runs: {tag: [(step, wall time, value), ...]} of its
    TensorBoard scalars (read on from where the last call stopped) and of the values the wandb stand-in beside a
    reference script keeps ("wandb/speed", "wandb/episode_return"; NaN left out)."""

    def __init__(self, workdir):
        self.workdir, self.events = workdir, None

    def read(self):
        if self.events is None and (folders := glob.glob(os.path.join(self.workdir, "runs", "*"))):
            from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

            self.events = EventAccumulator(folders[0], size_guidance={"scalars": 0})
        logged = {}
        if self.events:
            self.events.Reload()
            for tag in self.events.Tags()["scalars"]:
                logged[tag] = [(point.step, point.wall_time, point.value) for point in self.events.Scalars(tag)]
        if os.path.exists(path := os.path.join(self.workdir, "wandb_log.jsonl")):
            with open(path) as f:
                for row in map(json.loads, f):
                    for key in [key for key in ("speed", "episode_return") if math.isfinite(row.get(key, math.nan))]:
                        logged.setdefault(f"wandb/{key}", []).append((row["step"], row["time"], row[key]))
        return logged


@functools.cache
def python_name(python):
    """`python` as a record names it: python3.11, say (the path is this machine's)."""
    check = "import sys; print(f'python{sys.version_info[0]}.{sys.version_info[1]}')"
    return subprocess.run([python, "-c", check], capture_output=True, text=True).stdout.strip() or "python"


def record_command(python, words, env=None):
    """The command as a record keeps it: `env`'s settings, the Python by its version, then `words` (the script as
    the repository, ours, or the reference clone names it, and its flags)."""
    settings = [f"{name}={shlex.quote(value)}" for name, value in (env or {}).items()]
    return " ".join([*settings, python_name(python), *words])


def run_script(path, argv=None):
    """The script at `path` run in this process, its folder first on sys.path as `python path` puts it (so that the
    run bookkeeping module beside it is found): with `argv`, as `python path *argv` runs it (a sys.exit(0) ends only
    the script); without, imported (under its file's name, its `if __name__ == "__main__"` block left out). Its
    globals, as attributes."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    if argv is None:
        run_name = os.path.splitext(os.path.basename(path))[0]
    else:
        sys.argv = [path, *argv]
        run_name = "__main__"
    try:
        return SimpleNamespace(**runpy.run_path(path, run_name=run_name))
    except SystemExit as stop:
        if stop.code:
            raise
