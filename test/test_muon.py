"""Muon (torchtitan/muon.py): the Newton-Schulz batching, which parameters it takes,
equality with torch.optim.Muon + torch.optim.AdamW on one process, the same update on
2 forked gloo ranks (FSDP 2, TP 2, the MoE model under FSDP 2 and EP 2) as on one
process, the refusal of an AdamW checkpoint and an exact resume. Each test names its
negative control.

Exactness is torch.equal against a reference computed here, on this machine: the
sharded step moves bytes (exact) and orthogonalizes each whole matrix with the shapes
and ops one process uses. The 3-D (experts) case is batched (torch.baddbmm) and equals
each expert alone at the debug MoE shapes; muon.py's docstring says where a CPU's
batched GEMM may differ in the last bits at other shapes.
"""

from __future__ import annotations

import inspect
import shutil

import pytest
import torch
from helpers import CONFIG, error_lines, losses, rank_context, train_here

from torchtitan import muon
from torchtitan.config import parse_args
from torchtitan.models import build_model
from torchtitan.optim import build_lr_scheduler, build_optimizer

A, B, C = muon.NS_COEFFICIENTS
MUON = ["--optimizer.name", "Muon", "--optimizer.lr", "0.02", "--optimizer.muon_adamw_lr", "1e-3",
        "--optimizer.muon_adamw_weight_decay", "0.05"]  # fmt: skip


def muon_cfg(*extra):
    return parse_args([*CONFIG, *MUON, *map(str, extra)])


