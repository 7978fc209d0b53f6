"""How many CPU threads each script gives torch: one on CUDA, one for the small MLPs, the usable cores (less the
actors') for the convolutional learners; a user's --torch-threads or OMP_NUM_THREADS wins; the CNN scripts make
idle OpenMP threads sleep before torch loads OpenMP."""

import os
import re
from io import StringIO

import pytest
import torch
from conftest import SCRIPTS, load_script, run_script

CNN_SCRIPTS = ["ppo_atari_envpool.py", "ppo_atari_lstm.py", "dqn_atari.py", "dqn_atari_async.py", "impala_ray.py"]
MLP_SCRIPTS = ["sac_continuous_action.py", "td3_continuous_action.py", "ppo_continuous_action.py", "dqn.py"]
CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU


def choose(module, script, requested, device, reserved=0):
    """The learner's threads on Atari; `reserved` cores play beside it (IMPALA's local actors)."""
    if script == "impala_ray.py":
        return module.cpu_threads(requested, device, True, reserved)
    if script == "dqn_atari_async.py":  # its actor process always takes one core
        return module.cpu_threads(requested, device, True)
    return module.cpu_threads(requested, device)


@pytest.mark.parametrize("script", CNN_SCRIPTS)
def test_cnn_learners_take_the_usable_cores_on_cpu_and_one_thread_on_cuda(script, monkeypatch):
    module = load_script(script)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(module, "usable_cores", lambda: 16)
    assert choose(module, script, 0, CUDA) == 1
    assert choose(module, script, 0, CPU) == (15 if script == "dqn_atari_async.py" else 16)
    if script == "impala_ray.py":  # the actors play on the same cores while the learner trains
        assert choose(module, script, 0, CPU, reserved=4) == 12 and choose(module, script, 0, CPU, reserved=20) == 1
    assert choose(module, script, 3, CUDA) == 3  # --torch-threads wins
    monkeypatch.setenv("OMP_NUM_THREADS", "5")  # torch read it at import; the script keeps what torch has
    assert choose(module, script, 0, CUDA) == torch.get_num_threads()


def test_learners_on_flat_observations_take_one_thread(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    module = load_script("impala_ray.py")
    monkeypatch.setattr(module, "usable_cores", lambda: 16)
    assert module.cpu_threads(0, CPU, False, 2) == 1 and module.cpu_threads(0, CPU, True, 2) == 14
    module = load_script("dqn_atari_async.py")
    monkeypatch.setattr(module, "usable_cores", lambda: 16)
    assert module.cpu_threads(0, CPU, False) == 1 and module.cpu_threads(0, CPU, True) == 15


@pytest.mark.parametrize("cpu_max, affinity, expected", [
    ("max 100000\n", 16, 16),  # no quota
    ("400000 100000\n", 16, 4),  # a container limited to 4 CPUs
    ("150000 100000\n", 16, 1),  # 1.5 CPUs: a second thread would be throttled half the time
    ("800000 100000\n", 2, 2),  # the affinity is the tighter limit
    (None, 6, 6),  # no cgroup v2
])
def test_usable_cores_reads_the_affinity_and_the_cgroup_quota(cpu_max, affinity, expected, monkeypatch):
    for script in CNN_SCRIPTS:
        module = load_script(script)
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(affinity)))

        def fake_open(path, *args, **kwargs):
            assert path == "/sys/fs/cgroup/cpu.max"
            if cpu_max is None:
                raise FileNotFoundError(path)
            return StringIO(cpu_max)

        monkeypatch.setattr(module, "open", fake_open, raising=False)
        assert module.usable_cores() == expected, script


@pytest.mark.parametrize("script", CNN_SCRIPTS)
def test_idle_threads_sleep_is_set_before_torch_loads_openmp(script):
    """libgomp reads OMP_WAIT_POLICY once, when `import torch` loads it: the default must be set before that."""
    with open(os.path.join(SCRIPTS, script)) as f:
        source = f.read()
    setting = source.index('os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")')
    first_import = re.search(r"^(import|from) (torch|tensordict|envpool|ray|cv2|gymnasium)\b", source, re.M).start()
    assert setting < first_import


TINY_RUNS = {
    "sac_continuous_action.py": ["--env-id", "Pendulum-v1", "--total-timesteps", 250, "--learning-starts", 200,
                                 "--batch-size", 32, "--measure-burnin", 5, "--eval-episodes", 0],
    "ppo_atari_envpool.py": ["--total-timesteps", 128, "--num-envs", 2, "--num-steps", 32, "--num-minibatches", 2,
                             "--update-epochs", 1, "--eval-episodes", 0, "--measure-burnin", 0],
}


@pytest.mark.parametrize("script", TINY_RUNS)
def test_the_summary_reports_the_threads_and_the_user_choice_wins(script, workdir, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    chosen = 1 if script in MLP_SCRIPTS else load_script(script).usable_cores()
    summary, _ = run_script(script, TINY_RUNS[script], workdir)
    assert summary["torch_threads"] == chosen
    summary, _ = run_script(script, TINY_RUNS[script] + ["--torch-threads", 3], workdir)
    assert summary["torch_threads"] == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    summary, _ = run_script(script, TINY_RUNS[script], workdir)
    assert summary["torch_threads"] == 2
    _, proc = run_script(script, TINY_RUNS[script] + ["--torch-threads", -1], workdir, check=False, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --torch-threads")
