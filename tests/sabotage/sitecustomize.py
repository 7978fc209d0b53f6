"""Breaks the learner of a script run with this folder first on its PYTHONPATH (`pytest --break-learner`): every
optimizer step finds its gradients zeroed, so no weight learns from the data. Python imports this module as it
starts (tests/script_server.py does the same for the runs it forks), before the script, as a user's site
customisation would: the script itself is unchanged. Every learning test must fail under it."""

from torch.optim.optimizer import register_optimizer_step_pre_hook


def zero_gradients(optimizer, args, kwargs):
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            if parameter.grad is not None:
                parameter.grad.zero_()


register_optimizer_step_pre_hook(zero_gradients)