def torch_ns(g: torch.Tensor, coefficients=(A, B, C)) -> torch.Tensor:
    """torch.optim.Muon's own Newton-Schulz on one matrix (its private function)."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    return _zeropower_via_newtonschulz(g, coefficients, 5, muon.EPS)


# ---- Newton-Schulz: one matrix, and a batch of experts ----------------------------------


@pytest.mark.parametrize("shape", [(8, 64, 64), (8, 96, 64), (8, 64, 96), (3, 32, 64)])
def test_newton_schulz_of_a_3d_weight_is_each_expert_alone(shape):
    """A 2-D matrix orthogonalized here equals torch.optim.Muon's iteration bit for bit
    (the same kernels on the same shapes, so on any CPU). Each expert of a 3-D weight
    (square, tall, wide; debug_moe's experts are 8 x 64 x 64) orthogonalized in one
    batch (baddbmm) agrees with torch's iteration on that expert alone to 2 bf16 ulps
    of its scale, not to the bit: a batched and a single matmul are other kernels, whose
    blocking an AVX2 and an AVX-512 CPU choose differently. Negative control: each
    expert against its neighbour's result is far beyond that."""
    g = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
    batched = muon.newton_schulz(g)
    assert batched.shape == g.shape and batched.dtype == torch.bfloat16
    for e in range(shape[0]):
        alone = torch_ns(g[e]).float()
        tolerance = 2 * 2**-8 * alone.abs().max()  # bf16: 8 bits of mantissa
        assert torch.equal(muon.newton_schulz(g[e]), torch_ns(g[e])), e
        assert (batched[e].float() - alone).abs().max() <= tolerance, e
        assert (batched[e].float() - torch_ns(g[e - 1]).float()).abs().max() > 10 * tolerance


def test_the_lr_scale_of_an_expert_is_that_of_its_matrix():
    """torch.optim.Muon's two rules on a matrix's rows and columns; a 3-D weight's are an
    expert's (the last two dims), not (experts, rows). Control: (experts, rows) differs."""
    assert muon.adjusted_lr(1.0, "original", (128, 64)) == 2**0.5
    assert muon.adjusted_lr(1.0, "original", (64, 128)) == 1.0
    assert muon.adjusted_lr(1.0, "match_rms_adamw", (64, 128)) == 0.2 * 128**0.5
    for rule, shape in (("original", (8, 128, 64)), ("match_rms_adamw", (256, 128, 64))):
        expert = muon.adjusted_lr(1.0, rule, shape)
        assert expert == muon.adjusted_lr(1.0, rule, shape[1:])
        assert expert != muon.adjusted_lr(1.0, rule, shape[:2])


# ---- which parameters Muon takes --------------------------------------------------------


def split(flavor: str) -> tuple[set, set]:
    model = build_model(flavor, 4096, device="cpu", seed=0)
    optimizer = build_optimizer(model, muon_cfg())
    names = {p: n for n, p in model.named_parameters()}
    muon_group, adamw_group = optimizer.param_groups
    return {names[p] for p in muon_group["params"]}, {names[p] for p in adamw_group["params"]}


def test_the_configs_muon_defaults_are_torchs():
    """The config's Muon defaults (and muon.py's, which a direct user of the optimizer
    gets) are torch.optim.Muon's own: the reference the bit-for-bit tests compare with
    reads the same config, so a default moved here (5 Newton-Schulz steps to 6, another
    coefficient) would move both sides and pass them; this pins both to torch's."""
    torchs = {name: p.default for name, p in inspect.signature(torch.optim.Muon).parameters.items()
              if p.default is not inspect.Parameter.empty}  # fmt: skip
    o = parse_args([]).optimizer
    ours = {"momentum": o.muon_momentum, "nesterov": o.muon_nesterov, "ns_steps": o.muon_ns_steps,
            "ns_coefficients": (o.muon_ns_a, o.muon_ns_b, o.muon_ns_c), "eps": o.muon_eps,
            "adjust_lr_fn": None if o.muon_adjust_lr == "original" else o.muon_adjust_lr}  # fmt: skip
    assert ours == {name: torchs[name] for name in ours}
    assert (muon.NS_STEPS, muon.NS_COEFFICIENTS, muon.EPS) == (
        torchs["ns_steps"], torchs["ns_coefficients"], torchs["eps"])  # fmt: skip


def test_the_split_by_name_for_the_debug_models():
    """Muon takes the blocks' matrices (attention, feed-forward, the shared expert, the
    3-D routed experts); AdamW the embeddings, output, norms and the router. Each group
    has its own LR and weight decay from the config. Negative control: torch's docstring
    rule (every 2-D parameter to Muon) would give Muon the embeddings, output and router.
    The schedule scales each group from its own peak."""
    blocks = [f"layers.{i}." for i in range(2)]
    norms = {f"{b}{n}.weight" for b in blocks for n in ("attention_norm", "ffn_norm")}
    outside = {"tok_embeddings.weight", "output.weight", "norm.weight"}
    attention = {f"{b}attention.{w}.weight" for b in blocks for w in ("wq", "wk", "wv", "wo")}

    dense_muon, dense_adamw = split("debugmodel")
    ff = {f"{b}feed_forward.{w}.weight" for b in blocks for w in ("w1", "w2", "w3")}
    assert dense_muon == attention | ff
    assert dense_adamw == outside | norms

    moe_muon, moe_adamw = split("debug_moe")
    experts = {f"{b}feed_forward.experts.{w}" for b in blocks for w in ("w1", "w2", "w3")}
    shared = {f"{b}feed_forward.shared.{w}.weight" for b in blocks for w in ("w1", "w2", "w3")}
    router = {f"{b}feed_forward.router.weight" for b in blocks}
    assert moe_muon == attention | experts | shared
    assert moe_adamw == outside | norms | router

    model = build_model("debug_moe", 4096, device="cpu", seed=0)
    two_d = {n for n, p in model.named_parameters() if p.ndim == 2}
    assert {"tok_embeddings.weight", "output.weight"} | router <= two_d - moe_muon

    optimizer = build_optimizer(model, muon_cfg())
    m, a = optimizer.param_groups
    assert (m["peak_lr"], m["weight_decay"]) == (0.02, 0.1)
    assert (a["peak_lr"], a["weight_decay"]) == (1e-3, 0.05)
    schedule = build_lr_scheduler(optimizer, muon_cfg())  # warmup 2: the first step at 1/3
    assert schedule.get_last_lr() == [0.02 * (1 / 3), 1e-3 * (1 / 3)]
    defaults = build_optimizer(model, parse_args([*CONFIG, "--optimizer.name", "Muon"]))
    assert [g["peak_lr"] for g in defaults.param_groups] == [8e-4, 8e-4]  # optimizer.lr
    assert [g["weight_decay"] for g in defaults.param_groups] == [0.1, 0.1]


# ---- one process: torch.optim.Muon on the same split ------------------------------------


def grads_for(named: dict, step: int) -> dict:
    """Gradients for every parameter at ``step``, the same in every process."""
    g = torch.Generator().manual_seed(1000 + step)
    return {n: torch.randn(p.shape, generator=g) * 0.01 for n, p in named.items()}


def torch_reference(model, cfg, steps: int, coefficients=(A, B, C)) -> dict:
    """The weights after ``steps`` of torch.optim.Muon on the hidden matrices (each
    expert a matrix of its own) and torch.optim.AdamW(fused) on the rest."""
    o = cfg.optimizer
    named = dict(model.named_parameters())
    pieces, matrices, rest = {}, [], []
    for name, p in named.items():
        if muon.is_hidden_matrix(name, p):
            matrices_of_p = p if p.ndim == 3 else [p]
            pieces[name] = [t.detach().clone().requires_grad_() for t in matrices_of_p]
            matrices += pieces[name]
        else:
            rest.append(p)
    adjust = None if o.muon_adjust_lr == "original" else o.muon_adjust_lr
    reference = torch.optim.Muon(matrices, lr=o.lr, weight_decay=o.weight_decay,
                                 momentum=o.muon_momentum, nesterov=o.muon_nesterov,
                                 ns_coefficients=coefficients, ns_steps=o.muon_ns_steps,
                                 eps=o.muon_eps, adjust_lr_fn=adjust)  # fmt: skip
    adamw = torch.optim.AdamW(rest, lr=o.muon_adamw_lr, betas=(o.beta1, o.beta2), eps=o.eps,
                              weight_decay=o.muon_adamw_weight_decay, fused=True)  # fmt: skip
    for step in range(steps):
        for name, g in grads_for(named, step).items():
            if name in pieces:
                for t, gt in zip(pieces[name], g if g.ndim == 3 else [g]):
                    t.grad = gt.clone()
            else:
                named[name].grad = g
        reference.step()
        adamw.step()
    out = {n: p.detach().clone() for n, p in named.items() if n not in pieces}
    out.update({n: torch.stack(ts).detach() if named[n].ndim == 3 else ts[0].detach()
                for n, ts in pieces.items()})  # fmt: skip
    return out


def ours(model, cfg, steps: int, place=lambda p, g: g) -> dict:
    """The weights after ``steps`` of build_optimizer's Muon; ``place`` turns a whole
    gradient into the parameter's (its shard, for a DTensor)."""
    optimizer = build_optimizer(model, cfg)
    named = dict(model.named_parameters())
    for step in range(steps):
        for name, g in grads_for(named, step).items():
            named[name].grad = place(named[name], g)
        optimizer.step()
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in named.items()}  # fmt: skip


