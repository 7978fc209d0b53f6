"""A stand-in for envpool with two small Atari-shaped tasks, for the image scripts' learning tests in CI.

A test puts this folder first on a run's PYTHONPATH: the script's `import envpool` then finds this module, as it
would find a user's patched envpool, and makes one of the tasks below through its own env code path. What the
scripts meet of real envpool's Atari games (Breakout-v5) is held here and checked against the real one by
tests/test_standin_envpool.py: frames of (stack_num, 84, 84) uint8 with the newest last, a Discrete(4) action
space, the info keys and their dtypes, an episode ended at each lost life while info["terminated"] marks the game's
end, the reset step after an episode's end (its action ignored, reward 0, the frame stack kept after a lost life),
and the async send/recv with info["env_id"].

- Cue-v5: each frame lights one of four quadrants; pressing that quadrant's action scores 1, any other 0. A life is
  16 steps, a game 2 lives: a random policy scores 8 a game, a perfect one 32. What it takes is a CNN that reads
  the newest frame: the image pipeline (storage, frame order, the network, the update) has to work.
- Recall-v5: a quadrant lit once, then blank frames, then a frame with a bar across its middle: the action of the
  quadrant shown at the start scores 1 there and ends the game (one life; a random policy scores 0.25). The cue is
  RECALL_DELAY frames before the question, more than a stack of 4 frames holds: only a memory solves it.
"""

import gymnasium as gym
import numpy as np

SIZE = 84
NUM_ACTIONS = 4
LIFE_STEPS = 16  # Cue-v5
RECALL_DELAY = 6  # Recall-v5: blank frames between the cue and the question
LIVES = {"Cue-v5": 2, "Recall-v5": 1}
TASKS = ("Cue-v5", "Recall-v5")


class AtariEnvSpec:
    """What the scripts check of envpool.make_spec: the class's name says an Atari game."""

    def __init__(self, task_id):
        self.task_id = task_id


def list_all_envs():
    return list(TASKS)


def make_spec(task_id):
    return AtariEnvSpec(task_id)


def make(
    task_id,
    env_type="gymnasium",
    num_envs=1,
    batch_size=None,
    num_threads=None,
    seed=0,
    stack_num=4,
    episodic_life=True,
    reward_clip=True,
    render_mode=None,
    **unused,
):
    if task_id not in TASKS:
        raise ValueError(f"{task_id} is not one of the stand-in's tasks {TASKS}")
    if env_type != "gymnasium":
        raise ValueError("the stand-in makes gymnasium-style envs only")
    return CueEnvPool(task_id, num_envs, batch_size or num_envs, seed, stack_num, episodic_life, render_mode)


def quadrant_frame(quadrant):
    frame = np.zeros((SIZE, SIZE), np.uint8)
    row, col = divmod(quadrant, 2)
    half = SIZE // 2
    frame[row * half : (row + 1) * half, col * half : (col + 1) * half] = 255
    return frame


