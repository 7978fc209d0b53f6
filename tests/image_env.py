"""Envs made through gymnasium's "module:EnvId" ids that the scripts must refuse with one clear error line: a tiny env
with image observations and continuous actions (`tests.image_env:ImageObs-v0`), an id whose making raises an
ImportError (`tests.image_env:MovedAway-v0`), as gymnasium's MuJoCo v2 and v3 ids do, and one whose making raises
anything else (`tests.image_env:Broken-v0`), as ALE does for a game whose ROM is missing."""

import gymnasium as gym
import numpy as np


class ImageObsEnv(gym.Env):
    observation_space = gym.spaces.Box(0, 255, (8, 8, 3), np.uint8)
    action_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)

    def __init__(self, render_mode=None):
        self.render_mode = render_mode

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        return self.observation_space.sample(), {}

    def step(self, action):
        return self.observation_space.sample(), 0.0, False, False, {}


gym.register("ImageObs-v0", entry_point=ImageObsEnv, max_episode_steps=10)


def moved_away(render_mode=None):
    raise ImportError("this env moved to another package: pip install it")


gym.register("MovedAway-v0", entry_point=moved_away)


def broken(render_mode=None):
    raise RuntimeError("the ROM of this game is missing")


gym.register("Broken-v0", entry_point=broken)
