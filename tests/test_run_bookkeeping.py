"""The run bookkeeping lives in one module beside the scripts (leanrl_scripts/run_bookkeeping.py): each script imports
it in one line and holds only its algorithm, within the size a reader was promised; the module holds no algorithm;
the scripts run the ways users run them (from a clone, copied with the module, against a pip install)."""

import ast
import dataclasses
import io
import os
import shutil
import signal
import subprocess
import sys
import warnings
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from code_tokens import code_tokens, prose_words
from run_bookkeeping import Flag
from script_runs import ALL_SCRIPTS, MODULE, ROOT, SCRIPTS, run_script

# Code tokens (tests/code_tokens.py: comments, docstrings and layout left out, so packing lines saves nothing), each
# file at most what it holds now. The five scripts LeanRL also has sit at 1.05-1.43x LeanRL's compiled script of the
# same name (SAC 2,414, TD3 2,201, PPO continuous 2,450, DQN 1,535, PPO Atari 2,606): they carry the one-line errors
# (each flag's range among them), checkpoints, evaluation and the true Atari score that LeanRL's lack. The two PQN
# scripts, which LeanRL lacks, sit at 1.25-1.26x CleanRL's of the same name (1,684 and 2,006), with the same additions.
# The others carry what they exist to show: PPO-LSTM its padded replay, the async PPO its storage by env id, the multi-
# process PPO its collectives, the Atari DQN the ALE back-end's wrappers, the async DQN its actor process and rate
# limiter, IMPALA Ray and its actors, FastTD3 (in neither project) its distributional critics, normaliser, n-step
# replay and the recipe's flags beside TD3's pieces. The module holds, besides, the stop at once on a second signal or
# one in a blocked env call or a compile (a thread that watches the signals, the summary written from it, the
# processes the run started killed), and the run's own threads and memory check (Run.tune_cpu, Run.check_fits), which
# the scripts called with the run's device and --torch-threads.
MAX_TOKENS = {
    "sac_continuous_action.py": 2945,  # 74 above its 2,871: its run state named for --resume, the resumed counters
    "td3_continuous_action.py": 2590,  # 70 above its 2,520: the same
    "ppo_continuous_action.py": 3200,  # 83 above its 3,117: its run state named for --resume, the resumed counters
    "dqn.py": 2239,  # 68 above its 2,171: the state named for --checkpoint-every and --resume, the resumed counters
    "ppo_atari_envpool.py": 2794,  # 72 above its 2,722: the resumed counters, its envs made anew at the resume
    "ppo_atari_envpool_async.py": 2955,  # 52 above its 2,903: its run state named for --resume, the resumed counters
    "ppo_atari_lstm.py": 3949,  # 103 above its 3,846: the same, its minibatches' generator and step counts
    # 91 above its 3,685: the resumed counters, the snapshot by the first process alone, its processes ending with
    # torchrun killed at once (PR_SET_PDEATHSIG)
    "ppo_atari_multigpu.py": 3776,
    # 192 above its 3,051: its run state named for --resume, the resumed counters (the episodes' too); envpool's games,
    # which cannot be saved, restarted on resume with a seed of their own and the storage's new_games (about 100)
    "dqn_atari.py": 3243,
    # 109 above its 5,101: --resume's state, the limiter's counts, the actor's first step and the replay's cut, the
    # learner's snapshot also in its waits, the actor killed with its learner (22 fewer: the band's unread properties)
    "dqn_atari_async.py": 5210,
    # 177 above its 6,680: LASER's replay saved and restored in place on the device, six counters of the summary
    # resumed, the actors' weights published under the resumed update count
    "impala_ray.py": 6857,
    "pqn.py": 2177,  # 83 above its 2,094: its run state named for --resume, the resumed counters and observation
    "pqn_atari_envpool.py": 2554,  # 72 above its 2,482: as ppo_atari_envpool.py
    "rainbow_atari.py": 4810,  # 192 above its 4,618: the same as dqn_atari.py's
    # 45 above its 3,679 before: two named updates, FastTD3's exact actor schedule, the target update that takes
    # buffers; 101 above its 3,724 since: its run state named for --resume, its counters, noise scales and episode ends
    "fast_td3.py": 3825,
    # SAC's 2,945 less its target critics, plus what it exists to show: Batch Renormalization, the joint pass, its flags
    "crossq.py": 3334,  # 20 above its 3,314: the batch variance as a sum, the heap that keeps activations
    # a finished run kept from its evaluation, a crash from losing its summary; a flag declared once; 1,404 above its
    # 5,286 before: the Snapshot (--checkpoint-every, --resume: every state, generator and the clock; its refusals);
    # 116 above its 6,690 after: ALE's emulators kept (gymnasium pickles an ALE game as a new one), a buffer's parts (a
    # sum tree) restored in place, snapshots streamed to disk (fsync; torch.save's write errors one line), mapped back
    # and let go once restored; then MuJoCo's physics kept (gymnasium pickles a MuJoCo env as a new one), the loop's
    # tensors restored onto the run's device, no snapshot by a process that writes nothing, the last losses written
    # once a step; 78 above its 6,950 then: --checkpoint-minutes, a snapshot by the clock as well as by steps
    MODULE: 7028,
}
# Words of prose (comments and docstrings, tests/code_tokens.py), each script at most what it holds now. CleanRL's
# script of the same name (fe8d8a0) holds: SAC 266, TD3 245, PPO continuous 305, DQN 251 (dqn_atari.py's too),
# PPO Atari 269, PPO-LSTM 284, the multi-process PPO 353, PQN 201, PQN Atari 228, Rainbow 365. The thirteen scripts
# with a counterpart are at most 2x theirs (the async DQN against dqn_atari.py); IMPALA and FastTD3 have none.
MAX_PROSE_WORDS = {
    "sac_continuous_action.py": 536,
    "td3_continuous_action.py": 492,
    "ppo_continuous_action.py": 605,
    "dqn.py": 442,
    "ppo_atari_envpool.py": 529,
    "ppo_atari_envpool_async.py": 538,  # 9 above its 529: what a resumed run keeps (2x CleanRL's)
    "ppo_atari_lstm.py": 567,
    "ppo_atari_multigpu.py": 706,
    "dqn_atari.py": 500,
    "dqn_atari_async.py": 541,  # 41 above its 500 (2.2x dqn_atari.py's): why a snapshot beside the actor holds
    "impala_ray.py": 2586,  # 20 above its 2,566: the resumed state's comment, the replay restored in place
    "pqn.py": 381,  # 17 above its 364: what --resume restores, in a line
    "pqn_atari_envpool.py": 450,  # 2 above its 448: why a resumed run makes its envs anew
    "rainbow_atari.py": 729,
    "fast_td3.py": 822,
    # SAC's 536 and why Batch Renormalization and the joint pass read as they do; 31 above its 727: why the variance
    # is a sum and the heap keeps activations; 32 above its 758: why the log std, alpha's loss and the tanh correction
    # are SB3-contrib's
    "crossq.py": 790,
}
# What a script may take from the module; the rest of it is private (a leading underscore).
PUBLIC = {
    "RunArgs",
    "Flag",
    "Allowed",
    "Run",
    "Stopped",
    "SIGNALS_RECEIVED",
    "SUMMARY_KEYS",
    "fail",
    "game_mp4",
    "stop_if_signalled",
    "check_spaces",
    "usable_cores",
}


