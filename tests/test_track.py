"""--track: a run logged to Weights & Biases, read back from the files W&B writes offline (WANDB_MODE=offline: no
account, no network), and one clear line when wandb is not installed or cannot start."""

import glob
import json
import os

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from script_runs import ROOT, SHORT_RUNS, run_script, the_one_error_line

BLOCK = 32 * 1024
OFFLINE = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"}


def log_records(path):
    """The records of a W&B run log (.wandb): a 7-byte header, then LevelDB's log format: 32 KiB blocks of chunks, each
    a 4-byte checksum, a 2-byte length and a type (1 whole, 2 first, 3 middle, 4 last); a block's last 6 bytes or
    fewer are padding."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", path
    records, pending, position = [], b"", 7
    while position + 7 <= len(data):
        if BLOCK - position % BLOCK < 7:
            position += BLOCK - position % BLOCK
            continue
        length, kind = int.from_bytes(data[position + 4 : position + 6], "little"), data[position + 6]
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            records.append(pending)
            pending = b""
    return records


def wandb_run(workdir):
    """(name, config, history rows, files kept) of the one offline W&B run made in `workdir`."""
    from wandb.proto import wandb_internal_pb2

    (log,) = glob.glob(os.path.join(workdir, "wandb", "offline-run-*", "run-*.wandb"))
    name, config, rows = None, {}, []
    for data in log_records(log):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            name = record.run.display_name
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    files = glob.glob(os.path.join(os.path.dirname(log), "files", "**"), recursive=True)
    return name, config, rows, [os.path.basename(path) for path in files]


def test_track_offline_keeps_the_name_the_config_the_scalars_and_the_evaluation_video(workdir, monkeypatch):
    pytest.importorskip("wandb", reason='--track needs the wandb extra: pip install ".[wandb]"')
    for name, value in OFFLINE.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SDL_VIDEODRIVER", "dummy")
    args = [
        "--env-id",
        "Pendulum-v1",
        "--total-timesteps",
        600,
        "--learning-starts",
        200,
        "--batch-size",
        64,
        "--measure-burnin",
        5,
        "--eval-episodes",
        1,
        "--capture-video",
        "--track",
        "--wandb-project-name",
        "tests",
    ]
    summary, _ = run_script("td3_continuous_action.py", args, workdir, timeout=300)
    run_name, config, rows, files = wandb_run(workdir)
    assert run_name == os.path.basename(summary["run_dir"])
    assert config["env_id"] == "Pendulum-v1" and config["total_timesteps"] == 600 and config["capture_video"] is True
    # every scalar the TensorBoard file holds reached W&B with the same values
    events = EventAccumulator(summary["run_dir"])
    events.Reload()
    for tag in events.Tags()["scalars"]:
        logged = [row[tag] for row in rows if tag in row]
        assert logged == pytest.approx([event.value for event in events.Scalars(tag)], rel=1e-6), tag
    assert {"losses/qf_loss", "eval/episodic_return"} <= set(events.Tags()["scalars"])
    videos = [row["videos/eval/_type"] for row in rows if "videos/eval/_type" in row]
    assert videos == ["video-file"]
    assert any(name.endswith(".mp4") for name in files), files


@pytest.mark.parametrize("script", sorted(SHORT_RUNS))
def test_track_without_wandb_is_one_error_line_and_exit_code_2(script, workdir, tmp_path):
    """wandb is an optional extra: a run that asks for it says how to install it, before any work."""
    hidden = tmp_path / "no_wandb"
    hidden.mkdir()
    (hidden / "wandb.py").write_text("raise ModuleNotFoundError(\"No module named 'wandb'\", name='wandb')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(hidden), ROOT])}
    line = the_one_error_line(
        script, [*SHORT_RUNS[script]["base"], *SHORT_RUNS[script]["tiny"], "--track"], workdir, env
    )
    assert line == 'error: --track logs to Weights & Biases, which is not installed: pip install ".[wandb]"'


def test_track_when_wandb_cannot_start_is_one_error_line_and_exit_code_2(workdir, monkeypatch):
    """No API key and no offline mode: W&B refuses to start, and the run stops before it makes its folder."""
    pytest.importorskip("wandb", reason='--track needs the wandb extra: pip install ".[wandb]"')
    for name in [name for name in os.environ if name.startswith("WANDB_")]:
        monkeypatch.delenv(name)
    env = {"HOME": workdir, "WANDB_CONFIG_DIR": workdir, "NETRC": os.path.join(workdir, "no-netrc")}
    line = the_one_error_line("dqn.py", ["--total-timesteps", 20_000, "--track"], workdir, env)
    assert line.startswith("error: --track: W&B did not start (") and "WANDB_MODE=offline" in line, line
