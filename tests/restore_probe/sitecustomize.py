"""What a resumed run restored, for tests/test_resume_distributed.py: each process of a run with this folder first on
its PYTHONPATH writes, at its first optimizer step (before it, nothing changes the weights or the optimizer's state
that --resume restored), its parameters, its optimizer's state and the replay of a script that keeps one (the name
`replay` in its main block), to LEANRL_PROBE_RESTORED/<pid>.pt. Python imports this module as it starts, as it does
tests/sabotage's: the script itself is unchanged."""

import os
import sys

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook


def record(optimizer, args, kwargs):
    path = os.path.join(os.environ["LEANRL_PROBE_RESTORED"], f"{os.getpid()}.pt")
    if os.path.exists(path):
        return
    replay = getattr(sys.modules["__main__"], "replay", None)
    params = [param.detach().cpu() for group in optimizer.param_groups for param in group["params"]]
    state = optimizer.state_dict()["state"]
    torch.save(dict(params=params, optimizer=state, replay=replay and replay.state_dict()), path + ".tmp")
    os.replace(path + ".tmp", path)


register_optimizer_step_pre_hook(record)
