"""The update phase of PPO-LSTM, one minibatch at a time: the CNN alone, the padded one-call LSTM, the loop.

    python benchmarks/lstm_update.py [--env-rows 2] [--num-steps 128] [--episode-length 60] [--repeats 7]
prints one JSON line with the median milliseconds of a forward+backward+Adam step on one minibatch for
"cnn_only" (the CNN's features, no LSTM: the floor), "padded" and "loop", alternated so that drift hits all
three alike, and the padded/real steps of the done pattern (episode starts drawn with the given mean length).
"""

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from functools import partial

import numpy as np
import torch


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env-rows", type=int, default=2, help="env rows per minibatch (CleanRL: 8 envs / 4)")
    parser.add_argument("--num-steps", type=int, default=128)
    parser.add_argument("--episode-length", type=float, default=60.0, help="mean steps between episode starts")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "leanrl_scripts", "ppo_atari_lstm.py")
    sys.path.insert(0, os.path.dirname(path))  # the run bookkeeping module beside it
    spec = importlib.util.spec_from_file_location("ppo_atari_lstm", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    steps, rows = args.num_steps, args.env_rows
    agent = script.Agent(4)
    optimizer = torch.optim.Adam(agent.parameters(), lr=torch.tensor(2.5e-4), eps=1e-5, fused=True)
    starts = (rng.random((steps, rows)) < 1 / args.episode_length).astype(np.float32)
    dones = np.concatenate([starts[1:], np.zeros((1, rows), dtype=np.float32)])  # the reset steps before them
    layout = [torch.from_numpy(a) for a in script.segment_layout(starts)]
    minibatch = script.Minibatch(
        torch.randint(0, 256, (steps, rows, 1, 84, 84), dtype=torch.uint8),
        torch.from_numpy(dones),
        torch.from_numpy(starts),
        torch.zeros(1, rows, 128),
        torch.zeros(1, rows, 128),
        torch.randint(0, 4, (steps, rows)),
        *(torch.randn(steps, rows) for _ in range(4)),
        *layout,
    )

    def cnn_only():
        loss = agent.features(minibatch.obs).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    steps_of = {"cnn_only": cnn_only}
    for impl in ("padded", "loop"):
        loss_fn = partial(script.ppo_loss, agent=agent, args=script.Args(lstm_impl=impl))
        steps_of[impl] = partial(
            script.update, minibatch, loss_fn=loss_fn, agent=agent, optimizer=optimizer, max_grad_norm=0.5
        )
    times = {name: [] for name in steps_of}
    for step in steps_of.values():
        step()  # warm-up
    for _ in range(args.repeats):
        for name, step in steps_of.items():
            start = time.perf_counter()
            step()
            times[name].append(1000 * (time.perf_counter() - start))
    result = {name: statistics.median(values) for name, values in times.items()}
    result.update(
        env_rows=rows,
        num_steps=steps,
        episode_starts=int(starts.sum()),
        padded_steps=layout[0].numel(),
        real_steps=steps * rows,
        torch_threads=torch.get_num_threads(),
    )
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    sys.exit(main())
