"""The mixture-of-experts step: tokens/s of debug_moe against the dense debug model at
equal active parameters, and what expert parallelism adds to the step at EP 2.

    python scripts/benchmarks/bench_moe.py [--steps 40] [--rounds 2] [--smoke] [--json out.json]

One process, one thread: ``train.py`` with ``debugmodel`` and with ``debug_moe`` (8
experts, top-2 + 1 shared, each 64 wide: the dense model's 192 active hidden units,
plus the router), interleaved ``--rounds`` times; the median tokens/s of the steps
after the third. Then 2 ranks (torchrun, gloo, one thread each): debug_moe at EP 1
(FSDP 2, every rank all experts) and at EP 2 (FSDP 2, each rank 4 experts, tokens
dispatched and combined by ``all_to_all_single``); the median step time of each.
Last, the all-to-all's share of the step at EP 2: 2 ranks run forward and backward of
debug_moe (batch 4 x 128 per rank) under torch's profiler, and the time the training
thread spends in the all-to-alls (the counts', the dispatch's and combine's, forward
and backward, their waits included: the union of those events' intervals) is divided
by the steps' wall time. The bytes they move per token and layer are
docs/parallelism.md's formula (``2 k dim`` elements forward, as many backward).
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import _root  # noqa: F401 - the repository's root on the path: harness, this torchtitan

from harness import bench
from harness.jobs import torchrun
from torchtitan import REPO_ROOT as REPO
from torchtitan.records.runs import read_records

CONFIG = "train_configs/debug_moe.toml"


def steady(folder: Path, key: str) -> float:
    """The median ``key`` of a run's steps after the third."""
    return statistics.median(
        r[key] for r in read_records(folder / "metrics.jsonl") if r["step"] > 3
    )


def one_process(flavor: str, steps: int, folder: Path) -> float:
    shutil.rmtree(folder, ignore_errors=True)
    cmd = [sys.executable, "train.py", "--job.config_file", CONFIG, "--model.flavor", flavor,
           "--job.dump_folder", str(folder), "--training.steps", str(steps),
           "--metrics.log_freq", "1"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return steady(folder, "tokens_per_s")


def two_ranks(ep: int, steps: int, folder: Path) -> float:
    shutil.rmtree(folder, ignore_errors=True)
    args = ["--job.config_file", CONFIG, "--job.dump_folder", str(folder), "--training.steps",
            str(steps), "--metrics.log_freq", "1", "--parallelism.expert_parallel_degree", str(ep)]  # fmt: skip
    proc = torchrun(2, args)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return steady(folder, "step_ms")


A2A = ("alltoall", "all_to_all", "wait_tensor")  # the profiler's names for them


def ep_worker(out: str, steps: int):
    """(Under torchrun, 2 ranks.) Rank 0 writes the all-to-all's share of the step."""
    import json
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    from torchtitan import parallel
    from torchtitan.config import parse_args
    from torchtitan.models import build_model

    torch.set_num_threads(1)
    dims = parallel.init_distributed()
    cfg = parse_args(["--model.flavor", "debug_moe", "--parallelism.expert_parallel_degree", "2"])
    layout = parallel.apply_layout(dims, cfg)
    model = parallel.parallelize(build_model("debug_moe", 4096, device="meta"), cfg, layout)
    batch = torch.randint(0, 4096, (4, 128), generator=torch.Generator().manual_seed(dims.rank))

    def step():
        model.train()(batch).float().pow(2).mean().backward()

    for _ in range(3):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        wall_us = 1e6 * (time.perf_counter() - start)
    events = prof.events()
    main = next(e.thread for e in events if e.name == "aten::embedding")
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.thread == main and any(n in e.name for n in A2A))  # fmt: skip
    covered, end = 0.0, float("-inf")
    for a, b in spans:  # the union of the intervals (nested events counted once)
        if b > end:
            covered += b - max(a, end)
            end = b
    if dims.is_main:
        Path(out).write_text(json.dumps({"a2a_ms": covered / 1e3 / steps,
                                         "step_ms": wall_us / 1e3 / steps}))  # fmt: skip
    parallel.destroy_distributed()


def a2a_share(steps: int, folder: Path) -> dict:
    out = folder / "a2a.json"
    proc = torchrun(2, ["--ep-worker", str(out), "--steps", str(steps)],
                    script="scripts/benchmarks/bench_moe.py")  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    import json

    return json.loads(out.read_text())


def main(argv=None) -> int:
    if argv is None and "--ep-worker" in sys.argv:
        i = sys.argv.index("--ep-worker")
        return ep_worker(sys.argv[i + 1], int(sys.argv[sys.argv.index("--steps") + 1])) or 0
    p = bench.Arguments(__doc__, smoke={"steps": 6, "rounds": 1}, rounds=2, work="")
    p.add_argument("--steps", type=int, default=40, help="steps per run")
    args = p.parse(argv)
    tps = {"debugmodel": [], "debug_moe": []}
    step_ms = {1: [], 2: []}
    shares = []
    with bench.work_folder(args, "bench-moe-") as work:
        for _ in range(args.rounds):
            for flavor in tps:
                tps[flavor].append(one_process(flavor, args.steps, work / flavor))
            for ep in step_ms:
                step_ms[ep].append(two_ranks(ep, args.steps, work / f"ep{ep}"))
            shares.append(a2a_share(max(3, args.steps // 4), work))
    dense, moe = (statistics.median(tps[f]) for f in ("debugmodel", "debug_moe"))
    ep1, ep2 = (statistics.median(step_ms[e]) for e in (1, 2))
    result = {
        **bench.about(argv, commit=True),
        "smoke": args.smoke,
        "steps": args.steps,
        "rounds": args.rounds,
        "tokens_per_s": {"debugmodel": dense, "debug_moe": moe},
        "moe_over_dense": moe / dense,
        "step_ms": {"ep1": ep1, "ep2": ep2},
        "ep2_over_ep1": ep2 / ep1,
        "a2a_ms": statistics.median(x["a2a_ms"] for x in shares),
        "a2a_step_ms": statistics.median(x["step_ms"] for x in shares),
        "a2a_share": statistics.median(x["a2a_ms"] / x["step_ms"] for x in shares),
    }
    bench.print_table(["model (1 process, 1 thread)", "tokens/s (median)"],
                      [["debugmodel (dense)", f"{dense:.0f}"], ["debug_moe", f"{moe:.0f}"],
                       ["debug_moe / dense", f"{moe / dense:.2f}"]])  # fmt: skip
    bench.print_table(["debug_moe, 2 ranks", "step ms (median)"],
                      [["EP 1 (FSDP 2)", f"{ep1:.1f}"], ["EP 2 (FSDP 2)", f"{ep2:.1f}"],
                       ["EP 2 / EP 1", f"{ep2 / ep1:.2f}"],
                       ["all-to-alls per forward + backward at EP 2 (profiled)",
                        f"{result['a2a_ms']:.1f} of {result['a2a_step_ms']:.1f} "
                        f"({result['a2a_share']:.1%})"]])  # fmt: skip
    return bench.save(args, result)


if __name__ == "__main__":
    sys.exit(main())
