"""Fault tolerance, measured on one machine (docs/benchmarks.md, the last section).

    python scripts/benchmarks/bench_ft.py [--steps 40] [--kill-at 15] [--json out.json]

Side by side, on the debug model, 2 data-parallel replicas of 1 rank each:
- live (torchft): 2 replica groups; group 1 is SIGKILLed after step ``--kill-at``; the
  time from its death to the survivor's next committed step; group 1 is started again:
  the time it takes to heal (the transfer and load) and from its launch to its first
  committed step; the quorum's per-step cost (``quorum_s``), and the median step against
  plain HSDP (2 x 1) on the same layout;
- whole-job restart: plain HSDP with a checkpoint every 10 steps, every rank killed
  after ``--kill-at``, relaunched: from the kill to the first step after the relaunch,
  and the steps trained again.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import _root  # noqa: F401 - the repository's root on the path: harness, this torchtitan

from harness import bench
from torchtitan.tools.ft_launch import group_command, kill_group, start_group, start_lighthouse
from torchtitan.tools.launch import DEBUG_CONFIG, torchrun_command


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _wait_for(pred, timeout: float = 300.0, poll: float = 0.01):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError("bench_ft: a run did not get there in time")


def _step_at(folder: Path, step: int):
    """The time the metrics line of ``step`` appeared (polled)."""
    return _wait_for(lambda: any(r["step"] >= step for r in _records(folder / "metrics.jsonl"))
                     and time.time())  # fmt: skip


def live(work: Path, args: list[str], kill_at: int) -> dict:
    server = start_lighthouse()
    try:
        g = [start_group(group_command(i, 2, 1, server.address(), work, args), work / f"g{i}.log")
             for i in range(2)]  # fmt: skip
        (work / "replica_0").mkdir(exist_ok=True)
        _step_at(work / "replica_1", kill_at)
        kill_group(g[1])
        killed = time.time()
        g[1].wait()
        events = work / "replica_0" / "fault_tolerance.jsonl"
        after = _wait_for(lambda: [e for e in _records(events)
                                   if e.get("committed") and e["time"] > killed])  # fmt: skip
        launched = time.time()
        again = start_group(
            group_command(1, 2, 1, server.address(), work, args, work / "replica_1_again"),
            work / "g1_again.log",
        )
        joined = work / "replica_1_again" / "fault_tolerance.jsonl"
        first = _wait_for(lambda: [e for e in _records(joined) if e.get("committed")])[0]
        for p in (g[0], again):
            p.wait(timeout=600)
    finally:
        server.shutdown()
    heal = [e for e in _records(joined) if "heal_s" in e]
    if not heal:
        raise SystemExit(
            "bench_ft: the survivor finished before the restarted group joined "
            "(it heals only from a live peer); raise --steps"
        )
    steady = [e for e in _records(events) if e.get("committed") and e["participants"] == 2]
    metrics = _records(work / "replica_0" / "metrics.jsonl")
    return {
        "death_to_next_commit_s": after[0]["time"] - killed,
        "heal_s": heal[0]["heal_s"] if heal else None,
        "launch_to_first_commit_s": first["time"] - launched,
        "quorum_ms_median": 1e3 * statistics.median(e["quorum_s"] for e in steady),
        "step_ms_median": statistics.median(r["step_ms"] for r in metrics),
    }


def plain(work: Path, args: list[str], kill_at: int) -> dict:
    hsdp = [*args, "--parallelism.data_parallel_replicate_degree", "2",
            "--parallelism.data_parallel_shard_degree", "1", "--job.dump_folder", str(work),
            "--checkpoint.enable_checkpoint", "--checkpoint.interval", "10"]  # fmt: skip
    proc = start_group(torchrun_command(2, hsdp), work.parent / "plain.log")
    _step_at(work, kill_at)
    kill_group(proc)
    killed = time.time()
    proc.wait()
    done = max(r["step"] for r in _records(work / "metrics.jsonl"))
    saved = max((int(p.name.split("-")[1]) for p in (work / "checkpoint").glob("step-*")),
                default=0)  # fmt: skip
    # The relaunch trims the metrics to the checkpoint's step; done here first, so the
    # step after it is seen when the relaunch writes it, not in the first life's lines.
    kept = [r for r in _records(work / "metrics.jsonl") if r["step"] <= saved]
    (work / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    relaunch = start_group(torchrun_command(2, hsdp), work.parent / "plain_again.log")
    back = _step_at(work, saved + 1)
    relaunch.wait(timeout=600)
    metrics = _records(work / "metrics.jsonl")
    return {
        "kill_to_first_step_s": back - killed,
        "steps_trained_again": done - saved,
        "step_ms_median": statistics.median(r["step_ms"] for r in metrics),
    }


def main(argv=None) -> int:
    parser = bench.Arguments(__doc__, smoke={"steps": 150, "kill_at": 4}, work="")
    parser.add_argument("--steps", type=int, default=120, help="of the live run")
    parser.add_argument("--kill-at", type=int, default=15)
    a = parser.parse(argv)
    args = ["--job.config_file", DEBUG_CONFIG, "--training.steps", str(a.steps),
            "--training.global_batch_size", "8", "--metrics.log_freq", "1"]  # fmt: skip
    with bench.work_folder(a, "bench_ft-") as work:
        (work / "live").mkdir(exist_ok=True)
        short = [*args[:3], str(2 * a.kill_at), *args[4:]]  # the restart needs no long run
        report = {"live": live(work / "live", args, a.kill_at),
                  "restart": plain(work / "restart", short, a.kill_at)}  # fmt: skip
    live_, restart = report["live"], report["restart"]
    bench.print_table(
        ["", "live (torchft)", "whole-job restart"],
        [["death -> next committed step (s)", f"{live_['death_to_next_commit_s']:.2f}",
          f"{restart['kill_to_first_step_s']:.2f} (to the first step after the relaunch)"],
         ["steps trained again", 0, restart["steps_trained_again"]],
         ["joiner heal (s)", f"{live_['heal_s']:.2f}" if live_["heal_s"] else "-", "-"],
         ["joiner launch -> first commit (s)", f"{live_['launch_to_first_commit_s']:.2f}", "-"],
         ["quorum per step (ms, median)", f"{live_['quorum_ms_median']:.1f}", "-"],
         ["median step (ms)", f"{live_['step_ms_median']:.0f}",
          f"{restart['step_ms_median']:.0f} (plain HSDP, same layout)"]],
        "fault tolerance: a replica group killed, live recovery against a whole-job restart",
    )  # fmt: skip
    return bench.save(a, report | {"about": bench.about(argv)})


if __name__ == "__main__":
    sys.exit(main())
