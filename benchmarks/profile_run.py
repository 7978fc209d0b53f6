"""Where does a run's time go? Runs a training script (ours or a reference copy) in this process under
torch.profiler and prints its ops by self CPU time, with the FLOPs of its matmuls and convolutions against what
this machine's cores do on a large matmul (the learner's physical floor).

    python benchmarks/profile_run.py [--threads N] [--steps S] SCRIPT.py [SCRIPT ARGS...]

--steps: the env steps the run takes with its network in the loop (after learning starts), to print per-step
times. The profiler adds a few microseconds to every op, so absolute times read high for small ops; compare two
scripts' tables made the same way. OMP_NUM_THREADS is set to --threads before torch loads, for both sides.
"""

import argparse
import os
import runpy
import sys
import time

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--threads", type=int, default=1)
parser.add_argument("--steps", type=int, default=0, help="env steps with the network in the loop (per-step times)")
parser.add_argument("--top", type=int, default=18)
parser.add_argument("script")
parser.add_argument("script_args", nargs=argparse.REMAINDER)
args = parser.parse_args()
os.environ["OMP_NUM_THREADS"] = str(args.threads)

import torch  # noqa: E402  (after OMP_NUM_THREADS)
from torch.profiler import ProfilerActivity, profile  # noqa: E402


def matmul_peak(n=1024, reps=20):
    """GFLOP/s of a large float32 matmul at this thread count: the ceiling of the learner's kernels."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - start) / 1e9


torch.set_num_threads(args.threads)
peak = matmul_peak()
sys.argv = [args.script, *args.script_args]
start = time.perf_counter()
with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
    try:
        runpy.run_path(args.script, run_name="__main__")
    except SystemExit as stop:
        if stop.code:
            raise
wall = time.perf_counter() - start
events = prof.key_averages()
flops = sum(event.flops for event in events)
matmul_time = sum(event.self_cpu_time_total for event in events if event.flops) / 1e6
total_self = sum(event.self_cpu_time_total for event in events) / 1e6
per = args.steps or 1
unit = "ms per step" if args.steps else "s in all"
scale = 1e3 / per if args.steps else 1.0
print(f"\n{os.path.basename(args.script)}, {args.threads} thread(s): wall {wall:.1f} s, torch ops {total_self:.1f} s "
      f"(self CPU), matmul/conv FLOPs {flops / 1e9:.1f} G in {matmul_time:.2f} s: {flops / 1e9 / max(matmul_time, 1e-9):.0f}"
      f" GFLOP/s against a large matmul's {peak:.0f}")
if args.steps:
    print(f"per step: wall {wall * 1e3 / per:.2f} ms, torch ops {total_self * 1e3 / per:.2f} ms, "
          f"{flops / 1e6 / per:.0f} MFLOP, floor at the large-matmul rate {flops / per / (peak * 1e9) * 1e3:.2f} ms")
print(f"| op | calls{' per step' if args.steps else ''} | self CPU {unit} | share |\n| --- | ---: | ---: | ---: |")
for event in sorted(events, key=lambda e: -e.self_cpu_time_total)[: args.top]:
    seconds = event.self_cpu_time_total / 1e6
    print(f"| {event.key} | {event.count / per:.2f} | {seconds * scale:.3f} | {seconds / total_self:.0%} |")
