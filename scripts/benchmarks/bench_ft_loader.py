"""What a participant change costs a fault-tolerant rank's loader workers (docs/benchmarks.md,
"Fault tolerance: a participant change with loader workers").

    python scripts/benchmarks/bench_ft_loader.py [--steps 60] [--every 6] [--step-ms 100]
                                                 [--rounds 3] [--smoke] [--json out.json]

One rank's real loader (the bundled corpus, seq 512, global batch 16 in micro-batches of
4) with 1 and 2 workers, pulled as a training loop pulls it: ``next_step``, then
``--step-ms`` of a step that leaves the CPU to the workers (a sleep: an accelerator's
step). Every ``--every`` steps the step's participants change (1 <-> 2, through
``replica_steps.split_loader``, as ``ReplicaGroup.next_step`` does). Timed: the wait for
the step's batches, the step after a change against the others, two ways:
- ``request``: what the loader does (the running workers follow the new split);
- ``restart``: the workers stopped at the change and started again at the next batch
  (what ``reshard`` did before: ``close`` then the next batch), the same windows.
The batches of both ways are compared with a 0-worker loader's (the same split each
step): a run that differs stops the benchmark.
"""

from __future__ import annotations

import statistics
import sys
import time

import _root  # noqa: F401 - the repository's root on the path: harness, this torchtitan

from harness import bench
from torchtitan.config import parse_args
from torchtitan.data import build_dataloader
from torchtitan.data.tokenizer import build_tokenizer
from torchtitan.faults.replica_steps import split_loader
from torchtitan.tools.launch import DEBUG_CONFIG


def _cfg(workers: int):
    return parse_args(["--job.config_file", DEBUG_CONFIG, "--training.seq_len", "512",
                       "--training.batch_size", "4", "--training.global_batch_size", "16",
                       "--training.num_workers", str(workers)])  # fmt: skip


def _participants(step: int, every: int) -> int:
    return 2 if (step // every) % 2 == 0 else 1


def pull(workers: int, how: str, steps: int, every: int, step_s: float, tokenizer) -> dict:
    """One run: the data wait (ms) of each step after a change and of the others, and the
    steps' windows (participant 0's share)."""
    loader = build_dataloader(_cfg(workers), tokenizer, 0, 1)
    changed, steady, windows = [], [], []
    try:
        for step in range(steps):
            n = _participants(step, every)
            change = step > 0 and n != _participants(step - 1, every)
            if change and how == "restart":
                loader.close()
            begin = time.perf_counter()
            split_loader(loader, 0, n, 0, 1)
            batches = loader.next_step()
            wait = 1e3 * (time.perf_counter() - begin)
            if step >= every:  # the first change after the start-up's steps
                (changed if change else steady).append(wait)
            windows.append([row.tolist() for b in batches for row in b["input"]])
            time.sleep(step_s)
    finally:
        loader.close()
    return {"changed": changed, "steady": steady, "windows": windows}


def main(argv=None) -> int:
    parser = bench.Arguments(__doc__, smoke={"steps": 14, "every": 4, "step_ms": 20}, rounds=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=6, help="steps between two changes")
    parser.add_argument("--step-ms", type=float, default=100.0)
    a = parser.parse(argv)
    if a.smoke:
        a.rounds = 1
    tokenizer = build_tokenizer(_cfg(0).model)
    reference = pull(0, "request", a.steps, a.every, 0.0, tokenizer)["windows"]
    waits = {}
    for _ in range(a.rounds):  # interleaved: the machine's drift is spread over both ways
        for workers in (1, 2):
            for how in ("request", "restart"):
                run = pull(workers, how, a.steps, a.every, a.step_ms / 1e3, tokenizer)
                if run["windows"] != reference:
                    raise SystemExit(f"bench_ft_loader: {workers} workers ({how}) read other "
                                     "windows than the 0-worker loader")  # fmt: skip
                w = waits.setdefault(f"{workers} {how}", {"changed": [], "steady": []})
                w["changed"] += run["changed"]
                w["steady"] += run["steady"]
    report = {}
    for key, w in waits.items():
        changed, steady = statistics.median(w["changed"]), statistics.median(w["steady"])
        report[key] = {"changed_ms": changed, "steady_ms": steady, "cost_ms": changed - steady,
                       "changes": len(w["changed"])}  # fmt: skip
    bench.print_table(
        ["workers, a change by", "wait after a change (ms)", "wait otherwise (ms)",
         "cost of a change (ms)", "changes timed"],
        [[k, f"{r['changed_ms']:.1f}", f"{r['steady_ms']:.1f}", f"{r['cost_ms']:.1f}",
          r["changes"]] for k, r in report.items()],
        f"loader workers: a participant change (medians; a step of {a.step_ms:g} ms)",
    )  # fmt: skip
    return bench.save(a, {"waits": report, "same_windows": True, "about": bench.about(argv)})


if __name__ == "__main__":
    sys.exit(main())
