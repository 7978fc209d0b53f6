"""Why --compile is slower than eager on some CPUs: inductor's kernel that stores a boolean mask.

In a backward pass through frozen weights (the actor's loss through the critics), the compiled graph saves
ReLU masks as booleans, and on the CPU where the README's table was made that store costs over 10x eager's:
    python benchmarks/studies/inductor_relu_mask/inductor_relu_mask.py
prints eager and compiled microseconds for ReLU with its mask, and for ReLU alone, on a 256x256 activation.
"""

import time

import torch


def relu_and_mask(x):
    return x.relu(), x <= 0


def relu_only(x):
    return x.relu() * 2


def microseconds(fn, x, calls=2000):
    for _ in range(50):
        fn(x)
    start = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter() - start) / calls * 1e6


if __name__ == "__main__":
    activation = torch.randn(256, 256)
    for fn in (relu_and_mask, relu_only):
        eager, compiled = microseconds(fn, activation), microseconds(torch.compile(fn), activation)
        print(f"{fn.__name__}: eager {eager:.1f} us, compiled {compiled:.1f} us ({compiled / eager:.1f}x)")
