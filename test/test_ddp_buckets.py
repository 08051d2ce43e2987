"""DDP's gradient buckets (parallel/wrapping.apply_ddp) on three forked gloo ranks: a
step's all-reduced gradient is the same bits in a fresh wrapper as in one that has run
steps before, which a resume needs (a resumed process's first step runs in a fresh
wrapper). Found by the fault campaign (a DDP job on 3 ranks resumed at step 5 drifted by
ulps from step 6 on)."""

from __future__ import annotations

import torch
from helpers import rank_context, rank_results

from torchtitan import parallel
from torchtitan.models import build_model


def _rank(rank: int, store: str, out, ddp_kwargs: dict | None) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from torchtitan.parallel.wrapping import apply_ddp

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=3)
    try:
        torch.set_num_threads(1)
        dims = parallel.ParallelDims(rank, 3, rank, torch.device("cpu"), "gloo")

        def wrapped():
            model = build_model("debugmodel", 4096, device="cpu", seed=3)
            if ddp_kwargs is None:
                return apply_ddp(model, dims)
            return DistributedDataParallel(model, **ddp_kwargs)  # the control

        def grads(model, batch) -> list:
            model.zero_grad()
            model(batch).float().square().mean().backward()
            return [p.grad.clone() for p in model.parameters()]

        g = torch.Generator().manual_seed(rank)
        first, second = (torch.randint(0, 4096, (2, 32), generator=g) for _ in range(2))
        warm = wrapped()
        grads(warm, first)
        after_a_step = grads(warm, second)
        fresh = grads(wrapped(), second)
        out.put((rank, all(torch.equal(a, b) for a, b in zip(after_a_step, fresh))))
    finally:
        dist.destroy_process_group()


def _same_bits_fresh_or_warm(tmp_path, ddp_kwargs=None) -> dict:
    tmp_path.mkdir()
    ctx = rank_context()
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "store"), out, ddp_kwargs))
             for r in range(3)]  # fmt: skip
    for p in procs:
        p.start()
    return dict(rank_results(out, procs))


def test_a_steps_gradient_does_not_depend_on_the_steps_before_it(tmp_path):
    """3 ranks: the gradient of the second batch, all-reduced by a wrapper that has
    already run a step, equals bit for bit the one a fresh wrapper gives (the resumed
    process). Negative control: DDP's default, which re-buckets after its first step,
    gives other bits on some rank."""
    assert _same_bits_fresh_or_warm(tmp_path / "ours") == {0: True, 1: True, 2: True}
    control = _same_bits_fresh_or_warm(tmp_path / "default", {})
    assert not all(control.values()), control
