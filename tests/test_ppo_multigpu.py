"""PPO Atari on several processes (gloo on the CPU): two processes' averaged update against one process's update of
both rollouts, written plainly here; torchrun launches, one node and two, the speed modes, and the faults."""

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
from functools import partial

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import run_bookkeeping
from checks import assert_a_seed_learns, assert_compiled_as_designed, learned_the_cue
from reference_implementations import reference_ppo_update
from script_runs import ROOT, SCRIPTS, STANDIN, load_script, run_script, sabotaged_if_asked

pytest.importorskip("envpool")

SCRIPT = "ppo_atari_multigpu.py"
# per process: 2 envs x 16 steps, 2 minibatches, 1 epoch; 2 iterations of 2 processes
TINY = ["--local-num-envs", 2, "--num-steps", 16, "--num-minibatches", 2, "--update-epochs", 1, "--eval-episodes", 0]
NUM_STEPS, NUM_ENVS, NUM_MINIBATCHES = 8, 8, 2  # the equivalence test's rollout: 8 envs, shared by 2 processes
UNCLIPPED = 1e9  # a max_grad_norm that never clips


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rollout():
    """A rollout of NUM_ENVS envs x NUM_STEPS steps, flattened over (step, env) as the script's Batch is."""
    g = torch.Generator().manual_seed(3)
    obs = torch.randint(0, 256, (NUM_STEPS, NUM_ENVS, 4, 84, 84), dtype=torch.uint8, generator=g)
    actions = torch.randint(0, 4, (NUM_STEPS, NUM_ENVS), generator=g)
    logprobs, advantages, returns, values = (torch.randn(NUM_STEPS, NUM_ENVS, generator=g) for _ in range(4))
    return obs, actions, logprobs - 1.4, advantages, returns, values


def local_orders():
    """Each process's order of its own (step, env) rows: minibatch i is its rows order[i * m : (i + 1) * m]."""
    rows = NUM_STEPS * NUM_ENVS // 2
    return [torch.randperm(rows, generator=torch.Generator().manual_seed(10 + rank)) for rank in range(2)]