@pytest.mark.parametrize("extra", [[], ["--optimizer.muon_adjust_lr", "match_rms_adamw",
                                        "--optimizer.muon_nesterov", "false"]])  # fmt: skip
def test_one_process_equals_torch_muon_and_adamw_bit_for_bit(extra):
    """debugmodel, 3 steps of given gradients: every weight equals torch.optim.Muon's on
    the hidden matrices and fused torch.optim.AdamW's on the rest, torch.equal; both LR
    rules, Nesterov on and off. (The dense model: its matrices run the kernels torch's
    do, on the same shapes, on any CPU; a 3-D expert weight is batched here, one matrix
    at a time in torch, which agrees to rounding only: the Newton-Schulz test above.)
    Negative control: the reference with the coefficients a and c swapped differs."""
    cfg = muon_cfg(*extra)
    got = ours(build_model("debugmodel", 4096, device="cpu", seed=3), cfg, 3)
    want = torch_reference(build_model("debugmodel", 4096, device="cpu", seed=3), cfg, 3)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    swapped = torch_reference(build_model("debugmodel", 4096, device="cpu", seed=3), cfg, 3,
                              coefficients=(C, B, A))  # fmt: skip
    wq = "layers.0.attention.wq.weight"
    assert not torch.equal(swapped[wq], want[wq])


