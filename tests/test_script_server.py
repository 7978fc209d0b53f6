"""The tests start most runs through tests/script_server.py, a fork of an interpreter that has the scripts' imports
done. A run it forks must give what `python script.py` gives: the same numbers, output and exit codes."""

import json

from script_runs import run_script

TINY = ["--total-timesteps", 1000, "--learning-starts", 500, "--buffer-size", 1000, "--eval-episodes", 2]


def test_a_served_run_gives_what_a_fresh_interpreter_gives(workdir, monkeypatch):
    served, served_proc = run_script("dqn.py", TINY, workdir)
    _, served_refusal = run_script("dqn.py", ["--gamma", 2], workdir, check=False)
    monkeypatch.setenv("LEANRL_TESTS_FRESH", "1")
    fresh, fresh_proc = run_script("dqn.py", TINY, workdir)
    _, fresh_refusal = run_script("dqn.py", ["--gamma", 2], workdir, check=False)
    for key in ("eval_returns", "final_metrics", "return_mean", "steps_done", "torch_threads"):
        assert served[key] == fresh[key], key
    last_line = lambda proc: json.loads(proc.stdout.splitlines()[-1][len("SPEED ") :])  # noqa: E731
    assert last_line(served_proc).keys() == last_line(fresh_proc).keys()
    assert (served_refusal.returncode, served_refusal.stderr) == (fresh_refusal.returncode, fresh_refusal.stderr)
    assert served_refusal.returncode == 2


# A run that spawns a process (the async DQN's actor): its queue and lock reach the child, which sees its parent
# alive, exits with its own code, or dies with the process the run holds when that is killed.
SPAWNER = """
import json, multiprocessing as mp, os, sys, time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the scripts: else the child is a fresh interpreter


def child(queue, lock, wait):
    with lock:
        queue.put((os.getpid(), "tensordict.nn" in sys.modules, mp.parent_process().is_alive()))
    time.sleep(60 if wait else 0)
    sys.exit(3)


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    queue, lock = ctx.Queue(), ctx.Lock()
    process = ctx.Process(target=child, args=(queue, lock, sys.argv[1] == "kill"))
    process.start()
    pid, imports_done, parent_alive = queue.get(timeout=60)
    if sys.argv[1] == "kill":
        process.kill()
    process.join(30)
    for _ in range(50):  # a child that outlives the process it was started as is still there after 5 s
        try:
            os.kill(pid, 0)
            time.sleep(0.1)
        except ProcessLookupError:
            break
    gone = not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    print(json.dumps([process.exitcode, imports_done, parent_alive, gone]))
"""


def test_a_process_a_served_run_spawns_is_forked_by_the_server_and_acts_as_spawned(workdir, tmp_path, monkeypatch):
    spawner = tmp_path / "spawner.py"
    spawner.write_text(SPAWNER)
    results = {}
    for fresh in ("0", "1"):
        monkeypatch.setenv("LEANRL_TESTS_FRESH", fresh)
        for how in ("exit", "kill"):
            _, proc = run_script(str(spawner), [how], workdir, check=False, timeout=120)
            assert proc.returncode == 0, proc.stderr[-2000:]
            results[fresh, how] = json.loads(proc.stdout.splitlines()[-1])
    assert results["0", "exit"] == [3, True, True, True] and results["1", "exit"] == [3, False, True, True]
    assert results["0", "kill"] == [-9, True, True, True] and results["1", "kill"] == [-9, False, True, True]