def process_update(rank, port, out):
    """One of two processes: its half of the envs, the script's update_epoch over gloo."""
    module = load_script(SCRIPT)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    agent = module.Agent(4)
    flat_grads = module.gradients_in_one_buffer(agent)
    optimizer = torch.optim.Adam(agent.parameters(), lr=torch.tensor(2.5e-4), eps=1e-5, fused=True)
    # no clipping: clipped to the same norm, a wrong divisor of the averaged gradients would not show
    args = module.Args(num_minibatches=NUM_MINIBATCHES, world_size=2, max_grad_norm=UNCLIPPED)
    half = slice(rank * NUM_ENVS // 2, (rank + 1) * NUM_ENVS // 2)
    batch = module.Batch(*(t[:, half].flatten(0, 1) for t in rollout()))
    metrics = module.update_epoch(
        batch,
        local_orders()[rank],
        loss_step=partial(
            module.loss_and_gradients, loss_fn=module.ppo_loss, flat_grads=flat_grads, agent=agent, args=args
        ),
        apply_step=partial(module.apply_gradients, agent=agent, optimizer=optimizer, flat_grads=flat_grads, args=args),
        flat_grads=flat_grads,
        args=args,
        group=dist.group.WORLD,
    )
    grad_norms = torch.stack([minibatch["grad_norm"] for minibatch in metrics])
    torch.save({"weights": agent.state_dict(), "grad_norms": grad_norms}, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_two_processes_take_the_step_one_process_takes_on_both_rollouts(tmp_path):
    """Each process's minibatch is its share of one minibatch of the whole rollout: the averaged gradients (and the
    advantages normalised over both shares) give the gradient norms and the weights of one process updating on the
    union, without clipping (a gradient summed, not averaged, would double the norms)."""
    mp.start_processes(process_update, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    module = load_script(SCRIPT)
    torch.manual_seed(0)
    agent = module.Agent(4)
    whole = rollout()
    shares = [[t[:, half].flatten(0, 1) for t in whole] for half in (slice(0, 4), slice(4, 8))]
    minibatch_rows = NUM_STEPS * NUM_ENVS // 2 // NUM_MINIBATCHES
    minibatches = []
    for index in range(NUM_MINIBATCHES):
        rows = [order[index * minibatch_rows : (index + 1) * minibatch_rows] for order in local_orders()]
        minibatches.append([torch.cat([share[i][rows[rank]] for rank, share in enumerate(shares)]) for i in range(6)])
    before = {name: value.clone() for name, value in agent.state_dict().items()}
    grad_norms = reference_ppo_update(agent, minibatches, UNCLIPPED)
    for rank in range(2):
        saved = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(saved["grad_norms"], grad_norms, atol=1e-6, rtol=1e-5)
        for name, value in agent.state_dict().items():
            torch.testing.assert_close(saved["weights"][name], value, atol=1e-6, rtol=1e-5)
    assert any(not torch.equal(before[name], value) for name, value in agent.state_dict().items())


def test_the_minibatch_statistics_of_one_process_are_torchs():
    module = load_script(SCRIPT)
    advantages = torch.randn(64) * 3 + 5
    order = torch.randperm(64)
    means, stds = module.minibatch_statistics(advantages, order, 4, None)
    rows = advantages[order].view(4, 16)
    torch.testing.assert_close(means, rows.mean(1))
    torch.testing.assert_close(stds, rows.std(1))


def launch(args, cwd, processes=2, extra=(), env=None):
    """torchrun on one node (standalone), or with `extra` launcher flags (two nodes); returns the Popen."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes)]
    launcher += list(extra) or ["--standalone"]
    return subprocess.Popen(
        [*launcher, os.path.join(SCRIPTS, SCRIPT), *map(str, args)],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=sabotaged_if_asked({**os.environ, **(env or {})}),
        start_new_session=True,
    )


def summaries(cwd):
    return [json.load(open(path)) for path in glob.glob(os.path.join(cwd, "runs", "*", "summary.json"))]


def assert_nothing_left_running(cwd):
    out = subprocess.run(["pgrep", "-f", f"{SCRIPT}"], capture_output=True, text=True).stdout.split()
    assert not [pid for pid in out if os.path.exists(f"/proc/{pid}") and cwd in os.readlink(f"/proc/{pid}/cwd")]


def test_two_processes_count_every_step_and_only_the_first_writes(workdir):
    """CleanRL's --device-ids, its processes' GPUs, is taken (a CPU run has none to use)."""
    proc = launch([*TINY, "--total-timesteps", 128, "--device-ids", 0, 1], workdir)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    [summary] = summaries(workdir)  # one run folder: the first process's
    assert summary["world_size"] == 2 and summary["num_envs"] == 4 and summary["mode"] == "eager"
    assert summary["steps_done"] == 128 and summary["num_updates"] == 2 * 2  # 2 iterations x 2 minibatches
    assert all(np.isfinite(list(summary["final_metrics"].values())))
    assert stdout.count("SPEED ") == 1 and "one process" not in stdout


@pytest.mark.learning
def test_two_processes_learn_the_cue_task(workdir):
    """Cue-v5 (tests/standin/envpool.py) through each process's envpool code: two processes of 4 envs, rollouts of
    32 steps, lr 1e-3, 5,120 steps in all (ppo_atari_envpool.py's cue test, its envs split in two). A random policy
    scores 8 a game."""
    args = ["--env-id", "Cue-v5", "--local-num-envs", 4, "--num-steps", 32, "--learning-rate", 1e-3]
    args += ["--total-timesteps", 5120, "--eval-episodes", 10]

    def run_seed(seed):
        cwd = os.path.join(workdir, f"seed-{seed}")
        os.mkdir(cwd)
        proc = launch([*args, "--seed", seed], cwd, env={"PYTHONPATH": os.pathsep.join([STANDIN, ROOT])})
        _, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-3000:]
        [summary] = summaries(cwd)
        assert summary["world_size"] == 2
        return summary

    assert_a_seed_learns(run_seed, learned_the_cue)


def test_without_torchrun_it_is_one_process_and_says_so_with_both_speed_flags(workdir):
    """The fast tier's compiled run of this script: --compile compiles the pieces and, without CUDA, --cudagraphs runs
    eagerly. The launches of several processes are in the slow tier."""
    summary, proc = run_script(SCRIPT, [*TINY, "--total-timesteps", 64, "--compile", "--cudagraphs"], workdir)
    assert proc.stdout.count("one process: torchrun starts several") == 1
    assert summary["world_size"] == 1 and summary["num_envs"] == 2 and summary["steps_done"] == 64
    assert summary["mode"] == "compile+cudagraphs" and summary["cudagraphs_requested"]
    assert_compiled_as_designed(summary)


@pytest.mark.slow  # several processes launched by torchrun: 9-42 s each here
@pytest.mark.parametrize(
    "args, message",
    [
        (["--env-id", "NoSuchGame-v5"], "unknown env id"),
        (["--total-timesteps", 32], "less than one rollout of every process (64)"),
        (["--device-idz", 0, 1], "Unrecognized options: --device-idz"),
    ],
)
def test_bad_input_stops_every_process_with_one_line(args, message, workdir):
    """tyro's box for an unknown flag, too, is printed by the first process alone."""
    proc = launch([*TINY, "--total-timesteps", 128, *args], workdir)
    _, stderr = proc.communicate(timeout=300)
    said = "Unrecognized options:" if "Unrecognized" in message else "error: "
    assert proc.returncode != 0 and stderr.count(said) == 1 and message in stderr, stderr[-3000:]
    assert f'{SCRIPT}", line' not in stderr  # no traceback through the script (the launcher prints its own report)
    assert not os.path.exists(os.path.join(workdir, "runs"))


@pytest.mark.slow  # several processes launched by torchrun: 9-42 s each here
def test_two_launchers_meet_at_one_rendezvous_with_both_speed_flags(workdir):
    """Two nodes as SLURM starts them, here on one machine: one torchrun each, one c10d rendezvous. With both speed
    flags (the other launches run eager): --compile compiles the pieces and, without CUDA, --cudagraphs runs
    eagerly, so the two ends cover every flag's bookkeeping."""
    endpoint = f"127.0.0.1:{free_port()}"
    rendezvous = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "two-nodes"]
    for n in range(2):
        os.makedirs(os.path.join(workdir, f"node{n}"))
    flags = [*TINY, "--total-timesteps", 128, "--compile", "--cudagraphs"]
    nodes = [launch(flags, os.path.join(workdir, f"node{n}"), 1, rendezvous) for n in range(2)]
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [err[-2000:] for _, err in outputs]
    written = [summaries(os.path.join(workdir, f"node{n}")) for n in range(2)]
    assert sorted(len(found) for found in written) == [0, 1]  # the first process's node alone writes
    summary = [found for found in written if found][0][0]
    assert summary["world_size"] == 2 and summary["steps_done"] == 128 and summary["num_updates"] == 2 * 2
    assert summary["mode"] == "compile+cudagraphs" and summary["cudagraphs_requested"]
    assert_compiled_as_designed(summary)
    assert all(np.isfinite(list(summary["final_metrics"].values())))


def wait_for_steps(proc, workdir, seconds=120):
    """Until the first process logged a step (its progress lines), so that both are in the training loop."""
    deadline = time.time() + seconds
    while time.time() < deadline and not glob.glob(os.path.join(workdir, "runs", "*", "events.*")):
        time.sleep(0.5)
    time.sleep(8)  # a few iterations in


@pytest.mark.slow  # several processes launched by torchrun: 9-42 s each here
def test_sigterm_to_the_launcher_stops_every_process_with_the_steps_done(workdir):
    proc = launch([*TINY, "--total-timesteps", 100_000], workdir)
    wait_for_steps(proc, workdir)
    start = time.time()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert time.time() - start < 30 and proc.returncode != 0
    [summary] = summaries(workdir)
    assert summary["stopped"] == "stopped by SIGTERM" and 0 < summary["steps_done"] < 100_000, stderr[-2000:]
    assert summary["steps_done"] % 4 == 0  # both processes stopped at the same step
    assert_nothing_left_running(workdir)


def test_a_signal_during_the_stop_all_reduce_waits_for_the_next_one(monkeypatch):
    """The race behind a flaky SIGTERM stop: a process that notes its signal while the all-reduce of one number runs
    must not stop on its own (its peer, which sent 0, steps on into the next collective and finds it gone); the
    agreed number alone decides, and the signal goes into the next step's number."""
    module = load_script(SCRIPT)
    received = run_bookkeeping.SIGNALS_RECEIVED  # the list the signal handler fills and stop_if_signalled reads
    received.clear()

    def all_reduce_during_which_sigterm_comes(tensor, group, op):  # the peer sends 0
        received.append(signal.SIGTERM)  # the handler runs while the collective is under way

    def stop_together():  # the script's safe point, each env step
        module.stop_if_signalled(agree=partial(module.signal_of_any_process, group=object()))

    try:
        monkeypatch.setattr(module, "all_reduce", all_reduce_during_which_sigterm_comes)
        stop_together()  # agreed: 0 from both; no stop
        with pytest.raises(module.Stopped, match="stopped by SIGTERM"):
            stop_together()  # this time the process sends it, and both stop here

        received.clear()
        monkeypatch.setattr(module, "all_reduce", lambda tensor, group, op: tensor.fill_(signal.SIGINT))
        with pytest.raises(module.Stopped, match="stopped by SIGINT"):  # a peer's signal stops one that got none
            stop_together()
    finally:
        received.clear()


@pytest.mark.slow  # several processes launched by torchrun: 9-42 s each here
def test_a_killed_process_ends_the_others_within_seconds(workdir):
    """The first process keeps the summary and the model as the last whole update left it."""
    proc = launch([*TINY, "--total-timesteps", 100_000, "--save-model"], workdir)
    wait_for_steps(proc, workdir)
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    environments = {
        pid: dict(item.split("=", 1) for item in open(f"/proc/{pid}/environ").read().split("\0") if "=" in item)
        for pid in workers
    }
    ranks = {int(environment["RANK"]): pid for pid, environment in environments.items()}
    start = time.time()
    os.kill(int(ranks[1]), signal.SIGKILL)
    _, stderr = proc.communicate(timeout=60)
    assert time.time() - start < 15 and proc.returncode != 0
    assert "error: another process of this run ended" in stderr, stderr[-3000:]
    [summary] = summaries(workdir)
    assert summary["stopped"].startswith("another process of this run ended") and summary["steps_done"] > 0
    (model,) = glob.glob(os.path.join(workdir, "runs", "*", "model.pt"))
    weights = torch.load(model, weights_only=True)["agent"]
    assert weights.keys() == load_script(SCRIPT).Agent(4).state_dict().keys()
    assert all(torch.isfinite(value).all() for value in weights.values())
    assert_nothing_left_running(workdir)
