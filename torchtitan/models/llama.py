"""Llama-style decoder-only transformer and its flavors.

This module owns the model definition (`ModelArgs`, `Transformer`), its
deterministic weight initialisation, the named flavors in `llama_configs`, and
`build_model`, the one way the trainer turns a flavor name into a model.

It must never touch the process group, wrap itself for FSDP/DDP, or keep RNG
state of its own: parallelism is applied from outside (per block, on
`Transformer.layers`), and all randomness (init and dropout) is drawn from
torch's global generators so that checkpointing torch's RNG state is enough to
resume a run exactly.
"""

import itertools
import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn


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
    flavor: str = "custom"  # only used to make error messages name the flavor

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
    # GPT-3 Small width/depth with a Llama block.
    "125M": ModelArgs(
        dim=768,
        n_layers=12,
        n_heads=12,
        n_kv_heads=12,
        vocab_size=32000,
        multiple_of=256,
        max_seq_len=2048,
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


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self):
        nn.init.ones_(self.weight)

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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (2i, 2i+1) of x [B, T, H, D] by position-dependent angles.

    ``cos``/``sin`` are the tables ([max_seq_len, D/2]: positions 0..T-1 for every row)
    or already gathered per token ([B, T, D/2]: per-document positions).
    """
    B, T, H, D = x.shape
    # The rotation is done in fp32 (the tables are fp32) so bf16 activations
    # do not lose the small angles of high positions.
    xf = x.float().reshape(B, T, H, D // 2, 2)
    x0, x1 = xf.unbind(-1)
    if cos.dim() == 3:
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    else:
        cos = cos[:T].view(1, T, 1, D // 2)
        sin = sin[:T].view(1, T, 1, D // 2)
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
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

    def _sdpa(self, q, k, v) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=True,
            enable_gqa=self.n_kv_heads != self.n_heads,
        )

    def init_weights(self, out_std: float):
        for linear in (self.wq, self.wk, self.wv):
            nn.init.normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.normal_(self.wo.weight, mean=0.0, std=out_std)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments=None
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, T, head_dim]
        if segments is None:
            y = self._sdpa(q, k, v)
        else:
            # Block-causal: each document attends causally within itself only. Run as
            # one causal attention per document, so a document's result is the same
            # computation wherever it sits in the sequence (bit for bit).
            rows = []
            for b, lengths in enumerate(segments):
                bounds = [0, *itertools.accumulate(lengths)]
                rows.append(torch.cat([
                    self._sdpa(q[b : b + 1, :, s:e], k[b : b + 1, :, s:e], v[b : b + 1, :, s:e])
                    for s, e in zip(bounds, bounds[1:])
                ], dim=2))  # fmt: skip
            y = torch.cat(rows)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        return self.resid_dropout(self.wo(y))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        hidden = args.hidden_dim
        self.w1 = nn.Linear(args.dim, hidden, bias=False)  # gate
        self.w3 = nn.Linear(args.dim, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, args.dim, bias=False)  # down
        self.dropout = nn.Dropout(args.dropout)

    def init_weights(self, out_std: float):
        nn.init.normal_(self.w1.weight, mean=0.0, std=0.02)
        nn.init.normal_(self.w3.weight, mean=0.0, std=0.02)
        nn.init.normal_(self.w2.weight, mean=0.0, std=out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.w2(F.silu(self.w1(x)) * self.w3(x)))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def init_weights(self, out_std: float):
        self.attention_norm.reset_parameters()
        self.attention.init_weights(out_std)
        self.ffn_norm.reset_parameters()
        self.feed_forward.init_weights(out_std)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments=None):
        x = x + self.attention(self.attention_norm(x), cos, sin, segments)
        return x + self.feed_forward(self.ffn_norm(x))


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
        # A ModuleList of identical blocks so FSDP2 can fully_shard each one.
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Derived from args, so not saved in checkpoints (persistent=False);
        # init_weights recomputes them after a meta-device build.
        table_shape = (args.max_seq_len, args.head_dim // 2)
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
    def init_weights(self):
        """Deterministically (re)initialise every parameter and buffer in place.

        Draws from torch's global RNG in a fixed order, so the same
        torch.manual_seed gives the same weights whether the model was built
        on the target device or on meta and then `to_empty`'d there.
        """
        self.reset_rope()
        nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=0.02)
        # Each block adds two residual branches; shrinking their output
        # projections keeps the residual stream's variance from growing with depth.
        out_std = 0.02 / math.sqrt(2 * self.args.n_layers)
        for layer in self.layers:
            layer.init_weights(out_std)
        self.norm.reset_parameters()
        nn.init.normal_(self.output.weight, mean=0.0, std=0.02)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        segments: list[list[int]] | None = None,
    ) -> torch.Tensor:
        """tokens: LongTensor [B, T] -> logits [B, T, vocab_size].

        Causal over the whole sequence by default. With ``positions`` ([B, T], per-document
        RoPE positions) and ``segments`` (per row, the lengths of its documents, summing to
        T), attention stays within each document (block-causal).
        """
        T = tokens.shape[1]
        if T > self.args.max_seq_len:
            raise ValueError(
                f"sequence length {T} exceeds the model's max_seq_len {self.args.max_seq_len} "
                f"(flavor {self.args.flavor!r}): lower --training.seq_len to at most "
                f"{self.args.max_seq_len} or build the model with a larger max_seq_len"
            )
        cos, sin = self.rope_cos, self.rope_sin
        if positions is not None:
            cos, sin = cos[positions], sin[positions]  # [B, T, head_dim / 2]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin, segments)
        return self.output(self.norm(h))


def build_model(
    flavor: str,
    vocab_size: int,
    max_seq_len: int | None = None,
    dropout: float = 0.0,
    device: str | torch.device = "meta",
) -> Transformer:
    """Build the named flavor with the tokenizer's vocab_size.

    On "meta" the model has no storage and is NOT initialised: the caller
    shards/moves it, then calls `model.to_empty(device=...)` and
    `model.init_weights()`. On any other device the same two steps are done
    here, so both paths draw the same numbers from the same seed.
    """
    if flavor not in llama_configs:
        raise ValueError(
            f"unknown llama flavor {flavor!r}: valid choices are {sorted(llama_configs)}"
        )
    args = replace(llama_configs[flavor], vocab_size=vocab_size, dropout=dropout)
    if max_seq_len is not None:
        args = replace(args, max_seq_len=max_seq_len)
    with torch.device("meta"):
        model = Transformer(args)
    if torch.device(device).type != "meta":
        model.to_empty(device=device)
        model.init_weights()
    return model


def count_parameters(model: nn.Module) -> int:
    """Number of parameter elements (works on meta-device models)."""
    return sum(p.numel() for p in model.parameters())
