"""Run under torchrun with 2 ranks: the expert-parallel scenarios of
test_expert_parallel.py (debug_moe, gloo on CPU).

    torchrun --nproc_per_node=2 test/dist/expert_parallel.py OUT CORPUS

What the checks need is written under OUT:

- ``init.pt`` (rank 0): the step-0 weights and buffers of debug_moe built on meta and
  materialized at EP 2 x FSDP 2, gathered whole; as a negative control, the same
  model's experts drawn from the global RNG on each rank (the naive way).
- ``forward-rank<r>.pt``: one forward and backward of the same batch per rank at EP 1
  (FSDP 2) and at EP 2: the outputs, the first layer's expert gradient (whole), the
  smallest expert group of the batch, and, as a negative control, EP 2's outputs with
  the two ranks' experts swapped.
- ``ep2/`` 4 steps at EP 2 (checkpoints at 2 and 4), ``ep2-to-1/`` the same resumed from
  step 2 at EP 1; ``ep1/`` and ``ep1-to-2/`` the other way round; ``ep2-to-1-nobias/``
  resumed at EP 1 with the bias zeroed after the load (the negative control).
- ``records/rank<r>.json``: per scenario, the digest of every training forward's input
  tokens, and the balancing bias each resumed run holds right after its load.
"""

import hashlib
import json
import os
import shutil
import sys

import torch

import train as train_script
from torchtitan import parallel
from torchtitan.config import parse_args
from torchtitan.models import build_model

CONFIG = ["--job.config_file", "train_configs/debug_moe.toml"]
RECORDS: dict[str, list] = {}
scenario = ""


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest()[:16]


def observe(model):
    inner = getattr(model, "module", model)

    def tokens(module, args):
        if module.training:
            RECORDS.setdefault(scenario, []).append(["tokens", digest(args[0])])

    inner.register_forward_pre_hook(tokens)
    return model


BUILD = train_script.build_training_model
train_script.build_training_model = lambda *a, **k: (observe(BUILD(*a, **k)[0]), None)
RESUME = train_script.resume
ZERO_BIAS = False


def resume_recorded(run):
    """The load, then the bias it left (zeroed first for the negative control)."""
    RESUME(run)
    for moe in run.model.moe_layers():
        if ZERO_BIAS:
            moe.expert_bias.zero_()
        RECORDS.setdefault(scenario, []).append(["bias", moe.expert_bias.tolist()])


train_script.resume = resume_recorded


def parallel_model(dims, ep: int):
    cfg = parse_args([*CONFIG, "--parallelism.expert_parallel_degree", str(ep)])
    layout = parallel.apply_layout(dims, cfg)
    meta = build_model("debug_moe", 4096, device="meta")
    return parallel.parallelize(meta, cfg, layout)


def whole(model) -> dict:
    return {n: t.full_tensor() if hasattr(t, "full_tensor") else t.detach()
            for n, t in model.state_dict().items()}  # fmt: skip


def sharded_init(out: str, dims):
    model = parallel_model(dims, 2)
    weights = whole(model)
    torch.manual_seed(42)
    with torch.no_grad():
        for moe in model.moe_layers():
            for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3):
                w.to_local().normal_(0.0, 0.02)
    naive = whole(model)  # every rank: full_tensor is a collective
    if dims.is_main:
        torch.save({"ep2": weights, "naive": naive}, os.path.join(out, "init.pt"))


def forward_and_backward(model, batch):
    model.train()
    out = model(batch)
    out.float().pow(2).mean().backward()
    grad = model.layers["0"].feed_forward.experts.w1.grad
    return out.detach(), grad.full_tensor() if hasattr(grad, "full_tensor") else grad


def forwards(out: str, dims):
    """The same batch per rank through EP 1 and EP 2 (and EP 2 with swapped experts)."""
    batch = torch.randint(0, 4096, (4, 64), generator=torch.Generator().manual_seed(dims.rank))
    ep1, grad1 = forward_and_backward(parallel_model(dims, 1), batch)
    model = parallel_model(dims, 2)
    ep2, grad2 = forward_and_backward(model, batch)
    # This rank's smallest expert group (the groups at EP 2 hold both ranks' rows).
    smallest = int(model.expert_loads().min())
    reference = build_model("debug_moe", 4096, device="cpu", seed=42).state_dict()
    other = 1 - dims.rank
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".experts." in name:
                local = param.to_local()
                local.copy_(reference[name][other * len(local) : (other + 1) * len(local)])
    swapped = model(batch).detach()
    torch.save({"ep1": ep1, "ep2": ep2, "grad1": grad1, "grad2": grad2, "swapped": swapped,
                "smallest_group": smallest},
               os.path.join(out, f"forward-rank{dims.rank}.pt"))  # fmt: skip


def run(name: str, dump: str, *argv, dims):
    global scenario
    scenario = name
    train_script.train(parse_args([*CONFIG, "--job.dump_folder", dump, *map(str, argv)]), dims)


def resumable_copy(dump: str, name: str, dims) -> str:
    copy = os.path.join(os.path.dirname(dump), name)
    if dims.is_main:
        shutil.copytree(dump, copy)
        shutil.rmtree(os.path.join(copy, "checkpoint", "step-4"))
    parallel.barrier(dims)
    return copy


def main():
    global ZERO_BIAS
    out, corpus = sys.argv[1], sys.argv[2]
    dims = parallel.init_distributed()
    train_script.setup_logging(dims.rank)
    sharded_init(out, dims)
    forwards(out, dims)
    data = ["--training.dataset_path", corpus, "--training.seq_len", 32,
            "--training.batch_size", 4, "--training.global_batch_size", 8,
            "--training.steps", 4, "--checkpoint.enable_checkpoint",
            "--checkpoint.interval", 2, "--lr_scheduler.warmup_steps", 2]  # fmt: skip
    ep2 = ["--parallelism.expert_parallel_degree", 2]
    run("ep2", os.path.join(out, "ep2"), *data, *ep2, dims=dims)
    run("ep2-to-1", resumable_copy(os.path.join(out, "ep2"), "ep2-to-1", dims), *data, dims=dims)
    run("ep1", os.path.join(out, "ep1"), *data, dims=dims)
    run("ep1-to-2", resumable_copy(os.path.join(out, "ep1"), "ep1-to-2", dims), *data, *ep2,
        dims=dims)  # fmt: skip
    ZERO_BIAS = True
    run("ep2-to-1-nobias", resumable_copy(os.path.join(out, "ep2"), "ep2-to-1-nobias", dims),
        *data, dims=dims)  # fmt: skip
    os.makedirs(os.path.join(out, "records"), exist_ok=True)
    with open(os.path.join(out, "records", f"rank{dims.rank}.json"), "w") as f:
        json.dump(RECORDS, f)
    parallel.destroy_distributed()


if __name__ == "__main__":
    main()
