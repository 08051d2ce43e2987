"""Llama-style decoder-only transformer and its flavors.

This module owns the model definition (`ModelArgs`, `Transformer`), its
weight initialisation (a function of the seed and each parameter's name only, so
the same at any sharding), the named flavors in `llama_configs`, the FLOPs per
token used for MFU, and `build_model`, the one way the trainer turns a flavor
name into a model. The attention kernels and the per-batch document masks they read
are in `torchtitan.models.attention`.

It must never touch the process group or wrap itself for FSDP/DDP/TP: parallelism,
activation checkpointing and compilation are applied from outside (per block,
on `Transformer.layers`). Dropout draws from torch's global generators, so that
checkpointing torch's RNG state is enough to resume a run exactly; under tensor
parallelism the draws over a rank's own part of an activation run inside a context
set from outside (``heads_rng``, ``output_rng``; see tensor_parallel.py).
"""

import contextlib
import hashlib
import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.utils.checkpoint import checkpoint

from torchtitan.models import attention
from torchtitan.models.moe import MoE

# Rows of a weight drawn from one seeded generator. Any sharding of dim 0 then draws
# exactly the same numbers: a rank generates only the blocks that overlap its rows.
INIT_BLOCK_ROWS = 256


@dataclass
class ModelArgs:
    dim: int = 256
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None  # None means n_heads (plain multi-head attention)
    vocab_size: int = -1  # set from the tokenizer by build_model
    multiple_of: int = 256  # SwiGLU hidden size is rounded up to a multiple of this
    ffn_hidden_dim: int | None = None  # explicit SwiGLU hidden size; overrides the 8/3 rule
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    dropout: float = 0.0
    attention_backend: str = "sdpa"  # one of attention.BACKENDS; no parameter depends on it
    flavor: str = "custom"  # only used to make error messages name the flavor
    # Mixture of experts (models/moe.py): 0 experts is the dense model.
    n_experts: int = 0  # routed experts per MoE block
    n_active_experts: int = 2  # experts each token is routed to (top-k)
    n_shared_experts: int = 1  # experts every token goes through (one SwiGLU that wide)
    moe_hidden_dim: int = 0  # each expert's SwiGLU hidden size
    moe_bias_rate: float = 1e-3  # the balancing bias's step per optimizer step (sign rule)
    moe_aux_loss_weight: float = 0.0  # the sequence-level balance loss's weight (0: none)

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.dim % self.n_heads != 0:
            raise ValueError(
                f"dim {self.dim} is not divisible by n_heads {self.n_heads} "
                f"(flavor {self.flavor!r}): pick a dim that is a multiple of n_heads"
            )
        if (self.dim // self.n_heads) % 2 != 0:
            raise ValueError(
                f"head dim {self.dim // self.n_heads} is odd (flavor {self.flavor!r}): "
                "RoPE rotates pairs of channels, so dim / n_heads must be even"
            )
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads} "
                f"(flavor {self.flavor!r}): each kv head must serve a whole group of query heads"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout {self.dropout} must be in [0, 1)")
        if self.n_experts and not (0 < self.n_active_experts <= self.n_experts):
            raise ValueError(
                f"n_active_experts {self.n_active_experts} must be in [1, n_experts "
                f"{self.n_experts}] (flavor {self.flavor!r})"
            )
        if self.n_experts and self.moe_hidden_dim <= 0:
            raise ValueError(f"moe_hidden_dim must be positive (flavor {self.flavor!r})")
        if self.attention_backend not in attention.BACKENDS:
            raise ValueError(
                f"attention_backend {self.attention_backend!r}: choose one of {attention.BACKENDS}"
            )

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_hidden_dim is not None:
            return self.ffn_hidden_dim
        # SwiGLU has three matrices instead of two, so 2/3 of the usual 4*dim
        # keeps the parameter count of a classic MLP.
        hidden = int(2 * 4 * self.dim / 3)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