# The parts that Run is made of, each owning one job; a script reaches them through its run.
PARTS = {"check_flags", "Checkpoint", "Snapshot", "Clock", "SilentSinks", "Sinks", "SignalWatcher"}
# the run object itself, its parts left out: lines of code (no docstring, comment or blank); 4 of them hand the
# threads and the memory check to _tune_cpu and _check_fits; 7 write the training's files before the evaluation and
# turn an exception in the training or the evaluation into a failed run that keeps them
RUN_MAX_CODE_LINES = 140  # 14 above its 126 before: resumable and checkpoint_if_due, the Snapshot made and refused, the
# last losses not written twice at one step


def source(name):
    with open(os.path.join(SCRIPTS, name)) as f:
        return f.read()


def test_every_script_and_the_module_have_a_size_limit():
    assert sorted(MAX_TOKENS) == sorted([*ALL_SCRIPTS, MODULE])


@pytest.mark.parametrize("name", sorted(MAX_TOKENS))
def test_each_file_stays_within_its_size_in_code_tokens(name):
    assert code_tokens(source(name)) <= MAX_TOKENS[name]


@pytest.mark.parametrize("script", ALL_SCRIPTS)
def test_each_script_stays_within_its_words_of_prose(script):
    assert prose_words(source(script)) <= MAX_PROSE_WORDS[script]


