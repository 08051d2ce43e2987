"""Per-step cost of checkpointing and data loading in the training loop, and the step
itself side by side with torchtitan 0.3.0's.

    python scripts/benchmarks/bench_step.py [--steps 300] [--rounds 2] [--work DIR] [--smoke]
        [--json out.json]
        [--peer-python /path/to/venv/bin/python] [--baseline-repo DIR] [--peer-only]

Trains the debug model (one process, one thread) alternately with checkpointing off
and on (interval 100), --rounds times each, and compares the median step time of the
steady-state steps (the save steps themselves excluded: their cost is measured by
bench_checkpoint.py). Also reports data-wait time as a share of step time.
Targets: on/off within 2%; data wait <= 2% of the step.

Then a 2-rank torchrun job with checkpointing on (so save-on-signal is armed) reports
the preemption agreement the loop pays every step (``stop_check_ms`` in its metrics)
as a share of the step time. Target: <= 1%.

Last, the step against torchtitan 0.3.0 (``--peer-python``: a virtual environment
where ``import torchtitan`` is 0.3.0; this script installs nothing and skips the peer,
saying why, when it cannot import it): the same Llama shapes (dim 256, 6 layers, 16
heads, vocab 4096: 7,212,288 parameters), seq 512, batch 4, fp32, one CPU thread,
eager; forward, cross-entropy, backward, clipping, AdamW and LR step. Ours is the
product path (``BatchLoss`` and ``TrainStep`` with the optimizer and schedule from the
config); the peer's model is built from its own llama3 ``debugmodel`` spec at vocab
4096 (fused QKV, complex RoPE) with its SDPA attention (its flex attention has no
backward on CPU), and its default AdamW (``fused``). ``--peer-rounds`` rounds, each a
fresh process per side, ours first; medians of the steps' wall time and of their CPU
time (one thread: the figure another job on the machine cannot inflate by taking the
core away). ``--baseline-repo DIR`` adds another
checkout of this project (e.g. the commit before a change) to every round: a
before/after ratio measured side by side. Target: ours / peer <= 1.0.
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


def run(steps: int, checkpoint: bool, folder: Path, interval: int) -> tuple[list[dict], int]:
    """Per-step records of one training process, and how many checkpoints it wrote."""
    shutil.rmtree(folder, ignore_errors=True)
    cmd = [sys.executable, "train.py", "--job.config_file", "train_configs/debug_model.toml",
           "--job.dump_folder", str(folder), "--training.steps", str(steps), "--metrics.log_freq", "1",
           "--lr_scheduler.warmup_steps", "10"]  # fmt: skip
    if checkpoint:
        cmd += ["--checkpoint.enable_checkpoint", "--checkpoint.interval", str(interval)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    saved = folder / "checkpoint"
    written = len([n for n in os.listdir(saved) if n.startswith("step-")]) if saved.is_dir() else 0
    return read_records(folder / "metrics.jsonl"), written


def agreement_share(steps: int, folder: Path) -> tuple[float, float]:
    """Median stop-agreement ms and median step ms of a 2-rank job (all steps after 2)."""
    shutil.rmtree(folder, ignore_errors=True)
    args = ["--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder", str(folder),
            "--training.steps", str(steps), "--metrics.log_freq", "1", "--checkpoint.enable_checkpoint",
            "--checkpoint.interval", str(steps)]  # fmt: skip
    proc = torchrun(2, args)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    records = [r for r in read_records(folder / "metrics.jsonl") if r["step"] > 2]
    return (statistics.median(r["stop_check_ms"] for r in records),
            statistics.median(r["step_ms"] for r in records))  # fmt: skip


# ---- the step side by side with torchtitan 0.3.0 ------------------------------------

STEP_SHAPE = {"dim": 256, "n_layers": 6, "n_heads": 16, "vocab_size": 4096, "seq_len": 512,
              "batch_size": 4, "rope_theta": 500000.0}  # fmt: skip

# One process of ours, the product path, against the checkout on its PYTHONPATH (this
# one or --baseline-repo: only APIs both have).
OURS_STEP = r"""
import json, statistics, sys, time
import torch
a = json.loads(sys.argv[1])
torch.set_num_threads(1)
from torchtitan import parallel
from torchtitan.config import parse_args
from torchtitan.models.llama import ModelArgs, Transformer
from torchtitan.optim import build_lr_scheduler, build_optimizer
from torchtitan.step import BatchLoss, TrainStep
cfg = parse_args(["--training.seq_len", str(a["seq_len"]), "--training.batch_size",
                  str(a["batch_size"]), "--training.mixed_precision_param", "float32"])
dims = parallel.ParallelDims(0, 1, 0, torch.device("cpu"), "gloo")
args = ModelArgs(dim=a["dim"], n_layers=a["n_layers"], n_heads=a["n_heads"],
                 vocab_size=a["vocab_size"], multiple_of=256, rope_theta=a["rope_theta"],
                 max_seq_len=a["seq_len"])
with torch.device("meta"):
    model = Transformer(args)
