"""No host sync in the pieces a script compiles: each script runs a few updates with torch.compile replaced by a
probe (tests/host_sync_probe.py) that records every call making the host wait for the device on CUDA. On a GPU
such a call stalls the stream every step and cannot be captured in a CUDA graph; on this CPU it costs nothing,
so only a test finds it."""

import json
import os

import pytest

from script_runs import PROBE, PROBED_RUNS, SCRIPTS, run_script


@pytest.mark.parametrize("script", PROBED_RUNS)
def test_compiled_pieces_make_no_host_sync(script, tmp_path):
    flags, pieces = PROBED_RUNS[script]
    log = tmp_path / "syncs.json"
    env = {"HOST_SYNC_LOG": str(log), "HOST_SYNC_PIECES": ",".join(sorted(pieces))}
    _, proc = run_script(
        PROBE,
        [os.path.join(SCRIPTS, script), *flags, "--compile", "--eval-episodes", 0],
        tmp_path,
        check=False,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    calls = json.loads(log.read_text())
    assert set(calls) == pieces  # every piece ran under the probe: those handed to torch.compile and the updates
    assert calls == {piece: [] for piece in pieces}


def test_the_probe_finds_host_syncs(tmp_path):
    """The probe itself: a piece that reads a value, branches on a tensor, copies to the host and masks by value."""
    piece = tmp_path / "piece.py"
    piece.write_text(
        "import torch\n"
        "def update(x):\n"
        "    total = x.sum().item()\n"
        "    if x.max() > 0:\n"
        "        x = x.cpu()\n"
        "    return x[x > 0], total\n"
        "torch.compile(update)(torch.arange(-2.0, 3.0))\n"
    )
    log = tmp_path / "syncs.json"
    assert run_script(PROBE, [piece], tmp_path, check=False, env={"HOST_SYNC_LOG": str(log)})[1].returncode == 0
    found = [call.split(" at ")[0] for call in json.loads(log.read_text())["update"]]
    assert found == ["item", "__bool__", "cpu", "__getitem__"]


def test_the_probe_also_watches_the_pieces_a_script_leaves_eager(tmp_path):
    """The updates around the compiled losses are eager; named in HOST_SYNC_PIECES, they are probed all the same."""
    piece = tmp_path / "piece.py"
    piece.write_text(
        "import torch\n"
        "def policy(x):\n"
        "    return x.sum().item()\n"
        "def update(x):\n"
        "    return x.cpu()\n"
        "policy(torch.ones(3))\n"
        "torch.compile(update)(torch.ones(3))\n"
    )
    log = tmp_path / "syncs.json"
    env = {"HOST_SYNC_LOG": str(log), "HOST_SYNC_PIECES": "policy,update"}
    assert run_script(PROBE, [piece], tmp_path, check=False, env=env)[1].returncode == 0
    found = {name: [call.split(" at ")[0] for call in found] for name, found in json.loads(log.read_text()).items()}
    assert found == {"policy": ["item"], "update": ["cpu"]}  # update: once, though compiled and named
