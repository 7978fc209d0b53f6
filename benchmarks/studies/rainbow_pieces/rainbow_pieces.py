"""What Rainbow costs beside DQN on a CPU, piece by piece: rainbow_atari.py's update (a prioritized draw, the
distributional loss with its three forward passes, Adam, the new priorities) beside dqn_atari.py's (a uniform draw,
two forward passes, Adam), their Adam steps alone (the dueling, noisy heads hold 4x the weights), their policy steps
of one env, and the replay's draw and priority write alone beside a binary sum tree walked in Python one item at a
time, as most implementations do (CleanRL's among them), and the replay's whole part of an update. Replays of 100,000
transitions, batches of 32, alternating, the median milliseconds of five rounds, 2 threads (the scripts' choice on 2
cores).

    python benchmarks/studies/rainbow_pieces/rainbow_pieces.py
"""

import os
import statistics
import sys
import time
from functools import partial

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # runner.py, two folders up
import runner  # noqa: E402


def milliseconds(fn, calls):
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def report(label, first, second, calls, names=("Rainbow", "DQN")):
    times = [(milliseconds(first, calls), milliseconds(second, calls)) for _ in range(5)]
    a, b = (statistics.median(column) for column in zip(*times))
    print(f"{label}: {names[0]} {a:.2f} ms, {names[1]} {b:.2f} ms", flush=True)


class PythonSumTree:
    """A binary sum tree in a NumPy array, one item at a time: a draw walks the levels, a write climbs them."""

    def __init__(self, capacity):
        self.capacity = 2 ** int(np.ceil(np.log2(capacity)))
        self.tree = np.zeros(2 * self.capacity - 1)

    def update(self, index, value):
        node = index + self.capacity - 1
        self.tree[node] = value
        while node > 0:
            node = (node - 1) // 2
            self.tree[node] = self.tree[2 * node + 1] + self.tree[2 * node + 2]

    def retrieve(self, value):
        node = 0
        while 2 * node + 1 < len(self.tree):
            left = 2 * node + 1
            if value <= self.tree[left]:
                node = left
            else:
                value -= self.tree[left]
                node = left + 1
        return node - (self.capacity - 1)

    def draw_and_write(self, batch_size, rng):
        """A stratified batch, its probabilities, then a new priority for each item."""
        segment = self.tree[0] / batch_size
        indices = [self.retrieve(rng.uniform(segment * i, segment * (i + 1))) for i in range(batch_size)]
        probabilities = np.array([self.tree[i + self.capacity - 1] for i in indices]) / self.tree[0]
        for index, priority in zip(indices, rng.random(batch_size)):
            self.update(index, (priority + 1e-6) ** 0.5)
        return probabilities


def materialized(layer, x):
    """A noisy layer as most implementations write it: the noisy weight matrix made, then one matrix product."""
    if not layer.training:
        return torch.nn.functional.linear(x, layer.weight, layer.bias)
    noise_in, noise_out = layer.noise()
    weight = layer.weight + layer.weight_sigma * torch.outer(noise_out, noise_in)
    return torch.nn.functional.linear(x, weight, layer.bias + layer.bias_sigma * noise_out)


def filled(replay, steps):
    """`steps` single-env steps of random frames into a replay with dqn_atari.py's add()."""
    rng = np.random.default_rng(0)
    obs = rng.integers(0, 256, (1, 4, 84, 84), dtype=np.uint8)
    for step in range(steps):
        done = np.array([rng.random() < 0.01])
        replay.add(step, obs, np.array([1]), np.array([0.0]), done, done, done)
    return replay


