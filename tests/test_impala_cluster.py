"""IMPALA on a Ray cluster of two nodes on this machine (ray.cluster_utils.Cluster: a head and a second node, each
with its own raylet and CPUs, as `ray start --head` and `ray start --address` make them): the actors are spread
over both nodes and none outlives the run; the second node stopped mid-run costs its actors, not the run; the head
going away ends the driver with one error line; a SIGTERM reaches the driver through the process watching it, and
the driver stops when that process is killed. The nodes hold Ray but not the run bookkeeping module (a module of that
name that fails to import is first on their path, and the script runs from a folder of its own): the driver ships it
with the job."""

import glob
import json
import os
import shutil
import signal
import subprocess
import time

import pytest

from script_runs import MODULE, ROOT, SCRIPTS, start_script

cluster_utils = pytest.importorskip("ray.cluster_utils")
pytestmark = pytest.mark.slow  # a two-node cluster starts for each test: 25-160 s each

# 4 actors x 4 envs on CartPole, 16 unrolls (one call from each actor) per update
ARGS = [
    "--env-id",
    "CartPole-v1",
    "--num-actors",
    "4",
    "--envs-per-actor",
    "4",
    "--batch-size",
    "16",
    "--eval-episodes",
    "0",
]


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """A head with 4 CPUs (room for every actor once the other node is gone) and a second node with 2. The head
    checks its nodes' health every second, not every 3 s (Ray's default: a node is declared dead, and its actors
    restarted, about 15 s after it stops), so that restarts come within a short run. Their workers find no run
    bookkeeping module but the one the driver ships."""
    hidden = tmp_path / "nodes_path"
    hidden.mkdir()
    (hidden / MODULE).write_text("raise ModuleNotFoundError('not on this node', name='run_bookkeeping')\n")
    monkeypatch.setenv("PYTHONPATH", str(hidden))  # the nodes' processes and their workers inherit it
    health_checks = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}
    cluster = cluster_utils.Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 4, "include_dashboard": False, "_system_config": health_checks},
    )
    cluster.add_node(num_cpus=2)
    agents = started_by(cluster, AGENTS)
    yield cluster
    agents |= started_by(cluster, AGENTS)
    cluster.shutdown()
    for pid in agents:  # a killed raylet's agents outlive it (see docs/impala.md)
        if os.path.exists(f"/proc/{pid}"):
            os.kill(int(pid), signal.SIGKILL)


AGENTS, ACTORS = "ray::DashboardAgent|ray::RuntimeEnvAgent", "ray::UnrollActor"


def started_by(cluster, names, nodes=None):
    """The processes named `names` (a pgrep pattern) that the cluster's raylets started (a node's workers and agents
    are its raylet's children), on `nodes` or all of them. Other tests' Ray instances on this machine are not theirs."""
    nodes = [node for node in [cluster.head_node, *cluster.worker_nodes] if node] if nodes is None else nodes
    pids = set()
    for node in nodes:
        (raylet,) = node.all_processes["raylet"]
        pgrep = ["pgrep", "-P", str(raylet.process.pid), "-f", names]
        pids |= set(subprocess.run(pgrep, capture_output=True, text=True).stdout.split())
    return pids


def gone(pids):
    """None of `pids` runs (a zombie whose new parent has yet to reap it has ended)."""
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    return False
        except FileNotFoundError:
            pass
    return True


def start_run(cluster, total_timesteps, workdir):
    """The script run from a folder of its own, the module on the driver's path alone (Ray puts the script's folder
    and the working directory on its workers' paths: neither holds the module)."""
    alone, driver_only = os.path.join(workdir, "script"), os.path.join(workdir, "driver_only")
    for folder, name in ((alone, "impala_ray.py"), (driver_only, MODULE)):
        os.makedirs(folder, exist_ok=True)
        shutil.copy(os.path.join(SCRIPTS, name), folder)
    args = [*ARGS, "--total-timesteps", total_timesteps, "--ray-address", cluster.address]
    env = {"PYTHONPATH": os.pathsep.join([driver_only, ROOT])}
    return start_script(os.path.join(alone, "impala_ray.py"), args, workdir, env=env)


def wait_for_actors(cluster, proc, count=4, timeout=120, on=None):
    """Until `count` actor processes play, two of them on the node `on` if given (then a few seconds more: some
    updates in)."""
    deadline = time.time() + timeout
    while len(started_by(cluster, ACTORS)) < count or (on is not None and len(started_by(cluster, ACTORS, [on])) < 2):
        assert time.time() < deadline and proc.poll() is None, (
            started_by(cluster, ACTORS, [on]) if on else "",
            proc.communicate()[1][-2000:],
        )
        time.sleep(0.5)
    time.sleep(3)


