"""Traces, memory views and the W&B logger: written where the docs say, readable by the
tools people open them with, and absent unless asked for."""

from __future__ import annotations

import json
import sys
import time

from helpers import error_lines, train_here

from torchtitan.records.profiling import tracing_ranks


def test_profiling_writes_a_trace_a_trace_viewer_loads(tmp_path):
    """Every 2nd step: a Chrome-trace JSON (the format chrome://tracing and Perfetto
    read) with the step's operators, and on CPU a memory summary beside it. Negative
    control: without the option there is no trace folder."""
    train_here(tmp_path / "on", "--training.steps", 4, "--profiling.enable_profiling",
               "--profiling.profile_freq", 2, "--profiling.enable_memory_snapshot")  # fmt: skip
    folder = tmp_path / "on" / "profile_traces"
    assert sorted(p.name for p in folder.iterdir()) == ["iteration_2", "iteration_4"]
    trace = json.loads((folder / "iteration_4" / "rank0_trace.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any("aten::mm" in n or "aten::addmm" in n for n in names), sorted(names)[:20]
    assert "peak resident memory" in (folder / "iteration_4" / "rank0_memory.txt").read_text()
    train_here(tmp_path / "off", "--training.steps", 2)
    assert not (tmp_path / "off" / "profile_traces").exists()


def test_rank_0_and_the_last_rank_trace():
    assert tracing_ranks(1) == {0} and tracing_ranks(64) == {0, 63}


def test_wandb_offline_writes_a_run_and_missing_wandb_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    train_here(tmp_path / "run", "--training.steps", 3, "--metrics.log_freq", 1,
               "--metrics.enable_wandb")  # fmt: skip
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    # The run file (for `wandb sync`) holds a history record per logged step; this wandb
    # has no Python reader for it, so its bytes are searched for the logged key.
    # wandb's own service process writes the file, and may finish after wandb.finish().
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        record = next(runs[0].glob("*.wandb")).read_bytes()
        if record.count(b"train/loss") >= 3:
            break
        time.sleep(0.1)
    assert record.count(b"train/loss") >= 3 and record.count(b"train/grad_norm") >= 3

    monkeypatch.setitem(sys.modules, "wandb", None)
    status, log = train_here(tmp_path / "none", "--metrics.enable_wandb", expect_ok=False)
    lines = error_lines(log)
    assert status != 0 and len(lines) == 1 and "Traceback" not in log
    assert "pip install wandb" in lines[0]
