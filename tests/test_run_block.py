"""The run bookkeeping is one block of the same text in every script, between two marker comments, right before the
main block; outside it, each script stays within the size a reader of its algorithm was promised.

    python tests/test_run_block.py --copy-from leanrl_scripts/td3_continuous_action.py
copies one script's block into all the others after an edit (the test then passes again)."""

import collections
import os
import re
import sys

import pytest

from conftest import SCRIPTS

ALL_SCRIPTS = sorted(name for name in os.listdir(SCRIPTS) if name.endswith(".py"))
START, END = "# ---- run bookkeeping", "# ---- end of the run bookkeeping ----"
# Lines outside the block: what a reader of the algorithm reads (CleanRL's scripts are 248-375 lines, LeanRL's
# compiled ones 271-436). dqn_atari_async.py carries three env kinds (envpool, ALE through gymnasium with the
# classic wrappers, classic control): the ALE wrappers alone are about 110 of its lines.
# The block itself: 198 lines with every behaviour it holds (about 130 was the aim;
# benchmarks/results/cpu-2core/run_block.md lists what each part costs), then 23 for --track (W&B's check, start
# and end), then 9 for --capture-video (its two refusals before any work, pygame off-screen, the videos' folder),
# then 59 for the machine tuning every script did before its networks (tune_cpu: the usable and idle cores, torch's
# threads, glibc's malloc thresholds; 20-35 lines left each of seven scripts), then 2 for a folder of its own for a
# run started in the same second with the same settings, then 28 for ruff format's layout (a call that does not fit
# in 120 columns gets one argument a line and its closing bracket on a line of its own), then 1 to keep the slash of
# an id such as dm_control/cartpole-balance-v0 out of the run folder's path. The cap keeps it from growing back.
MAX_BLOCK_LINES = 320
# --track's three fields in Args took six more lines in each; keep_freed_memory() took 14 more in IMPALA's learner,
# the one-sample statistics and the flat parameters 20 more in PPO continuous, the CPU compile choice 4 in PPO Atari
# and 2 in the async DQN, whose actor's GPU copy of the network took 27 more and its learner's copy of the storage
# on the GPU 27; PPO-LSTM's idle-core check before its spin took 20. --capture-video's frame writer (and, where a
# script has gymnasium vector envs, the first env's screen) took 19-28 in each Atari script and IMPALA. PPO Atari's
# sync mode acting on the bootstrap observation after the update, as CleanRL's does, took 12. The machine tuning
# moved into the block (tune_cpu) gave back 34-35 in SAC, TD3, both PPO Atari scripts and IMPALA, 19-20 in the
# Atari DQNs. ruff format's layout took 7-90 more (2-13%: dqn.py 7, SAC 41, TD3 45, PPO continuous 41, PPO Atari 50,
# PPO-LSTM 47, the Atari DQN 34, the async DQN 61, IMPALA 90), the same line breaks as the block's. CleanRL's
# dm_control tasks took 5 in PPO continuous (shimmy registers them; without it, one line naming the extra) and 7 in SAC
# and TD3 (their dict observations flattened too), SAC's note on where its autotuned alpha starts 1, and CleanRL's
# NoFrameskip-v4 Atari ids 1 in each Atari script. The Atari DQNs' replay keeping envpool's reset step after a lost
# life out of the transitions (its own flag, since envpool keeps the frame stack there) took 4 and 3. PPO Atari on
# several processes is PPO Atari's 457 without its async mode, plus what several processes need: the gradients in one
# buffer, the update in two halves around the all-reduce, the minibatch statistics over every process, one stop
# agreed at each env step, the bad input said once, the first process alone writing (527).
MAX_LINES = {
    "sac_continuous_action.py": 427,
    "td3_continuous_action.py": 408,
    "ppo_continuous_action.py": 452,
    "ppo_atari_envpool.py": 457,
    "ppo_atari_lstm.py": 529,
    "ppo_atari_multigpu.py": 527,
    "dqn.py": 333,
    "dqn_atari.py": 509,
    "dqn_atari_async.py": 825,
    "impala_ray.py": 913,
}


def split(path):
    """The script's lines before the block, the block (markers included), and after it."""
    with open(path) as f:
        lines = f.read().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(START)]
    ends = [i for i, line in enumerate(lines) if line == END]
    assert len(starts) == 1 and len(ends) == 1 and starts[0] < ends[0], f"{path}: one block between the two markers"
    return lines[: starts[0]], lines[starts[0] : ends[0] + 1], lines[ends[0] + 1 :]


def test_every_script_has_a_size_limit():
    assert sorted(MAX_LINES) == ALL_SCRIPTS


def test_the_block_is_the_same_text_in_every_script():
    """Each copy against the text most copies have: a drifted copy is named with its first differing line."""
    blocks = {script: split(os.path.join(SCRIPTS, script))[1] for script in ALL_SCRIPTS}
    common, count = collections.Counter("\n".join(block) for block in blocks.values()).most_common(1)[0]
    assert count > len(blocks) / 2, "no text is shared by most of the scripts' blocks"
    common = common.split("\n")
    drifted = []
    for script, block in blocks.items():
        before = split(os.path.join(SCRIPTS, script))[0]
        for offset, (line, expected) in enumerate(zip(block + [""] * len(common), common + [""] * len(block))):
            if line != expected:
                drifted.append(
                    f"{script} line {len(before) + offset + 1}: {line!r}, where {count} scripts have {expected!r}"
                )
                break
    assert drifted == []


def test_the_block_stays_short():
    block = split(os.path.join(SCRIPTS, ALL_SCRIPTS[0]))[1]
    assert len(block) <= MAX_BLOCK_LINES


@pytest.mark.parametrize("script", ALL_SCRIPTS)
def test_the_block_comes_right_before_the_main_block_and_nothing_redefines_it(script):
    before, block, after = split(os.path.join(SCRIPTS, script))
    assert [line for line in after if line.strip()][0] == 'if __name__ == "__main__":'
    defined = lambda lines: set(re.findall(r"^(?:def|class) (\w+)|^([A-Z_]+) =", "\n".join(lines), re.M))  # noqa: E731
    names = lambda found: {name for pair in found for name in pair if name}  # noqa: E731
    assert names(defined(block)) & names(defined(before + after)) == set()


@pytest.mark.parametrize("script", ALL_SCRIPTS)
def test_the_algorithm_outside_the_block_stays_within_its_size(script):
    before, block, after = split(os.path.join(SCRIPTS, script))
    assert len(before) + len(after) <= MAX_LINES[script]


if __name__ == "__main__":
    if sys.argv[1:2] != ["--copy-from"] or len(sys.argv) != 3:
        sys.exit("usage: python tests/test_run_block.py --copy-from leanrl_scripts/<script>.py")
    source_block = split(sys.argv[2])[1]
    for name in ALL_SCRIPTS:
        path = os.path.join(SCRIPTS, name)
        before, _, after = split(path)
        with open(path, "w") as f:
            f.write("\n".join(before + source_block + after) + "\n")
