"""How many CPU threads each script gives torch: one on CUDA; for SAC and TD3 the cores idle when the run starts,
for the other small MLPs one; the usable cores (less the actors') for the convolutional learners; a user's
--torch-threads or OMP_NUM_THREADS wins; the CNN scripts make idle OpenMP threads sleep before torch loads OpenMP;
the learners of minibatches of frames keep freed memory instead of faulting it in again for each minibatch."""

import ast
import json
import multiprocessing as mp
import os
import re
import subprocess
import sys
import textwrap
import time
from io import StringIO
from types import SimpleNamespace

import pytest
import torch

import run_bookkeeping as bookkeeping  # Run.tune_cpu's rules (_tune_cpu) and the core counts
from script_runs import ALL_SCRIPTS, SCRIPTS, run_script

CNN_SCRIPTS = ["ppo_atari_envpool.py", "ppo_atari_envpool_async.py", "ppo_atari_lstm.py", "dqn_atari.py"]
CNN_SCRIPTS += ["dqn_atari_async.py", "impala_ray.py", "pqn_atari_envpool.py", "rainbow_atari.py"]
FREED_MEMORY_SCRIPTS = ["ppo_atari_envpool.py", "ppo_atari_envpool_async.py", "ppo_atari_lstm.py", "impala_ray.py"]
FREED_MEMORY_SCRIPTS += ["pqn_atari_envpool.py"]
CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU


def chosen(requested, device, threads):
    """What run.tune_cpu sets torch to; this process's own thread count is put back."""
    before = torch.get_num_threads()
    try:
        return bookkeeping._tune_cpu(requested, device, threads)
    finally:
        torch.set_num_threads(before)


def test_the_users_choice_wins_then_one_thread_on_cuda_then_the_scripts(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert chosen(0, CPU, 3) == 3 and chosen(0, CPU, 0) == 1 and chosen(0, CPU, -4) == 1  # never below one
    assert chosen(0, CUDA, 16) == 1 and chosen(0, CUDA, "idle") == 1
    assert chosen(3, CUDA, 16) == 3 and chosen(3, CPU, "idle") == 3  # --torch-threads wins
    monkeypatch.setenv("OMP_NUM_THREADS", "5")  # torch read it at import; the script keeps what torch has
    assert chosen(0, CUDA, 16) == torch.get_num_threads() and chosen(0, CPU, "idle") == torch.get_num_threads()


# Per script: what its main block's names are in the case, and the threads it then asks for on 16 usable cores
# ("idle": the cores idle at start). SAC and TD3 are the ones a second core pays; the other MLPs take one thread;
# the CNN learners take the usable cores, less the actor process's one (async DQN) or the local actors' (IMPALA).
THREADS_ASKED = [
    ("sac_continuous_action.py", {}, "idle"),
    ("td3_continuous_action.py", {}, "idle"),
    ("ppo_continuous_action.py", {}, 1),
    ("dqn.py", {}, 1),
    ("pqn.py", {}, 1),
    ("pqn_atari_envpool.py", {}, 16),
    ("ppo_atari_envpool.py", {}, 16),
    ("ppo_atari_envpool_async.py", {}, 16),
    ("ppo_atari_lstm.py", {}, 16),
    ("dqn_atari.py", {}, 16),
    ("rainbow_atari.py", {}, 16),
    ("dqn_atari_async.py", {"q_network": SimpleNamespace(pixels=True)}, 15),
    ("dqn_atari_async.py", {"q_network": SimpleNamespace(pixels=False)}, 1),
    ("impala_ray.py", {"kind": "atari", "args": SimpleNamespace(ray_address="", num_actors=4)}, 12),
    ("impala_ray.py", {"kind": "atari", "args": SimpleNamespace(ray_address="auto", num_actors=4)}, 16),  # cluster
    # more actors than cores: one thread, not none
    ("impala_ray.py", {"kind": "atari", "args": SimpleNamespace(ray_address="", num_actors=20)}, 1),
    ("impala_ray.py", {"kind": "classic", "args": SimpleNamespace(ray_address="", num_actors=2)}, 1),
]


@pytest.mark.parametrize("script, names, expected", THREADS_ASKED)
def test_each_script_asks_for_its_threads(script, names, expected, monkeypatch):
    with open(os.path.join(SCRIPTS, script)) as f:
        main = textwrap.dedent(f.read().split('if __name__ == "__main__":')[1])
    (call,) = [
        node
        for node in ast.walk(ast.parse(main))
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "run.tune_cpu"
    ]
    assert call.args == []
    keywords = {keyword.arg: keyword.value for keyword in call.keywords}
    if isinstance(keywords["threads"], ast.Name):  # a name the main block sets just before
        (keywords["threads"],) = [
            node.value
            for node in ast.walk(ast.parse(main))
            if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == keywords["threads"].id
        ]
    threads = eval(ast.unparse(keywords["threads"]), {"usable_cores": lambda: 16, **names})
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads == expected if expected == "idle" else chosen(0, CPU, threads) == expected
    keeps = ast.unparse(keywords["keep_freed_memory"]) if "keep_freed_memory" in keywords else None
    assert keeps == ("True" if script in FREED_MEMORY_SCRIPTS else None)


@pytest.mark.parametrize(
    "cpu_max, affinity, expected",
    [
        ("max 100000\n", 16, 16),  # no quota
        ("400000 100000\n", 16, 4),  # a container limited to 4 CPUs
        ("150000 100000\n", 16, 1),  # 1.5 CPUs: a second thread would be throttled half the time
        ("800000 100000\n", 2, 2),  # the affinity is the tighter limit
        (None, 6, 6),  # no cgroup v2
    ],
)
def test_usable_cores_reads_the_affinity_and_the_cgroup_quota(cpu_max, affinity, expected, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(affinity)))

    def fake_open(path, *args, **kwargs):
        assert path == "/sys/fs/cgroup/cpu.max"
        if cpu_max is None:
            raise FileNotFoundError(path)
        return StringIO(cpu_max)

    monkeypatch.setattr(bookkeeping, "open", fake_open, raising=False)
    assert bookkeeping.usable_cores() == expected


