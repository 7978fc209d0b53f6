"""The env-only ceiling of a script: its own env setup stepping random actions, no network.

    python benchmarks/env_only.py leanrl_scripts/sac_continuous_action.py --env-id HalfCheetah-v5 [--num-envs N]
    python benchmarks/env_only.py leanrl_scripts/ppo_atari_envpool.py --env-id Breakout-v5 --num-envs 8
    python benchmarks/env_only.py leanrl_scripts/dqn_atari.py --env-id Breakout-v5 --env-backend gymnasium
    python benchmarks/env_only.py leanrl_scripts/impala_ray.py --env-id Breakout-v5 --num-actors 2 --envs-per-actor 4
    python benchmarks/env_only.py leanrl_scripts/ppo_atari_multigpu.py --env-id Breakout-v5 --local-num-envs 4 \
        --nproc-per-node 2
(for impala_ray.py: all the actors' envs stepped by one process; for ppo_atari_multigpu.py, every process's)
prints one JSON line with `env_only_sps` (environment steps per second, all envs together).
"""

import argparse
import importlib.util
import json
import os
import sys
import time
from functools import partial

import numpy as np


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("script")
    parser.add_argument("--env-id", required=True)
    parser.add_argument("--num-envs", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--env-backend", help="for dqn_atari.py: envpool or gymnasium")
    parser.add_argument("--num-actors", type=int, default=2, help="for impala_ray.py")
    parser.add_argument("--envs-per-actor", type=int, help="for impala_ray.py")
    parser.add_argument("--local-num-envs", type=int, help="for ppo_atari_multigpu.py: envs per process")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="for ppo_atari_multigpu.py: torchrun's processes")
    parser.add_argument("--steps", type=int, default=20_000, help="environment steps to time, all envs together")
    args, _ = parser.parse_known_args()  # the script's other flags (budget, speed modes) do not matter here
    if args.envs_per_actor:
        args.num_envs = args.num_actors * args.envs_per_actor
    if args.local_num_envs:
        args.num_envs = args.nproc_per_node * args.local_num_envs

    sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))  # the run bookkeeping module beside it
    spec = importlib.util.spec_from_file_location("script_under_test", args.script)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    envs = script.make_envs(args.env_id, args.num_envs, **({"backend": args.env_backend} if args.env_backend else {}))
    if hasattr(envs, "recv"):  # envpool: seeded at construction, its action space is one env's
        envs.reset()
        rng = np.random.default_rng(args.seed)
        sample = partial(rng.integers, envs.action_space.n, size=args.num_envs, dtype=np.int32)
    else:  # a gymnasium vector env: its action space is batched
        envs.action_space.seed(args.seed)
        envs.reset(seed=args.seed)
        sample = envs.action_space.sample
    actions = [sample() for _ in range(max(1, args.steps // args.num_envs))]
    start = time.perf_counter()
    for action in actions:
        envs.step(action)
    seconds = time.perf_counter() - start
    envs.close()
    print(
        json.dumps(
            {
                "script": os.path.basename(args.script),
                "env_id": args.env_id,
                "num_envs": args.num_envs,
                "steps": len(actions) * args.num_envs,
                "seconds": seconds,
                "env_only_sps": len(actions) * args.num_envs / seconds,
                **cores(),
            }
        )
    )


def cores():
    """What bounds the envs' parallelism here: the CPUs the machine has, those this process may run on, a cgroup
    quota (a container's limit, in CPUs), and the cores the scripts count as usable (envpool worker threads)."""
    from run_bookkeeping import usable_cores  # beside the script, on the path since main()

    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()
        quota = None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        quota = None
    usable = usable_cores()
    return {
        "cpu_count": os.cpu_count(),
        "affinity_cores": len(os.sched_getaffinity(0)),
        "cgroup_cpu_quota": quota,
        "usable_cores": usable,
    }


if __name__ == "__main__":
    sys.exit(main())
