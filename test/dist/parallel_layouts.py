"""Run under torchrun with 4 ranks: every multi-rank layout scenario of test_parallel.py.

    torchrun --nproc_per_node=4 test/dist/parallel_layouts.py OUT CORPUS

One launch, because starting 4 interpreters costs more on a small CPU machine than
what they then do. Each scenario is the product path: ``train.train`` on this
process group with a parsed config, or the functions it calls. What the checks need
is written under OUT; test_parallel.py asserts on it:

- ``init.pt`` (rank 0): the step-0 weights of the training model on 4 FSDP ranks, on
  pairs of ranks (a 2 x 2 mesh), under FSDP x TP (2 x 2) and HSDP (2 x 2); the compute
  and parameter dtypes; and, as a negative control, a naive sharded init.
- ``chain/``: one run over layouts, global batch 12 throughout: 2 DP x 2 TP (steps
  1-2) -> HSDP 2 x 2 (4 DP, 3-4) -> FSDP 4 (5-6) -> 1 DP x 2 TP (7-8, on ranks 0-1 of
  a 2-rank world), and ``fsdp4/``, the same 8 steps on FSDP 4 without a break.
- ``dropout/``: 2 DP x 2 TP with dropout and sequence parallel off (replicated
  residual dropout) for 3 steps; ``dropout-resumed/``: the same from its step-1
  checkpoint; then ``dropout/`` goes on at FSDP 4 (step 4) and on 1 DP x 2 TP (5-6,
  ranks 2-3 of a 2-rank world), where the TP group must get one dropout stream from
  two ranks that had their own.
- ``masked.pt`` (rank 0): one ``TrainStep`` under ``mask_document_boundaries`` on FSDP 4,
  each rank's batch holding another number of labels that count: rank 0's shard of the
  gradient it applies (read just before the update), the whole global batch's on one
  rank, and, as a negative control, FSDP 4's with each rank normalizing by its own count.
- ``pp-chain/``: one run over pipeline layouts, global batch 12: PP 2 x DP 2 (steps
  1-3) -> FSDP 4 (4-5) -> PP 2 x TP 2 (6-8); ``pp-hf/``, the export of its step-3;
  ``pp-dropout/`` and ``pp-dropout-resumed/``: PP 2 x DP 2 with dropout, a checkpoint
  every step, and the same resumed from step-2; ``unmasked-fsdp4/``, ``masked-fsdp4/`` and ``masked-pp/``:
  two steps with document boundaries masked, FSDP 4 and PP 2 x DP 2;
- ``hub/``: one step on a Hub-style dataset folder (a README's ``configs`` naming parquet
  files); ``records``' ``hub_resolutions``: how many times this rank resolved the folder
  (``hub.folder_source``, counted by a wrapper that changes nothing); ``start_reads``:
  how many times this rank listed the unfinished saves and read a checkpoint's manifest
  to resume (``partial_steps``; ``read_manifest`` as the manager, verification and
  timeline call it) while the job was whole;
- stdout: the loader through real DCP into a never-iterated loader (0 and 2 workers
  per rank) and the log line's view of all ranks (``dataloader_dcp.py``);
- ``records/rank<r>.json``: per scenario, every training forward's digest of this
  rank's input tokens and of each block's residual-dropout mask; ``sp_masks``: the
  same masks under sequence parallel (one forward); ``initial_loads``: whether the
  weights loaded from a TP checkpoint (dcp) and its HF export (hf) equal the
  checkpoint's (and, as a control, whether the fresh ones did); ``errors``: what
  ``train.main`` of an impossible layout printed, per rank.
"""

import contextlib
import hashlib
import io
import json
import os
import shutil
import sys

import dataloader_dcp  # this folder's: the loader through DCP, the view of all ranks
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import train as train_script
from torchtitan import parallel
from torchtitan.checkpoint import integrity, timeline
from torchtitan.checkpoint import manager as manager_module
from torchtitan.config import parse_args
from torchtitan.data import ParallelDataLoader, hub
from torchtitan.hf import export, read_dcp_model
from torchtitan.initial_weights import load_initial_weights
from torchtitan.models import build_model
from torchtitan.tools.launch import free_port
from torchtitan.loss import BatchLoss
from torchtitan.step import TrainStep

CONFIG = ["--job.config_file", "train_configs/debug_model.toml"]
RECORDS: dict[str, list] = {}  # scenario -> [[what, digest], ...] in call order
scenario = ""


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest()[:16]


