"""Checkpoints on an object store against a local folder, as train.py drives CheckpointManager.

    python scripts/benchmarks/bench_s3_checkpoint.py [--flavor 125M] [--ranks 2]
                                       [--interval 4] [--saves 2] [--smoke] [--json out.json]

Starts the local S3 API of ``harness/s3.py`` (moto's server on 127.0.0.1, reached through
fsspec/s3fs and the AWS_* variables as a job reaches a bucket), then one torchrun job of
``--ranks`` CPU ranks (gloo, FSDP2) that builds the model and AdamW with the project's
builders and runs the loop's calls as train.py makes them (``wait_for_staging()`` before
the optimizer step, ``save()`` every ``interval`` steps, ``close()``), for each folder
(``local``: under the work folder; ``s3``: ``s3://<bucket>/run``) and each mode (sync,
async). Measured on rank 0:

  durable s     a save from its call until the checkpoint is complete (sync: the call;
                async: until the manifest is written, from the finalizer thread)
  blocked s     every moment the loop spent inside CheckpointManager calls, over all saves
                (sync: the whole write; async: the hand-off, staging and a wait for an
                earlier save), per save
  resume s      a new manager's load() of the newest checkpoint: listing, verification
                (CRC32 locally, ETags on the store), DCP's read

The local server is one Python process on this machine: its figures bound the client's
overhead (requests, no rename), not a real bucket's bandwidth.
"""

from __future__ import annotations

import argparse
import json
import logging
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

VOCAB = {"debugmodel": 4096, "125M": 32000}


def rank_main(args) -> dict:
    """One rank of the measured job (run under torchrun)."""
    import torch
    import torch.nn.functional as F

    from torchtitan import parallel
    from torchtitan.checkpoint import CheckpointManager, TrainState
    from torchtitan.checkpoint.stateful import training_components
    from torchtitan.config import parse_args
    from torchtitan.models import build_model, count_parameters
    from torchtitan.optim import build_lr_scheduler, build_optimizer

    logging.getLogger("torchtitan").setLevel(logging.WARNING)
    dims = parallel.init_distributed()
    torch.manual_seed(0)
    vocab = VOCAB[args.flavor]
    model = build_model(args.flavor, vocab, device="meta")
    params = count_parameters(model)
    model = parallel.parallelize(model, parse_args([]), dims)  # FSDP, as train.py does
    tokens = torch.randint(
        0, vocab, (1, args.seq_len + 1), generator=torch.Generator().manual_seed(0)
    )
    rows = []
    for where, folder in (("local", os.path.join(args.root, "local")), ("s3", args.url)):
        for mode in ("disabled", "async"):
            target = f"{folder}/{mode}"
            cfg = parse_args([
                "--job.dump_folder", os.path.join(args.root, "dump"),
                "--checkpoint.folder", target,
                "--checkpoint.enable_checkpoint", "--checkpoint.async_mode", mode,
                "--checkpoint.interval", str(args.interval), "--checkpoint.keep_latest_k", "1",
                "--training.steps", str(args.interval * args.saves),
                "--lr_scheduler.warmup_steps", "1",
            ])  # fmt: skip
            optimizer = build_optimizer(model, cfg)
            scheduler = build_lr_scheduler(optimizer, cfg)

            def manager_for(state, cfg=cfg, optimizer=optimizer, scheduler=scheduler):
                components = training_components(cfg, dims, model=model, optimizer=optimizer,
                                                 lr_scheduler=scheduler, train_state=state,
                                                 fingerprint={})  # fmt: skip
                return CheckpointManager(cfg, dims, components, fingerprint={})

            state = TrainState()
            manager = manager_for(state)
            blocked, durable, steps_s = 0.0, [], []
            while state.step < cfg.training.steps:
                begin = time.perf_counter()
                logits = model(tokens[:, :-1])
                F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
                t = time.perf_counter()
                manager.wait_for_staging()
                blocked += time.perf_counter() - t
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                state.step += 1
                steps_s.append(time.perf_counter() - begin)
                if manager.should_save(state.step):
                    t = time.perf_counter()
                    manager.save(state.step)
                    blocked += time.perf_counter() - t
                    durable.append(time.perf_counter() - t)
            manager.close()
            if mode == "async":  # the last save, from its call until its manifest is written
                durable = [manager.saver.last_write_s]
            resumed = TrainState()
            again = manager_for(resumed)
            t = time.perf_counter()
            again.load()
            resume_s = time.perf_counter() - t
            again.close()
            assert resumed.step == state.step, "the resume must load the last save"
            rows.append({
                "flavor": args.flavor, "parameters": params, "ranks": dims.world_size,
                "folder": where, "mode": "sync" if mode == "disabled" else "async",
                "interval": args.interval, "saves": args.saves,
                "durable_s": statistics.median(durable),
                "blocked_per_save_s": blocked / args.saves,
                "resume_s": resume_s, "median_step_s": statistics.median(steps_s),
            })  # fmt: skip
    parallel.destroy_distributed()
    return rows


def run_job(args, root: Path, url: str) -> list[dict]:
    out = root / "result.json"
    argv = ["--rank-main", "--flavor", args.flavor, "--interval", str(args.interval),
            "--saves", str(args.saves), "--seq-len", str(args.seq_len), "--root", str(root),
            "--url", url, "--json", str(out)]  # fmt: skip
    env = {**run_env(), "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // args.ranks))}
    script = "scripts/benchmarks/bench_s3_checkpoint.py"
    proc = subprocess.run(torchrun_command(args.ranks, argv, script=script), cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True)  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-2000:] + proc.stderr[-4000:])
    return json.loads(out.read_text())


def main(argv=None) -> int:
    p = bench.Arguments(__doc__, smoke={"flavor": "debugmodel", "ranks": 2, "saves": 2,
                                        "interval": 2}, work="")  # fmt: skip
    p.add_argument("--flavor", default="125M", choices=sorted(VOCAB))
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--saves", type=int, default=2)
    p.add_argument("--interval", type=int, default=4, help="steps between saves")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--root", default="", help=argparse.SUPPRESS)
    p.add_argument("--url", default="", help=argparse.SUPPRESS)
    args = p.parse(argv)
    if args.rank_main:
        rows = rank_main(args)
        if int(os.environ.get("RANK", "0")) == 0:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        return 0
    from harness.s3 import local_s3, missing

    reason = missing()
    if reason:
        raise SystemExit(f"bench_s3_checkpoint: {reason}")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    # The local server joins a multipart upload's parts in Python: on a busy 2-core machine
    # completing a 700 MB object outlasts botocore's 60 s read timeout, and the retry finds
    # the upload gone. The ranks' clients (fsspec's per-protocol config, read from the
    # environment) wait longer; a real bucket needs nothing of the kind.
    os.environ["FSSPEC_S3"] = json.dumps({"config_kwargs": {"read_timeout": 900}})
    with bench.work_folder(args, "bench_s3_ckpt_") as root, local_s3() as (bucket, _):
        rows = run_job(args, root, f"s3://{bucket}/run")
    header = ["flavor", "params", "ranks", "folder", "mode", "interval s", "durable s",
              "blocked s / save", "resume s"]  # fmt: skip
    bench.print_table(header, [
        [r["flavor"], f"{r['parameters']:,}", r["ranks"], r["folder"], r["mode"],
         f"{r['interval'] * r['median_step_s']:.2f}", f"{r['durable_s']:.2f}",
         f"{r['blocked_per_save_s']:.3f}", f"{r['resume_s']:.2f}"]
        for r in rows])  # fmt: skip
    return bench.save(args, rows)


if __name__ == "__main__":
    sys.exit(main())
