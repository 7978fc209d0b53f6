"""What a run meets where no safe point comes, for the signal tests, made through gymnasium's "module:EnvId" ids (the
script imports this module when it makes the env): `tests.signal_probe:BlockingCartPole-v0`, a CartPole whose step
blocks for ten minutes once it reached LEANRL_PROBE_BLOCK_AT steps; and with LEANRL_PROBE_SLOW_COMPILE=1, a compile
that takes ten minutes (a callback at torch.compile's start sleeps). Each writes the file LEANRL_PROBE_MARKER first."""

import os
import time

import gymnasium as gym


def stall():
    with open(os.environ["LEANRL_PROBE_MARKER"], "w"):
        pass
    time.sleep(600)


class BlockingCartPole(gym.Wrapper):
    def __init__(self, render_mode=None):
        super().__init__(gym.make("CartPole-v1", render_mode=render_mode))
        self.steps, self.block_at = 0, int(os.environ.get("LEANRL_PROBE_BLOCK_AT", 10**9))

    def step(self, action):
        self.steps += 1
        if self.steps == self.block_at:
            stall()
        return self.env.step(action)


gym.register("BlockingCartPole-v0", entry_point=BlockingCartPole, max_episode_steps=500)

if os.environ.get("LEANRL_PROBE_SLOW_COMPILE") == "1":
    from torch._dynamo.callback import on_compile_start

    on_compile_start(lambda _: stall())