def record(what: str, value: str):
    RECORDS.setdefault(scenario, []).append([what, value])


def observe(model):
    """Hooks that record what this rank computes (they change nothing)."""
    inner = getattr(model, "module", model)

    def tokens(module, args):
        if module.training:
            record("tokens", digest(args[0]))

    def mask(module, args, output):
        # (A pipeline stage's first step runs it on meta tensors to learn the shapes.)
        if module.training and not output.is_meta:
            local = output.to_local() if hasattr(output, "to_local") else output
            record("mask", digest(local == 0))

    inner.register_forward_pre_hook(tokens)
    for block in inner.layers.values():
        block.attention.resid_dropout.register_forward_hook(mask)
    return model


def build_and_observe(*args, **kwargs):
    model, stages = BUILD(*args, **kwargs)
    return observe(model), stages


BUILD = train_script.build_training_model
train_script.build_training_model = build_and_observe
NEXT_STEP = ParallelDataLoader.next_step


def next_step_counted(self):
    """A step's batches, and how many windows this rank read for them."""
    batches = NEXT_STEP(self)
    record("reads", str(sum(len(b["input"]) for b in batches)))
    return batches


ParallelDataLoader.next_step = next_step_counted

# How many times this rank read what a start needs once per job (the unfinished saves'
# listing, the chosen checkpoint's manifest): counted by wrappers that change nothing.
START_READS = {"partial_steps": 0, "read_manifest": 0, "loads": 0}
LOADING = [False]  # inside CheckpointManager.load (a start), not an initial load or export


def _counted(name: str, fn):
    def counted(*args, **kwargs):
        START_READS[name] += LOADING[0]
        return fn(*args, **kwargs)

    return counted


def _loading(load):
    def counted_load(self, *args, **kwargs):
        START_READS["loads"] += 1
        LOADING[0] = True
        try:
            return load(self, *args, **kwargs)
        finally:
            LOADING[0] = False

    return counted_load


manager_module.CheckpointManager.load = _loading(manager_module.CheckpointManager.load)
manager_module.partial_steps = _counted("partial_steps", manager_module.partial_steps)
for _module in (manager_module, integrity, timeline):  # every reader of a manifest at a start
    _module.read_manifest = _counted("read_manifest", _module.read_manifest)


def resumable_copy(dump: str, deleted: tuple, dims) -> str:
    """``<dump>-resumed``: a copy of a run's folder without the checkpoints of ``deleted``
    steps, so that a relaunch resumes before them (made by rank 0, seen by all)."""
    copy = f"{dump}-resumed"
    if dims.is_main:
        shutil.copytree(dump, copy)
        for step in deleted:
            shutil.rmtree(os.path.join(copy, "checkpoint", f"step-{step}"))
    parallel.barrier(dims)
    return copy


def run(name: str, dump: str, *argv, dims):
    global scenario
    scenario = name
    train_script.train(parse_args([*CONFIG, "--job.dump_folder", dump, *map(str, argv)]), dims)


