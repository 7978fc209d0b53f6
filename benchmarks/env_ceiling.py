"""Env-only Breakout-v5 steps/s: the PPO Atari scripts' envpool set-up against envpool's own, at 8, 16 and 32 envs.

    python benchmarks/env_ceiling.py [--steps 10000] [--envs 8,16,32] > env_ceiling.jsonl
The first line says what bounds the envs' parallelism (the cores, the process's CPU affinity, a cgroup quota); then
one JSON line per set-up: the script's (one worker thread per env, up to the usable cores), envpool's default
(num_threads=0), the workers pinned to cores (thread_affinity_offset=0), ppo_atari_envpool_async.py's (half the envs
a batch), and the async layout of envpool's own benchmark (3 envs per batch slot, a worker thread per slot).
"""

import argparse
import importlib.util
import json
import os
import sys
import time

import envpool
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def steps_per_second(steps, num_envs, batch_size, **options):
    """Random actions, stepped synchronously (batch = envs) or with send/recv (a batch of the envs at a time)."""
    envs = envpool.make(
        "Breakout-v5", env_type="gymnasium", num_envs=num_envs, batch_size=batch_size, seed=1, **options
    )
    rng = np.random.default_rng(1)
    iterations = steps // batch_size
    actions = [rng.integers(4, size=batch_size, dtype=np.int32) for _ in range(iterations + 1)]
    if batch_size == num_envs:
        envs.reset()
        envs.step(actions[0])
        start = time.perf_counter()
        for action in actions[1:]:
            envs.step(action)
    else:
        envs.async_reset()
        *_, info = envs.recv()
        envs.send(actions[0], info["env_id"])
        start = time.perf_counter()
        for action in actions[1:]:
            *_, info = envs.recv()
            envs.send(action, info["env_id"])
    seconds = time.perf_counter() - start
    envs.close()
    return iterations * batch_size / seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000, help="env steps timed per set-up, all envs together")
    parser.add_argument("--envs", default="8,16,32", help="the env counts, comma-separated")
    args = parser.parse_args()
    path = os.path.join(ROOT, "leanrl_scripts", "ppo_atari_envpool.py")
    sys.path.insert(0, os.path.dirname(path))  # the run bookkeeping module beside it
    spec = importlib.util.spec_from_file_location("ppo_atari", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
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
                "usable_cores": script.usable_cores(),
                "envpool": envpool.__version__,
            }
        ),
        flush=True,
    )
    layouts = []
    sizes = [int(n) for n in args.envs.split(",")]
    for n in sizes:
        threads = min(n, script.usable_cores())
        layouts += [
            ("script", n, n, {"num_threads": threads}),
            ("envpool default", n, n, {}),
            ("pinned", n, n, {"num_threads": threads, "thread_affinity_offset": 0}),
            ("async script", n, n // 2, {"num_threads": threads}),
        ]
    for batch in [n for n in sizes if n <= 16]:  # 3 envs a batch slot: 48 envs at most
        pinned = {"num_threads": batch, "thread_affinity_offset": 0}
        layouts += [
            ("envpool benchmark async", 3 * batch, batch, {"num_threads": batch}),
            ("envpool benchmark async, pinned", 3 * batch, batch, pinned),
        ]
    for label, num_envs, batch_size, options in layouts:
        sps = steps_per_second(args.steps, num_envs, batch_size, **options)
        record = {"setup": label, "num_envs": num_envs, "batch_size": batch_size, **options, "sps": round(sps)}
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
