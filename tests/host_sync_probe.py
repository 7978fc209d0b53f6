"""Runs a script with torch.compile replaced by a probe, to find host syncs in the pieces it compiles.

    HOST_SYNC_LOG=out.json python tests/host_sync_probe.py leanrl_scripts/<script>.py --compile [flags]
Every function the script hands to torch.compile runs eagerly under a TorchFunctionMode that records each call
that makes the host wait for the device on CUDA: reading a value (.item(), .tolist(), bool(), float(), printing),
copying to the host (.cpu(), .numpy()), or an op whose output shape depends on the data (nonzero, boolean-mask
indexing, unique). At exit, {piece name: [calls]} goes to $HOST_SYNC_LOG. On a CPU these calls cost nothing,
which is why a test has to look for them: on a GPU each one stalls the stream and breaks CUDA graph capture.
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
SYNCS = {T.item, T.tolist, T.__bool__, T.__float__, T.__int__, T.__index__, T.__repr__, T.__format__, T.cpu, T.numpy,
         torch.nonzero, T.nonzero, torch.argwhere, torch.masked_select, T.masked_select, torch.unique, T.unique,
         torch.repeat_interleave, T.repeat_interleave}
calls = {}


class HostSyncs(TorchFunctionMode):
    def __init__(self, piece):
        super().__init__()
        self.found = calls.setdefault(piece, [])

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        bool_index = func in (T.__getitem__, T.__setitem__) and any(
            isinstance(i, T) and i.dtype == torch.bool for i in (args[1] if isinstance(args[1], tuple) else (args[1],)))
        if func in SYNCS or bool_index:
            where = traceback.extract_stack(limit=2)[0]  # the line that made the call
            self.found.append(f"{getattr(func, '__name__', func)} at {os.path.basename(where.filename)}:{where.lineno}")
        return func(*args, **kwargs)


def probe_compile(fn=None, **options):
    if fn is None:  # used as @torch.compile(...)
        return lambda f: probe_compile(f, **options)
    piece = getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", repr(fn))

    def run(*args, **kwargs):
        with HostSyncs(piece):
            return fn(*args, **kwargs)

    return run


if __name__ == "__main__":
    torch.compile = probe_compile
    log = os.environ["HOST_SYNC_LOG"]

    @atexit.register
    def write_log():
        with open(log, "w") as f:
            json.dump(calls, f)

    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
