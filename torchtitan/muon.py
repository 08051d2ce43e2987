"""Muon for the hidden matrices, AdamW for everything else, as one optimizer.

Owns: which parameters Muon takes (``is_hidden_matrix``: the 2-D weights inside the
transformer blocks and the 3-D expert weights ``[E, out, in]``, each expert a matrix of
its own; not the embeddings, the output, norms, biases or the MoE router), the
Newton-Schulz orthogonalization (``newton_schulz``: torch.optim.Muon's iteration and
defaults, batched over a 3-D weight's experts), and the step over sharded parameters.

The update of a matrix W with gradient G is torch.optim.Muon's, op for op:
``B = lerp(B, G, 1 - momentum)``; ``U = lerp(G, B, momentum)`` (Nesterov) or ``B``;
``O = NS(bf16(U))``; ``W *= 1 - lr * wd``; ``W -= adjusted_lr * O``. On one process it
equals torch.optim.Muon (its ``momentum_buffer`` state, its param-group keys) bit for bit
on the same matrices, and the rest equals torch.optim.AdamW(fused=True) bit for bit (it
is one: ``self.adamw`` shares this optimizer's state and its param group).

Sharded matrices (DTensors of FSDP2 / HSDP / TP / FSDP x TP). Newton-Schulz needs the
whole matrix; everything else is elementwise and runs on the local shard. The matrices
of one shape and layout are taken in buckets of R, the number of ranks that hold a
piece of each (the product of the mesh dimensions that shard a matrix dimension): the
bucket's local bf16 pieces are stacked and redistributed from pieces to whole matrices
(``DTensor.redistribute``, Shard(d + 1) -> Shard(0): an all-to-all on NCCL; gloo has
none, so DTensor all-gathers and keeps its chunk), so each rank holds at most one whole
matrix of the bucket, orthogonalizes it, and a second redistribution hands every rank
its pieces back. Moving bytes is exact and each matrix is orthogonalized whole with the
same shapes and ops as on one process: the result equals one process's bit for bit. A
rank that holds whole matrices already (experts sharded by expert under EP or FSDP,
replicated norms, PP stages, DDP) orthogonalizes them where they are, with no
communication. HSDP replicas (and a TP group's Replicate dimension) each do the same
work. FSDP x TP column-wise weights (``_StridedShard(0)`` over the data-parallel dim)
DTensor redistributes through all-gathers (its planner has no all-to-all for them): the
bytes of the all-gather scheme below for those, the compute still 1 / R.

Cost per step (hidden-matrix parameters P, ranks sharing a matrix R; bf16 on the wire;
NS = 5 iterations of ``4 m^2 n + 2 m^3`` FLOPs for an m x n matrix, m <= n):
- bytes per rank: 2P / R out and 2P / R back (its pieces of every matrix, less the
  1 / R it keeps), none for matrices held whole;
- compute per rank: the NS of one matrix per bucket, about NS(all) / R;
- memory: a bucket at a time, about 4 matrices of its shape in bf16 (pieces, the whole
  matrix, its result, the pieces back; on gloo the all-gather holds the bucket's R), and
  the bf16 update of every local matrix (2 bytes per local element) while the step
  runs; state: one fp32 momentum buffer per matrix (AdamW keeps two).
- debug model (0.10 M hidden in 14 matrices): 0.4 MB / R, negligible compute; measured
  on 2 ranks (docs/benchmarks.md § 28): +412 KB a step over AdamW's 7.9 MB, the step
  1.34 x AdamW's on CPU.
- ``moe_1B`` (75.5 M dense hidden in 112 matrices; 805 M in experts): 0.3 GB / R and
  1.6 TFLOP / R for the dense ones; the experts are whole on their rank (EP, or FSDP
  sharding by expert): 10.3 TFLOP spread over the ranks holding them, no bytes.
- ``8B`` (6.98 G hidden in 224 matrices, the largest 14336 x 4096 at 5.5 TFLOP):
  28 GB / R and 666 TFLOP / R per rank (FSDP 8: 3.5 GB, 83 TFLOP, ~0.2 s on an H100).
- 1,000 ranks: FSDP over all (R = 1000): 28 MB per rank; at most 64 matrices share a
  shape, so 64 ranks work, the busiest on one matrix of each of the 4 shapes (~13
  TFLOP, ~30 ms on an H100) while the rest wait. HSDP: R is the shard group's, the
  replicas repeating it. The all-gather scheme (every rank gathers and orthogonalizes
  every matrix) costs 14 GB and 666 TFLOP per rank at 8B whatever the rank count: why
  the buckets.

Exactness: 2-D matrices go through ``torch.addmm`` as torch.optim.Muon does; 3-D weights
through ``torch.baddbmm`` over their experts, which equals each expert alone at the MoE
debug shapes on the CPUs tested (test_muon.py); at other shapes a CPU's batched bf16
GEMM can differ from its single GEMM in the last bits (measured: 2 of 48 matrices of
1024 x 512, by 16 bf16 ulps), so a change of expert-parallel degree (another batch per
rank) is equal to that rounding, as MoE outputs already are (test_expert_parallel.py);
a resume on the same layout is bit-exact either way.

Never: choose the learning rate (optim.LRSchedule sets each group's ``lr`` from its
``peak_lr``), clip gradients, or read the config (optim.build_optimizer does).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's (Keller Jordan's)
NS_STEPS = 5
EPS = 1e-7
ADJUST_LR = ("original", "match_rms_adamw")


def is_hidden_matrix(name: str, param: torch.Tensor) -> bool:
    """Whether Muon takes ``name`` (a ``named_parameters`` name, any wrapper prefix): a 2-D
    or 3-D (experts) weight inside a transformer block that is not the MoE router. The
    embeddings and output are outside the blocks, norms and biases 1-D."""
    parts = name.split(".")
    return param.ndim in (2, 3) and "layers" in parts and "router" not in parts


def newton_schulz(g: torch.Tensor, coefficients=NS_COEFFICIENTS, steps: int = NS_STEPS,
                  eps: float = EPS) -> torch.Tensor:  # fmt: skip
    """The orthogonalized ``g`` in bf16: torch.optim.Muon's quintic iteration on each
    matrix of ``g`` (the last two dims; 3-D: one per expert, batched).

    A tall matrix is iterated transposed, divided by its Frobenius norm (at least
    ``eps``), then ``steps`` times ``X = a X + (b A + c A^2) X`` with ``A = X X^T``.
    Cost: ``steps * (4 m^2 n + 2 m^3)`` FLOPs per m x n matrix (m <= n), in bf16; memory:
    a few copies of the matrix and two m x m."""
    a, b, c = coefficients
    x = g.bfloat16()
    tall = g.size(-2) > g.size(-1)
    if g.ndim == 2:  # torch.optim.Muon's ops exactly (the bits depend on them)
        if tall:
            x = x.T
        x.div_(x.norm().clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        return x.T if tall else x
    x = x.reshape(-1, *x.shape[-2:])
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.mT if tall else x).reshape(g.shape)


def adjusted_lr(lr: float, adjust: str, shape) -> float:
    """torch.optim.Muon's per-matrix LR scale, on the matrix dims (an expert's, for 3-D)."""
    rows, cols = shape[-2:]
    if adjust == "match_rms_adamw":
        return lr * (0.2 * math.sqrt(max(rows, cols)))
    return lr * math.sqrt(max(1, rows / cols))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view: writes reach the DTensor), or ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _splits_matrices(param: torch.Tensor) -> bool:
    """Whether some rank holds only a piece of one of ``param``'s matrices."""
    if not isinstance(param, DTensor):
        return False
    return any(isinstance(pl, Shard) and pl.dim % param.ndim >= param.ndim - 2
               for pl in param.placements)  # fmt: skip


