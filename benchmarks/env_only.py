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
import json
import os
import time
from functools import partial

import numpy as np

import runner


def cores():
    """What bounds the envs' parallelism here: the CPUs the machine has, those this process may run on, a cgroup
    quota (a container's limit, in CPUs), and the cores the scripts count as usable (envpool worker threads)."""
    # beside the script, on the path once it is loaded; the quota as the scripts' usable_cores() reads it
    from run_bookkeeping import _cpu_quota, usable_cores

    return {
        "cpu_count": os.cpu_count(),
        "affinity_cores": len(os.sched_getaffinity(0)),
        "cgroup_cpu_quota": _cpu_quota(),
        "usable_cores": usable_cores(),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    number = partial(parser.add_argument, type=int)
    parser.add_argument("script")
    parser.add_argument("--env-id", required=True)
    number("--num-envs", default=1)
    number("--seed", default=1)
    parser.add_argument("--env-backend", help="for dqn_atari.py: envpool or gymnasium")
    number("--num-actors", default=2, help="for impala_ray.py")
    number("--envs-per-actor", help="for impala_ray.py")
    number("--local-num-envs", help="for ppo_atari_multigpu.py: envs per process")
    number("--nproc-per-node", default=1, help="for ppo_atari_multigpu.py: torchrun's processes")
    number("--steps", default=20_000, help="environment steps to time, all envs together")
    args, _ = parser.parse_known_args()  # the script's other flags (budget, speed modes) do not matter here
    if args.envs_per_actor:
        args.num_envs = args.num_actors * args.envs_per_actor
    if args.local_num_envs:
        args.num_envs = args.nproc_per_node * args.local_num_envs

    envs = runner.run_script(args.script).make_envs(
        args.env_id, args.num_envs, **({"backend": args.env_backend} if args.env_backend else {})
    )
    if hasattr(envs, "recv"):  # envpool: seeded at construction, its action space is one env's
        envs.reset()
        sample = partial(
            np.random.default_rng(args.seed).integers, envs.action_space.n, size=args.num_envs, dtype=np.int32
        )
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
    steps = len(actions) * args.num_envs
    print(
        json.dumps(
            {
                "script": os.path.basename(args.script),
                "env_id": args.env_id,
                "num_envs": args.num_envs,
                "steps": steps,
                "seconds": seconds,
                "env_only_sps": steps / seconds,
                **cores(),
            }
        )
    )


if __name__ == "__main__":
    main()