FRAMES = [quadrant_frame(q) for q in range(NUM_ACTIONS)]
BLANK = np.zeros((SIZE, SIZE), np.uint8)
QUESTION = BLANK.copy()
QUESTION[SIZE // 2 - 4 : SIZE // 2 + 4] = 255


class CueEnvPool:
    """num_envs games stepped together (or batch_size of them at a time through send/recv)."""

    def __init__(self, task_id, num_envs, batch_size, seed, stack_num, episodic_life, render_mode):
        self.recall, self.full_lives = task_id == "Recall-v5", LIVES[task_id]
        self.num_envs, self.batch_size, self.episodic_life = num_envs, batch_size, episodic_life
        self.render_mode = render_mode
        self.observation_space = gym.spaces.Box(0, 255, (stack_num, SIZE, SIZE), np.uint8)
        self.action_space = gym.spaces.Discrete(NUM_ACTIONS)
        self.rngs = [np.random.default_rng(seed + i) for i in range(num_envs)]
        self.stacks = np.zeros((num_envs, stack_num, SIZE, SIZE), np.uint8)
        self.cue = np.zeros(num_envs, np.int64)
        self.t = np.zeros(num_envs, np.int64)  # step within the life
        self.lives = np.full(num_envs, self.full_lives, np.int32)
        self.elapsed = np.zeros(num_envs, np.int32)
        self.needs_reset = np.zeros(num_envs, bool)
        self.game_over = np.zeros(num_envs, bool)

    def _push(self, i, frame):
        self.stacks[i, :-1] = self.stacks[i, 1:]
        self.stacks[i, -1] = frame

    def _start_life(self, i):
        self.t[i] = 0
        self.cue[i] = self.rngs[i].integers(NUM_ACTIONS)
        self._push(i, FRAMES[self.cue[i]])

    def _reset_game(self, i):
        self.stacks[i] = 0
        self.lives[i], self.elapsed[i] = self.full_lives, 0
        self._start_life(i)

    def _info(self, ids, rewards, terminated):
        return {
            "env_id": np.asarray(ids, np.int32),
            "players": {"env_id": np.asarray(ids, np.int32)},
            "lives": self.lives[ids].copy(),
            "reward": rewards,
            "terminated": terminated.astype(np.int32),
            "ram": np.zeros((len(ids), 128), np.uint8),
            "elapsed_step": self.elapsed[ids].copy(),
        }

    def _step(self, ids, actions):
        n = len(ids)
        rewards, terminations = np.zeros(n, np.float32), np.zeros(n, bool)
        game_ends = np.zeros(n, bool)
        for k, (i, action) in enumerate(zip(ids, actions)):
            if self.needs_reset[i]:  # the reset step: the action is ignored
                self.needs_reset[i] = False
                if self.game_over[i]:
                    self._reset_game(i)
                else:
                    self._start_life(i)
                continue
            self.elapsed[i] += 1
            self.t[i] += 1
            if self.recall:
                asked = self.t[i] == RECALL_DELAY + 1
                rewards[k] = float(asked and action == self.cue[i])
                life_over = asked
            else:
                rewards[k] = float(action == self.cue[i])
                life_over = self.t[i] == LIFE_STEPS
            if life_over:
                self.lives[i] -= 1
                game_ends[k] = self.lives[i] == 0
                terminations[k] = game_ends[k] or self.episodic_life
                self.needs_reset[i], self.game_over[i] = terminations[k], game_ends[k]
            if life_over and not terminations[k]:  # without episodic_life a lost life goes on in the same episode
                self._start_life(i)
            elif self.recall:
                self._push(i, QUESTION if self.t[i] == RECALL_DELAY else BLANK)
            else:
                self.cue[i] = self.rngs[i].integers(NUM_ACTIONS)
                self._push(i, FRAMES[self.cue[i]])
        obs = self.stacks[ids].copy()
        truncations = np.zeros(n, bool)
        return obs, rewards, terminations, truncations, self._info(ids, rewards, game_ends)

    def reset(self, seed=None, options=None):
        for i in range(self.num_envs):
            self._reset_game(i)
            self.needs_reset[i] = False
        ids = np.arange(self.num_envs)
        return self.stacks.copy(), self._info(ids, np.zeros(self.num_envs, np.float32), np.zeros(self.num_envs, bool))

    def step(self, actions, env_id=None):
        ids = np.arange(self.num_envs) if env_id is None else np.asarray(env_id)
        return self._step(ids, np.asarray(actions))

    def async_reset(self):
        self.reset()
        batches = [np.arange(start, start + self.batch_size) for start in range(0, self.num_envs, self.batch_size)]
        self.results = [self._reset_result(ids) for ids in batches]

    def _reset_result(self, ids):
        n = len(ids)
        zeros = np.zeros(n, bool)
        info = self._info(ids, np.zeros(n, np.float32), zeros)
        return self.stacks[ids].copy(), np.zeros(n, np.float32), zeros, zeros.copy(), info

    def send(self, actions, env_id):
        self.results.append(self._step(np.asarray(env_id), np.asarray(actions)))

    def recv(self):
        return self.results.pop(0)

    def render(self, env_ids=None):
        ids = [0] if env_ids is None else list(np.atleast_1d(env_ids))
        return np.stack([np.repeat(self.stacks[i, -1][:, :, None], 3, axis=2) for i in ids])

    def close(self):
        pass
