"""Runs a script with torch.compile replaced by a probe, to find host syncs in the pieces it compiles.

    HOST_SYNC_LOG=out.json [HOST_SYNC_PIECES=policy,update] \
        python tests/host_sync_probe.py leanrl_scripts/<script>.py --compile [flags]
Every function the script hands to torch.compile runs eagerly under a TorchFunctionMode that records each call
that makes the host wait for the device on CUDA: reading a value (.item(), .tolist(), bool(), float(), printing),
copying to the host (.cpu(), .numpy()), or an op whose output shape depends on the data (nonzero, boolean-mask
indexing, unique). The script's functions named in $HOST_SYNC_PIECES run under it too when they are not handed to
torch.compile (the updates around the compiled losses: their backward, clipping and Adam step run eagerly, and in
a CUDA graph with --cudagraphs, so they must be free of syncs all the same). At exit, {piece name: [calls]} goes to
$HOST_SYNC_LOG. On a CPU these calls cost nothing, which is why a test has to look for them: on a GPU each one stalls
the stream and breaks CUDA graph capture.
"""

import atexit
import json
import os
import runpy
import sys
import traceback

import torch
from torch.overrides import TorchFunctionMode

T = torch.Tensor
SYNCS = {
    T.item,
    T.tolist,
    T.__bool__,
    T.__float__,
    T.__int__,
    T.__index__,
    T.__repr__,
    T.__format__,
    T.cpu,
    T.numpy,
    torch.nonzero,
    T.nonzero,
    torch.argwhere,
    torch.masked_select,
    T.masked_select,
    torch.unique,
    T.unique,
    torch.repeat_interleave,
    T.repeat_interleave,
}
# Reads of tensors that live on the host on every device: an optimizer that is neither capturable nor fused (RAdam
# has no fused kernel) keeps its step count on the CPU, parameters on CUDA or not, and reads it with .item()
HOST_READS = {("optimizer.py", "_get_value")}
calls = {}
active = set()  # the pieces running under the probe now


class HostSyncs(TorchFunctionMode):
    def __init__(self, piece):
        super().__init__()
        self.found = calls.setdefault(piece, [])

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        bool_index = func in (T.__getitem__, T.__setitem__) and any(
            isinstance(i, T) and i.dtype == torch.bool for i in (args[1] if isinstance(args[1], tuple) else (args[1],))
        )
        where = traceback.extract_stack(limit=2)[0]  # the line that made the call
        if (func in SYNCS or bool_index) and (os.path.basename(where.filename), where.name) not in HOST_READS:
            self.found.append(f"{getattr(func, '__name__', func)} at {os.path.basename(where.filename)}:{where.lineno}")
        return func(*args, **kwargs)


def probe_compile(fn=None, disable=False, **options):
    if fn is None:  # used as @torch.compile(...)
        return lambda f: probe_compile(f, disable=disable, **options)
    if disable:  # torch.compile(fn, disable=True) is fn: the script runs without --compile
        return fn
    piece = getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", repr(fn))

    def run(*args, **kwargs):
        with HostSyncs(piece):
            active.add(piece)
            try:
                return fn(*args, **kwargs)
            finally:
                active.discard(piece)

    return run


def probe_eager_pieces(script, pieces):
    """Enters the probe when one of the script's functions named in `pieces` starts and leaves it when that call
    returns, unless the piece already runs under the probe (handed to torch.compile)."""
    paths, entered = {script, os.path.abspath(script)}, {}  # the code's file name is the path as given to runpy

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_name in pieces and code.co_name not in active and code.co_filename in paths:
            mode = HostSyncs(code.co_name)
            mode.__enter__()
            active.add(code.co_name)
            entered[frame] = mode
        elif event == "return" and frame in entered:
            entered.pop(frame).__exit__(None, None, None)
            active.discard(code.co_name)

    sys.setprofile(profile)


if __name__ == "__main__":
    torch.compile = probe_compile
    log = os.environ["HOST_SYNC_LOG"]

    @atexit.register
    def write_log():
        with open(log, "w") as f:
            json.dump(calls, f)

    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # as `python script.py`: the module beside it
    if os.environ.get("HOST_SYNC_PIECES"):
        probe_eager_pieces(sys.argv[0], set(os.environ["HOST_SYNC_PIECES"].split(",")))
    runpy.run_path(sys.argv[0], run_name="__main__")