def _stacked(placement):
    """A parameter's placement as that of a stack of such parameters (one dim in front)."""
    if isinstance(placement, _StridedShard):
        return _StridedShard(placement.dim + 1, split_factor=placement.split_factor)
    if isinstance(placement, Shard):
        return Shard(placement.dim + 1)
    return placement


def orthogonalize(params: list[torch.Tensor], updates: list[torch.Tensor], *, coefficients,
                  steps: int, eps: float) -> list[torch.Tensor]:  # fmt: skip
    """``newton_schulz`` of each parameter's whole update, as this rank's local piece.

    ``updates``: each parameter's local update (bf16). Matrices this rank holds whole
    are orthogonalized here; the others in buckets of R (the ranks sharing a matrix),
    redistributed so that each rank orthogonalizes at most one whole matrix per bucket
    (the module docstring has the costs). Every rank must call it with the same
    parameters in the same order (the buckets' collectives)."""
    out: list[torch.Tensor | None] = [None] * len(params)
    buckets: dict[tuple, list[int]] = defaultdict(list)
    for i, (param, update) in enumerate(zip(params, updates)):
        if _splits_matrices(param):
            buckets[(tuple(param.shape), param.device_mesh, param.placements)].append(i)
        else:
            out[i] = newton_schulz(update, coefficients, steps, eps)
    for (shape, mesh, placements), members in buckets.items():
        pieces = [_stacked(pl) for pl in placements]
        sharding = [d for d, pl in enumerate(placements) if isinstance(pl, Shard)]
        whole = [Shard(0) if d in sharding else pl for d, pl in enumerate(placements)]
        size = math.prod(mesh.size(d) for d in sharding)
        for start in range(0, len(members), size):
            bucket = members[start : start + size]
            full_shape = torch.Size((len(bucket), *shape))
            stride = _contiguous_stride(full_shape)
            stack = DTensor.from_local(
                torch.stack([updates[i] for i in bucket]), mesh, pieces,
                run_check=False, shape=full_shape, stride=stride,
            )  # fmt: skip
            mine = stack.redistribute(mesh, whole).to_local()
            done = torch.stack([newton_schulz(m, coefficients, steps, eps) for m in mine]) \
                if len(mine) else mine  # fmt: skip
            back = DTensor.from_local(done, mesh, whole, run_check=False, shape=full_shape,
                                      stride=stride).redistribute(mesh, pieces).to_local()  # fmt: skip
            for i, piece in zip(bucket, back.unbind(0)):
                out[i] = piece
    return out


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