@pytest.mark.parametrize("script", CNN_SCRIPTS)
def test_idle_threads_sleep_is_set_before_torch_loads_openmp(script):
    """libgomp reads OMP_WAIT_POLICY once, when `import torch` loads it: the default must be set before that."""
    with open(os.path.join(SCRIPTS, script)) as f:
        source = f.read()
    setting = source.index('os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")')
    first_import = re.search(r"^(import|from) (torch|tensordict|envpool|ray|cv2|gymnasium)\b", source, re.M).start()
    assert setting < first_import
    if script == "ppo_atari_lstm.py":  # its LSTM's back-to-back kernels: a short spin before the sleep
        assert source.index('os.environ.setdefault("GOMP_SPINCOUNT", "30000")') < first_import


# Page faults in 25 forward and backward passes of a channels-last Nature CNN on 256 frames, in a fresh process after
# 5 passes of warm-up, with glibc's default thresholds ("-") or those run.tune_cpu() keeps freed memory with.
COUNT_FAULTS = """
import json, resource, sys, torch, torch.nn as nn
sys.path.insert(0, sys.argv[1])
from script_runs import load_script
if sys.argv[2] != "-":
    load_script(sys.argv[2])
    sys.modules["run_bookkeeping"]._tune_cpu(1, torch.device("cpu"), 1, keep_freed_memory=True)
torch.set_num_threads(1)
net = nn.Sequential(nn.Conv2d(4, 32, 8, stride=4), nn.ReLU(), nn.Conv2d(32, 64, 4, stride=2), nn.ReLU(),
                    nn.Conv2d(64, 64, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3136, 512))
net = net.to(memory_format=torch.channels_last)  # as the scripts: NCHW's backward maps a 100 MB buffer each pass
frames = torch.randint(0, 256, (256, 4, 84, 84), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
def forward_backward():
    net(frames / 255.0).square().mean().backward()
for _ in range(5):
    forward_backward()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(25):
    forward_backward()
print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before))
"""