if __name__ == "__main__":
    torch.set_num_threads(2)
    torch.manual_seed(0)
    rainbow = runner.run_script(f"{runner.ROOT}/leanrl_scripts/rainbow_atari.py")
    dqn = runner.run_script(f"{runner.ROOT}/leanrl_scripts/dqn_atari.py")
    cpu, steps = torch.device("cpu"), 100_000
    rb = filled(rainbow.FrameReplay(steps, 1, cpu), steps + 10)
    dqn_rb = filled(dqn.FrameReplay(steps, 1, cpu), steps + 10)
    support = torch.linspace(-10, 10, 51)
    q_network, target = rainbow.RainbowNetwork(4, 51), rainbow.RainbowNetwork(4, 51).requires_grad_(False)
    dqn_network, dqn_target = dqn.QNetwork(4), dqn.QNetwork(4).requires_grad_(False)
    lr = torch.tensor(1e-4)
    optimizer = torch.optim.Adam(q_network.parameters(), lr=lr, eps=1.5e-4, fused=True)
    dqn_optimizer = torch.optim.Adam(dqn_network.parameters(), lr=lr, fused=True)
    update = partial(
        rainbow.update,
        sample_fn=rb.sample,
        batch_size=32,
        loss_fn=rainbow.rainbow_loss,
        optimizer=optimizer,
        replay=rb,
        q_network=q_network,
        target_network=target,
        support=support,
    )
    dqn_nets = dict(q_network=dqn_network, target_network=dqn_target, gamma=0.99)
    beta = torch.tensor(0.5)
    report(
        "an update",
        partial(update, beta),
        lambda: dqn.update(*dqn_rb.sample(steps + 10, 32), loss_fn=dqn.td_loss, optimizer=dqn_optimizer, **dqn_nets),
        10,
    )
    report("Adam's step alone", optimizer.step, dqn_optimizer.step, 20)
    weights = [sum(p.numel() for p in net.parameters()) for net in (q_network, dqn_network)]
    print(f"weights: Rainbow {weights[0]:,}, DQN {weights[1]:,}", flush=True)
    obs = torch.randint(0, 256, (1, 4, 84, 84), dtype=torch.uint8)
    with torch.no_grad():
        report(
            "a policy step of 1 env",
            partial(rainbow.policy, obs, q_network=q_network, support=support),
            partial(dqn.policy, obs, q_network=dqn_network),
            50,
        )
    factorized = rainbow.NoisyLinear.forward

    def with_forward(forward, fn):
        rainbow.NoisyLinear.forward = forward
        try:
            return fn()
        finally:
            rainbow.NoisyLinear.forward = factorized

    report(
        "a Rainbow update, noise as two products / as a made matrix",
        partial(with_forward, factorized, partial(update, beta)),
        partial(with_forward, materialized, partial(update, beta)),
        10,
        names=("two products", "made matrix"),
    )
    with torch.no_grad():
        report(
            "a Rainbow policy step of 1 env, noise as two products / as a made matrix",
            partial(with_forward, factorized, partial(rainbow.policy, obs, q_network=q_network, support=support)),
            partial(with_forward, materialized, partial(rainbow.policy, obs, q_network=q_network, support=support)),
            50,
            names=("two products", "made matrix"),
        )
    tree, rng = PythonSumTree(steps), np.random.default_rng(0)
    for index, priority in enumerate(rb.tree.leaves.view(-1)[:steps].tolist()):
        tree.update(index, priority)

    strata = torch.arange(32)

    def device_tree():
        leaf, probability = rb.tree.sample((strata + torch.rand(32)) / 32)
        rb.update_priorities(leaf, torch.rand(32))
        return probability

    def replay_part():
        leaf, weights, *transitions = rb.sample(32, beta)
        rb.update_priorities(leaf, torch.rand(32))
        return transitions

    report(
        "the replay's part of a Rainbow update: the draw with its n-step transitions and the priority write",
        replay_part,
        device_tree,
        50,
        names=("with transitions", "the tree alone"),
    )
    report(
        "a batch's stratified draw and priority write, the tree alone",
        device_tree,
        partial(tree.draw_and_write, 32, rng),
        50,
        names=("device tree", "Python sum tree"),
    )