# Shapes follow the published Llama models; vocab_size is only the flavor's
# nominal vocabulary, build_model replaces it with the tokenizer's.
llama_configs: dict[str, ModelArgs] = {
    # One optimizer step at batch 4 x 128 tokens with a 4096 vocab must stay
    # well under 100 ms on one CPU thread. At that size the [tokens, vocab]
    # output head and loss dominate and scale with dim, hence dim 64 (dim 128
    # measured ~110 ms). max_seq_len is long so it can still exercise
    # long-sequence training.
    "debugmodel": ModelArgs(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=4096,
        multiple_of=32,
        max_seq_len=4096,
        flavor="debugmodel",
    ),
    # GPT-3 Small width/depth with a Llama block. max_seq_len only sizes the RoPE
    # tables (not checkpointed), so 8192 costs nothing and lets it train long sequences.
    "125M": ModelArgs(
        dim=768,
        n_layers=12,
        n_heads=12,
        n_kv_heads=12,
        vocab_size=32000,
        multiple_of=256,
        max_seq_len=8192,
        flavor="125M",
    ),
    # Llama 3.2 1B shapes (that model ties its embeddings; this one does not).
    "1B": ModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_hidden_dim=8192,
        rope_theta=500000.0,
        max_seq_len=8192,
        flavor="1B",
    ),
    # Llama 3 8B shapes.
    "8B": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_hidden_dim=14336,
        norm_eps=1e-5,
        rope_theta=500000.0,
        max_seq_len=8192,
        flavor="8B",
    ),
}
# The debug model with its feed-forwards made mixtures of 8 experts, 2 routed + 1 shared
# per token, each 64 wide: 3 x 64 = 192 active hidden units, the dense debug model's
# hidden size, so the two compare at equal active parameters (plus the 64 x 8 router).
llama_configs["debug_moe"] = replace(
    llama_configs["debugmodel"],
    n_experts=8,
    n_active_experts=2,
    n_shared_experts=1,
    moe_hidden_dim=64,
    flavor="debug_moe",
)
# ~1.0B parameters in all, ~0.2B active per token (OLMoE-like proportions): 16 layers of
# 32 experts 512 wide, top-3 + 1 shared. count_parameters and active_parameters give
# the exact figures (test_llama checks them).
llama_configs["moe_1B"] = ModelArgs(
    dim=1024,
    n_layers=16,
    n_heads=16,
    n_kv_heads=8,
    vocab_size=32000,
    rope_theta=500000.0,
    max_seq_len=8192,
    n_experts=32,
    n_active_experts=3,
    n_shared_experts=1,
    moe_hidden_dim=512,
    flavor="moe_1B",
)
# The debug model 4 layers deep: enough stages for the pipeline schedules on a laptop
# CPU (an interleaved schedule over 2 ranks runs 4 stages).
llama_configs["debugmodel_4layers"] = replace(
    llama_configs["debugmodel"], n_layers=4, flavor="debugmodel_4layers"
)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32: the mean of squares underflows/overflows in bf16.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rope_cos_sin(head_dim: int, max_seq_len: int, theta: float, device=None):
    """cos and sin tables of shape [max_seq_len, head_dim // 2], in fp32."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    )
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (2i, 2i+1) of x [B, T, H, D] by position-dependent angles.

    ``rotation`` holds (cos, sin) of each angle in fp32: the table's first T rows
    ([T, D/2, 2], positions 0..T-1 for every row) or gathered per token
    ([B, T, D/2, 2], per-document positions). Eagerly a pair is one complex number and
    the rotation one complex multiplication: one kernel forward and one backward, no
    stack or cat (3.4x faster than the written-out rotation on CPU), equal to
    (x0 cos - x1 sin, x0 sin + x1 cos) to the last bit or two (the complex kernel may
    fuse multiply-adds). Compiled, the rotation is written out: inductor generates no
    code for complex numbers, and the real form fuses into one kernel with its neighbours.
    """
    B, T, H, D = x.shape
    # In fp32 (the rotation is fp32), so bf16 activations do not lose the small angles
    # of high positions.
    pairs = x.float().reshape(B, T, H, D // 2, 2)
    rotation = rotation.unsqueeze(2) if rotation.dim() == 4 else rotation.view(1, T, 1, D // 2, 2)
    if torch.compiler.is_compiling():
        x0, x1 = pairs.unbind(-1)
        cos, sin = rotation.unbind(-1)
        out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    else:
        out = torch.view_as_real(torch.view_as_complex(pairs) * torch.view_as_complex(rotation))
    return out.flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.head_dim
        self.dropout = args.dropout
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.resid_dropout = nn.Dropout(args.dropout)
        # Set from outside (tensor_parallel): contexts for the dropout draws over this
        # rank's heads, and over the output; None draws from the global generators.
        self.heads_rng = None
        self.output_rng = None

    def forward(self, x: torch.Tensor, rotation: torch.Tensor, mask=None) -> torch.Tensor:
        """``mask``: what `attention.document_mask` built for this batch (None: causal
        over whole rows with sdpa)."""
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, rotation), apply_rope(k, rotation)
        with _draws(self.heads_rng, self.training and self.dropout > 0):
            y = attention.attend(q, k, v, mask, self.dropout if self.training else 0.0)
        out = self.wo(y)
        with _draws(self.output_rng, self.training and self.dropout > 0):
            return self.resid_dropout(out)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        hidden = args.hidden_dim
        self.w1 = nn.Linear(args.dim, hidden, bias=False)  # gate
        self.w3 = nn.Linear(args.dim, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, args.dim, bias=False)  # down
        self.dropout = nn.Dropout(args.dropout)
        self.output_rng = None  # as Attention's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.w2(F.silu(self.w1(x)) * self.w3(x))
        with _draws(self.output_rng, self.training and self.dropout.p > 0):
            return self.dropout(out)


def _draws(rng, drawing: bool):
    """``rng()`` around dropout draws when there are any, else nothing."""
    return rng() if rng is not None and drawing else contextlib.nullcontext()


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = MoE(args) if args.is_moe else FeedForward(args)

        # Set from outside (torchtitan.parallel): recompute this block's activations in the
        # backward pass, and the compiled form of `compute`. Neither changes parameter
        # names, so checkpoints do not depend on them.
        self.recompute = False
        self.compiled = None
        self.compiled_attend = None  # an MoE block's: compiled around the expert dispatch

    def attend(self, x: torch.Tensor, rotation: torch.Tensor, mask=None):
        """The attention sublayer's output and the feed-forward's normed input."""
        x = x + self.attention(self.attention_norm(x), rotation, mask)
        return x, self.ffn_norm(x)

    def compute(self, x: torch.Tensor, rotation: torch.Tensor, mask=None):
        x, normed = (self.compiled_attend or self.attend)(x, rotation, mask)
        return x + self.feed_forward(normed)

    def forward(self, x: torch.Tensor, rotation: torch.Tensor, mask=None):
        # FSDP's hooks run around this call, outside the recomputed region, as with a
        # checkpoint wrapper; the dropout RNG state is replayed by the recomputation.
        compute = self.compiled or self.compute
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(compute, x, rotation, mask, use_reentrant=False)
        return compute(x, rotation, mask)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        if args.vocab_size <= 0:
            raise ValueError(
                f"vocab_size {args.vocab_size} must be positive (flavor {args.flavor!r}): "
                "set it from the tokenizer, e.g. via build_model(..., vocab_size=...)"
            )
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # Identical blocks, each its own FSDP2 unit, keyed by index: a pipeline stage keeps
        # some of them under their unsplit names ("layers.5"), so checkpoints move
        # between pipeline degrees.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Derived from args, so not saved in checkpoints (persistent=False);
        # init_weights recomputes them after a meta-device build.
        table_shape = (args.max_seq_len, args.head_dim // 2)
        # Ranks the residual stream is split over by sequence between blocks (tensor
        # parallel's sequence parallel sets it): a later pipeline stage receives 1/this.
        self.seq_shards = 1
        self.register_buffer("rope_cos", torch.empty(table_shape), persistent=False)
        self.register_buffer("rope_sin", torch.empty(table_shape), persistent=False)
        self.reset_rope()

    @torch.no_grad()
    def reset_rope(self):
        # Nothing to compute on meta: the values are only read after
        # to_empty() + init_weights() on a real device.
        if self.rope_cos.is_meta:
            return
        cos, sin = rope_cos_sin(
            self.args.head_dim, self.args.max_seq_len, self.args.rope_theta, self.rope_cos.device
        )
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    @torch.no_grad()
    def init_weights(self, seed: int = 0):
        """(Re)initialise every parameter and buffer in place from ``seed``.

        Each weight is drawn in blocks of INIT_BLOCK_ROWS rows, each block from a
        generator seeded by (seed, parameter name, block), so the values depend on
        neither the device build order nor the sharding: a model sharded over any
        number of ranks holds, shard for shard, the weights of the unsharded one.
        (DTensor's own RNG would give that too, but only on CUDA.) Growth: O(own
        shard + one block) memory and time per rank.
        """
        self.reset_rope()
        # Each block adds two residual branches; shrinking their output
        # projections keeps the residual stream's variance from growing with depth.
        out_std = 0.02 / math.sqrt(2 * self.args.n_layers)
        outputs = (
            "attention.wo.weight",
            "feed_forward.w2.weight",
            "shared.w2.weight",
            "experts.w2",
        )
        for name, param in self.named_parameters():
            std = out_std if name.endswith(outputs) else 0.02
            if name.endswith("norm.weight"):
                _local(param)[0].fill_(1.0)
            elif ".experts." in name:
                fill_experts(param, std, seed, name)
            else:
                fill_normal(param, std, seed, name)
        for moe in self.moe_layers():
            moe.reset_balance()

    def moe_layers(self) -> list[MoE]:
        """The MoE feed-forwards, in layer order (none in a dense model)."""
        return [b.feed_forward for b in self.layers.values() if isinstance(b.feed_forward, MoE)]

    def expert_loads(self) -> torch.Tensor | None:
        """This rank's tokens per expert in the step so far, [MoE layers, experts] int64
        (None: a dense model). The trainer sums it over the data-parallel ranks."""
        layers = self.moe_layers()
        if not layers:
            return None
        device = layers[0].expert_bias.device
        empty = torch.zeros(self.args.n_experts, dtype=torch.int64, device=device)
        return torch.stack([m.step_load if m.step_load is not None else empty for m in layers])

    def balance_experts(self, loads: torch.Tensor):
        """Apply one step's balancing update from ``loads`` (expert_loads summed over the
        data-parallel ranks: the same on every rank, so every rank's bias stays equal)
        and keep them as ``last_loads`` for the metrics."""
        for moe, load in zip(self.moe_layers(), loads):
            moe.balance(load)
        self.last_loads = loads

    def forget_expert_loads(self):
        """A step that was not taken (fault tolerance dropped it) counts no load."""
        for moe in self.moe_layers():
            moe.step_load = None

    def aux_loss(self) -> torch.Tensor | None:
        """The sequence-level balance losses of the last training forward, summed over
        layers (None: no MoE, or its weight is 0)."""
        losses = [m.aux_loss for m in self.moe_layers() if m.aux_loss is not None]
        for m in self.moe_layers():
            m.aux_loss = None
        return sum(losses) if losses else None

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens: LongTensor [B, T] -> logits [B, T, vocab_size].

        A pipeline stage (pipeline.py) holds some of the parts: without
        ``tok_embeddings`` it takes the previous stage's hidden states [B, T, dim] in
        place of tokens, and without ``output`` it returns its own.

        Causal over the whole sequence by default. ``positions`` ([B, T]) are the RoPE
        positions of each token (per document: restarting at 0); with ``document_ids``
        ([B, T], equal within a document, on the host or the device) each token attends
        only to the earlier tokens of its own document (block-causal). The mask is built
        once per batch, for the model's attention backend, and shared by all layers.
        """
        B, T = tokens.shape[:2]
        if self.tok_embeddings is None:  # a later stage's input, split by sequence under SP
            T *= self.seq_shards
        if T > self.args.max_seq_len:
            raise ValueError(
                f"sequence length {T} exceeds the model's max_seq_len {self.args.max_seq_len} "
                f"(flavor {self.args.flavor!r}): lower --training.seq_len to at most "
                f"{self.args.max_seq_len} or build the model with a larger max_seq_len"
            )
        cos, sin = self.rope_cos, self.rope_sin
        if positions is None:
            cos, sin = cos[:T], sin[:T]
        else:
            positions = positions.to(cos.device, non_blocking=True)
            cos, sin = cos[positions], sin[positions]  # [B, T, head_dim / 2]
        rotation = torch.stack((cos, sin), dim=-1)
        mask = attention.document_mask(
            self.args.attention_backend, B, T, tokens.device, document_ids
        )
        h = tokens if self.tok_embeddings is None else self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, rotation, mask)
        return h if self.output is None else self.output(self.norm(h))


def build_model(
    flavor: str,
    vocab_size: int,
    max_seq_len: int | None = None,
    dropout: float = 0.0,
    device: str | torch.device = "meta",
    seed: int = 0,
    attention_backend: str = "sdpa",
) -> Transformer:
    """Build the named flavor with the tokenizer's vocab_size.

    On "meta" the model has no storage and is NOT initialised: the caller
    shards/moves it, then calls `model.to_empty(device=...)` and
    `model.init_weights(seed)`. On any other device the same two steps are done
    here, so both paths hold the same numbers for the same seed.
    """
    if flavor not in llama_configs:
        raise ValueError(
            f"unknown llama flavor {flavor!r}: valid choices are {sorted(llama_configs)}"
        )
    args = replace(
        llama_configs[flavor],
        vocab_size=vocab_size,
        dropout=dropout,
        attention_backend=attention_backend,
    )
    if max_seq_len is not None:
        args = replace(args, max_seq_len=max_seq_len)
    with torch.device("meta"):
        model = Transformer(args)
    if torch.device(device).type != "meta":
        model.to_empty(device=device)
        model.init_weights(seed)
    return model


def count_parameters(model: nn.Module) -> int:
    """Number of parameter elements (works on meta-device models)."""
    return sum(p.numel() for p in model.parameters())


def _local(param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, tuple]:
    """The part of ``param`` this rank holds, the global indices of its rows, those of
    its columns (None: all columns), and the whole tensor's shape.

    Any DTensor sharding: FSDP's Shard(0), HSDP's (Replicate, Shard(0)), tensor
    parallel's row or column split, and FSDP over TP (a strided split of dim 0). The
    indices come from splitting ``arange`` the way the parameter is split, locally
    (``src_data_rank=None``: no communication). Cost: O(rows + columns).
    """
    if not isinstance(param, DTensor):
        return param.data, torch.arange(param.shape[0]), None, tuple(param.shape)
    rows = _held_indices(param, 0)
    cols = _held_indices(param, 1) if param.dim() > 1 else None
    return param.to_local(), rows, cols, tuple(param.shape)


def _held_indices(param: DTensor, dim: int) -> torch.Tensor | None:
    """Global indices along ``dim`` of the local shard of ``param`` (None: all of them)."""
    splits = [_splits(p, dim) for p in param.placements]
    if not any(splits) and dim > 0:
        return None
    # The same placements applied to a 1-D index tensor: a split of ``dim`` becomes a
    # split of dim 0 (strided ones keep their split factor); the rest replicate.
    placements = [
        _as_dim0(p) if split else Replicate() for p, split in zip(param.placements, splits)
    ]
    index = torch.arange(param.shape[dim])
    split = distribute_tensor(index, param.device_mesh, placements, src_data_rank=None)
    return split.to_local().cpu()


def _splits(placement, dim: int) -> bool:
    # torch's _StridedShard (FSDP over TP's rows) is not is_shard() in torch 2.13.
    strided = getattr(placement, "split_factor", None) is not None
    return placement.is_shard(dim) or (strided and placement.dim == dim)


def _as_dim0(placement):
    if hasattr(placement, "split_factor"):  # torch's _StridedShard: FSDP over TP's rows
        return type(placement)(0, split_factor=placement.split_factor)
    return Shard(0)


def _block_seed(seed: int, name: str, block: int) -> int:
    key = f"{seed}/{name}/{block}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


@torch.no_grad()
def fill_normal(param: torch.Tensor, std: float, seed: int, name: str):
    """Fill this rank's part of ``param`` with N(0, std) drawn as the whole tensor would be.

    Each block of INIT_BLOCK_ROWS rows is drawn whole (every column) from its own
    generator, then the local rows and columns are taken from it. Cost: the blocks
    overlapping the local rows, O(own rows x all columns + one block): a column split
    (tensor parallel's row-wise matrices) draws tp times what it keeps.
    """
    local, rows, cols, shape = _local(param)
    if local.numel() == 0:
        return
    total, rest = shape[0], shape[1:]
    blocks = torch.div(rows, INIT_BLOCK_ROWS, rounding_mode="floor")
    for block in torch.unique(blocks).tolist():
        start, stop = block * INIT_BLOCK_ROWS, min((block + 1) * INIT_BLOCK_ROWS, total)
        generator = torch.Generator(device=local.device)
        generator.manual_seed(_block_seed(seed, name, block))
        values = torch.empty((stop - start, *rest), device=local.device)
        values.normal_(0.0, std, generator=generator)
        mine = (blocks == block).nonzero().flatten()  # local positions of this block's rows
        picked = values[(rows[mine] - start).to(local.device)]
        if cols is not None:
            picked = picked[:, cols.to(local.device)]
        local[mine.to(local.device)] = picked


@torch.no_grad()
def fill_experts(param: torch.Tensor, std: float, seed: int, name: str):
    """Fill this rank's experts of a 3-D expert weight, each expert drawn as the 2-D
    weight ``<name>.<global expert index>`` is by ``fill_normal``: the same values at any
    expert-parallel degree or FSDP split of the expert dim. Cost: O(own experts)."""
    local, rows, _, shape = _local(param)
    for i, expert in enumerate(rows.tolist()):
        fill_normal(local[i], std, seed, f"{name}.{expert}")


def active_matmul_weights(args: ModelArgs) -> int:
    """Weights that multiply each token: every matrix but the embedding lookup, and of
    an MoE's experts only the shared and the ``n_active_experts`` routed ones (plus the
    router)."""
    if args.is_moe:
        experts = args.n_active_experts + args.n_shared_experts
        ffn = 3 * args.dim * args.moe_hidden_dim * experts + args.dim * args.n_experts
    else:
        ffn = 3 * args.dim * args.hidden_dim
    attention_weights = args.dim * args.head_dim * (args.n_heads * 2 + args.n_kv_heads * 2)
    return args.n_layers * (attention_weights + ffn) + args.dim * args.vocab_size


def flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward) for MFU.

    6 per weight that multiplies the token (every matrix but the embedding lookup; of an
    MoE, the active experts only: ``active_matmul_weights``), plus attention's QK^T and
    AV: 12 * layers * dim * seq_len, counting the full square as the usual MFU
    convention does (the causal half is not subtracted).
    """
    matmul_weights = active_matmul_weights(args)
    return 6 * matmul_weights + 12 * args.n_layers * args.dim * seq_len
