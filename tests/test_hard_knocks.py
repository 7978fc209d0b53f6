"""What a run does when things go wrong: divergence, Ctrl-C and SIGTERM, a full disk, a run folder that cannot be
made, bad checkpoints, values that make no sense; and the progress lines it prints when its output goes to a pipe."""

import dataclasses
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import typing

import pytest
import torch

from run_bookkeeping import Flag, RunArgs, check_flags
from script_runs import ALL_SCRIPTS, OFF_POLICY, SCRIPTS, SHORT_RUNS, load_script, run_script, shared_run, start_script

LONG = ["--total-timesteps", 10**7]  # a run that only a signal ends in the test's time


def strict_json(path):
    """The file's JSON, refusing NaN and Infinity (Python's json accepts them; strict readers do not)."""
    with open(path) as f:
        return json.load(f, parse_constant=lambda constant: pytest.fail(f"{path} holds {constant}"))


def only_run_dir(workdir):
    (run_dir,) = glob.glob(os.path.join(workdir, "runs", "*"))
    return run_dir


def error_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("error")]


def saved_tiny_run(script, *more):
    """The session's shared run of `script`'s tiny settings that keeps its model, with `more` arguments."""
    return shared_run(script, [*SHORT_RUNS[script]["base"], *SHORT_RUNS[script]["tiny"], "--save-model", *more])


@pytest.mark.parametrize("script", SHORT_RUNS)
def test_a_diverging_run_stops_with_one_error_line_and_a_strict_summary(script, workdir):
    case = SHORT_RUNS[script]
    args = [
        *case["base"],
        *case["tiny"],
        "--total-timesteps",
        20_000,
        *case["diverge"],
        "--save-model",
        "--eval-episodes",
        2,
    ]
    _, proc = run_script(script, args, workdir, check=False)
    assert proc.returncode == 1, proc.stderr[-2000:]
    (line,) = error_lines(proc.stderr)
    assert line.startswith("error: step ") and "diverged" in line and ("nan" in line or "inf" in line), line
    assert "Traceback" not in proc.stderr
    run_dir = only_run_dir(workdir)
    summary = strict_json(os.path.join(run_dir, "summary.json"))
    assert summary["stopped"] == line[len("error: ") :]
    assert summary["steps_done"] < 20_000 and summary["eval_returns"] == []
    assert not os.path.exists(os.path.join(run_dir, "model.pt"))  # a diverged model is not kept
    assert proc.stdout.rstrip().splitlines()[-1] == "SPEED " + json.dumps(summary)


def broken_copy(script, name, folder):
    """`script` and the module copied into `folder`, as a user copies them, with the function `name` replaced by one
    that raises: a researcher's change with a bug in it."""
    with open(os.path.join(SCRIPTS, script)) as f:
        source = f.read()
    broken = f"def {name}(*args, **kwargs):\n    raise ValueError('a bug in the changed {name}')\n\n\n"
    main = 'if __name__ == "__main__":'
    assert main in source
    with open(os.path.join(folder, script), "w") as f:
        f.write(source.replace(main, broken + main))
    shutil.copy(os.path.join(SCRIPTS, "run_bookkeeping.py"), folder)
    return os.path.join(folder, script)


def run_broken(script, name, workdir):
    """`script` with `name` raising (broken_copy), run to its end: its one error line, its run folder, its summary,
    its output; the traceback and the exit code checked."""
    copied = broken_copy(script, name, workdir)
    args = [*SHORT_RUNS[script]["base"], *SHORT_RUNS[script]["tiny"], "--save-model", "--eval-episodes", 2]
    _, proc = run_script(copied, args, workdir, check=False)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" in proc.stderr and f"ValueError: a bug in the changed {name}" in proc.stderr
    (line,) = error_lines(proc.stderr)
    run_dir = only_run_dir(workdir)
    summary = strict_json(os.path.join(run_dir, "summary.json"))
    assert summary["eval_returns"] == [] and summary["stopped"] == line[len("error: ") :]
    return line, os.path.relpath(run_dir, workdir), summary, proc.stdout


@pytest.mark.parametrize("script", ["dqn.py", "sac_continuous_action.py"])
def test_an_exception_in_the_evaluation_keeps_the_trained_run(script, workdir):
    """The summary and the model are written as the training ends; the evaluation's exception (its traceback
    printed) fails the run without taking them."""
    line, run_dir, summary, stdout = run_broken(script, "evaluate", workdir)
    assert line == (
        f"error: the evaluation raised ValueError (the traceback above); the training's summary (and model, with "
        f"--save-model) is in {run_dir}"
    )
    assert summary["steps_done"] == summary["total_timesteps"] and summary["num_updates"] > 0
    assert stdout.rstrip().splitlines()[-1] == "SPEED " + json.dumps(summary)
    trained = torch.load(os.path.join(workdir, run_dir, "model.pt"), weights_only=True)
    assert trained["env_id"] == summary["env_id"]


