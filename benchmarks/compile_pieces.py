"""Does each compiled piece gain on this machine? Runs a script with --compile in this process, with torch.compile
replaced by a wrapper that alternates each piece's calls between the compiled and the eager function (the same
state, the same inputs, one call each in turn) and times them; prints each piece's median time both ways. A loss
piece is timed with the update it belongs to: from its call to the last optimizer step before the next piece's call,
so its backward (compiled with it, or eager) and the Adam step are in its row.

    python benchmarks/compile_pieces.py [--threads N] SCRIPT.py --compile [SCRIPT ARGS...]
"""

import argparse
import os
import runpy
import statistics
import sys
import time

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
pieces = []
pending = []  # the call being timed: [piece, compiled or not, start, end]


def now():
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def close_pending():
    if pending:
        piece, use_compiled, start, end = pending.pop()
        if piece["calls"] > args.skip:
            piece["compiled" if use_compiled else "eager"].append(end - start)


def step_taken(optimizer, step_args, step_kwargs):  # an optimizer step ends the timed call of the loss before it
    if pending:
        pending[0][3] = now()


register_optimizer_step_post_hook(step_taken)


def alternating_compile(fn=None, disable=False, **options):
    if fn is None:  # used as @torch.compile(...)
        return lambda f: alternating_compile(f, disable=disable, **options)
    if disable:
        return fn
    compiled = real_compile(fn, **options)
    piece = {"name": getattr(getattr(fn, "func", fn), "__name__", type(fn).__name__), "calls": 0}
    piece.update(eager=[], compiled=[])
    pieces.append(piece)

    def call(*call_args, **call_kwargs):
        close_pending()
        piece["calls"] += 1
        use_compiled = piece["calls"] % 2 == 0
        start = now()
        out = (compiled if use_compiled else fn)(*call_args, **call_kwargs)
        pending.append([piece, use_compiled, start, now()])
        return out

    return call


torch.compile = alternating_compile
sys.argv = [args.script, *args.script_args]
sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))  # as `python script.py`: the module beside it
try:
    runpy.run_path(args.script, run_name="__main__")
except SystemExit as stop:
    if stop.code:
        raise
close_pending()
print(f"\n{os.path.basename(args.script)} {' '.join(args.script_args)}, {torch.get_num_threads()} thread(s)")
print("| piece | calls timed | eager ms | compiled ms | compiled / eager |\n| --- | ---: | ---: | ---: | ---: |")
for piece in pieces:
    if piece["eager"] and piece["compiled"]:
        eager, compiled = (statistics.median(piece[k]) * 1e3 for k in ("eager", "compiled"))
        timed = len(piece["eager"]) + len(piece["compiled"])
        print(f"| {piece['name']} | {timed} | {eager:.3f} | {compiled:.3f} | {compiled / eager:.2f} |")
