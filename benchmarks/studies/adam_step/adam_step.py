"""Where the Adam step is fastest: fused and eager, as the scripts step it outside the compiled loss, or compiled
(torch.compile of a plain Adam's step, inductor's kernels). Prints the median microseconds of each, three times, for
the twin critics of SAC and TD3 on HalfCheetah and for DQN's CartPole network, their gradients set.

    python benchmarks/studies/adam_step/adam_step.py [THREADS]
"""

import statistics
import sys
import time

import torch


def stacked_layers(sizes, stack=2):
    """Weights and biases of `stack` MLPs of `sizes`, stacked as the scripts' critic ensemble stacks them."""
    shapes = [*zip(sizes, sizes[1:]), *((1, n_out) for n_out in sizes[1:])]  # the weights', then the biases'
    return [torch.randn(stack, *shape, requires_grad=True) for shape in shapes]


def median_microseconds(step, params, calls=1000):
    for param in params:
        param.grad = torch.randn_like(param)
    for _ in range(50):  # warm-up, compilation included
        step()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


if __name__ == "__main__":
    torch.set_num_threads(int((sys.argv + ["1"])[1]))  # THREADS, 1 by default
    for name, sizes in (("SAC/TD3 critics, 23-256-256-1 x 2", [23, 256, 256, 1]), ("DQN, 4-120-84-2", [4, 120, 84, 2])):
        params, copies = stacked_layers(sizes), stacked_layers(sizes)
        fused = torch.optim.Adam(params, lr=torch.tensor(1e-3), fused=True)
        compiled = torch.compile(torch.optim.Adam(copies, lr=torch.tensor(1e-3), foreach=False).step)
        for _ in range(3):
            eager_us, compiled_us = median_microseconds(fused.step, params), median_microseconds(compiled, copies)
            print(
                f"{name}, {torch.get_num_threads()} thread(s): "
                f"fused eager {eager_us:.1f} us, compiled {compiled_us:.1f} us"
            )
