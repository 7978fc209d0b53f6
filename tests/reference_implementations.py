"""Plain implementations the tests hold the scripts' pieces against: written for reading, not speed."""

import torch


def reference_gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda):
    """CleanRL's reverse loop."""
    advantages, last = torch.zeros_like(rewards), 0
    for t in reversed(range(len(rewards))):
        if t == len(rewards) - 1:
            next_nonterminal, next_values = 1.0 - next_done, next_value
        else:
            next_nonterminal, next_values = 1.0 - dones[t + 1], values[t + 1]
        delta = rewards[t] + gamma * next_values * next_nonterminal - values[t]
        advantages[t] = last = delta + gamma * gae_lambda * next_nonterminal * last
    return advantages, advantages + values


def plain_projection(atoms, probs, support):
    """CleanRL's projection (rainbow_atari.py, c51_atari.py): floor and ceiling, index_add_ one row at a time."""
    v_min, v_max, n_atoms = support[0].item(), support[-1].item(), len(support)
    delta_z = (v_max - v_min) / (n_atoms - 1)
    b = (atoms.clamp(v_min, v_max) - v_min) / delta_z
    lower, upper = b.floor().clamp(0, n_atoms - 1), b.ceil().clamp(0, n_atoms - 1)
    d_m_l = (upper + (lower == b).float() - b) * probs
    d_m_u = (b - lower) * probs
    target = torch.zeros_like(probs)
    for i in range(len(probs)):
        target[i].index_add_(0, lower[i].long(), d_m_l[i])
        target[i].index_add_(0, upper[i].long(), d_m_u[i])
    return target
