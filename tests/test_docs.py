"""The README and the pages under docs/ name only flags that the scripts have: they cannot drift from the code; and
every markdown page speaks of the product, not of how it was made."""

import functools
import glob
import os
import re

import pytest

from script_runs import ALL_SCRIPTS, ROOT, run_script

# Flags of the other commands the pages show: ray start and stop, run.sh, tensorboard, benchmarks/threads.py,
# benchmarks/collect.py, benchmarks/learning.py, benchmarks/tune.py, torchrun, pytest (this suite's --break-learner).
OTHER_COMMANDS = {
    "--standalone",
    "--nproc-per-node",
    "--nnodes",
    "--rdzv-backend",
    "--rdzv-endpoint",
    "--rdzv-id",
    "--compare",
    "--rounds",
    "--budget-minutes",
    "--run-timeout",
    "--readme",
    "--head",
    "--address",
    "--force",
    "--quick",
    "--smoke",
    "--results",
    "--learning",
    "--seeds",
    "--help",
    "--cleanrl",
    "--leanrl",
    "--fasttd3",
    "--sb3-contrib",
    "--reference-python",
    "--jax-python",
    "--until-score",
    "--profile",
    "--max-minutes",
    "--sides",
    "--headline",
    "--only",
    "--break-learner",
    "--xla-cpu-multi-thread-eigen",  # an XLA flag, in XLA_FLAGS
    "--logdir",
    "--busy",
    "--dry-run",
    "--group",
    "--durations",  # pytest's
    "--tune",  # run.sh's, and benchmarks/tune.py's own
    "--space",
    "--trials",
    "--workers",
    "--storage",
    "--objective",
    "--pruner",
    "--poll-seconds",
}
# "Flags every script has", but for these scripts, whose row names what they have instead.
EXCEPT_IN = {"--num-envs": {"impala_ray.py", "ppo_atari_multigpu.py"}}  # actors; --local-num-envs per process
FLAG = re.compile(r"--[a-z][a-z0-9_-]*")


@functools.cache
def help_flags(script):
    _, proc = run_script(script, ["--help"], ROOT, check=False, timeout=120, env={"COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return set(FLAG.findall(proc.stdout))


def code_flags(text):
    """Flags inside code: `inline` spans and fenced blocks."""
    code = re.findall(r"```.*?```", text, flags=re.S) + re.findall(
        r"`[^`\n]+`", re.sub(r"```.*?```", "", text, flags=re.S)
    )
    # CleanRL's spelling, `--capture_video`, is tyro's `--capture-video`: checked as that
    return {flag.replace("_", "-") for span in code for flag in FLAG.findall(span)} - OTHER_COMMANDS


def scripts_named(text):
    return {name for name in ALL_SCRIPTS if name in text}


PAGES = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def test_there_is_a_page_for_every_script():
    named = set().union(*(scripts_named(open(page).readline()) for page in PAGES))
    assert named == set(ALL_SCRIPTS)


@pytest.mark.parametrize("page", PAGES, ids=os.path.basename)
def test_a_page_names_only_flags_its_scripts_have(page):
    with open(page) as f:
        text = f.read()
    scripts = scripts_named(text.splitlines()[0]) or set(ALL_SCRIPTS)  # the title names the page's scripts
    known = set().union(*(help_flags(script) for script in scripts))
    assert code_flags(text) - known == set()


def readme():
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def test_the_readme_names_only_flags_that_exist():
    known = set().union(*(help_flags(script) for script in ALL_SCRIPTS))
    assert code_flags(readme()) - known == set()


def test_each_row_of_the_scripts_table_names_its_own_flags():
    rows = [line for line in readme().splitlines() if line.startswith("| [`")]
    assert len(rows) == len(ALL_SCRIPTS)
    for row in rows:
        (script,) = re.findall(r"\[`(\w+\.py)`\]", row)
        assert code_flags(row) - help_flags(script) == set(), row


def test_the_flags_every_script_has_are_in_every_script():
    text = readme()
    section = text[text.index("## Flags every script has") :]
    table = section[: section.index("\n\n", section.index("| flag |"))]
    flags = code_flags(table)
    assert {"--compile", "--cudagraphs", "--save-model", "--eval-episodes"} <= flags
    for script in ALL_SCRIPTS:
        missing = {flag for flag in flags - help_flags(script) if script not in EXCEPT_IN.get(flag, ())}
        assert missing == set(), script


# How the work was organised is not the product's business: its pages name what was measured, where and when.
WORKSHOP_WORDS = re.compile(
    r"\bissues? #?\d+|(?<![\w/&])#\d+\b|\bsittings?\b|\bsessions?\b|device tool|machine kinds?", re.I
)


def test_no_markdown_page_speaks_of_issues_sittings_sessions_or_machine_kinds():
    pages = []
    for folder, subfolders, names in os.walk(ROOT):
        subfolders[:] = [name for name in subfolders if not name.startswith(".")]  # .git, .venv, clones
        pages += [os.path.join(folder, name) for name in names if name.endswith(".md")]
    assert os.path.join(ROOT, "README.md") in pages and len(pages) > 20
    found = []
    for page in pages:
        with open(page) as f:
            for number, line in enumerate(f, 1):
                where = f"{os.path.relpath(page, ROOT)}:{number}"
                found += [f"{where}: {match.group(0)!r}" for match in WORKSHOP_WORDS.finditer(line)]
    assert not found, "\n".join(found)