# ---- forked gloo ranks: FSDP, TP, MoE under FSDP and EP, HSDP, FSDP x TP ---------------


def build_layout(layout: str, world: int):
    """The model ``layout`` describes, on this rank of ``world``, wrapped by the product's
    own calls (parallel.apply_fsdp, tensor_parallel.apply, expert_parallel.apply)."""
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan.parallel import apply_fsdp, expert_parallel, tensor_parallel

    model = build_model("debug_moe" if layout.startswith("moe") else "debugmodel", 4096,
                        device="cpu", seed=3)  # fmt: skip
    if layout in ("hsdp", "fsdp_tp"):  # 2 x 2
        names = ("dp_replicate", "dp_shard") if layout == "hsdp" else ("dp_shard", "tp")
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
        if layout == "fsdp_tp":
            tensor_parallel.apply(model, mesh["tp"], sequence_parallel=True,
                                  with_loss_parallel=True)  # fmt: skip
            mesh = mesh["dp_shard"]
        apply_fsdp(model, torch.float32, torch.float32, mesh)
        return model
    mesh = init_device_mesh("cpu", (world,))
    if layout == "tp":
        tensor_parallel.apply(model, mesh, sequence_parallel=False, with_loss_parallel=False)
        return model
    experts = expert_parallel.apply(model, mesh) if layout == "moe_ep" else None
    apply_fsdp(model, torch.float32, torch.float32, mesh, ignored=experts)
    return model


def _rank(rank: int, world: int, layouts: tuple, store: str, out) -> None:
    """One rank: each layout's 3 steps; rank 0 reports the whole weights as arrays (a
    tensor would travel as shared memory that ends with this process)."""
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    def place(p, g):
        if not hasattr(p, "device_mesh"):
            return g
        return distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        results = {}
        for layout in layouts:
            if layout == "fsdp_unbucketed":  # the negative control: shards orthogonalized alone
                muon._splits_matrices = lambda param: False
            weights = ours(build_layout(layout, world), muon_cfg(), 3, place)
            results[layout] = {n: w.numpy().copy() for n, w in weights.items()}
        out.put((rank, results if rank == 0 else None))
    finally:
        dist.destroy_process_group()