model.to_empty(device="cpu")
model.init_weights(0)
optimizer = build_optimizer(model, cfg)
step = TrainStep(cfg, model, optimizer, build_lr_scheduler(optimizer, cfg),
                 BatchLoss(cfg, model, dims), lambda: None)
tokens = torch.randint(0, a["vocab_size"], (a["batch_size"], a["seq_len"] + 1),
                       generator=torch.Generator().manual_seed(0))
batch = {"input": tokens[:, :-1], "label": tokens[:, 1:]}
times, cpu = [], []
for i in range(a["warmup"] + a["steps"]):
    start, start_cpu = time.perf_counter(), time.process_time()
    step([batch])
    times.append(time.perf_counter() - start)
    cpu.append(time.process_time() - start_cpu)
print("RESULT", json.dumps({"step_ms": 1000 * statistics.median(times[a["warmup"]:]),
      "cpu_step_ms": 1000 * statistics.median(cpu[a["warmup"]:]),
      "parameters": sum(p.numel() for p in model.parameters())}))
"""

PEER_STEP = (
    bench.peer_check(
        """
    import torch
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry
    """,
        "llama3 model",
    )
    + r"""
import torch.nn.functional as F
torch.set_num_threads(1)
spec = model_registry("debugmodel")  # dim 256, 6 layers, 16 heads
config = spec.model
config.vocab_size = config.tok_embeddings.num_embeddings = args["vocab_size"]
config.lm_head.out_features = args["vocab_size"]
for layer in config.layers:  # its flex attention has no backward on CPU
    layer.attention.inner_attention = ScaledDotProductAttention.Config()
torch.manual_seed(0)
model = config.build()
model.init_states()
# default_adamw with the default implementation of its OptimizersContainer ("fused").
optimizer = torch.optim.AdamW(model.parameters(), lr=8e-4, betas=(0.9, 0.95), eps=1e-8,
                              weight_decay=0.1, fused=True)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 201))
tokens = torch.randint(0, args["vocab_size"], (args["batch_size"], args["seq_len"] + 1),
                       generator=torch.Generator().manual_seed(0))
inputs, labels = tokens[:, :-1], tokens[:, 1:]
times, cpu = [], []
for i in range(args["warmup"] + args["steps"]):
    start, start_cpu = time.perf_counter(), time.process_time()
    logits = model(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - start)
    cpu.append(time.process_time() - start_cpu)
print("RESULT", json.dumps({"step_ms": 1000 * statistics.median(times[args["warmup"]:]),
      "cpu_step_ms": 1000 * statistics.median(cpu[args["warmup"]:]),
      "parameters": sum(p.numel() for p in model.parameters())}))