class Muon(torch.optim.Optimizer):
    """Muon on the hidden matrices (``is_hidden_matrix``), AdamW on the other parameters.

    Param groups: first Muon's (torch.optim.Muon's keys: ``lr``, ``weight_decay``,
    ``momentum``, ``nesterov``, ``ns_coefficients``, ``ns_steps``, ``eps``,
    ``adjust_lr_fn``), then AdamW's (torch.optim.AdamW's, ``fused=True``); each has a
    ``peak_lr``, the LR the schedule scales. State: ``momentum_buffer`` per matrix,
    AdamW's ``step``/``exp_avg``/``exp_avg_sq`` per other parameter, DTensors shaped as
    their parameters, so DCP reshards them across layouts as AdamW's.

    Cost per step: the AdamW part as torch's fused AdamW; the Muon part elementwise on
    each local shard plus ``orthogonalize`` (module docstring).
    """

    def __init__(self, named_parameters: Iterable[tuple[str, torch.Tensor]], *, lr: float,
                 weight_decay: float, momentum: float = 0.95, nesterov: bool = True,
                 ns_coefficients=NS_COEFFICIENTS, ns_steps: int = NS_STEPS, eps: float = EPS,
                 adjust_lr_fn: str = "original", adamw_lr: float, adamw_weight_decay: float,
                 betas=(0.9, 0.95), adamw_eps: float = 1e-8):  # fmt: skip
        if adjust_lr_fn not in ADJUST_LR:
            raise ValueError(f"adjust_lr_fn {adjust_lr_fn!r}: choose one of {ADJUST_LR}")
        matrices, rest = [], []
        for name, param in named_parameters:
            if param.requires_grad:
                (matrices if is_hidden_matrix(name, param) else rest).append(param)
        defaults = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum,
                    "nesterov": nesterov, "ns_coefficients": tuple(ns_coefficients),
                    "ns_steps": ns_steps, "eps": eps, "adjust_lr_fn": adjust_lr_fn,
                    "peak_lr": lr}  # fmt: skip
        groups = [{"params": matrices}] if matrices else []
        # torch.optim.Optimizer refuses an empty list: a model without hidden matrices
        # gets an AdamW-only Muon (its first group then the AdamW one).
        super().__init__(groups or [{"params": rest, "lr": adamw_lr}], defaults)
        if not groups:
            self.param_groups.clear()
        self.adamw = None
        if rest:
            self.adamw = torch.optim.AdamW(rest, lr=adamw_lr, betas=tuple(betas), eps=adamw_eps,
                                           weight_decay=adamw_weight_decay, fused=True)  # fmt: skip
            self.adamw.param_groups[0]["peak_lr"] = adamw_lr
            self.param_groups.append(self.adamw.param_groups[0])
        self._link()

    def _link(self):
        """The inner AdamW steps this optimizer's own AdamW group and state (the same
        objects), so that the schedule, the state dict and DCP see one optimizer."""
        if self.adamw is not None:
            self.adamw.param_groups = [g for g in self.param_groups if "ns_steps" not in g]
            self.adamw.state = self.state

    def load_state_dict(self, state_dict: dict):
        super().load_state_dict(state_dict)  # new group dicts and a new state mapping
        self._link()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if "ns_steps" in group:
                self._muon_step(group)
        if self.adamw is not None:
            self.adamw.step()
        return loss

    def _muon_step(self, group: dict):
        lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
        params, updates = [], []
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(
                    param.grad, memory_format=torch.preserve_format
                )
            grad, buf = _local(param.grad), _local(state["momentum_buffer"])
            buf.lerp_(grad, 1 - momentum)
            update = grad.lerp(buf, momentum) if group["nesterov"] else buf
            params.append(param)
            updates.append(update.bfloat16())  # NS's first op: cast before moving bytes
        orthogonal = orthogonalize(params, updates, coefficients=group["ns_coefficients"],
                                   steps=group["ns_steps"], eps=group["eps"])  # fmt: skip
        for param, o in zip(params, orthogonal):
            weight = _local(param)
            weight.mul_(1 - lr * wd)
            weight.add_(o, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], param.shape))
