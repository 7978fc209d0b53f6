"""pytest's hooks and fixtures for this suite: the tiers (a plain `python -m pytest` leaves out the tests marked slow
and benchmark; `-m slow` and `-m benchmark` run them), each tier's per-test limit, the xdist workers and how tests go
to them, `--break-learner`, the folder of the runs that tests share. Running a script is tests/script_runs.py; the
shared checks are tests/checks.py; the plain implementations the pieces are held against are
tests/reference_implementations.py."""

import os
import shutil
import tempfile

import pytest

from script_runs import BREAK_LEARNER, SHARED_RUNS


@pytest.fixture
def workdir(tmp_path):
    return str(tmp_path)


SLOW_LEFT_OUT = pytest.StashKey[int]()

# Per test, past which it fails in its place (pytest-timeout; the fast tier's limit is pyproject.toml's): the slow
# tier's longest take 2-5 minutes here, the benchmark tier's up to 11.
SLOW_TEST_LIMIT, BENCHMARK_TEST_LIMIT = 900, 1800


def pytest_addoption(parser):
    parser.addoption(
        "--break-learner",
        action="store_true",
        help="run every script with its gradients zeroed (tests/sabotage): each learning test must then fail",
    )


def pytest_configure(config):
    if config.getoption("--break-learner"):  # read by start_script, in xdist's workers too
        os.environ[BREAK_LEARNER] = "1"
    if not hasattr(config, "workerinput"):  # the main process, before it starts xdist's workers, which inherit it
        os.environ[SHARED_RUNS] = tempfile.mkdtemp(prefix="leanrl-shared-runs-")
    if config.option.markexpr and getattr(config, "workerinput", {}).get("workercount", 1) > 1:
        # the slow tier's two workers share two cores: each run takes one torch thread (OMP_NUM_THREADS, which
        # every script reads), as a user's own setting would
        os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """pyproject.toml's `-n auto`: two worker processes. Most of the fast tier's tests wait on one script's run, which
    keeps one core busy (tiny budgets, one torch thread), so a second worker uses the core that would idle. The slow
    tier's learning tests keep both cores busy in one process with two torch threads each, and get less out of the
    second: in two workers, each run on one thread (pytest_configure), four of them finished in 198 s against 264 s
    one after the other, each 1.15-1.4x slower. The benchmark tier's real games (two workers made each 1.4-2.7x
    slower, the tier no faster) and a test named by its node id run in this process. `-n N` sets another count,
    `-n 0` runs in this process."""
    named = any("::" in arg for arg in config.args)
    return 0 if named or "benchmark" in (config.option.markexpr or "") else 2


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Tests go to whichever worker is free, but the two-node Ray clusters (tests/test_impala_cluster.py) start one
    after the other on one worker: each binds Ray's ports and writes the address that `ray.init()` finds. The
    scripts' local Ray instances (`--ray-address` empty: Ray's "local") stay out of a cluster's way and run anywhere;
    in one worker with the clusters they made the slow tier's critical path. xdist's own `--dist loadgroup` groups
    tests by a marker, but renames the tests to do it, which pytest 9.2 no longer lets it."""
    from xdist.scheduler import LoadScopeScheduling

    class ClustersTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid):  # a scope is a unit of work that one worker runs, largest first
            return "clusters" if nodeid.startswith("tests/test_impala_cluster.py") else nodeid

    return ClustersTogether(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Three tiers: `python -m pytest` leaves out the tests marked slow (the learning tests among them) and those
    marked benchmark (learning for minutes), `-m slow` runs only the slow ones, `-m benchmark` only those; a test
    named by its node id runs whatever its tier."""
    for item in items:
        if item.get_closest_marker("learning") and not item.get_closest_marker("benchmark"):
            item.add_marker(pytest.mark.slow)
        for tier, seconds in (("benchmark", BENCHMARK_TEST_LIMIT), ("slow", SLOW_TEST_LIMIT)):
            if item.get_closest_marker(tier) and not item.get_closest_marker("timeout"):
                item.add_marker(pytest.mark.timeout(seconds))
    if config.option.markexpr or any("::" in arg for arg in config.args):
        return
    slow = [item for item in items if item.get_closest_marker("slow") or item.get_closest_marker("benchmark")]
    if slow:
        items[:] = [item for item in items if item not in slow]
        config.hook.pytest_deselected(items=slow)
        config.stash[SLOW_LEFT_OUT] = len(slow)
        if hasattr(config, "workeroutput"):  # an xdist worker: the count goes to the main process
            config.workeroutput["slow_left_out"] = len(slow)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist's main process, as a worker ends: every worker collected the same tests."""
    if "slow_left_out" in getattr(node, "workeroutput", {}):
        node.config.stash[SLOW_LEFT_OUT] = node.workeroutput["slow_left_out"]


def pytest_terminal_summary(terminalreporter, config):
    if config.stash.get(SLOW_LEFT_OUT, 0):
        terminalreporter.write_line(
            f"{config.stash[SLOW_LEFT_OUT]} slow and benchmark tests left out: python -m pytest -m slow runs the "
            "slow ones (CI runs both tiers), -m benchmark the minutes-long learning tests"
        )


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ.pop(SHARED_RUNS), ignore_errors=True)