"""
)


def step_process(python: str, program: str, pythonpath: str | None, steps: int, warmup: int):
    """(median step ms, median CPU ms of a step, parameters) of one fresh process running
    ``program``, from the temporary folder: only ``pythonpath`` decides whose torchtitan
    it is."""
    args = {**STEP_SHAPE, "steps": steps, "warmup": warmup}
    result = bench.run_program(program, args, python=python, pythonpath=pythonpath)
    return result["step_ms"], result["cpu_step_ms"], result["parameters"]


def step_vs_peer(peer_python: str, baseline: str, rounds: int, steps: int, warmup: int) -> dict:
    """Interleaved rounds of ours (this checkout), the baseline checkout and the peer."""
    sides = {"ours": (sys.executable, OURS_STEP, str(REPO))}
    if baseline:
        sides["baseline"] = (sys.executable, OURS_STEP, str(Path(baseline).resolve()))
    skipped = "" if peer_python else "no --peer-python"
    if peer_python:
        sides["peer"] = (peer_python, PEER_STEP, None)
    ms = {name: [] for name in sides}
    cpu = {name: [] for name in sides}
    parameters = {}
    for _ in range(rounds):
        for name, (python, program, path) in list(sides.items()):
            try:
                step_ms, cpu_ms, parameters[name] = step_process(
                    python, program, path, steps, warmup
                )
            except bench.PeerUnavailable as e:
                skipped = str(e)
                del sides[name], ms[name], cpu[name]
                continue
            ms[name].append(step_ms)
            cpu[name].append(cpu_ms)
            print(f"step {name}: {step_ms:.1f} ms ({cpu_ms:.1f} ms of CPU time)", flush=True)
    result = {"shape": STEP_SHAPE, "rounds": rounds, "steps": steps, "step_ms": ms,
              "cpu_step_ms": cpu, "parameters": parameters,
              "peer_skipped": skipped}  # fmt: skip
    med = {name: statistics.median(v) for name, v in ms.items()}
    result["median_step_ms"] = med
    # On a shared machine wall time counts the moments another job held the core; the
    # process's CPU time (one thread) does not, so it is the steadier figure of the two.
    result["median_cpu_step_ms"] = {n: statistics.median(v) for n, v in cpu.items()}
    for other in ("peer", "baseline"):
        if other in ms:
            result[f"ours_over_{other}"] = med["ours"] / med[other]
            result[f"rounds_ours_slower_than_{other}"] = sum(
                o > p for o, p in zip(ms["ours"], ms[other])
            )
            own = result["median_cpu_step_ms"]
            result[f"cpu_ours_over_{other}"] = own["ours"] / own[other]
            result[f"cpu_rounds_ours_slower_than_{other}"] = sum(
                o > p for o, p in zip(cpu["ours"], cpu[other])
            )
    return result


def print_step_vs_peer(r: dict):
    print(f"\nstep, {r['parameters']['ours']:,} parameters, seq {r['shape']['seq_len']} x batch "
          f"{r['shape']['batch_size']}, fp32, 1 CPU thread, eager: median of {r['rounds']} rounds")  # fmt: skip
    for name, values in r["step_ms"].items():
        runs = ", ".join(f"{v:.0f}" for v in values)
        own = ", ".join(f"{v:.0f}" for v in r["cpu_step_ms"][name])
        print(f"  {name:<9}{r['median_step_ms'][name]:9.1f} ms   ({runs}); CPU time "
              f"{r['median_cpu_step_ms'][name]:.1f} ms ({own})")  # fmt: skip
    for other in ("peer", "baseline"):
        if f"ours_over_{other}" in r:
            print(f"  ours / {other:<9}{r[f'ours_over_{other}']:6.3f}   "
                  f"(ours slower in {r[f'rounds_ours_slower_than_{other}']} of {r['rounds']} rounds); "
                  f"CPU time {r[f'cpu_ours_over_{other}']:.3f} (slower in "
                  f"{r[f'cpu_rounds_ours_slower_than_{other}']})"
                  + ("; target <= 1.0" if other == "peer" else ""))  # fmt: skip
    if r["peer_skipped"]:
        print(f"  peer skipped: {r['peer_skipped']}")


def steady(records: list[dict], interval: int, warmup: int) -> list[dict]:
    # Skip warm-up, and the steps right after a save (the save itself runs after
    # the step's metrics are taken, so it shows in neither).
    return [r for r in records if r["step"] > warmup and (r["step"] - 1) % interval != 0]


def main(argv=None) -> int:
    p = bench.Arguments(__doc__, smoke={"steps": 12, "rounds": 1, "peer_rounds": 1,
                                        "peer_steps": 2}, rounds=2, work="", peer=True)  # fmt: skip
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--baseline-repo", default="", help="another checkout, measured alongside")
    p.add_argument("--peer-rounds", type=int, default=6)
    p.add_argument("--peer-steps", type=int, default=8, help="timed steps per process")
    p.add_argument("--peer-only", action="store_true", help="only the step against the peer")
    args = p.parse(argv)
    interval, warmup = (4, 2) if args.smoke else (100, 10)
    vs_peer = step_vs_peer(args.peer_python, args.baseline_repo, args.peer_rounds,
                           args.peer_steps, warmup=1 if args.smoke else 3)  # fmt: skip
    if args.peer_only:
        print_step_vs_peer(vs_peer)
        return bench.save(args, {"step_vs_peer": vs_peer})
    step_ms = {"off": [], "on": []}
    wait_share = []
    written = 0
    with bench.work_folder(args, "bench_step_") as root:
        for _ in range(args.rounds):
            for mode in ("off", "on"):
                records, saves = run(args.steps, mode == "on", root / mode, interval)
                written += saves
                records = steady(records, interval, warmup)
                step_ms[mode] += [r["step_ms"] for r in records]
                wait_share += [r["data_wait_ms"] / r["step_ms"] for r in records]
        check_ms, two_rank_step_ms = agreement_share(args.steps, root / "agreement")
    med = {k: statistics.median(v) for k, v in step_ms.items()}
    result = {
        "steps_per_run": args.steps,
        "rounds": args.rounds,
        "checkpoint_interval": interval,
        "checkpoints_written": written,
        "median_step_ms_checkpoint_off": med["off"],
        "median_step_ms_checkpoint_on": med["on"],
        "on_over_off": med["on"] / med["off"],
        "median_data_wait_share": statistics.median(wait_share),
        "p90_data_wait_share": statistics.quantiles(wait_share, n=10)[-1],
        "median_stop_check_ms_2ranks": check_ms,
        "median_step_ms_2ranks": two_rank_step_ms,
        "stop_check_share": check_ms / two_rank_step_ms,
        "step_vs_peer": vs_peer,
    }
    print(f"median step, checkpointing off      {med['off']:8.2f} ms")
    print(f"median step, checkpointing on ({interval}) {med['on']:8.2f} ms")
    print(f"on / off                            {result['on_over_off']:8.3f}   (target <= 1.02)")
    print(
        f"data wait / step, median            {result['median_data_wait_share']:8.3%}   (target <= 2%)"
    )
    print(f"data wait / step, p90               {result['p90_data_wait_share']:8.3%}")
    print(f"stop agreement / step, 2 ranks      {result['stop_check_share']:8.3%}   "
          f"({check_ms:.3f} of {two_rank_step_ms:.1f} ms; target <= 1%)")  # fmt: skip
    print_step_vs_peer(vs_peer)
    return bench.save(args, result)


if __name__ == "__main__":
    sys.exit(main())
