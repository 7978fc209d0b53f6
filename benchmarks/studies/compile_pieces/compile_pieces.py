"""Does each compiled piece gain on this machine? Runs a script with --compile in this process, with torch.compile
replaced by a wrapper that alternates each piece's calls between the compiled and the eager function (the same
state, the same inputs, one call each in turn) and times them; prints each piece's median time both ways. A loss
piece is timed with the update it belongs to: from its call to the last optimizer step before the next piece's call,
so its backward (compiled with it, or eager) and the Adam step are in its row.

    python benchmarks/studies/compile_pieces/compile_pieces.py [--threads N] SCRIPT.py --compile [SCRIPT ARGS...]
"""

import argparse
import itertools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # runner.py, two folders up
import runner  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS for the run (0: the script's choice)")
parser.add_argument("--skip", type=int, default=20, help="calls of each piece left out (compilation, warm-up)")
parser.add_argument("script")
parser.add_argument("script_args", nargs=argparse.REMAINDER)
args = parser.parse_args()
if args.threads:
    os.environ["OMP_NUM_THREADS"] = str(args.threads)

import torch  # noqa: E402  (after OMP_NUM_THREADS)
from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: E402

real_compile = torch.compile
pieces = []  # (name, eager times, compiled times) of each piece
pending = []  # the call being timed: [the times it joins (none while skipped), start, end]


def now():
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def close_pending():
    if pending:
        times, start, end = pending.pop()
        times.append(end - start)


def step_taken(*_):  # an optimizer step (a post-hook's arguments unused) ends the timed call of the loss before it
    if pending:
        pending[0][2] = now()


register_optimizer_step_post_hook(step_taken)


def alternating_compile(fn=None, disable=False, **options):
    if fn is None:  # used as @torch.compile(...)
        return lambda f: alternating_compile(f, disable=disable, **options)
    if disable:
        return fn
    eager, compiled = [], []
    pieces.append((getattr(getattr(fn, "func", fn), "__name__", type(fn).__name__), eager, compiled))
    versions = [(fn, eager), (real_compile(fn, **options), compiled)]
    calls = itertools.count(1)

    def call(*call_args, **call_kwargs):
        close_pending()
        n = next(calls)
        version, times = versions[n % 2 == 0]  # eager first, then in turn
        start = now()
        out = version(*call_args, **call_kwargs)
        pending.append([times if n > args.skip else [], start, now()])
        return out

    return call


torch.compile = alternating_compile
runner.run_script(args.script, args.script_args)
close_pending()
print(f"\n{os.path.basename(args.script)} {' '.join(args.script_args)}, {torch.get_num_threads()} thread(s)")
print("| piece | calls timed | eager ms | compiled ms | compiled / eager |\n| --- | ---: | ---: | ---: | ---: |")
for name, eager, compiled in pieces:
    if eager and compiled:
        timed = len(eager) + len(compiled)
        eager_ms, compiled_ms = statistics.median(eager) * 1e3, statistics.median(compiled) * 1e3
        print(f"| {name} | {timed} | {eager_ms:.3f} | {compiled_ms:.3f} | {compiled_ms / eager_ms:.2f} |")
