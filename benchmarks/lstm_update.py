"""The update phase of PPO-LSTM, one minibatch at a time: the CNN alone, the padded one-call LSTM, the loop.

    python benchmarks/lstm_update.py [--env-rows 2] [--num-steps 128] [--episode-length 60] [--repeats 7]
prints one JSON line with the median milliseconds of a forward+backward+Adam step on one minibatch for
"cnn_only" (the CNN's features, no LSTM: the floor), "padded" and "loop", alternated so that drift hits all
three alike, and the padded/real steps of the done pattern (episode starts drawn with the given mean length).
"""

import argparse
import json
import statistics
import time
from functools import partial

import numpy as np
import torch

import runner

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
number = partial(parser.add_argument, type=int)
number("--env-rows", default=2, help="env rows per minibatch (CleanRL: 8 envs / 4)")
number("--num-steps", default=128)
parser.add_argument("--episode-length", type=float, default=60.0, help="mean steps between episode starts")
number("--repeats", default=7)
args = parser.parse_args()
script = runner.run_script(f"{runner.ROOT}/leanrl_scripts/ppo_atari_lstm.py")

torch.manual_seed(0)
steps, rows = args.num_steps, args.env_rows
agent = script.Agent(4)
optimizer = torch.optim.Adam(agent.parameters(), lr=torch.tensor(2.5e-4), eps=1e-5, fused=True)
starts = (np.random.default_rng(0).random((steps, rows)) < 1 / args.episode_length).astype(np.float32)
dones = np.zeros_like(starts)
dones[:-1] = starts[1:]  # the reset steps before them
layout = [*map(torch.from_numpy, script.segment_layout(starts))]
minibatch = script.Minibatch(
    torch.randint(256, (steps, rows, 1, 84, 84), dtype=torch.uint8),
    *map(torch.from_numpy, (dones, starts)),
    *torch.zeros(2, 1, rows, 128),  # the LSTM's initial h and c
    torch.randint(4, (steps, rows)),
    *torch.randn(4, steps, rows),  # log-probabilities, advantages, returns, values
    *layout,
)


def cnn_only():
    loss = agent.features(minibatch.obs).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


steps_of = {"cnn_only": cnn_only}
for impl in ("padded", "loop"):
    settings = script.Args(lstm_impl=impl, max_grad_norm=0.5)
    steps_of[impl] = partial(
        script.update, minibatch, loss_fn=script.ppo_loss, agent=agent, optimizer=optimizer, args=settings
    )
times = {name: [] for name in steps_of}
for _ in range(args.repeats + 1):  # the first round warms up, left out below
    for name, step in steps_of.items():
        start = time.perf_counter()
        step()
        times[name].append(1000 * (time.perf_counter() - start))
medians = {name: round(statistics.median(ms[1:]), 2) for name, ms in times.items()}
print(
    json.dumps(
        dict(
            medians,
            env_rows=rows,
            num_steps=steps,
            episode_starts=int(starts.sum()),
            padded_steps=layout[0].numel(),
            real_steps=steps * rows,
            torch_threads=torch.get_num_threads(),
        )
    )
)