def hub_folder(out: str, corpus_lines: int, dims) -> str:
    """A Hub-style dataset folder (a README whose ``configs`` name the parquet files), made
    by rank 0 and seen by all; each rank counts its resolutions of it in ``RECORDS``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = os.path.join(out, "hubdata")
    if dims.is_main:
        os.makedirs(os.path.join(folder, "data"))
        rows = [f"Line {i} of a document.\n" * 20 for i in range(corpus_lines)]
        pq.write_table(pa.table({"text": rows}), os.path.join(folder, "data", "train-00000.parquet"))
        with open(os.path.join(folder, "README.md"), "w") as f:
            f.write("---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
                    "    path: data/train-*.parquet\n---\n")  # fmt: skip
    parallel.barrier(dims)
    resolve = hub.folder_source
    RECORDS["hub_resolutions"] = 0

    def counted(*args, **kwargs):
        RECORDS["hub_resolutions"] += 1
        return resolve(*args, **kwargs)

    hub.folder_source = counted
    return folder


def full_weights(model) -> dict:
    return {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for n, p in
            model.named_parameters()}  # fmt: skip


def parallel_model(dims, *argv):
    cfg = parse_args([*CONFIG, *map(str, argv)])
    layout = parallel.apply_layout(dims, cfg)
    meta = build_model("debugmodel", 4096, dropout=cfg.model.dropout, device="meta")
    model = parallel.parallelize(meta, cfg, layout)
    return model, cfg, layout


def sharded_init(out: str, dims):
    """The step-0 weights on 4 ranks under each layout, and the dtypes FSDP computes in."""
    model, _, _ = parallel_model(dims, "--training.mixed_precision_param", "bfloat16")
    seen = {}
    model.layers["0"].attention.wq.register_forward_hook(
        lambda module, inputs, output: seen.setdefault("compute", output.dtype) and None
    )
    model.layers["0"].register_forward_pre_hook(
        lambda module, args: seen.setdefault("rope", args[1].dtype) and None
    )
    model(torch.zeros(1, 8, dtype=torch.long, device=dims.device))
    model.reshard()  # the root keeps its parameters gathered after a forward
    weights = full_weights(model)

    pairs = build_model("debugmodel", 4096, device="meta")
    mesh = init_device_mesh(dims.device.type, (2, 2), mesh_dim_names=("copy", "shard"))
    parallel.apply_fsdp(pairs, torch.float32, torch.float32, mesh=mesh["shard"])
    pairs.to_empty(device=dims.device)
    pairs.init_weights(42)
    on_two = full_weights(pairs)
    tp, _, _ = parallel_model(dims, "--parallelism.tensor_parallel_degree", 2)
    hsdp, _, _ = parallel_model(dims, "--parallelism.data_parallel_replicate_degree", 2)

    torch.manual_seed(42)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0.0, 0.02)
    naive = full_weights(model)
    result = {"weights": weights, "on_two": on_two, "tp": full_weights(tp),
              "hsdp": full_weights(hsdp), "naive": naive, "compute": str(seen["compute"]),
              "rope": str(seen["rope"]), "params": sorted({str(p.dtype) for p in model.parameters()})}  # fmt: skip
    if dims.is_main:
        torch.save(result, os.path.join(out, "init.pt"))


def sequence_parallel_masks(dims):
    """One training forward under SP with dropout: each rank's residual-dropout masks."""
    global scenario
    scenario = "sp_masks"
    model, _, layout = parallel_model(dims, "--parallelism.tensor_parallel_degree", 2,
                                 "--model.dropout", 0.5)  # fmt: skip
    for block in model.layers.values():
        # Ones in, so that the output's zeros are the mask alone: a row the attention
        # dropout zeroed on one peer would otherwise look like a different mask.
        block.attention.resid_dropout.register_forward_pre_hook(
            lambda module, args: (torch.ones_like(args[0]),)
        )
    observe(model).train()
    torch.manual_seed(7 + layout.dp_rank)  # as train.py seeds: one stream per TP group
    tokens = torch.arange(2 * 32).view(2, 32) % 4096
    model(tokens)


def initial_loads(out: str, step: str, dims):
    """A TP model starting from a TP checkpoint (dcp) and from its HF export (hf)."""
    folder = os.path.join(out, "hf")
    if dims.is_main:
        export(step, folder)
    parallel.barrier(dims)
    expected = read_dcp_model(step)
    for fmt, path in (("dcp", step), ("hf", folder)):
        model, cfg, layout = parallel_model(
            dims, "--parallelism.tensor_parallel_degree", 2,
            "--checkpoint.initial_load_path", path, "--checkpoint.initial_load_format", fmt,
        )  # fmt: skip
        fresh = full_weights(model)
        load_initial_weights(cfg, model, layout)
        loaded = full_weights(model)
        same = loaded.keys() == expected.keys()
        same = same and all(torch.equal(loaded[n], expected[n]) for n in expected)
        fresh_same = all(torch.equal(fresh[n], expected[n]) for n in expected)
        RECORDS.setdefault("initial_loads", []).append([fmt, same, fresh_same])


def pipeline_loads(out: str, step: str, dims):
    """A checkpoint written by PP 2 x DP 2 holds the unsplit model's names (its HF export
    has every weight), and a PP 2 x DP 2 model started from another checkpoint
    (initial_load_path) holds exactly its weights, stage by stage."""
    folder = os.path.join(out, "pp-hf")
    if dims.is_main:
        export(step, folder)
    parallel.barrier(dims)
    whole = set(build_model("debugmodel", 4096, device="meta").state_dict())
    RECORDS["pp_names"] = sorted(set(read_dcp_model(step)) ^ whole)
    source = os.path.join(out, "fsdp4", "checkpoint", "step-8")
    expected = read_dcp_model(source)
    cfg = parse_args([*CONFIG, "--parallelism.pipeline_parallel_degree", "2",
                      "--checkpoint.initial_load_path", source])  # fmt: skip
    layout = parallel.apply_layout(dims, cfg)
    model, _ = BUILD(cfg, 4096, layout)
    fresh = full_weights(model)
    load_initial_weights(cfg, model, layout)
    loaded = full_weights(model)
    held = bool(loaded) and set(loaded) < expected.keys()
    RECORDS["pp_initial_load"] = [
        held and all(torch.equal(loaded[n], expected[n]) for n in loaded),
        all(torch.equal(fresh[n], expected[n]) for n in loaded),
    ]


