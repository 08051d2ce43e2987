"""Fault tolerance at a thousand groups, simulated (docs/benchmarks.md, "Fault tolerance
at scale, simulated").

    python scripts/benchmarks/bench_ft_sim.py [--groups 1000] [--ranks 8] [--steps 10000]
                                              [--seed 0] [--smoke] [--json out.json]

``harness/ft_sim.py`` drives the real split (``replica_steps.split_loader``,
``BatchSchedule.rank_slice``) and the real try of a step (``StepTry``: the rewind of an
uncommitted step) through a simulated quorum: groups die (before a quorum, during a
step, after their commit; several at once), start again fresh and heal, votes fail.
Every committed step's spans are checked against the uninterrupted run's windows
(each window once); the run stops at the first that is not. Reported: the events, and
what the real code costs a rank a step: ``split_loader`` (a step whose participants did
not change, and one whose did: a new ``BatchSchedule``), and a rewind.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time

import _root  # noqa: F401 - the repository's root on the path: harness, this torchtitan

from harness import bench
from harness.ft_sim import RankLoader, WindowLoader, simulate
from torchtitan.data.schedule import BatchSchedule
from torchtitan.faults.replica_steps import split_loader


def split_cost(groups: int, ranks: int, calls: int = 5000, rounds: int = 7) -> dict:
    """``split_loader`` of one rank at ``groups`` x ``ranks``: unchanged, and changing
    (the participants alternate between ``groups`` and ``groups - 1``); microseconds,
    the medians of ``rounds`` interleaved rounds."""
    logging.getLogger("torchtitan.data.schedule").setLevel(logging.ERROR)  # uneven: said
    schedule = BatchSchedule([(0, 4 * groups * ranks + 3)], 4, groups * ranks)
    rank = RankLoader(WindowLoader(schedule, ranks), schedule)
    same, changed = [], []
    for _ in range(rounds):
        split_loader(rank, groups // 2, groups, 3, ranks)
        begin = time.perf_counter()
        for _ in range(calls):
            split_loader(rank, groups // 2, groups, 3, ranks)
        same.append((time.perf_counter() - begin) / calls)
        begin = time.perf_counter()
        for i in range(calls):
            split_loader(rank, groups // 2, groups - (i % 2), 3, ranks)
        changed.append((time.perf_counter() - begin) / calls)
    return {"unchanged_us": statistics.median(same) * 1e6,
            "changed_us": statistics.median(changed) * 1e6}  # fmt: skip


def main(argv=None) -> int:
    p = bench.Arguments(__doc__, smoke={"groups": 20, "ranks": 4, "steps": 300})
    p.add_argument("--groups", type=int, default=1000)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse(argv)
    report = simulate(args.groups, args.ranks, args.steps, seed=args.seed)
    costs = split_cost(args.groups, args.ranks)
    result = {"about": bench.about(argv, commit=True), "simulation": report.summary(),
              "split": costs}  # fmt: skip
    r = result["simulation"]
    rows = [
        ["groups x ranks, steps", f"{r['groups']} x {r['ranks']}, {r['steps']:,}"],
        ["committed steps checked (windows = the uninterrupted run's, none twice)",
         f"**{r['committed']:,}** (all)"],
        ["tries not committed (rewound)", f"{r['uncommitted']:,}"],
        ["deaths; most in one step", f"{r['deaths']:,}; {r['deaths_in_a_step_most']}"],
        ["joins (fresh, healed); quorums healing more than one group", f"{r['joins']:,}; "
         f"{r['joins_while_healing']}"],
        ["heals in a step a group died in", f"{r['heals_with_death']}"],
        ["participants (min - max)", f"{r['participants_min']} - {r['participants_max']}"],
        ["split_loader calls that changed a rank's split", f"{r['reshards']:,}"],
        ["a rank's split_loader, unchanged / changed (us)",
         f"**{costs['unchanged_us']:.2f}** / **{costs['changed_us']:.2f}**"],
        ["a rank's split_loader in the run (median, sampled steps, us)",
         f"{r['split_us_median']:.2f}"],
        ["a rewind, StepTry.settle(False) (median, us)", f"**{r['rewind_us_median']:.2f}**"],
        ["the check, all steps (s); the whole simulation (s)",
         f"{r['check_s']:.1f}; {r['seconds']:.0f}"],
    ]  # fmt: skip
    bench.print_table(["", "figure"], rows, "fault tolerance at scale, simulated")
    print(f"\n{result['about']}")
    return bench.save(args, result)


if __name__ == "__main__":
    sys.exit(main())
