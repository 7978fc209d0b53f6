"""--capture-video that cannot work: one clear line before any training (no evaluation to record, no moviepy). Each
script's video of its first evaluation game is checked in its own tests, on its one tiny run
(checks.assert_records_the_first_evaluation_game)."""

import os

import pytest

from script_runs import ROOT, SHORT_RUNS, the_one_error_line


@pytest.mark.parametrize("script", ["dqn.py", "ppo_atari_envpool.py"])
def test_capture_video_that_cannot_work_is_one_error_line_and_exit_code_2(script, workdir, tmp_path):
    """The videos are made after the training: what would stop them must show before it (the check is the run
    bookkeeping module's, which every script imports)."""
    args = [*SHORT_RUNS[script]["base"], *SHORT_RUNS[script]["tiny"], "--capture-video"]
    line = the_one_error_line(script, [*args, "--eval-episodes", "0"], workdir)
    assert line == "error: --capture-video records the evaluation: it needs --eval-episodes 1 or more"
    hidden = tmp_path / "no_moviepy"
    hidden.mkdir()
    (hidden / "moviepy.py").write_text("raise ModuleNotFoundError(\"No module named 'moviepy'\", name='moviepy')\n")
    line = the_one_error_line(script, args, workdir, {"PYTHONPATH": os.pathsep.join([str(hidden), ROOT])})
    assert (
        line == 'error: --capture-video writes mp4 files with moviepy, which is not installed: pip install ".[video]"'
    )
