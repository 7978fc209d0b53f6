"""Where does a run's time go? Runs a training script (ours or a reference copy) in this process and prints the
time per env step of its pieces, and the learner's physical floor: the FLOPs of its matmuls and convolutions
at the rate this machine's cores reach on a large matmul.

    python benchmarks/studies/profile_run/profile_run.py [--threads N] [--steps S] [--flops] SCRIPT.py [SCRIPT ARGS...]

Times come from cProfile (cumulative time of the script's functions and of the env's and the optimizer's
steps), which adds about a microsecond per Python call, not per tensor op. torch.profiler was tried first: on
this CPU it put a ReLU that takes 13 us at 0.5 ms, and stretched a TD3 run 2.5x. --flops counts FLOPs instead
(with torch.profiler, whose counts are exact where its times are not), in a separate run. --steps: the env
steps taken with the network in the loop (after learning starts), for per-step figures. OMP_NUM_THREADS is set
to --threads before torch loads, for either side.
"""

import argparse
import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # runner.py, two folders up
import runner  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--threads", type=int, default=1)
parser.add_argument("--steps", type=int, default=1, help="env steps with the network in the loop (per-step times)")
parser.add_argument("--flops", action="store_true", help="count the FLOPs instead of timing")
parser.add_argument("--top", type=int, default=25)
parser.add_argument("script")
parser.add_argument("script_args", nargs=argparse.REMAINDER)
args = parser.parse_args()
os.environ["OMP_NUM_THREADS"] = str(args.threads)

import torch  # noqa: E402  (after OMP_NUM_THREADS)


def matmul_peak(n=1024, reps=20):
    """GFLOP/s of a large float32 matmul at this thread count: the ceiling of the learner's kernels."""
    a, b = torch.randn(2, n, n)
    for _ in range(3):
        a @ b
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - start) / 1e9


torch.set_num_threads(args.threads)
name = f"{os.path.basename(args.script)}, {args.threads} thread(s)"
if args.flops:
    from torch.profiler import ProfilerActivity, profile

    peak = matmul_peak()
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        runner.run_script(args.script, args.script_args)
    flops = sum(event.flops for event in prof.key_averages()) / args.steps
    print(
        f"\n{name}: {flops / 1e6:.0f} MFLOP per step in matmuls and convolutions; a large matmul runs at "
        f"{peak:.0f} GFLOP/s here, so the floor is {flops / (peak * 1e9) * 1e3:.2f} ms per step"
    )
else:
    start = time.perf_counter()
    with cProfile.Profile() as profiler:
        runner.run_script(args.script, args.script_args)
    wall = time.perf_counter() - start
    rows = [
        (cumulative, calls, f"{function} ({os.path.basename(path)}:{line})")
        for (path, line, function), (_, calls, _, cumulative, _) in pstats.Stats(profiler).stats.items()
        # the script's own functions, and the env's and the optimizer's steps (what the loop calls into)
        if (path == args.script and function != "<module>")
        or function in ("step", "run_backward", "_fused_adam", "lerp_")
    ]
    print(f"\n{name}: wall {wall:.1f} s under cProfile, {wall * 1e3 / args.steps:.2f} ms per step")
    print("| function | calls per step | cumulative ms per step |\n| --- | ---: | ---: |")
    for cumulative, calls, label in sorted(rows, reverse=True)[: args.top]:
        print(f"| {label} | {calls / args.steps:.2f} | {cumulative * 1e3 / args.steps:.3f} |")
