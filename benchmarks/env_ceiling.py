"""Env-only Breakout-v5 steps/s: the PPO Atari scripts' envpool set-up against envpool's own, at 8, 16 and 32 envs.

    python benchmarks/env_ceiling.py [--steps 10000] [--envs 8,16,32] > env_ceiling.jsonl
The first line says what bounds the envs' parallelism (the cores, the process's CPU affinity, a cgroup quota); then
one JSON line per set-up: the script's (one worker thread per env, up to the usable cores), envpool's default
(num_threads=0), the workers pinned to cores (thread_affinity_offset=0), ppo_atari_envpool_async.py's (half the envs
a batch), and the async layout of envpool's own benchmark (3 envs per batch slot, a worker thread per slot).
"""

import argparse
import json
import os
import time

import envpool
import numpy as np

import runner


def measure(steps, setup, num_envs, batch_size, **options):
    """Prints a set-up's JSON line: its steps/s with random actions, stepped synchronously (batch = envs) or with
    send/recv (a batch of the envs at a time)."""
    envs = envpool.make(
        "Breakout-v5", env_type="gymnasium", num_envs=num_envs, batch_size=batch_size, seed=1, **options
    )
    if batch_size == num_envs:
        envs.reset()
        step = envs.step
    else:
        envs.async_reset()

        def step(action):  # to the envs of the batch that recv returns
            envs.send(action, envs.recv()[-1]["env_id"])

    iterations = steps // batch_size
    actions = np.random.default_rng(1).integers(4, size=(iterations + 1, batch_size), dtype=np.int32)
    step(actions[0])  # the first step, untimed
    start = time.perf_counter()
    for action in actions[1:]:
        step(action)
    seconds = time.perf_counter() - start
    envs.close()
    sps = round(iterations * batch_size / seconds)
    print(
        json.dumps({"setup": setup, "num_envs": num_envs, "batch_size": batch_size, **options, "sps": sps}), flush=True
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000, help="env steps timed per set-up, all envs together")
    parser.add_argument("--envs", default="8,16,32", help="the env counts, comma-separated")
    args = parser.parse_args()
    usable = runner.run_script(f"{runner.ROOT}/leanrl_scripts/ppo_atari_envpool.py").usable_cores()
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota = f.read().strip()
    except OSError:
        quota = None
    print(
        json.dumps(
            {
                "cpu_count": os.cpu_count(),
                "affinity": sorted(os.sched_getaffinity(0)),
                "cpu.max": quota,
                "usable_cores": usable,
                "envpool": envpool.__version__,
            }
        ),
        flush=True,
    )
    sizes = [int(n) for n in args.envs.split(",")]
    for n in sizes:
        threads = min(n, usable)
        measure(args.steps, "script", n, n, num_threads=threads)
        measure(args.steps, "envpool default", n, n)
        measure(args.steps, "pinned", n, n, num_threads=threads, thread_affinity_offset=0)
        measure(args.steps, "async script", n, n // 2, num_threads=threads)
    for batch in [n for n in sizes if n <= 16]:  # 3 envs a batch slot: 48 envs at most
        measure(args.steps, "envpool benchmark async", 3 * batch, batch, num_threads=batch)
        measure(
            args.steps, "envpool benchmark async, pinned", 3 * batch, batch, num_threads=batch, thread_affinity_offset=0
        )


if __name__ == "__main__":
    main()
