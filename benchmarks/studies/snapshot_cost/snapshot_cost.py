"""What one --checkpoint-every snapshot of dqn_atari.py or rainbow_atari.py costs at a replay size: its seconds, the
size of state.pt, the process's resident memory before it and at its peak during it (VmHWM, reset before the save);
then, in a second process, what --resume costs: the seconds to load and restore it, and the peak memory.

    python benchmarks/studies/snapshot_cost/snapshot_cost.py dqn_atari.py /tmp/snapshot-cost --buffer-size 1000000

The script's own states (its networks, Adam, the target, the frame storage with every row written, Rainbow's sum
tree, the generators, one gymnasium ALE env) through the bookkeeping module's Run, as the script names them; the
storage is filled with random frames, so that every page is resident, as in a run that filled it. No training."""

import argparse
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SCRIPTS = os.path.join(ROOT, "leanrl_scripts")
sys.path.insert(0, SCRIPTS)


def memory_mb():
    """The process's resident memory now and its peak (VmRSS, VmHWM), in MB."""
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {key: int(status[key].split()[0]) / 1024 for key in ("VmRSS", "VmHWM")}


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:  # "5": the peak resident memory starts again from now
        f.write("5")


def the_run(script, buffer_size, folder, resume):
    """The script's states, named to a Run as the script names them; the Run (restored with `resume`)."""
    spec = importlib.util.spec_from_file_location("script", os.path.join(SCRIPTS, script))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    import numpy as np

    from run_bookkeeping import Run

    args = module.Args(
        env_backend="gymnasium", buffer_size=buffer_size, checkpoint_every=1, resume=resume, exp_name="snapshot_cost"
    )
    run = Run(args)
    run.dir = resume or folder
    envs = module.make_envs(args.env_id, 1, args.seed, "gymnasium")
    num_actions = int(envs.single_action_space.n)
    rainbow = script == "rainbow_atari.py"
    network = module.RainbowNetwork(num_actions, args.n_atoms) if rainbow else module.QNetwork(num_actions)
    target_network = module.RainbowNetwork(num_actions, args.n_atoms) if rainbow else module.QNetwork(num_actions)
    optimizer = torch.optim.Adam(network.parameters(), lr=torch.tensor(1e-4), fused=True)
    network(torch.zeros(1, 4, 84, 84)).sum().backward()
    optimizer.step()  # Adam's moments exist, as after an update
    rb = module.FrameReplay(buffer_size, 1, torch.device("cpu"))
    run.save_and_load({"q_network": network, "optimizer": optimizer}, num_actions=num_actions)
    start = time.perf_counter()
    if not resume:
        for row in range(0, len(rb.frames), 65536):  # every page written, as a full storage's
            rb.frames[row : row + 65536] = torch.randint(0, 256, rb.frames[row : row + 65536].shape, dtype=torch.uint8)
        rb.valid[:] = True
        if rainbow:
            rb.tree.leaves.uniform_()
    rng = np.random.default_rng(args.seed)
    filled = time.perf_counter() - start
    start = time.perf_counter()
    resumed = run.resumable(target_network=target_network, rb=rb, rng=rng, envs=envs)
    return run, envs, rb, (time.perf_counter() - start, filled, resumed)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("script", choices=["dqn_atari.py", "rainbow_atari.py"])
    parser.add_argument("--buffer-size", type=int, default=1_000_000)
    parser.add_argument("folder", help="the run folder for state.pt (made here: not there yet)")
    parser.add_argument("--resume", default="", help="(the second process) restore the snapshot in this folder")
    options = parser.parse_args()
    run, envs, rb, (restore_seconds, fill_seconds, _) = the_run(
        options.script, options.buffer_size, options.folder, options.resume
    )
    peak = memory_mb()["VmHWM"]
    checksum = hashlib.sha1(rb.frames.numpy()).hexdigest()  # the frames written (over 2 GB at 1M) read back whole
    if options.resume:
        print(json.dumps({"restore_seconds": restore_seconds, "peak_mb_from_start": peak, "checksum": checksum}))
        return
    envs.reset(seed=1)
    run.start()  # the run folder's Sinks, as the script's run.start()
    before = memory_mb()
    reset_peak()
    run.checkpoint_if_due(0)  # the first call sets the next snapshot's step
    start = time.perf_counter()
    run.checkpoint_if_due(1, iteration=1)
    seconds = time.perf_counter() - start
    during = memory_mb()
    size = os.path.getsize(os.path.join(options.folder, "state.pt"))
    resumed = subprocess.run(
        [sys.executable, __file__, options.script, options.folder, "--buffer-size", str(options.buffer_size)]
        + ["--resume", options.folder],
        capture_output=True,
        text=True,
    )
    figures = {
        "script": options.script,
        "buffer_size": options.buffer_size,
        "fill_seconds": fill_seconds,
        "snapshot_seconds": seconds,
        "state_pt_mb": size / 2**20,
        "rss_before_mb": before["VmRSS"],
        "peak_during_snapshot_mb": during["VmHWM"],
        "resume": json.loads(resumed.stdout.strip().splitlines()[-1]) if resumed.returncode == 0 else resumed.stderr,
    }
    figures["restored_frames_equal"] = resumed.returncode == 0 and figures["resume"]["checksum"] == checksum
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
