"""Ours against LeanRL's scripts in one sitting, each side at one and two threads and ours at its default.

    python benchmarks/reference_sitting.py --ref-dir DIR [--rounds 3] [--only td3,dqn] [--out FILE.jsonl]

DIR holds scratch copies of LeanRL's scripts (leanrl_<name>.py, not in this repository; see
benchmarks/results/cpu-2core/reference_threads.md for the commit and the patches that let them run on gymnasium 1.x)
that print `STEADY_SPS <value>` last. The runs alternate (LeanRL 1 thread, LeanRL 2, ours default, ours 1, ours 2),
one at a time, in scratch folders; LeanRL's threads are set with OMP_NUM_THREADS, ours with --torch-threads.
Prints each run as it ends and a markdown table of the medians over rounds.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HALF_CHEETAH_OFF_POLICY = ["--env-id", "HalfCheetah-v5", "--total-timesteps", "3000", "--learning-starts", "1000"]
NO_EVAL = ["--eval-episodes", "0"]
# name: (our script, LeanRL's script, the flags both take, the flags only ours takes, the flags only LeanRL's takes)
ROWS = {
    "td3": ("td3_continuous_action.py", "leanrl_td3_continuous_action.py", HALF_CHEETAH_OFF_POLICY, NO_EVAL, []),
    "sac": ("sac_continuous_action.py", "leanrl_sac_continuous_action.py", HALF_CHEETAH_OFF_POLICY, NO_EVAL, []),
    "dqn": ("dqn.py", "leanrl_dqn.py", ["--total-timesteps", "60000", "--exploration-fraction", "0.1"], NO_EVAL, []),
    "ppo_continuous": (
        "ppo_continuous_action.py",
        "leanrl_ppo_continuous_action.py",
        ["--env-id", "HalfCheetah-v5", "--total-timesteps", "20480"],
        NO_EVAL,
        [],
    ),
    # LeanRL's compiled PPO continuous, its fastest there (its compiled DQN is slower than its plain one on a CPU)
    "ppo_continuous_compiled": (
        "ppo_continuous_action.py",
        "leanrl_ppo_continuous_action_torchcompile.py",
        ["--env-id", "HalfCheetah-v5", "--total-timesteps", "20480"],
        NO_EVAL,
        ["--compile"],
    ),
    # the same, ours with --compile too (on a CPU it compiles PPO continuous's policy and update): best against best
    "ppo_continuous_both_compiled": (
        "ppo_continuous_action.py",
        "leanrl_ppo_continuous_action_torchcompile.py",
        ["--env-id", "HalfCheetah-v5", "--total-timesteps", "20480"],
        NO_EVAL + ["--compile"],
        ["--compile"],
    ),
    # LeanRL's compiled PPO Atari, its fastest on a CPU; both time from the second iteration (its count is 1-based)
    "ppo_atari": (
        "ppo_atari_envpool.py",
        "leanrl_ppo_atari_envpool_torchcompile.py",
        ["--env-id", "Breakout-v5", "--total-timesteps", "20480"],
        NO_EVAL,
        ["--compile", "--measure-burnin", "2"],
    ),
}


def run(command, threads=None):
    """SPS of one run in a scratch folder; `threads` sets OMP_NUM_THREADS (LeanRL's runs)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    with tempfile.TemporaryDirectory() as workdir:
        proc = subprocess.run(command, cwd=workdir, capture_output=True, text=True, env=env)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines:
        raise SystemExit(f"error: {' '.join(command)} failed:\n{proc.stderr[-2000:]}")
    if lines[-1].startswith("SPEED "):
        summary = json.loads(lines[-1][len("SPEED ") :])
        return summary["sps"], summary["torch_threads"]
    return float(lines[-1].split()[-1]), threads


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref-dir", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="", help="comma-separated names from: " + ", ".join(ROWS))
    parser.add_argument("--out", help="append each run as a JSON line to this file")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(ROWS)
    if unknown := set(names) - set(ROWS):
        parser.error(f"unknown names {sorted(unknown)}")
    results = {}
    for round_index in range(args.rounds):
        for name in names:
            ours, theirs, flags, our_flags, their_flags = ROWS[name]
            ours = [sys.executable, os.path.join(ROOT, "leanrl_scripts", ours), *flags, *our_flags]
            theirs = [sys.executable, os.path.join(os.path.abspath(args.ref_dir), theirs), *flags, *their_flags]
            runs = [
                ("LeanRL 1 thread", theirs, 1),
                ("LeanRL 2 threads", theirs, 2),
                ("ours default", ours, None),
                ("ours 1 thread", ours + ["--torch-threads", "1"], None),
                ("ours 2 threads", ours + ["--torch-threads", "2"], None),
            ]
            for label, command, threads in runs:
                sps, used = run(command, threads)
                results.setdefault((name, label), []).append(sps)
                record = {"row": name, "round": round_index + 1, "run": label, "sps": sps, "threads": used}
                print(json.dumps(record), flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(record) + "\n")
    labels = ["LeanRL 1 thread", "LeanRL 2 threads", "ours default", "ours 1 thread", "ours 2 threads"]
    print("\n| row | " + " | ".join(labels) + " | ours default / LeanRL best | ours best / LeanRL best |")
    print("| --- |" + " ---: |" * (len(labels) + 2))
    for name in names:
        medians = [statistics.median(results[(name, label)]) for label in labels]
        best_theirs, best_ours = max(medians[:2]), max(medians[2:])
        print(
            f"| {name} | "
            + " | ".join(f"{m:.1f}" for m in medians)
            + f" | {medians[2] / best_theirs:.2f}x | {best_ours / best_theirs:.2f}x |"
        )


if __name__ == "__main__":
    main()
