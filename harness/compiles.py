"""Counting torch.compile's work inside training steps: compiles, recompiles, graph breaks.

``counting(train)`` runs ``train.train_loop`` (in this process) and gives each step's
count, everything from one step's call to the next one's (its report and a save
included), as harness/syncs.py does for host reads:

- ``compiles``: frames dynamo compiled (its compile ids, ``"frame/n"``): the first step
  compiles each region once (forward; AOT autograd builds the backward with it);
- ``recompiles``: compiles of a frame already compiled (``n > 0``): a guard failed, e.g.
  a shape, a Python value or a module attribute that changed since the last compile;
- ``breaks``: graph breaks dynamo met while tracing (``torch._dynamo.utils.counters
  ["graph_break"]``, by reason): counted on the step that traced the region, not again
  on the steps that run its pieces from the cache. The project compiles each region ``fullgraph`` (parallel/wrapping.py), so
  a break there raises; the count sees one where a caller compiles without it.

A step with 0 compiles, 0 recompiles and 0 breaks ran only code compiled before it.

Cost: a callback on each compile start and a dict read a step; for tests and benchmarks.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field


@dataclass
class StepCompiles:
    step: int
    compiles: list[str] = field(default_factory=list)  # dynamo compile ids, "frame/n"
    breaks: dict[str, int] = field(default_factory=dict)  # graph breaks, by reason

    @property
    def recompiles(self) -> list[str]:
        return [c for c in self.compiles if not c.endswith("/0")]


class CompileCounter:
    def __init__(self):
        self.steps: list[StepCompiles] = []
        self._breaks: dict[str, int] = {}

    def _seen_breaks(self) -> dict[str, int]:
        from torch._dynamo.utils import counters

        return dict(counters["graph_break"])

    def begin(self, step: int):
        self._close()
        self.steps.append(StepCompiles(step))

    def _close(self):
        now = self._seen_breaks()
        if self.steps:
            new = {k: v - self._breaks.get(k, 0) for k, v in now.items()}
            self.steps[-1].breaks = {k: v for k, v in new.items() if v}
        self._breaks = now


def _compile_id(raw: str) -> str:
    """``"0/1"`` from dynamo's id (``"[0/1]"``, or with a compiled-autograd prefix)."""
    return raw.strip("[]").split("-")[-1]


@contextlib.contextmanager
def counting(train_module):
    """``train_module.train_loop`` (train.py, in this process inside the block) with a
    ``CompileCounter`` over it, a count per step call; yields the counter."""
    import torch._dynamo
    from torch._dynamo import callback

    from harness.syncs import per_step

    counter = CompileCounter()

    def loop(real_loop, run, preemption):
        try:
            return real_loop(run, preemption)
        finally:
            counter._close()

    def on_start(args):
        if counter.steps and args.callback_trigger == callback.CallbackTrigger.DYNAMO:
            counter.steps[-1].compiles.append(_compile_id(str(args.compile_id)))

    torch._dynamo.reset()  # a clean cache: an earlier run's regions would be hits
    handle = callback.on_compile_start(on_start)
    try:
        with per_step(train_module, counter.begin, loop):
            yield counter
    finally:
        callback.callback_handler.remove_start_callback(handle)


def main(argv: list[str] | None = None) -> int:
    """``torchrun harness/compiles.py OUT train.py-arguments...``: ``train.main`` counted;
    each rank writes its steps to ``OUT.rank<r>.json`` and rank 0 prints a summary (the
    repository root on the path)."""
    import json
    import os
    import sys
    from dataclasses import asdict

    import train

    argv = sys.argv[1:] if argv is None else argv
    with counting(train) as counter:
        status = train.main(argv[1:])
    steps = counter.steps
    with open(f"{argv[0]}.rank{os.environ.get('RANK', '0')}.json", "w") as f:
        json.dump([{**asdict(s), "recompiles": s.recompiles} for s in steps], f)
    if os.environ.get("RANK", "0") == "0" and steps:
        later = steps[1:]
        print(f"steps {len(steps)}: step {steps[0].step} compiled {len(steps[0].compiles)} "
              f"regions, {sum(map(sum, (s.breaks.values() for s in steps)))} graph breaks; "
              f"later steps: {sum(len(s.compiles) for s in later)} compiles, "
              f"{sum(len(s.recompiles) for s in later)} recompiles "
              f"(at steps {[s.step for s in later if s.recompiles]})")  # fmt: skip
    return status


if __name__ == "__main__":
    raise SystemExit(main())
