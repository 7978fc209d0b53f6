"""The tests start most runs through tests/script_server.py, a fork of an interpreter that has the scripts' imports
done. A run it forks must give what `python script.py` gives: the same numbers, output and exit codes."""

import json

from conftest import run_script

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
