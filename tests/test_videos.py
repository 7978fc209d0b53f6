"""--capture-video: the first evaluation game as an mp4, read back frame by frame; and one clear line when the flag
cannot work (no evaluation to record, no moviepy). SAC's RecordVideo path is in test_continuous_scripts.py."""

import glob
import os

import pytest
from test_hard_knocks import CASES, saved_tiny_run
from test_track import the_one_error_line

from script_runs import ROOT

imageio = pytest.importorskip("imageio.v2")  # moviepy's own reader and writer (the [video] extra)

CARTPOLE_SCREEN, ATARI_SCREEN = (400, 600, 3), (210, 160, 3)
# script: the back-end flags of the run (if any) and the screen it records. dqn.py records with gymnasium's
# RecordVideo; the others write frames as they come, from envpool (PPO Atari, PPO-LSTM), from the first env of a
# gymnasium vector env (ALE in dqn_atari.py, CartPole in the async DQN and IMPALA).
RECORDED = {
    "dqn.py": ([], CARTPOLE_SCREEN),
    "dqn_atari.py": (["--env-backend", "gymnasium"], ATARI_SCREEN),
    "dqn_atari_async.py": ([], CARTPOLE_SCREEN),
    "ppo_atari_envpool.py": ([], ATARI_SCREEN),
    "ppo_atari_envpool_async.py": ([], ATARI_SCREEN),
    "ppo_atari_lstm.py": ([], ATARI_SCREEN),
    "impala_ray.py": ([], CARTPOLE_SCREEN),
    "pqn.py": ([], CARTPOLE_SCREEN),
    "pqn_atari_envpool.py": ([], ATARI_SCREEN),
    "rainbow_atari.py": ([], ATARI_SCREEN),
}


@pytest.mark.parametrize("script", RECORDED)
def test_capture_video_records_the_first_evaluation_game(script):
    flags, screen = RECORDED[script]
    summary, _ = saved_tiny_run(script, *flags, "--eval-episodes", 1, "--capture-video")
    videos = glob.glob(os.path.join(summary["run_dir"], "videos", "*.mp4"))
    assert len(videos) == 1, videos
    with imageio.get_reader(videos[0]) as reader:
        first, frames, moved = None, 0, False
        for frame in reader:
            first = frame if first is None else first
            moved |= bool((frame != first).any())
            frames += 1
    assert first.shape == screen and moved
    if screen == CARTPOLE_SCREEN:  # the reset screen, then one per step; CartPole pays 1 a step
        # a game held to the 500-step limit reads back one frame short: imageio's reader gives 500 frames of the 501
        # that gymnasium's RecordVideo writes (seen with RecordVideo alone, no script)
        assert frames == summary["eval_returns"][0] + 1 - (summary["eval_returns"][0] == 500)
    else:  # a whole Breakout game, five balls, not one life of it (117-357 frames here)
        assert frames >= 100


@pytest.mark.parametrize("script", ["dqn.py", "ppo_atari_envpool.py"])
def test_capture_video_that_cannot_work_is_one_error_line_and_exit_code_2(script, workdir, tmp_path):
    """The videos are made after the training: what would stop them must show before it (the check is the run
    bookkeeping module's, which every script imports)."""
    args = [*CASES[script]["base"], *CASES[script]["tiny"], "--capture-video"]
    line = the_one_error_line(script, [*args, "--eval-episodes", "0"], workdir)
    assert line == "error: --capture-video records the evaluation: it needs --eval-episodes 1 or more"
    hidden = tmp_path / "no_moviepy"
    hidden.mkdir()
    (hidden / "moviepy.py").write_text("raise ModuleNotFoundError(\"No module named 'moviepy'\", name='moviepy')\n")
    line = the_one_error_line(script, args, workdir, {"PYTHONPATH": os.pathsep.join([str(hidden), ROOT])})
    assert (
        line == 'error: --capture-video writes mp4 files with moviepy, which is not installed: pip install ".[video]"'
    )
