"""DCP save/load cost, and how long a save blocks training: sync versus async.

    python scripts/bench_checkpoint.py [--flavors debugmodel,125M] [--smoke] [--json out.json]

For each flavor (125M with a 32,000-token vocab has 134 M parameters), builds the
model and an AdamW optimizer with its state, then in one process:
  sync   time blocked in ``dcp.save``
  async  time the loop is blocked by ``dcp.async_save``: the call, plus the wait for the
         background staging copy after one forward/backward (the next optimizer step
         must not change parameters still being copied); steady state (second save)
  load   time of ``dcp.load`` into a fresh state dict
and reports MB/s and the ratio async-blocked / sync (target <= 0.2 at >= 100 M params).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from torchtitan.models import build_model, count_parameters

warnings.filterwarnings("ignore")  # DCP's "saving in a single process" notices

VOCAB = {"debugmodel": 4096, "125M": 32000}


def folder_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def state_of(flavor: str):
    torch.manual_seed(0)
    model = build_model(flavor, VOCAB.get(flavor, 4096), device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randint(0, 100, (1, 16))).float().mean().backward()
    opt.step()
    return model, {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, opt),
    }


def train_work(model: torch.nn.Module):
    """A forward and backward pass: what a training step does before its optimizer step."""
    model(torch.randint(0, 100, (2, 128))).float().mean().backward()


def bench(flavor: str, root: Path) -> dict:
    model, state = state_of(flavor)
    sync_dir = root / f"{flavor}-sync"
    start = time.perf_counter()
    dcp.save(state, checkpoint_id=str(sync_dir), no_dist=True)
    sync_s = time.perf_counter() - start

    # As CheckpointManager does: one stager for the run, staging in the background; the
    # loop blocks for the call, then (if staging is not done) before the optimizer step.
    stager = DefaultStager(StagingOptions(False, False, True, False))
    blocked = []
    for i in range(2):  # the first save allocates the staging buffers, later ones reuse them
        start = time.perf_counter()
        response = dcp.async_save(state, checkpoint_id=str(root / f"{flavor}-async{i}"), no_dist=True,
                                  async_stager=stager)  # fmt: skip
        call_s = time.perf_counter() - start
        train_work(model)
        start = time.perf_counter()
        response.staging_completion.result()
        blocked.append(call_s + time.perf_counter() - start)
        response.upload_completion.result()
    stager.close()
    async_blocked_s = blocked[-1]

    _, fresh = state_of(flavor)
    start = time.perf_counter()
    dcp.load(fresh, checkpoint_id=str(sync_dir), no_dist=True)
    load_s = time.perf_counter() - start
    assert all(torch.equal(fresh["model"][k], state["model"][k]) for k in state["model"])
    mb = folder_mb(sync_dir)
    return {
        "flavor": flavor,
        "parameters": count_parameters(model),
        "checkpoint_mb": mb,
        "sync_save_s": sync_s,
        "async_blocked_s": async_blocked_s,
        "async_blocked_first_save_s": blocked[0],
        "load_s": load_s,
        "save_mb_per_s": mb / sync_s,
        "load_mb_per_s": mb / load_s,
        "async_blocked_over_sync": async_blocked_s / sync_s,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--flavors", default="debugmodel,125M")
    p.add_argument("--smoke", action="store_true", help="debugmodel only")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    flavors = ["debugmodel"] if args.smoke else args.flavors.split(",")
    root = Path(tempfile.mkdtemp(prefix="bench_ckpt_"))
    try:
        rows = [bench(f, root) for f in flavors]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{'flavor':<12}{'params':>14}{'MB':>9}{'save s':>9}{'save MB/s':>11}{'load s':>9}{'load MB/s':>11}"
          f"{'async blk s':>13}{'async/sync':>12}")  # fmt: skip
    for r in rows:
        print(f"{r['flavor']:<12}{r['parameters']:>14,}{r['checkpoint_mb']:>9.1f}{r['sync_save_s']:>9.2f}"
              f"{r['save_mb_per_s']:>11.0f}{r['load_s']:>9.2f}{r['load_mb_per_s']:>11.0f}"
              f"{r['async_blocked_s']:>13.3f}{r['async_blocked_over_sync']:>12.3f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
