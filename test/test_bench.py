"""Benchmarks are not tests: this only checks that each runs in smoke mode and reports its fields."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO

FIELDS = {
    "bench_data.py": {
        "raw_encode_tokens_per_s",
        "workers0_over_raw",
        "workers2_over_workers0",
        "state_bytes_per_rank",
    },
    "bench_resume.py": {"median_1pct_s", "median_99pct_s", "ratio_99_over_1"},
    "bench_step.py": {"on_over_off", "median_data_wait_share"},
    "bench_checkpoint.py": {"save_mb_per_s", "load_mb_per_s", "async_blocked_over_sync"},
}


@pytest.mark.parametrize("script", sorted(FIELDS))
def test_benchmark_smoke(script, tmp_path):
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(REPO / "scripts" / script), "--smoke", "--json", str(out)]
    if script == "bench_resume.py":
        cmd += ["--corpus", str(tmp_path / "corpus")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    row = result[0] if isinstance(result, list) else result
    assert FIELDS[script] <= set(row), proc.stdout