@pytest.mark.parametrize("script, loss", [("dqn.py", "td_loss"), ("sac_continuous_action.py", "critic_loss")])
def test_an_exception_in_the_training_keeps_the_summary_of_the_steps_done(script, loss, workdir):
    line, run_dir, summary, _ = run_broken(script, loss, workdir)
    assert line == (
        f"error: the training raised ValueError (the traceback above); the summary of the steps done is in {run_dir}"
    )
    assert 0 < summary["steps_done"] < summary["total_timesteps"]
    assert not os.path.exists(os.path.join(workdir, run_dir, "model.pt"))  # its update may have been half done


# Each script with one of the two signals, in turn; both for the scripts with processes of their own (the async DQN's
# actor, IMPALA's Ray), their SIGINT in the slow tier (a run of theirs takes 6-12 s here), and for SAC. The handler is
# the run bookkeeping module's, which every script imports.
OWN_PROCESSES = ("dqn_atari_async.py", "impala_ray.py")
SIGNALLED = [
    pytest.param(
        script, signum, marks=[pytest.mark.slow] if script in OWN_PROCESSES and signum == signal.SIGINT else []
    )
    for i, script in enumerate(SHORT_RUNS)
    for signum in (signal.SIGTERM, signal.SIGINT)
    if script in ("sac_continuous_action.py", *OWN_PROCESSES) or i % 2 == signum % 2
]


@pytest.mark.parametrize("script, signum", SIGNALLED)
def test_a_signal_keeps_the_steps_done_and_the_model(script, signum, workdir):
    """Output to a pipe, as under nohup or CI: progress lines come while it runs; the signal comes after one."""
    args = [*SHORT_RUNS[script]["base"], *SHORT_RUNS[script]["tiny"], *LONG, "--save-model", "--eval-episodes", 0]
    # a test runner started in the background (`cmd &`) ignores SIGINT, and so would the script
    proc = start_script(script, args, workdir, sigint_default=True)
    try:
        first_line = proc.stderr.readline()
        assert first_line.startswith("step ") and " SPS, return " in first_line, first_line
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    name = signal.Signals(signum).name
    assert proc.returncode == 128 + signum, stderr
    assert stderr.splitlines()[-1].startswith(f"stopped by {name}: the steps done are in runs/"), stderr
    assert "Traceback" not in stderr
    run_dir = only_run_dir(workdir)
    summary = strict_json(os.path.join(run_dir, "summary.json"))
    assert summary["stopped"] == f"stopped by {name}" and 0 < summary["steps_done"] < 10**7
    *_, human_line, speed_line = stdout.rstrip().splitlines()
    assert speed_line == "SPEED " + json.dumps(summary)
    assert human_line.startswith(f"{summary['steps_done']} steps, ") and human_line.endswith(
        f"no evaluation; written to {os.path.relpath(run_dir, workdir)}"
    ), human_line
    checkpoint = torch.load(os.path.join(run_dir, "model.pt"), weights_only=True)
    assert checkpoint["env_id"] == SHORT_RUNS[script]["base"][1]


# impala_ray.py and dqn_atari_async.py write the same way, but the limit would stop Ray's own log files, or the
# storage in shared memory (a file in /dev/shm), first
@pytest.mark.parametrize(
    "script", [script for script in SHORT_RUNS if script not in ("impala_ray.py", "dqn_atari_async.py")]
)
def test_a_failed_write_is_one_error_line_and_the_summary_comes_first(script, workdir):
    args = [*SHORT_RUNS[script]["base"], *SHORT_RUNS[script]["tiny"], "--save-model", "--eval-episodes", 0]
    proc = start_script(script, args, workdir, file_size_limit=50_000)  # the summary and the events fit, a model not
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 1, stderr[-2000:]
    run_dir = only_run_dir(workdir)
    model = os.path.join(os.path.relpath(run_dir, workdir), "model.pt")
    assert error_lines(stderr) == [f"error: could not write {model}: File too large"], stderr
    assert "Traceback" not in stderr
    assert strict_json(os.path.join(run_dir, "summary.json"))["stopped"] is None
    assert sorted(os.listdir(run_dir))[1:] == ["summary.json"]  # the events file, no model, no model.pt.tmp