def masked_batch(rank: int | None) -> dict:
    """Rank ``rank``'s 2 sequences of a global batch of 8 (all 8 for None), documents of
    4 + 5 x rank tokens: each rank holds another number of labels that count."""
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 4096, (8, 33), generator=g)
    docs = torch.stack([torch.arange(33) // (4 + 5 * (row // 2)) for row in range(8)])
    rows = slice(None) if rank is None else slice(2 * rank, 2 * rank + 2)
    tokens, docs = tokens[rows], docs[rows]
    return {"input": tokens[:, :-1], "label": tokens[:, 1:], "document_ids": docs[:, :-1],
            "label_document_ids": docs[:, 1:]}  # fmt: skip


def masked_gradient(cfg, model, dims, batch: dict) -> tuple[dict, int]:
    """The gradient one TrainStep applies for ``batch`` (this rank's shard of it under
    FSDP: rows ``[0, n)`` of each parameter on rank 0), and the batch's labels that
    count. The learning rate is 0: the model is unchanged for the next call."""
    seen = {}

    def capture():
        seen.update({n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone()
                     for n, p in model.named_parameters()})  # fmt: skip

    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    loss = BatchLoss(cfg, model, dims)
    TrainStep(cfg, model, optimizer, scheduler, loss, capture)([batch])
    return seen, loss.counted(batch)


def masked_gradients(out: str, dims):
    """FSDP 4 against one rank under mask_document_boundaries (see ``masked.pt``)."""
    model, cfg, layout = parallel_model(dims, "--training.mask_document_boundaries",
                                        "--training.max_norm", 1e9)  # fmt: skip
    fsdp, counted = masked_gradient(cfg, model, layout, masked_batch(dims.rank))
    counts = parallel.all_gather_objects(dims, counted)
    sum_over_ranks = parallel.sum_over_ranks
    try:
        parallel.sum_over_ranks = lambda value: value * dims.world_size  # each rank its own
        own = masked_gradient(cfg, model, layout, masked_batch(dims.rank))[0]
        # One rank (each computes it: no collective), the whole global batch.
        parallel.sum_over_ranks = lambda value: value
        one = parallel.ParallelDims(0, 1, 0, dims.device, dims.backend)
        plain = build_model("debugmodel", 4096, device=dims.device, seed=42)
        reference = masked_gradient(cfg, plain, one, masked_batch(None))[0]
    finally:
        parallel.sum_over_ranks = sum_over_ranks
    if dims.is_main:
        torch.save({"fsdp": fsdp, "one_rank": reference, "own_counts": own, "counted": counts},
                   os.path.join(out, "masked.pt"))  # fmt: skip


def split_world(dims):
    """Two 2-rank worlds, ranks 0-1 and 2-3, each a job of its own (its own store)."""
    port = free_port() if dims.rank in (0, 2) else None
    ports = parallel.all_gather_objects(dims, port)
    first = 0 if dims.rank < 2 else 2
    dist.destroy_process_group()
    os.environ.update(RANK=str(dims.rank - first), WORLD_SIZE="2", LOCAL_RANK=str(dims.rank - first),
                      MASTER_PORT=str(ports[first]))  # fmt: skip
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # this world's rank 0 hosts its store
    return parallel.init_distributed()


def one_line_errors(corpus: str, rank: int):
    """train.main of a layout that cannot be: its stderr, per rank (main ends the world)."""
    bad = (["--parallelism.tensor_parallel_degree", "4"] if rank < 2 else
           ["--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "33"])  # fmt: skip
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = train_script.main([*CONFIG, "--training.dataset_path", corpus, *bad])
    RECORDS["errors"] = [status, err.getvalue()]


def main():
    out, corpus = sys.argv[1], sys.argv[2]
    dims = parallel.init_distributed()
    train_script.setup_logging(dims.rank)
    rank = dims.rank
    sharded_init(out, dims)
    sequence_parallel_masks(dims)
    masked_gradients(out, dims)
    for workers in (0, 2):
        dataloader_dcp.save_and_restore(corpus, os.path.join(out, f"loader-{workers}"), workers)
    dataloader_dcp.across_ranks_names_the_slowest()

    data = ["--training.dataset_path", corpus,
            "--training.seq_len", 32, "--training.batch_size", 3,
            "--training.global_batch_size", 12, "--training.steps", 8,
            "--checkpoint.enable_checkpoint", "--checkpoint.interval", 100,
            "--metrics.data_provenance", "--lr_scheduler.warmup_steps", 2]  # fmt: skip
    tp2 = ["--parallelism.tensor_parallel_degree", 2]
    chain = os.path.join(out, "chain")
    run("fsdp4", os.path.join(out, "fsdp4"), *data, dims=dims)
    run("chain-2x2", chain, *data, *tp2, "--training.stop_at_step", 2, dims=dims)
    initial_loads(out, os.path.join(chain, "checkpoint", "step-2"), dims)
    run("chain-hsdp", chain, *data, "--parallelism.data_parallel_replicate_degree", 2,
        "--training.stop_at_step", 4, dims=dims)  # fmt: skip
    run("chain-fsdp4", chain, *data, "--training.stop_at_step", 6, dims=dims)

    dropout = [*data, *tp2, "--model.dropout", 0.5, "--parallelism.sequence_parallel", "false",
               "--parallelism.loss_parallel", "false", "--checkpoint.interval", 1]  # fmt: skip
    first = os.path.join(out, "dropout")
    run("dropout", first, *dropout, "--training.stop_at_step", 3, dims=dims)
    resumed = resumable_copy(first, (2, 3), dims)
    run("dropout-resumed", resumed, *dropout, "--training.stop_at_step", 3, dims=dims)
    run("dropout-fsdp4", first, *dropout, "--parallelism.tensor_parallel_degree", 1,
        "--training.stop_at_step", 4, dims=dims)  # fmt: skip

    # Pipeline parallel: a chain PP 2 x DP 2 -> DP 4 -> PP 2 x TP 2 over one timeline,
    # and an exact resume at PP 2 x DP 2 with dropout (a stream per stage).
    pp2 = ["--parallelism.pipeline_parallel_degree", 2]
    pp_chain = os.path.join(out, "pp-chain")
    run("pp-2x2", pp_chain, *data, *pp2, "--training.stop_at_step", 3, dims=dims)
    pipeline_loads(out, os.path.join(pp_chain, "checkpoint", "step-3"), dims)
    run("pp-dp4", pp_chain, *data, "--training.stop_at_step", 5, dims=dims)
    run("pp-tp", pp_chain, *data, *pp2, *tp2, "--parallelism.loss_parallel", "false", dims=dims)
    pp_dropout = [*data, *pp2, "--model.dropout", 0.5, "--checkpoint.interval", 1,
                  "--training.stop_at_step", 4]  # fmt: skip
    pp_first = os.path.join(out, "pp-dropout")
    run("pp-dropout", pp_first, *pp_dropout, dims=dims)
    run("pp-dropout-resumed", resumable_copy(pp_first, (3, 4), dims), *pp_dropout, dims=dims)
    # Unshuffled (one lane), so that the first steps' windows cross document boundaries.
    unmasked = [*data, "--training.shuffle", "false", "--training.stop_at_step", 2]
    masked = [*unmasked, "--training.mask_document_boundaries"]
    run("unmasked-fsdp4", os.path.join(out, "unmasked-fsdp4"), *unmasked, dims=dims)
    run("masked-fsdp4", os.path.join(out, "masked-fsdp4"), *masked, dims=dims)
    run("masked-pp", os.path.join(out, "masked-pp"), *masked, *pp2, dims=dims)

    folder = hub_folder(out, 16, dims)
    run("hub", os.path.join(out, "hub"), "--training.dataset_path", folder,
        "--training.steps", 1, "--training.seq_len", 32, dims=dims)  # fmt: skip

    RECORDS["start_reads"] = dict(START_READS)  # every resume so far on the whole world
    dims = split_world(dims)
    if rank < 2:
        run("chain-1x2", chain, *data, *tp2, dims=dims)
    else:
        run("dropout-1x2", first, *dropout, "--training.stop_at_step", 6, dims=dims)
    one_line_errors(corpus, rank)
    os.makedirs(os.path.join(out, "records"), exist_ok=True)
    with open(os.path.join(out, "records", f"rank{rank}.json"), "w") as f:
        json.dump(RECORDS, f)
    parallel.destroy_distributed()


if __name__ == "__main__":
    main()
