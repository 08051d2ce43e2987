"""Step time with document-aware attention: block_causal versus causal, side by side.

    python scripts/benchmarks/bench_attention.py [--rounds 2] [--steps 12] [--smoke] [--json out.json]

Trains through ``train.py`` (one process, all cores) the debug model and the 125M flavor
(with the bundled 4,096-token vocab), alternating ``--model.attention_mask causal`` and
``block_causal`` in interleaved rounds, and compares the median step time of the steps
after the first two (``step_ms`` in the metrics: data, forward, backward, optimizer).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import _root  # noqa: F401 - the repository's root on the path: harness, this torchtitan

from torchtitan import REPO_ROOT
from torchtitan.runs import read_records
from torchtitan.tools.launch import DEBUG_CONFIG, run_env

MODELS = {"debugmodel": ["--training.batch_size", "4"], "125M": ["--training.batch_size", "2"]}


def step_ms(flavor: str, mask: str, steps: int, seq_len: int, folder: Path) -> list[float]:
    shutil.rmtree(folder, ignore_errors=True)
    cmd = [sys.executable, "train.py", "--job.config_file", DEBUG_CONFIG, "--job.dump_folder", str(folder),
           "--model.flavor", flavor, "--model.attention_mask", mask, "--training.steps", str(steps),
           "--training.seq_len", str(seq_len), "--metrics.log_freq", "1", *MODELS[flavor]]  # fmt: skip
    env = {**run_env(), "OMP_NUM_THREADS": "2"}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return [r["step_ms"] for r in read_records(folder / "metrics.jsonl") if r["step"] > 2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--smoke", action="store_true", help="debug model only, 4 steps, 1 round")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    flavors = ["debugmodel"] if args.smoke else list(MODELS)
    if args.smoke:
        args.rounds, args.steps, args.seq_len = 1, 4, 128
    times = {(f, m): [] for f in flavors for m in ("causal", "block_causal")}
    with tempfile.TemporaryDirectory(prefix="bench_attention_") as root:
        for _ in range(args.rounds):
            for flavor, mask in times:
                times[(flavor, mask)] += step_ms(flavor, mask, args.steps, args.seq_len,
                                                 Path(root) / f"{flavor}-{mask}")  # fmt: skip
    rows = []
    print(f"{'flavor':<12}{'causal ms':>11}{'block_causal ms':>17}{'ratio':>8}")
    for flavor in flavors:
        causal = statistics.median(times[(flavor, "causal")])
        block = statistics.median(times[(flavor, "block_causal")])
        rows.append({"flavor": flavor, "seq_len": args.seq_len, "causal_ms": causal,
                     "block_causal_ms": block, "block_over_causal": block / causal})  # fmt: skip
        print(f"{flavor:<12}{causal:>11.1f}{block:>17.1f}{block / causal:>8.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