@pytest.mark.parametrize("script", [script for script, case in SHORT_RUNS.items() if case["other"]])
def test_a_bad_checkpoint_is_one_error_line_and_exit_code_2(script, workdir):
    trained, _ = saved_tiny_run(SHORT_RUNS[script]["other"], "--eval-episodes", 0)
    with open(os.path.join(trained["run_dir"], "model.pt"), "rb") as f:
        checkpoint = f.read()
    # a file that torch.load cannot read and a checkpoint of another script: the module's check, which
    # test_run_bookkeeping.py gives every kind of bad file, reached through this script's own start
    bad = {"truncated.pt": checkpoint[: len(checkpoint) // 2], "other_script.pt": checkpoint}
    for name, content in bad.items():
        with open(os.path.join(workdir, name), "wb") as f:
            f.write(content)
        _, proc = run_script(
            script, [*SHORT_RUNS[script]["base"], "--total-timesteps", 0, "--load-model", name], workdir, check=False
        )
        assert proc.returncode == 2, (name, proc.stderr[-2000:])
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert lines == [lines[0]] and lines[0].startswith(f"error: --load-model: {name} "), proc.stderr[-2000:]
        # refused as not this script's or, for another script's checkpoint of another env, as made for other spaces
        assert "is not a checkpoint of this script" in lines[0] or "was trained on" in lines[0], lines[0]


@pytest.mark.parametrize("script", SHORT_RUNS)
def test_a_run_folder_that_cannot_be_made_is_one_error_line_and_exit_code_2(script, workdir):
    """`runs` is a file here; the same line comes for no permission or a read-only disk, before any training."""
    with open(os.path.join(workdir, "runs"), "w") as f:
        f.write("not a folder\n")
    _, proc = run_script(script, [*SHORT_RUNS[script]["base"], *SHORT_RUNS[script]["tiny"]], workdir, check=False)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: cannot make the run folder runs/") and lines[0].endswith(": Not a directory")


def test_a_run_started_in_the_same_second_with_the_same_settings_gets_a_folder_of_its_own(workdir):
    now = int(time.time())
    taken = [os.path.join(workdir, "runs", f"CartPole-v1__dqn__1__eager__{t}") for t in range(now, now + 60)]
    for folder in taken:
        os.makedirs(folder)
        with open(os.path.join(folder, "summary.json"), "w") as f:
            f.write("{}")
    summary, _ = run_script("dqn.py", SHORT_RUNS["dqn.py"]["tiny"] + ["--eval-episodes", 0], workdir)
    assert os.path.dirname(summary["run_dir"]) == os.path.join(workdir, "runs")
    assert summary["run_dir"].endswith("-2") and summary["run_dir"][: -len("-2")] in taken
    assert all(os.listdir(folder) == ["summary.json"] for folder in taken)


@pytest.mark.parametrize("script", SHORT_RUNS)
def test_values_that_make_no_sense_stop_before_any_work(script, workdir):
    case = SHORT_RUNS[script]
    bad = [
        ([case["lr"], -1], f"{case['lr']} must be a positive number"),
        ([case["lr"], "nan"], f"{case['lr']} must be a positive number"),
        (["--gamma", 2], "--gamma"),
        (["--eval-episodes", -1], "--eval-episodes"),
        (["--seed", -1], "--seed must be from 0 to 2**30, not -1"),
    ]
    if script.startswith(("ppo", "pqn")):  # on-policy: whole rollouts
        bad.append((["--total-timesteps", 100], "less than one rollout"))
    elif script != "impala_ray.py":
        bad.append((["--buffer-size", 10**11], "--buffer-size needs"))
    if script not in ("impala_ray.py", "fast_td3.py") and not script.startswith(("ppo", "pqn")):
        # FastTD3 draws its batches with replacement, from the first steps on (a batch of 32,768 after 1,280 steps)
        bad.append((["--buffer-size", 10, "--batch-size", 64], "must hold at least one batch"))
    for args, message in bad:
        _, proc = run_script(script, [*case["base"], *args], workdir, check=False, timeout=120)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (
            args,
            proc.stderr[-2000:],
        )
        assert not os.path.exists(os.path.join(workdir, "runs"))


# Numeric flags whose type allows any number, each with why: the script checks them against each other.
CHECKED_TOGETHER = {
    "impala_ray.py": {"replay_ratio", "hide_obs"},  # a fraction below 1; observation indices, each in range
    "ppo_atari_multigpu.py": {"device_ids", "world_size", "num_envs"},  # one GPU per process; set from torchrun
    "rainbow_atari.py": {"n_atoms", "v_min", "v_max"},  # 2 or more atoms on [v_min, v_max], v_min below v_max
    "fast_td3.py": {"v_min", "v_max"},  # v_min below v_max
}
OUTSIDE = {  # values outside each kind of flag, as a user might type them
    "Count": [0, -1],
    "CountFrom0": [-1],
    "Positive": [0, -0.5, float("nan")],
    "Fraction": [1.5, -0.1],
    "PositiveFraction": [0, 1.5, float("nan")],
    "AtLeast0": [-0.5, float("nan")],
    "BeforeTheEnd": [],  # the script's own --total-timesteps, below
}


@pytest.mark.parametrize("script", ALL_SCRIPTS)
def test_every_numeric_flag_has_its_kind_and_a_value_outside_it_is_one_error_line(script, capsys):
    """Each numeric flag of a script's Args declares in its type (run_bookkeeping.Flag) the values it may take;
    every value outside them is refused in one line before any work. Here in-process, each flag with each kind's bad
    values."""
    module = load_script(script)
    types = typing.get_type_hints(module.Args, include_extras=True)
    kinds = {kind: getattr(Flag, kind) for kind in OUTSIDE}
    declared = {
        name: kind
        for name, hint in types.items()
        for kind, flag in kinds.items()
        if flag in (hint, *typing.get_args(hint))
    }
    shared = {field.name for field in dataclasses.fields(RunArgs)}  # the module's own flags
    numeric = {
        name for name, kind in typing.get_type_hints(module.Args).items() if re.search(r"\b(int|float)\b", str(kind))
    }
    assert numeric - shared - CHECKED_TOGETHER.get(script, set()) == set(declared) - shared
    check_flags(module.Args())  # the defaults are allowed
    bad = [(name, value) for name, kind in declared.items() for value in OUTSIDE[kind]]
    bad += [(name, module.Args().total_timesteps) for name, kind in declared.items() if kind == "BeforeTheEnd"]
    for name, value in bad:
        with pytest.raises(SystemExit) as stop:
            check_flags(dataclasses.replace(module.Args(), **{name: value}))
        line = capsys.readouterr().err
        assert stop.value.code == 2 and line.startswith(f"error: --{name.replace('_', '-')} ") and line.count("\n") == 1


# Values that trained and exited 0 before their scripts declared their ranges
NO_SENSE = [
    ("td3_continuous_action.py", ["--noise-clip", -0.5], "error: --noise-clip must be 0 or more, not -0.5"),
    ("ppo_continuous_action.py", ["--clip-coef", -0.2], "error: --clip-coef must be a positive number, not -0.2"),
    ("ppo_atari_envpool.py", ["--max-grad-norm", -0.5], "error: --max-grad-norm must be a positive number, not -0.5"),
    ("dqn.py", ["--start-e", 1.5], "error: --start-e must be in [0, 1], not 1.5"),
    ("dqn_atari.py", ["--end-e", -0.1], "error: --end-e must be in [0, 1], not -0.1"),
    ("rainbow_atari.py", ["--end-e", 2, "--no-noisy"], "error: --end-e must be in [0, 1], not 2.0"),
    (
        "sac_continuous_action.py",
        ["--total-timesteps", 400, "--learning-starts", 500],
        "error: --learning-starts 500 leaves no update: it must be below --total-timesteps 400",
    ),
]


@pytest.mark.parametrize("script, args, line", NO_SENSE, ids=[case[0] for case in NO_SENSE])
def test_a_value_that_makes_no_sense_is_refused_from_the_command_line(script, args, line, workdir):
    _, proc = run_script(script, [*SHORT_RUNS[script]["base"], *args], workdir, check=False, timeout=120)
    assert proc.returncode == 2 and proc.stderr == line + "\n" and not os.path.exists(os.path.join(workdir, "runs"))


def test_mujocos_own_warnings_wait_for_the_run_so_a_refusal_is_one_line(workdir):
    """MuJoCo prints its model compiler's warnings itself, not through Python's (HalfCheetah-v5's deprecated
    `settotalmass`): held until the run starts, they stay off the terminal of a refused checkpoint and show in a run."""
    pytest.importorskip("mujoco")
    with open(os.path.join(workdir, "bad.pt"), "w") as f:
        f.write("not a checkpoint")
    base = ["--env-id", "HalfCheetah-v5", "--eval-episodes", 0]
    _, proc = run_script(
        "td3_continuous_action.py", [*base, "--total-timesteps", 0, "--load-model", "bad.pt"], workdir, check=False
    )
    assert (
        proc.returncode == 2
        and proc.stderr == "error: --load-model: bad.pt is not a checkpoint of this script (UnpicklingError)\n"
    )
    _, proc = run_script("td3_continuous_action.py", [*base, *OFF_POLICY], workdir)
    assert proc.stderr.startswith("WARNING: compiler attribute 'settotalmass' is deprecated")


def wait_for(path, proc, timeout=300):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"{path} never came"
        time.sleep(0.05)


def assert_stopped_at_once(proc, signum, where, workdir):
    """The run ended within seconds of the signal, with its exit code, one line and the summary of the steps done."""
    sent = time.monotonic()
    proc.send_signal(signum)
    try:
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    name = signal.Signals(signum).name
    assert time.monotonic() - sent < 10
    assert proc.returncode == 128 + signum, stderr[-3000:]
    assert stderr.splitlines()[-1].startswith(f"stopped by {name} during {where}: the steps done are in runs/"), stderr
    assert "Traceback" not in stderr
    summary = strict_json(os.path.join(only_run_dir(workdir), "summary.json"))
    assert summary["stopped"] == f"stopped by {name} during {where}"
    assert stdout.rstrip().splitlines()[-1] == "SPEED " + json.dumps(summary)
    return summary


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_a_blocked_env_step_stops_the_run_at_once(signum, workdir):
    """An env step that blocks for ten minutes: the run stops within seconds, the steps logged before it kept."""
    marker = os.path.join(workdir, "blocked")
    env = {"LEANRL_PROBE_MARKER": marker, "LEANRL_PROBE_BLOCK_AT": "3000"}
    args = ["--env-id", "tests.signal_probe:BlockingCartPole-v0", "--learning-starts", 500, *LONG, "--save-model"]
    proc = start_script("dqn.py", args, workdir, env=env, sigint_default=True)
    wait_for(marker, proc)
    summary = assert_stopped_at_once(proc, signum, "an env call", workdir)
    assert 500 < summary["steps_done"] < 3000  # the last step logged (every 100 updates: 1000 steps)
    assert not os.path.exists(os.path.join(only_run_dir(workdir), "model.pt"))  # its update may be half done


def test_a_signal_during_compilation_stops_the_run_at_once(workdir):
    """A compile that takes ten minutes (the probe sleeps as it starts): Ctrl-C stops the run within seconds."""
    marker = os.path.join(workdir, "compiling")
    env = {"LEANRL_PROBE_MARKER": marker, "LEANRL_PROBE_SLOW_COMPILE": "1"}
    args = ["--env-id", "tests.signal_probe:BlockingCartPole-v0", "--learning-starts", 500, *LONG, "--compile"]
    proc = start_script("dqn.py", args, workdir, env=env, sigint_default=True)
    wait_for(marker, proc)
    assert assert_stopped_at_once(proc, signal.SIGINT, "a compile", workdir)["steps_done"] == 0


LOOP_WITHOUT_SAFE_POINTS = """
import subprocess, sys
from run_bookkeeping import Run, RunArgs
run = Run(RunArgs(env_id="none", total_timesteps=10))
run.start()
child = subprocess.Popen(["sleep", "600"])
print(child.pid, flush=True)
while True:  # a loop with no stop_if_signalled()
    pass
"""


def test_a_second_signal_stops_a_loop_without_safe_points_and_what_it_started(workdir):
    """The first Ctrl-C waits for a safe point that never comes; the second stops the run, and the process it
    started, at once."""
    proc = subprocess.Popen(
        [sys.executable, "-c", LOOP_WITHOUT_SAFE_POINTS],
        cwd=workdir,
        env={**os.environ, "PYTHONPATH": SCRIPTS},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    child = int(proc.stdout.readline())
    proc.send_signal(signal.SIGINT)
    time.sleep(1)
    assert proc.poll() is None  # the first only asks for a stop at the next safe point
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=10)
    stderr = proc.stderr.read()
    assert proc.returncode == 130, stderr
    assert stderr.splitlines()[-1].startswith("stopped by SIGINT: the steps done are in runs/"), stderr
    summary = strict_json(os.path.join(only_run_dir(workdir), "summary.json"))
    assert summary["stopped"] == "stopped by SIGINT" and summary["steps_done"] == 0
    time.sleep(0.5)
    assert not os.path.exists(f"/proc/{child}") or open(f"/proc/{child}/stat").read().split()[2] == "Z"
