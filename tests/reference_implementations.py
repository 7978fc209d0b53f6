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