def test_code_tokens_leave_out_comments_docstrings_and_layout_and_count_what_packing_hides():
    plain = 'def f(x):\n    """Doc."""\n    a = x  # why\n    b = x\n    return a, b\n'
    packed = "def f(x):\n    a, b = x, x\n    return a, b\n"
    assert code_tokens(plain) == 16 and code_tokens(packed) == 17  # def f ( x ) : a = x b = x return a , b
    assert code_tokens(plain.replace("  # why", "")) == code_tokens(plain)


@pytest.mark.parametrize("script", ALL_SCRIPTS)
def test_a_script_imports_the_module_in_one_line_and_redefines_none_of_it(script):
    tree = ast.parse(source(script))
    imports = [node for node in tree.body if isinstance(node, ast.ImportFrom) and node.module == "run_bookkeeping"]
    assert len(imports) == 1 and imports[0].lineno == imports[0].end_lineno
    assert {alias.name for alias in imports[0].names} <= PUBLIC
    assert not [
        node for node in ast.walk(tree) if isinstance(node, ast.Import) and "run_bookkeeping" in ast.unparse(node)
    ]
    defined = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    assert defined & PUBLIC == set()
    assert "# ---- run bookkeeping" not in source(script)


def test_the_run_is_made_of_parts_and_is_short_itself():
    """Run holds each part (the checkpoint, the clock, the sinks, the signal watcher) and delegates its job to it."""
    tree = ast.parse(source(MODULE))
    (run,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Run"]
    docstrings = {
        line
        for node in ast.walk(run)
        if isinstance(node, ast.ClassDef | ast.FunctionDef) and ast.get_docstring(node) is not None
        for line in range(node.body[0].lineno, node.body[0].end_lineno + 1)
    }
    lines = source(MODULE).splitlines()
    code = [n for n in range(run.lineno, run.end_lineno + 1) if n not in docstrings and lines[n - 1].strip()]
    assert len([n for n in code if not lines[n - 1].strip().startswith("#")]) <= RUN_MAX_CODE_LINES
    made = {ast.unparse(node) for node in ast.walk(run) if isinstance(node, ast.Call)}
    assert all(any(call.startswith(part + "(") for call in made) for part in PARTS)


# Run's methods that only hand their arguments to a part: the loop's calls, kept on the run (the comment above them
# says why); a part's other jobs a script calls on the part (run.clock.add_env_seconds, run.sinks.recent_return)
LOOP_FORWARDS = {"start_speed_measure", "record_episode", "record_gymnasium_episodes", "log"}


def test_the_run_forwards_to_its_parts_only_the_loops_calls():
    tree = ast.parse(source(MODULE))
    (run,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Run"]
    forwards = set()
    for method in [node for node in run.body if isinstance(node, ast.FunctionDef)]:
        body = method.body[1:] if ast.get_docstring(method) is not None else method.body
        if len(body) == 1 and isinstance(body[0], ast.Expr | ast.Return) and isinstance(body[0].value, ast.Call):
            call = body[0].value
            on_a_part = isinstance(call.func, ast.Attribute) and ast.unparse(call.func.value).startswith("self.")
            passed = [ast.unparse(arg) for arg in call.args] == [arg.arg for arg in method.args.args[1:]]
            if on_a_part and passed and not call.keywords:
                forwards.add(method.name)
    assert forwards == LOOP_FORWARDS


def test_the_module_has_a_few_public_names_each_with_a_docstring_and_no_algorithm():
    tree = ast.parse(source(MODULE))
    names = {node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    names.update({target.id: node for node in tree.body if isinstance(node, ast.Assign) for target in node.targets})
    assert {name for name in names if not name.startswith("_")} == PUBLIC | PARTS
    undocumented = [
        name
        for name, node in names.items()
        if not name.startswith("_") and not isinstance(node, ast.Assign) and ast.get_docstring(node) is None
    ]
    assert undocumented == []
    # no networks, losses, env wrappers or replay storage: nothing of torch.nn, torch.optim or gymnasium is used
    used = {ast.unparse(node) for node in ast.walk(tree) if isinstance(node, (ast.Attribute, ast.Name))}
    imported = {
        alias.name for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom) for alias in node.names
    }
    assert not {name for name in used if name.startswith(("torch.nn", "nn.", "torch.optim", "gym", "F."))}
    assert not imported & {"torch.nn", "gymnasium", "envpool", "tensordict"}


def test_a_script_copied_with_the_module_runs_outside_the_clone(tmp_path):
    """The two files alone in a fresh folder, run from another: the copy of the module beside the script is the one
    imported (a line it prints says so), whatever else the interpreter can import."""
    project, elsewhere = tmp_path / "my_project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    shutil.copy(os.path.join(SCRIPTS, "dqn.py"), project)
    module = source(MODULE) + '\nprint("the copied module", file=sys.stderr)\n'
    (project / MODULE).write_text(module)
    args = ["--total-timesteps", 600, "--learning-starts", 200, "--eval-episodes", 1]
    summary, proc = run_script(str(project / "dqn.py"), args, elsewhere, env={"PYTHONPATH": ""})
    assert "the copied module" in proc.stderr and summary["steps_done"] == 600 and len(summary["eval_returns"]) == 1


@pytest.mark.slow  # a fresh venv and a pip install: about a minute
def test_a_copied_script_runs_against_a_plain_pip_install_of_the_project(tmp_path):
    """`pip install .` (not editable) into a fresh venv installs the module as a top-level module: a script copied
    alone into another project runs with it. The venv borrows this one's packages (torch and the rest) through a
    .pth file placed after its own site-packages, so its own install of the module is the one imported."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    own, borrowed = (
        subprocess.run(
            [exe, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for exe in (python, sys.executable)
    )
    install = subprocess.run(
        [python, "-m", "pip", "install", "--quiet", "--no-deps", ROOT], capture_output=True, text=True
    )
    assert install.returncode == 0, install.stderr[-2000:]
    with open(os.path.join(own, "borrowed.pth"), "w") as f:
        f.write(borrowed + "\n")
    where = subprocess.run(
        [python, "-c", "import run_bookkeeping; print(run_bookkeeping.__file__)"], capture_output=True, text=True
    )
    assert where.stdout.strip() == os.path.join(own, MODULE), where.stderr[-2000:]
    project = tmp_path / "my_project"
    project.mkdir()
    shutil.copy(os.path.join(SCRIPTS, "dqn.py"), project)
    args = ["--total-timesteps", "600", "--learning-starts", "200", "--eval-episodes", "1"]
    proc = subprocess.run(
        [python, str(project / "dqn.py"), *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("SPEED ") and '"steps_done": 600' in proc.stdout


def test_a_loaded_optimizer_keeps_the_script_settings_and_takes_the_checkpoint_state(tmp_path, monkeypatch):
    """Optimizer.load_state_dict alone would bring back the saved param groups: the checkpoint's lr tensor (the
    script's in-place schedule would no longer reach the optimizer) and its capturable setting (an eager run's
    checkpoint would fail Adam's capture check under --cudagraphs). Run.save_and_load keeps the script's lr tensor and
    settings, and takes the moments and step counts from the checkpoint."""
    import run_bookkeeping

    torch.manual_seed(0)
    trained = torch.nn.Linear(3, 2)
    saved = torch.optim.Adam(trained.parameters(), lr=torch.tensor(0.5), betas=(0.5, 0.6), fused=True)
    for _ in range(2):
        trained(torch.randn(4, 3)).square().sum().backward()
        saved.step()
    path = str(tmp_path / "model.pt")
    torch.save({"env_id": "Toy-v0", "inputs": 3, "net": trained.state_dict(), "optimizer": saved.state_dict()}, path)

    @dataclass
    class Args(run_bookkeeping.RunArgs):
        env_id: str = "Toy-v0"
        total_timesteps: int = 0
        gamma: float = 0.99

    monkeypatch.chdir(tmp_path)
    run = run_bookkeeping.Run(Args(load_model=path))
    net, lr = torch.nn.Linear(3, 2), torch.tensor(0.01)
    optimizer = torch.optim.Adam(net.parameters(), lr=lr, capturable=True, fused=True)
    run.save_and_load({"net": net, "optimizer": optimizer}, inputs=3)
    group = optimizer.param_groups[0]
    assert group["lr"] is lr and group["capturable"] and group["betas"] == (0.9, 0.999)
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), trained.parameters()))
    for param, trained_param in zip(net.parameters(), trained.parameters()):
        state, saved_state = optimizer.state[param], saved.state[trained_param]
        assert torch.equal(state["exp_avg"], saved_state["exp_avg"]) and state["step"].item() == 2
        assert state["step"].device == param.device  # capturable: the step count lives beside the parameter


@pytest.mark.parametrize("name", ["empty.pt", "text.pt", "truncated.pt", "other_script.pt"])
def test_a_file_that_is_no_checkpoint_of_this_script_is_one_error_line(name, tmp_path, capsys):
    """What each script's bad-checkpoint test (test_hard_knocks.py) sends through the module, every kind here: a file
    that torch.load cannot read, or a checkpoint without the states this script names."""
    import run_bookkeeping

    net = torch.nn.Linear(3, 2)
    buffer = io.BytesIO()
    torch.save({"env_id": "Toy-v0", "inputs": 3, "q_network": net.state_dict()}, buffer)
    content = {
        "empty.pt": b"",
        "text.pt": b"not a checkpoint\n",
        "truncated.pt": buffer.getvalue()[: len(buffer.getvalue()) // 2],
        "other_script.pt": buffer.getvalue(),
    }[name]
    path = tmp_path / name
    path.write_bytes(content)
    args = SimpleNamespace(env_id="Toy-v0", load_model=str(path))
    with pytest.raises(SystemExit) as stopped:
        run_bookkeeping.Checkpoint(args, torch.device("cpu"), {"net": net}, {"inputs": 3})
    stderr = capsys.readouterr().err
    assert stopped.value.code == 2 and stderr.startswith(
        f"error: --load-model: {path} is not a checkpoint of this script ("
    )
    assert stderr.count("\n") == 1 and stderr.endswith(")\n")


@pytest.fixture
def signals_kept():
    """The SignalWatcher's handlers and wakeup pipe, taken back after a test that starts a run in this process."""
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    yield
    signal.set_wakeup_fd(-1)
    for signum, handler in handlers.items():
        signal.signal(signum, handler)


@pytest.mark.parametrize("autoreset", ["SAME_STEP", "NEXT_STEP"])
def test_gymnasium_episodes_are_recorded_under_either_autoreset_mode(autoreset, tmp_path, monkeypatch, signals_kept):
    """Each env's RecordEpisodeStatistics: infos["final_info"] under the same-step autoreset, infos itself under the
    next-step one; the returns recorded are those of the episodes the envs played, counted in the test."""
    import gymnasium as gym

    import run_bookkeeping

    monkeypatch.chdir(tmp_path)
    run = run_bookkeeping.Run(run_bookkeeping.RunArgs(env_id="CartPole-v1", total_timesteps=10))  # only its fields
    run.start()
    make = lambda: gym.wrappers.RecordEpisodeStatistics(gym.make("CartPole-v1"))  # noqa: E731
    mode = getattr(gym.vector.AutoresetMode, autoreset)
    envs = gym.vector.SyncVectorEnv([make, make], autoreset_mode=mode)
    envs.reset(seed=0)
    envs.action_space.seed(0)
    played, lengths, ended_before = [], [0, 0], [False, False]
    for step in range(300):
        _, _, terminations, truncations, infos = envs.step(envs.action_space.sample())
        for i in range(2):
            if mode == gym.vector.AutoresetMode.NEXT_STEP and ended_before[i]:
                ended_before[i] = False  # this step was the reset
                continue
            lengths[i] += 1
            if terminations[i] or truncations[i]:
                played.append(lengths[i])
                lengths[i], ended_before[i] = 0, True
        run.record_gymnasium_episodes(step, infos)
    run.sinks.close()
    assert len(played) > 20 and list(run.sinks.recent_returns) == [float(n) for n in played[-20:]]


def test_save_model_without_saying_what_the_checkpoint_holds_is_refused_before_any_work(tmp_path, monkeypatch):
    import run_bookkeeping

    monkeypatch.chdir(tmp_path)
    run = run_bookkeeping.Run(run_bookkeeping.RunArgs(env_id="CartPole-v1", total_timesteps=10, save_model=True))
    with pytest.raises(SystemExit) as stop:
        run.start()
    assert stop.value.code == 2 and not os.path.exists("runs")


def test_warnings_before_the_run_starts_wait_for_it(tmp_path, monkeypatch, signals_kept):
    """A warning raised while the envs are made and a checkpoint checked (gymnasium's deprecated ids) is shown when
    the run starts: a refusal before that is its one line alone."""
    import run_bookkeeping

    monkeypatch.chdir(tmp_path)
    shown = []
    monkeypatch.setattr(warnings, "showwarning", lambda message, *rest: shown.append(str(message)))
    run = run_bookkeeping.Run(run_bookkeeping.RunArgs(env_id="CartPole-v1", total_timesteps=10))
    warnings.warn("the environment is out of date", UserWarning, stacklevel=1)
    assert shown == []
    run.start()
    run.sinks.close()
    assert shown == ["the environment is out of date"]


@pytest.mark.parametrize("seed", [-1, 2**30 + 1, 10**13])
def test_a_seed_the_generators_cannot_take_is_refused_before_any_work(seed, tmp_path, monkeypatch):
    import run_bookkeeping

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        run_bookkeeping.Run(run_bookkeeping.RunArgs(env_id="CartPole-v1", total_timesteps=10, seed=seed))
    assert stop.value.code == 2 and not os.path.exists("runs")


@dataclass
class FlaggedArgs:
    total_timesteps: int = 1000
    num_envs: Flag.Count = 4
    learning_rate: Flag.Positive = 3e-4
    gamma: Flag.Fraction = 0.99
    tau: Flag.PositiveFraction = 0.005
    ent_coef: Flag.AtLeast0 = 0.0
    measure_burnin: Flag.CountFrom0 = 1
    target_kl: Flag.Positive | None = None
    learning_starts: Flag.BeforeTheEnd = 100


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("num_envs", 0, "--num-envs must be positive, not 0"),
        ("learning_rate", 0.0, "--learning-rate must be a positive number, not 0.0"),
        ("learning_rate", float("nan"), "--learning-rate must be a positive number, not nan"),
        ("learning_rate", float("inf"), "--learning-rate must be a positive number, not inf"),
        ("target_kl", -0.1, "--target-kl must be a positive number, not -0.1"),
        ("gamma", 1.5, "--gamma must be in [0, 1], not 1.5"),
        ("gamma", -0.1, "--gamma must be in [0, 1], not -0.1"),
        ("tau", 0.0, "--tau must be in (0, 1], not 0.0"),
        ("tau", 1.5, "--tau must be in (0, 1], not 1.5"),
        ("ent_coef", -0.01, "--ent-coef must be 0 or more, not -0.01"),
        ("ent_coef", float("nan"), "--ent-coef must be 0 or more, not nan"),
        ("measure_burnin", -1, "--measure-burnin must be 0 or more, not -1"),
        ("learning_starts", 1000, "--learning-starts 1000 leaves no update: it must be below --total-timesteps 1000"),
    ],
)
def test_a_value_its_flags_type_does_not_allow_is_one_error_line(flag, value, message, capsys):
    import run_bookkeeping

    run_bookkeeping._check_allowed(FlaggedArgs())  # the defaults pass, target_kl's None (switched off) too
    with pytest.raises(SystemExit) as stop:
        run_bookkeeping._check_allowed(FlaggedArgs(**{flag: value}))
    assert stop.value.code == 2 and capsys.readouterr().err == f"error: {message}\n"


def test_learning_starts_beyond_the_budget_pass_when_a_checkpoint_is_evaluated():
    import run_bookkeeping

    run_bookkeeping._check_allowed(FlaggedArgs(total_timesteps=0))  # --total-timesteps 0 --load-model


def test_a_flag_removed_from_args_needs_no_other_edit_and_a_bound_on_a_missing_flag_is_one_line(capsys):
    """A flag's allowed values live in its type: a copy of Args without a flag has no list that still names it. A
    kind that bounds a flag by another (learning_starts by total_timesteps) refuses an Args without that one."""
    import run_bookkeeping

    def without(name):
        kept = [(f.name, f.type, f) for f in dataclasses.fields(FlaggedArgs) if f.name != name]
        return dataclasses.make_dataclass(f"Without_{name}", kept)()

    run_bookkeeping._check_allowed(without("tau"))
    with pytest.raises(SystemExit) as stop:
        run_bookkeeping._check_allowed(without("total_timesteps"))
    line = capsys.readouterr().err
    assert stop.value.code == 2 and line.count("\n") == 1
    assert line.startswith("error: --learning-starts is checked against --total-timesteps, which ") and "lacks" in line