def summary_of(stdout):
    return json.loads(stdout.strip().splitlines()[-1][len("SPEED ") :])


def head_node_name(summary, other_nodes):
    (head,) = set(summary["actor_nodes"]) - other_nodes
    return head


def test_actors_are_spread_over_both_nodes_and_none_outlives_the_run(cluster, workdir):
    proc = start_run(cluster, 40_000, workdir)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    summary = summary_of(stdout)
    assert sorted(summary["actor_nodes"].values()) == [2, 2], summary["actor_nodes"]  # two nodes, two actors each
    assert summary["steps_done"] >= 40_000 and summary["ray_address"] == cluster.address
    assert summary["actor_restarts"] == 0 and summary["unrolls_lost"] == 0
    deadline = time.time() + 15  # the cluster runs on; the run's actors end with their driver
    while started_by(cluster, ACTORS) and time.time() < deadline:
        time.sleep(0.5)
    assert not started_by(cluster, ACTORS)


def test_a_node_stopped_mid_run_costs_its_actors_not_the_run(cluster, workdir):
    """The second node's raylet and workers killed: its two actors die, Ray restarts them on the head, and the run
    reaches its budget. Whether a call in flight fails with them is Ray's choice (Ray 2.60 re-sends the calls it
    still holds to the restarted actor: 0 or 1 lost in two runs here); each failure the run sees is counted."""
    (second_node,) = cluster.worker_nodes
    proc = start_run(cluster, 300_000, workdir)
    wait_for_actors(cluster, proc, on=second_node)  # SPREAD places one actor per node in turn, but only as it can
    on_second_node = started_by(cluster, ACTORS, [second_node])
    cluster.remove_node(second_node, allow_graceful=False)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert gone(on_second_node)  # they died with their node
    summary = summary_of(stdout)
    assert list(summary["actor_nodes"].values()) == [4], summary["actor_nodes"]  # restarted on the head, and played
    assert summary["steps_done"] >= 300_000 and summary["num_updates"] == -(-300_000 // 320)
    # at most the node's two actors died (once a third restart was counted, on a machine busy with another cluster:
    # a restarted actor can die again while Ray tears the node down), and what the run saw is what it counts
    died = [line for line in stderr.splitlines() if "died; Ray restarts it" in line]
    assert len({line.split()[2] for line in died}) <= 2 and summary["actor_restarts"] == len(died), died
    assert summary["unrolls_lost"] >= 4 * len(died), summary


def test_a_head_that_goes_away_ends_the_driver_with_one_line(cluster, workdir):
    proc = start_run(cluster, 2_000_000, workdir)
    wait_for_actors(cluster, proc)
    removed = time.time()
    cluster.remove_node(cluster.head_node, allow_graceful=False)
    stdout, stderr = proc.communicate(timeout=120)
    assert time.time() - removed < 30, "the driver hung"  # 10 s without the head, when it is not the driver's node
    assert proc.returncode == 1 and "SPEED" not in stdout
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: Ray ended the driver: the Ray cluster at --ray-address") and "went away" in last


def test_sigterm_reaches_the_watched_driver(cluster, workdir):
    """On a cluster the driver runs in a child of the process the user started: a SIGTERM to that process stops
    the run as it does locally (summary of the steps done, exit code 143)."""
    proc = start_run(cluster, 2_000_000, workdir)
    wait_for_actors(cluster, proc)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    summary = summary_of(stdout)
    assert summary["stopped"] == "stopped by SIGTERM" and 0 < summary["steps_done"] < 2_000_000
    assert stderr.strip().splitlines()[-1].startswith("stopped by SIGTERM: the steps done are in runs/")


def test_the_driver_stops_when_its_watcher_is_killed(cluster, workdir):
    """SIGKILL to the process the user started (it cannot pass anything on): the driver gets a SIGTERM from the
    kernel (PR_SET_PDEATHSIG) and stops as after Ctrl-C, with a summary of the steps done; nothing trains on."""
    proc = start_run(cluster, 2_000_000, workdir)
    wait_for_actors(cluster, proc)
    (driver,) = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    proc.kill()
    proc.communicate(timeout=60)
    deadline = time.time() + 60
    while os.path.exists(f"/proc/{driver}") and time.time() < deadline:
        time.sleep(0.5)
    assert not os.path.exists(f"/proc/{driver}"), "the driver outlived its watcher"
    (summary_path,) = glob.glob(os.path.join(workdir, "runs", "*", "summary.json"))
    with open(summary_path) as f:
        summary = json.load(f)
    assert summary["stopped"] == "stopped by SIGTERM" and 0 < summary["steps_done"] < 2_000_000