def page_faults(script):
    tests = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", COUNT_FAULTS, tests, script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


@pytest.mark.slow  # 30 passes of a CNN in two to four fresh interpreters: 30 s here
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_the_memory_freed_after_a_minibatch_is_kept_for_the_next():
    """By default glibc gives freed blocks back to the OS, and most passes fault their activations and gradients in
    again (measured here: 0 to 17,000 pages a pass, 10,000-400,000 in 25 passes: its dynamic thresholds vary from run
    to run, so up to three default runs are measured); with the script's thresholds the heap keeps them, and only its
    occasional growth faults (0 to 7,000 in 25 passes; once 14,112 beside the other worker's tests, so a run over the
    limit is measured once more and the fewer counts)."""
    kept = page_faults("ppo_atari_envpool.py")
    if kept >= 25 * 500:
        kept = min(kept, page_faults("ppo_atari_envpool.py"))
    defaults = [page_faults("-")]
    while len(defaults) < 3 and max(defaults) < 5 * kept:
        defaults.append(page_faults("-"))
    assert kept < 25 * 500 and max(defaults) > 5 * kept, (defaults, kept)


def test_keeping_freed_memory_leaves_other_c_libraries_alone(monkeypatch):
    def no_glibc(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(bookkeeping.ctypes, "CDLL", no_glibc)
    before = torch.get_num_threads()
    try:
        assert bookkeeping._tune_cpu(1, CPU, 1, keep_freed_memory=True) == 1
    finally:
        torch.set_num_threads(before)


TINY_RUNS = {
    "sac_continuous_action.py": [
        "--env-id",
        "Pendulum-v1",
        "--total-timesteps",
        250,
        "--learning-starts",
        200,
        "--batch-size",
        32,
        "--measure-burnin",
        5,
        "--eval-episodes",
        0,
    ],
    "ppo_atari_envpool.py": [
        "--total-timesteps",
        128,
        "--num-envs",
        2,
        "--num-steps",
        32,
        "--num-minibatches",
        2,
        "--update-epochs",
        1,
        "--eval-episodes",
        0,
        "--measure-burnin",
        0,
    ],
}


@pytest.mark.parametrize("script", TINY_RUNS)
def test_the_summary_reports_the_threads_and_the_user_choice_wins(script, workdir, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    summary, _ = run_script(script, TINY_RUNS[script], workdir)
    if script == "sac_continuous_action.py":  # the cores idle at its start: this test's process waits meanwhile
        assert 1 <= summary["torch_threads"] <= len(os.sched_getaffinity(0))
    else:
        assert summary["torch_threads"] == bookkeeping.usable_cores()
    summary, _ = run_script(script, TINY_RUNS[script] + ["--torch-threads", 3], workdir)
    assert summary["torch_threads"] == 3
    if script == "sac_continuous_action.py":  # the module reads it for every script; it takes a fresh interpreter
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        summary, _ = run_script(script, TINY_RUNS[script], workdir)
        assert summary["torch_threads"] == 2
    _, proc = run_script(script, TINY_RUNS[script] + ["--torch-threads", -1], workdir, check=False, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --torch-threads")


def fake_proc_stat(monkeypatch, module, samples, affinity, quota=None):
    """/proc/stat as `samples` (one list of (idle, busy) jiffies per core for each read), cores `affinity`, and a
    cgroup CPU quota of `quota` cores (None: no cgroup v2 file)."""
    reads = iter(samples)

    def fake_open(path, *args, **kwargs):
        if path == "/sys/fs/cgroup/cpu.max":
            if quota is None:
                raise FileNotFoundError(path)
            return StringIO(f"{int(quota * 100000)} 100000\n")
        assert path == "/proc/stat"
        cores = next(reads)
        total = [sum(values) for values in zip(*cores)]
        lines = [f"cpu  {total[1]} 0 0 {total[0]} 0 0 0 0 0 0"]
        lines += [f"cpu{i} {busy} 0 0 {idle} 0 0 0 0 0 0" for i, (idle, busy) in enumerate(cores)]
        return StringIO("\n".join(lines + ["intr 1 2 3", "ctxt 5"]) + "\n")

    monkeypatch.setattr(module, "open", fake_open, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(affinity))
    monkeypatch.setattr(module.time, "sleep", lambda seconds: None)


IMPORT_EVERY_SCRIPT = """
import builtins, importlib.util, json, os, sys, time
real_open, real_sleep = builtins.open, time.sleep
def no_proc_stat(path, *args, **kwargs):
    assert path != "/proc/stat", "read /proc/stat at import"
    return real_open(path, *args, **kwargs)
builtins.open = no_proc_stat
time.sleep = lambda seconds: sys.exit("slept at import")
import torch, gymnasium, tensordict, tyro  # what the libraries themselves set as they load is theirs
for library in ("ale_py", "cv2", "envpool", "ray"):
    try:
        importlib.import_module(library)
    except ImportError:
        pass
changed = {}
for path in sys.argv[1:]:
    before = dict(os.environ)
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    names = os.environ.keys() | before.keys()
    changed[os.path.basename(path)] = sorted(k for k in names if os.environ.get(k) != before.get(k))
    os.environ.clear()
    os.environ.update(before)
print(json.dumps({"env": changed, "threads": torch.get_num_threads()}))
"""


def test_importing_a_script_reads_no_load_sleeps_not_and_sets_only_what_libraries_read_as_they_load():
    """A script's pieces can be imported (from ppo_atari_lstm import Agent) without changing the process: only the
    OpenMP variables libgomp reads when torch loads it, as fixed defaults, never from the load at start."""
    env = {key: value for key, value in os.environ.items() if key not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    paths = [os.path.join(SCRIPTS, script) for script in ALL_SCRIPTS]
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_EVERY_SCRIPT, *paths],
        env={**env, "PYTHONPATH": SCRIPTS},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["threads"] == torch.get_num_threads()
    for script, changed in result["env"].items():
        assert set(changed) <= {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"}, script
    assert result["env"]["ppo_atari_lstm.py"] == ["GOMP_SPINCOUNT", "OMP_WAIT_POLICY"]


def test_idle_core_count_reads_the_cores_this_process_may_use(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = [(100, 100), (100, 100), (100, 100), (100, 100)]
    # cores 0 and 1 idle, core 2 at 80% idle, core 3 busy (outside the affinity in the second case)
    after = [(200, 100), (200, 100), (180, 120), (100, 200)]
    fake_proc_stat(monkeypatch, bookkeeping, [before, after], affinity=range(4))
    assert bookkeeping._idle_cores() == pytest.approx(2.8)
    fake_proc_stat(monkeypatch, bookkeeping, [before, after, before, after], affinity=[1, 3])
    assert bookkeeping._idle_cores() == pytest.approx(1.0)
    assert chosen(0, CPU, "idle") == 1  # core 3 is busy: a second thread would stall at every barrier
    fake_proc_stat(monkeypatch, bookkeeping, [before, after], affinity=[0, 1, 2])
    assert chosen(0, CPU, "idle") == 3  # 2.8 idle cores: 80% idle counts
    fake_proc_stat(monkeypatch, bookkeeping, [before, after], affinity=[0, 1, 2], quota=1.5)
    assert chosen(0, CPU, "idle") == 1  # a container's 1.5 CPUs: a second thread is throttled half the time
    monkeypatch.setattr(
        bookkeeping, "open", lambda *args, **kwargs: (_ for _ in ()).throw(FileNotFoundError(args[0])), raising=False
    )
    assert bookkeeping._idle_cores() is None and chosen(0, CPU, "idle") == 1  # no /proc: one thread, the safe choice


def spin():
    while True:
        pass


def test_beside_busy_processes_the_run_takes_one_thread(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    spinners = [mp.Process(target=spin, daemon=True) for _ in range(len(os.sched_getaffinity(0)))]
    for process in spinners:
        process.start()
    try:
        time.sleep(0.3)
        assert bookkeeping._idle_cores(0.5) < 0.75 and chosen(0, CPU, "idle") == 1
    finally:
        for process in spinners:
            process.kill()
