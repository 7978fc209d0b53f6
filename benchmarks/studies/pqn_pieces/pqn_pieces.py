"""What bounds PQN's lead on a CPU: each piece of ours (the scripts' own `update` and `policy`) beside the same piece
as CleanRL's pqn.py and pqn_atari_envpool.py write it (nn.LayerNorm on the contiguous layout, a float learning rate,
the greedy value gathered by index), and RAdam's step alone. Alternating, the median milliseconds of five rounds;
Breakout on 2 threads (the scripts' choice on 2 cores), CartPole on 1.

    python benchmarks/studies/pqn_pieces/pqn_pieces.py
"""

import os
import statistics
import sys
import time
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # runner.py, two folders up
import runner  # noqa: E402


def milliseconds(fn, calls):
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def cleanrl_update(q_network, optimizer, obs, actions, returns):
    old_val = q_network(obs).gather(1, actions.unsqueeze(-1).long()).squeeze()
    loss = F.mse_loss(returns, old_val)
    optimizer.zero_grad()
    loss.backward()
    nn.utils.clip_grad_norm_(q_network.parameters(), 10.0)
    optimizer.step()


def cleanrl_policy(q_network, obs, num_actions, epsilon=0.3):
    random_actions = torch.randint(0, num_actions, (len(obs),))
    with torch.no_grad():
        q_values = q_network(obs)
        max_actions = torch.argmax(q_values, dim=1)
        q_values[torch.arange(len(obs)), max_actions].flatten()
    explore = torch.rand((len(obs),)) < epsilon
    return torch.where(explore, random_actions, max_actions).cpu().numpy()


def our_policy(script, q_network, obs, epsilon):
    with torch.no_grad():
        return script.policy(obs, epsilon, q_network=q_network)[0].cpu().numpy()


class Frames(nn.Module):
    """CleanRL's Atari network: nn.LayerNorm, the contiguous layout, frames divided by 255 in its forward."""

    def __init__(self, network):
        super().__init__()
        self.network = network

    def forward(self, obs):
        return self.network(obs / 255.0)


def report(label, ours, theirs, calls):
    times = [(milliseconds(ours, calls), milliseconds(theirs, calls)) for _ in range(5)]
    mine, cleanrl = (statistics.median(column) for column in zip(*times))
    print(f"{label}: ours {mine:.3f} ms, CleanRL's {cleanrl:.3f} ms", flush=True)


def compare(name, threads, rows, envs):
    """Both sides' update, RAdam step and policy step on the network of `name`, `rows` a minibatch, `envs` a step."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    script = runner.run_script(f"{runner.ROOT}/leanrl_scripts/{name}")
    atari = name != "pqn.py"
    ours = script.QNetwork(4) if atari else script.QNetwork(4, 2)
    theirs = script.QNetwork(4) if atari else script.QNetwork(4, 2)
    if atari:
        layers = [
            nn.LayerNorm(layer.normalized_shape) if isinstance(layer, nn.LayerNorm) else layer
            for layer in theirs.network
        ]
        theirs = Frames(nn.Sequential(*layers).to(memory_format=torch.contiguous_format))
        obs = torch.randint(0, 256, (rows, 4, 84, 84), dtype=torch.uint8)
    else:
        obs = torch.randn(rows, 4)
    actions, returns = torch.randint(0, 2, (rows,)), torch.randn(rows)
    optimizer = torch.optim.RAdam(ours.parameters(), lr=torch.tensor(2.5e-4))
    their_optimizer = torch.optim.RAdam(theirs.parameters(), lr=2.5e-4)
    update = partial(script.update, loss_fn=script.td_loss, q_network=ours, optimizer=optimizer, max_grad_norm=10.0)
    batch = script.Batch(obs.contiguous(memory_format=torch.channels_last) if atari else obs, actions, returns)
    stored = obs.float() if atari else obs  # CleanRL's rollout stores the frames as floats
    game = "Breakout" if atari else "CartPole"
    their_update = partial(cleanrl_update, theirs, their_optimizer, stored, actions, returns)
    report(f"{game}: an update of {rows} rows", partial(update, batch), their_update, 5 if atari else 200)
    report(f"{game}: RAdam's step", optimizer.step, their_optimizer.step, 20 if atari else 500)
    policy = partial(our_policy, script, ours, obs[:envs], torch.tensor(0.3))
    their_policy = partial(cleanrl_policy, theirs, stored[:envs], 2)
    report(f"{game}: a policy step of {envs} envs", policy, their_policy, 20 if atari else 2000)


if __name__ == "__main__":
    compare("pqn_atari_envpool.py", threads=2, rows=256, envs=8)
    compare("pqn.py", threads=1, rows=128, envs=4)