def forked(world: int, layouts: tuple, tmp_path) -> dict:
    ctx = rank_context()
    out = ctx.Queue()
    store = str(tmp_path / f"store-{world}")
    procs = [ctx.Process(target=_rank, args=(r, world, layouts, store, out))
             for r in range(world)]  # fmt: skip
    for p in procs:
        p.start()
    results = dict(out.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    return results[0]


def one_process(flavor: str) -> dict:
    return ours(build_model(flavor, 4096, device="cpu", seed=3), muon_cfg(), 3)


def assert_equal_weights(got: dict, want: dict, layout: str):
    assert got.keys() == want.keys(), layout
    for name, value in want.items():
        assert torch.equal(torch.from_numpy(got[name]), value), (layout, name)


def test_two_ranks_update_as_one_process_bit_for_bit(tmp_path):
    """2 forked gloo ranks, 3 steps of the same gradients: FSDP 2 (every matrix split by
    rows), TP 2 (column- and row-wise matrices, the embedding and output split, norms
    replicated), debug_moe under FSDP 2 (experts sharded by expert: orthogonalized where
    they are) and under EP 2 x FSDP 2: the weights, gathered, torch.equal one process's.
    Negative control: FSDP 2 with each rank orthogonalizing its own shard (no bucket
    redistributed) differs in the matrices, not in the AdamW part."""
    layouts = ("fsdp", "tp", "moe_fsdp", "moe_ep", "fsdp_unbucketed")
    got = forked(2, layouts, tmp_path)
    dense, moe = one_process("debugmodel"), one_process("debug_moe")
    for layout in layouts[:4]:
        assert_equal_weights(got[layout], moe if layout.startswith("moe") else dense, layout)
    control = got["fsdp_unbucketed"]
    assert not torch.equal(torch.from_numpy(control["layers.0.attention.wq.weight"]),
                           dense["layers.0.attention.wq.weight"])  # fmt: skip
    assert torch.equal(torch.from_numpy(control["norm.weight"]), dense["norm.weight"])


def test_hsdp_fsdp_x_tp_and_uneven_shards_update_as_one_process(tmp_path):
    """4 forked ranks: HSDP 2 x 2 (pieces over the shard dim, replicas repeating the
    work) and FSDP 2 x TP 2 with sequence and loss parallel (column-wise weights held as
    _StridedShard, row-wise as Shard(0), Shard(1)); 3 ranks: FSDP 3 (rows 64, 32 and 192
    in uneven pieces, buckets of 3 matrices). Weights, gathered, torch.equal one
    process's. (The negative control is the 2-rank test's.)"""
    dense = one_process("debugmodel")
    got = forked(4, ("hsdp", "fsdp_tp"), tmp_path)
    got.update(forked(3, ("fsdp",), tmp_path))
    for layout in ("hsdp", "fsdp_tp", "fsdp"):
        assert_equal_weights(got[layout], dense, layout)


# ---- checkpoints: the AdamW refusal, an exact resume -------------------------------------

SMALL = ["--training.seq_len", 32, "--training.batch_size", 2, "--metrics.log_freq", 1,
         "--checkpoint.enable_checkpoint", "--training.steps", 5, "--checkpoint.interval", 3,
         "--model.flavor", "debug_moe"]  # fmt: skip


def test_an_adamw_checkpoint_refuses_a_muon_resume_in_one_line(tmp_path):
    """A Muon run finding an AdamW checkpoint stops before loading, in one line naming
    both optimizers and both ways on. Control: with the optimizer state left out, Muon
    starts its state afresh from those weights and trains."""
    train_here(tmp_path, *SMALL, "--training.stop_at_step", 3)
    status, log = train_here(tmp_path, *SMALL, *MUON, expect_ok=False)
    (line,) = error_lines(log)
    assert status != 0 and "AdamW's" in line and "(Muon)" in line, line
    assert "--optimizer.name AdamW" in line
    assert "--checkpoint.exclude_from_loading optimizer" in line
    train_here(tmp_path, *SMALL, *MUON, "--checkpoint.exclude_from_loading", "optimizer")
    assert sorted(losses(tmp_path)) == [1, 2, 3, 4, 5]


def test_a_muon_resume_on_the_same_layout_is_bit_exact(tmp_path):
    """debug_moe with Muon, stopped after step 3 and resumed: steps 4-5 log the
    uninterrupted run's losses, ==. Negative control: the same resume without the
    optimizer's state (momentum buffers and AdamW moments afresh) differs."""
    train_here(tmp_path / "whole", *SMALL, *MUON)
    train_here(tmp_path / "a", *SMALL, *MUON, "--training.stop_at_step", 3)
    shutil.copytree(tmp_path / "a", tmp_path / "fresh")
    train_here(tmp_path / "a", *SMALL, *MUON)
    train_here(tmp_path / "fresh", *SMALL, *MUON, "--checkpoint.exclude_from_loading", "optimizer")
    whole = losses(tmp_path / "whole")
    assert sorted(whole) == [1, 2, 3, 4, 5] and losses(tmp_path / "a") == whole
    fresh = losses(tmp_path / "fresh")
    assert fresh[4] == whole[4] and fresh[5] != whole[5]  # step 4's loss: step 3's weights


# ---- 2 ranks under torchrun: the seed plan, and DP 2 -> 1 ----------------------------------


def launcher_for(left_out: str | None = None):
    """deterministic_resume's launcher: 2 ranks under torchrun, 1 in this process; with
    ``left_out``, a resumed run (one finding a checkpoint) leaves that component out."""
    import os

    from helpers import run_main

    from torchtitan.checkpoint import complete_steps
    from torchtitan.tools.deterministic_resume import torchrun_launcher

    def launcher(nproc: int, argv: list[str]) -> tuple[int, str]:
        dump = argv[argv.index("--job.dump_folder") + 1]
        if left_out and complete_steps(os.path.join(dump, "checkpoint")):
            argv = [*argv, "--checkpoint.exclude_from_loading", left_out]
        return run_main(argv) if nproc == 1 else torchrun_launcher(nproc, argv)

    return launcher


@pytest.mark.slow
def test_muon_on_2_fsdp_ranks_resumes_bit_exact_and_on_1_reads_every_token_once(tmp_path):
    """deterministic_resume with Muon on 2 FSDP ranks (torchrun, gloo): 6 steps, step-6
    deleted, resumed from step-4: steps 5-6 bit-equal, the same data; the same at TP 2
    (the matrices split by columns and rows, redistributed whole for Newton-Schulz);
    resumed from the FSDP run's step-4 on 1 rank (DP 2 -> 1, the global batch kept):
    every token read once. Negative control: the 2-rank resume without the optimizer's
    state fails the check."""
    from helpers import assert_run_read_every_token_once

    from torchtitan.tools.deterministic_resume import main as resume_check

    args = ["--nproc", "2", "--steps", "6", "--interval", "2", "--delete", "1",
            "--training.seq_len", "32", *MUON]  # fmt: skip
    assert resume_check(["--dump-folder", str(tmp_path / "dr"), *args], launcher_for()) == 0
    tp = ["--dump-folder", str(tmp_path / "tp"), *args, "--parallelism.tensor_parallel_degree", "2"]
    assert resume_check(tp, launcher_for()) == 0
    elastic = tmp_path / "elastic"
    assert resume_check(["--dump-folder", str(elastic), *args, "--resume-nproc", "1"],
                        launcher_for()) == 0  # fmt: skip
    assert sorted(losses(elastic)) == list(range(1, 7))
    assert_run_read_every_token_once(elastic)
    control = ["--dump-folder", str(tmp_path / "control"), *args]
    assert resume_check(control, launcher_for("optimizer")) == 1


def test_a_dropped_first_step_leaves_muon_as_if_it_never_ran():
    """The spike guard drops step 1 (NaN gradients, its device flag false) through
    step.update_unless_dropped, then steps 2-3 apply: the weights equal, bit for bit,
    those of a run that took only steps 2-3's gradients; the state the dropped step
    created (Muon's momentum, its AdamW part's moments and step) went back to zeros.
    Negative control: the state left as the dropped step made it is NaN, and so would
    be every later step."""
    from torchtitan.step import update_unless_dropped

    cfg = muon_cfg()

    def run(drop_first: bool) -> tuple[dict, torch.optim.Optimizer]:
        model = build_model("debugmodel", 4096, device="cpu", seed=3)
        optimizer = build_optimizer(model, cfg)
        named = dict(model.named_parameters())
        for step in range(3):
            if step == 0 and not drop_first:
                continue
            for name, g in grads_for(named, step).items():
                named[name].grad = torch.full_like(g, float("nan")) if step == 0 else g
            update_unless_dropped(optimizer, torch.tensor(step > 0))
        return {n: p.detach().clone() for n, p in named.items()}, optimizer

    dropped, optimizer = run(True)
    skipped, _ = run(False)
    for name in skipped:
        assert torch.equal(dropped[name], skipped[name]), name
    model = build_model("debugmodel", 4096, device="cpu", seed=3)
    plain = build_optimizer(model, cfg)
    for p in model.parameters():
        p.grad = torch.full_like(p, float("nan"))
    plain.step()  # the step applied as it came, NaN gradients and all
    assert any(torch.isnan(v).any() for s in plain.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))  # fmt: skip
