"""Step time with document-aware attention: block_causal versus causal, side by side.

    python scripts/benchmarks/bench_attention.py [--rounds 2] [--steps 12] [--smoke] [--json out.json]

Trains through ``train.py`` (one process, all cores) the debug model and the 125M flavor
(with the bundled 4,096-token vocab), alternating ``--model.attention_mask causal`` and
``block_causal`` in interleaved rounds, and compares the median step time of the steps
after the first two (``step_ms`` in the metrics: data, forward, backward, optimizer).
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import _root  # noqa: F401 - the repository's root on the path: harness, this torchtitan

from harness import bench
from torchtitan import REPO_ROOT
from torchtitan.records.runs import read_records
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
    p = bench.Arguments(__doc__, smoke={"rounds": 1, "steps": 4, "seq_len": 128}, rounds=2,
                        work="")  # fmt: skip
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=512)
    args = p.parse(argv)
    flavors = ["debugmodel"] if args.smoke else list(MODELS)  # the smoke: debugmodel only
    times = {(f, m): [] for f in flavors for m in ("causal", "block_causal")}
    with bench.work_folder(args, "bench_attention_") as root:
        for _ in range(args.rounds):
            for flavor, mask in times:
                times[(flavor, mask)] += step_ms(flavor, mask, args.steps, args.seq_len,
                                                 root / f"{flavor}-{mask}")  # fmt: skip
    rows = []
    for flavor in flavors:
        causal = statistics.median(times[(flavor, "causal")])
        block = statistics.median(times[(flavor, "block_causal")])
        rows.append({"flavor": flavor, "seq_len": args.seq_len, "causal_ms": causal,
                     "block_causal_ms": block, "block_over_causal": block / causal})  # fmt: skip
    bench.print_table(["flavor", "seq_len", "causal ms", "block_causal ms", "block / causal"],
                      [[r["flavor"], r["seq_len"], f"{r['causal_ms']:.1f}",
                        f"{r['block_causal_ms']:.1f}", f"{r['block_over_causal']:.3f}"]
                       for r in rows])  # fmt: skip
    return bench.save(args, {"rows": rows})


if __name__ == "__main__":
    sys.exit(main())
