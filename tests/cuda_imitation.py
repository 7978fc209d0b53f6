"""Runs a script with three things only CUDA does imitated on a CPU (on a GPU, done for real), and writes what it saw.

    CUDA_IMITATION_LOG=out.json [CUDA_IMITATION_VIEWS=agent_view=agent,...] \
        python tests/cuda_imitation.py leanrl_scripts/<script>.py [flags]

- An RNN flattens its weights as cuDNN does: `flatten_parameters` (called when the module moves, and by its first
  forward after its weight tensors changed) copies them into a new buffer and points the module's tensors there. On
  a CPU it does nothing, so an acting view of an LSTM shares the learner's weights here and stops sharing on CUDA.
- A tensor torch.load returns refuses `.numpy()` (and np.asarray), as a tensor loaded onto the GPU does.
- The script's copies to a device (Tensor.to) from pageable host memory that are not asked to be asynchronous are
  recorded, with their lines: on CUDA each makes the host wait for every kernel queued before it. Here `device` is
  the CPU and the copy costs nothing. pin_memory (which needs CUDA) gives a copy marked as pinned.
At exit the log holds {"copies": [lines], "views": {view: {"equal": bool, "learner_changed": bool}}}: each acting view
named in $CUDA_IMITATION_VIEWS (an attribute path of the script's globals, = the learner's) against its learner, the
weights the view's forward uses (an RNN's flat weights among them), and whether the learner trained since the run
opened (else equal views would prove nothing).
"""

import atexit
import json
import os
import runpy
import sys
import traceback
from functools import reduce

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

log = {"copies": [], "views": {}}


def copying_flatten(rnn):
    """cuDNN's _cudnn_rnn_flatten_weight: one new buffer, each weight copied in and its tensor pointed at it."""
    weights = rnn._flat_weights
    if not all(isinstance(w, torch.Tensor) for w in weights):
        return
    with torch.no_grad():
        buffer = torch.cat([w.detach().reshape(-1) for w in weights])
        offset = 0
        for w in weights:
            w.set_(buffer.untyped_storage(), offset, w.shape)
            offset += w.numel()


class LoadedOnDevice(torch.Tensor):
    """A tensor as torch.load(map_location=a GPU) gives it: .cpu() first, or .numpy() fails."""

    def numpy(self, *args, **kwargs):
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor first.")

    def __array__(self, *args, **kwargs):
        return self.numpy()

    def cpu(self, *args, **kwargs):
        return super().cpu(*args, **kwargs).as_subclass(torch.Tensor)

    def __deepcopy__(self, memo):  # Optimizer.load_state_dict deep-copies the saved settings (a tensor lr)
        return self.as_subclass(torch.Tensor).clone().as_subclass(LoadedOnDevice)

    def __reduce_ex__(self, protocol):  # saved again (a resumed run's model.pt, its next snapshot) as a plain tensor
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)


real_load, real_to, real_pin = torch.load, torch.Tensor.to, torch.Tensor.pin_memory


def load_onto_device(*args, **kwargs):
    return tree_map(
        lambda x: x.as_subclass(LoadedOnDevice) if type(x) is torch.Tensor else x, real_load(*args, **kwargs)
    )


def pin_memory(tensor, *args, **kwargs):  # no pinned memory without CUDA: the same copy, marked as pinned
    copy = tensor.clone()
    copy.pinned_here = True
    return copy


def to(tensor, *args, **kwargs):  # the script's own Tensor.to calls (not those of the libraries it calls)
    device_given = any(isinstance(a, torch.device | str) for a in args) or "device" in kwargs
    blocking = not kwargs.get("non_blocking", False) and not (len(args) > 2 and args[2] is True)
    where = traceback.extract_stack(limit=2)[0]
    in_script = os.path.basename(where.filename) == os.path.basename(sys.argv[0])
    pageable = tensor.device.type == "cpu" and not (hasattr(tensor, "pinned_here") or tensor.is_pinned())
    if in_script and device_given and blocking and pageable:
        log["copies"].append(f"{os.path.basename(where.filename)}:{where.lineno}")
    return real_to(tensor, *args, **kwargs)


def attribute(namespace, path):
    first, *rest = path.split(".")
    return reduce(getattr, rest, namespace[first])


def weights_used(module):
    """The tensors a module's forward reads: its parameters and buffers, and an RNN's flat weights."""
    found = dict(module.state_dict(keep_vars=True))
    for name, sub in module.named_modules():
        if isinstance(sub, nn.RNNBase):
            found.update({f"{name}._flat_weights.{i}": w for i, w in enumerate(sub._flat_weights)})
    return {name: value.detach().clone() for name, value in found.items()}


if __name__ == "__main__":
    torch.Tensor.to = to
    if not torch.cuda.is_available():  # on a GPU, cuDNN, the loads and the pinned memory are the real ones
        nn.RNNBase.flatten_parameters = copying_flatten
        torch.load, torch.Tensor.pin_memory = load_onto_device, pin_memory
    pairs = [pair.split("=") for pair in os.environ.get("CUDA_IMITATION_VIEWS", "").split(",") if pair]
    started = {}

    @atexit.register
    def write_log():
        with open(os.environ["CUDA_IMITATION_LOG"], "w") as f:
            json.dump(log, f)

    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # as `python script.py`: the module beside it
    if os.path.exists(os.path.join(sys.path[0], "run_bookkeeping.py")):
        import run_bookkeeping

        real_start = run_bookkeeping.Run.start

        def start_and_note(run, *args, **kwargs):  # the learners' weights as the run starts
            namespace = sys.modules["__main__"].__dict__
            started.update({learner: weights_used(attribute(namespace, learner)) for _, learner in pairs})
            return real_start(run, *args, **kwargs)

        run_bookkeeping.Run.start = start_and_note
        real_end = run_bookkeeping.Run.write_and_evaluate

        def end_and_note(run, *args, **kwargs):  # the script's names as it ends: it exits with the code this returns
            namespace.update(sys.modules["__main__"].__dict__)
            return real_end(run, *args, **kwargs)

        run_bookkeeping.Run.write_and_evaluate = end_and_note
    namespace = {}
    code = 0
    try:
        namespace.update(runpy.run_path(sys.argv[0], run_name="__main__"))
    except SystemExit as exit:
        code = exit.code
    for view_path, learner_path in pairs:
        view, learner = weights_used(attribute(namespace, view_path)), weights_used(attribute(namespace, learner_path))
        shared = [name for name in view if name in learner]
        before = started.get(learner_path)  # none without a Run
        changed = before and any(not torch.equal(learner[name], before[name]) for name in learner)
        equal = bool(shared) and all(torch.equal(view[name], learner[name]) for name in shared)
        log["views"][view_path] = {"equal": equal, "learner_changed": changed, "compared": len(shared)}
    sys.exit(code)
