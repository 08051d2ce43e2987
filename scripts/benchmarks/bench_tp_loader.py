"""Feeding tensor-parallel peers: every TP rank builds the same loader, or one broadcasts.

    python scripts/benchmarks/bench_tp_loader.py [--batches 200] [--shapes 4x128,8x2048]
        [--work DIR] [--smoke] [--json out.json]

A torchrun job of 4 CPU ranks (gloo) laid out as 2 DP x 2 TP. For each batch shape
(micro-batch x seq_len), on the bundled corpus, through the project's own data path as
train.py runs it (``data.plan.resolve_plan``: the job's data plan and length index, resolved
once over the ranks; then ``build_dataloader`` for the rank's data-parallel rank):

  build      every TP rank builds the DP rank's loader and draws its batches itself
             (what train.py does): no communication, each peer tokenizes and packs
  broadcast  TP rank 0 builds it; each batch (tensors over the TP group, then its
             spans and loss weight pickled) is broadcast to the peer, which draws
             nothing

Reports per mode: mean wall ms per batch on the TP rank 0 and on its peer, and CPU
ms per batch summed over the TP group (the first batch, which opens the source and
reads its first documents, is counted; it is the same work in both modes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import _root  # noqa: F401 - the repository's root on the path: harness, this torchtitan

from harness import bench
from torchtitan import REPO_ROOT
from torchtitan.tools.launch import run_env, torchrun_command

TENSORS = ("input", "label")
SCRIPT = "scripts/benchmarks/bench_tp_loader.py"  # each rank runs this file


def rank_main(args) -> list[dict]:
    import torch
    import torch.distributed as dist

    from torchtitan import parallel
    from torchtitan.config import parse_args
    from torchtitan.data import build_dataloader
    from torchtitan.data.plan import resolve_plan  # the product path, as train.py runs it
    from torchtitan.data.tokenizer import build_tokenizer

    dims = parallel.init_distributed()
    rows = []
    for shape in args.shapes.split(","):
        batch, seq = map(int, shape.split("x"))
        cfg = parse_args(["--job.config_file", "train_configs/debug_model.toml",
                          "--parallelism.tensor_parallel_degree", "2",
                          "--training.batch_size", str(batch), "--training.seq_len", str(seq)])  # fmt: skip
        layout = parallel.apply_layout(dims, cfg)
        tp_group = layout.mesh["tp"].get_group()
        tokenizer = build_tokenizer(cfg.model)
        plan = resolve_plan(cfg.training, tokenizer, parallel.JobRanks(layout))  # every rank
        row = {"shape": shape, "batches": args.batches}
        for mode in ("build", "broadcast"):
            dist.barrier()
            loader = None
            if mode == "build" or layout.tp_rank == 0:
                loader = build_dataloader(cfg, tokenizer, layout.dp_rank, layout.dp_world, plan)
            times, cpu = [], time.process_time()
            for _ in range(args.batches):
                start = time.perf_counter()
                if mode == "build":
                    item = next(loader)
                else:
                    item = _broadcast(loader, layout, tp_group, batch, seq, torch, dist)
                assert item["input"].shape == (batch, seq)
                times.append(time.perf_counter() - start)
            cpu_ms = 1000 * (time.process_time() - cpu) / args.batches
            group = parallel.all_gather_objects(dims, (statistics.fmean(times), cpu_ms))[:2]
            row[mode] = {  # the first TP group: ranks 0 and 1
                "tp0_ms_per_batch": 1000 * group[0][0],
                "peer_ms_per_batch": 1000 * group[1][0],
                "group_cpu_ms_per_batch": group[0][1] + group[1][1],
            }
        rows.append(row)
    parallel.destroy_distributed()
    return rows


def _broadcast(loader, layout, group, batch: int, seq: int, torch, dist) -> dict:
    """The DP rank's next batch on both TP peers, drawn by TP rank 0 only."""
    src = layout.rank - layout.tp_rank  # the group's first global rank
    item = next(loader) if loader is not None else None
    tensors = [item[k] if item else torch.empty(batch, seq, dtype=torch.long) for k in TENSORS]
    for t in tensors:
        dist.broadcast(t, src=src, group=group)
    rest = [{k: v for k, v in item.items() if k not in TENSORS} if item else None]
    dist.broadcast_object_list(rest, src=src, group=group)
    return {**rest[0], **dict(zip(TENSORS, tensors))}


def main(argv=None) -> int:
    p = bench.Arguments(__doc__, smoke={"batches": 20, "shapes": "4x128"}, work="")
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--shapes", default="4x128,8x2048")
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse(argv)
    if args.rank_main:
        rows = rank_main(args)
        if int(os.environ.get("RANK", "0")) == 0:
            Path(args.out).write_text(json.dumps(rows))
        return 0
    with bench.work_folder(args, "bench_tp_loader_") as root:
        out = root / "rows.json"
        argv = ["--rank-main", "--batches", str(args.batches), "--shapes", args.shapes,
                "--out", str(out)]  # fmt: skip
        proc = subprocess.run(torchrun_command(4, argv, script=SCRIPT), cwd=REPO_ROOT,
                              env=run_env(), capture_output=True, text=True)  # fmt: skip
        if proc.returncode != 0:
            raise SystemExit(proc.stdout[-2000:] + proc.stderr[-4000:])
        rows = json.loads(out.read_text())
    bench.print_table(["shape", "mode", "tp0 ms/batch", "peer ms/batch", "group cpu ms/batch"],
                      [[row["shape"], mode, f"{row[mode]['tp0_ms_per_batch']:.2f}",
                        f"{row[mode]['peer_ms_per_batch']:.2f}",
                        f"{row[mode]['group_cpu_ms_per_batch']:.2f}"]
                       for row in rows for mode in ("build", "broadcast")])  # fmt: skip
    return bench.save(args, {"rows": rows})


if __name__ == "__main__":
    sys.exit(main())
