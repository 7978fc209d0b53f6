"""Helpers shared by the tests: run a script as a subprocess and read its summary, or import its pieces."""

import glob
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "leanrl_scripts")
# One inductor cache for the whole session (and its subprocesses): each graph is compiled once.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(ROOT, ".torchinductor-cache"))

SUMMARY_KEYS = {
    "script", "env_id", "seed", "num_envs", "total_timesteps", "mode", "compile", "cudagraphs_requested",
    "cudagraphs_active", "device", "torch_version", "sps", "steady_steps", "steady_seconds", "warmup_seconds",
    "total_seconds", "return_mean", "eval_return_mean", "peak_memory_mb", "env_seconds",
}


def run_script(script, args, cwd, check=True, timeout=900):
    """Run leanrl_scripts/<script> in `cwd`; return (summary or None, completed process)."""
    before = set(glob.glob(os.path.join(cwd, "runs", "*")))
    env = {**os.environ, "PYTHONPATH": ROOT}  # lets gymnasium import test envs given as "tests.module:EnvId"
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, script), *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, env=env)
    if not check:
        return None, proc
    assert proc.returncode == 0, f"{script} {args} failed:\n{proc.stderr[-3000:]}"
    (run_dir,) = set(glob.glob(os.path.join(cwd, "runs", "*"))) - before
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    speed_lines = [line for line in proc.stdout.splitlines() if line.startswith("SPEED ")]
    assert speed_lines and speed_lines[-1] == proc.stdout.rstrip().splitlines()[-1], "SPEED must be the last line"
    assert json.loads(speed_lines[-1][len("SPEED "):]) == summary
    summary["run_dir"] = run_dir
    return summary, proc


def load_script(script):
    """Import a script as a module (its __main__ block does not run) to test its pieces."""
    name = "leanrl_" + script[: -len(".py")]
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(SCRIPTS, script))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # torch.compile resolves the functions' globals through sys.modules
        environ = dict(os.environ)
        spec.loader.exec_module(module)
        os.environ.clear()  # what a script sets at import (OMP_WAIT_POLICY) stays out of the later test runs
        os.environ.update(environ)
    return sys.modules[name]


@pytest.fixture
def workdir(tmp_path):
    return str(tmp_path)
