"""The mixture-of-experts feed-forward layer: token-choice top-k routing, a shared
expert, grouped experts, and load balancing without an auxiliary loss.

Owns: the router (sigmoid scores; the top ``n_active_experts`` of scores + a per-expert
bias are chosen; the gate weights are the chosen *unbiased* scores, normalized to sum
to one), the routed experts held as three 3-D weights ``[experts, ...]`` and computed
grouped (the layer's tokens sorted by expert, one matmul per expert over its whole
group: a loop over the few experts, never over tokens), the shared expert every token
goes through, the dispatch to experts held on other ranks and the combine back
(``all_to_all_single`` over the expert-parallel group that parallel/expert_parallel.py
sets), the balancing state (``expert_bias``, ``expert_tokens``: persistent buffers, so
a checkpoint holds them) and the optional sequence-level auxiliary loss.

The balancing rule (DeepSeek-V3's, "auxiliary-loss-free"): after each optimizer step,
for each layer, with ``load`` the tokens each expert received in the step over all
data-parallel ranks, ``bias += rate * sign(mean(load) - load)``: an expert above the
mean is chosen less often, one below it more often. The bias changes which experts are
chosen, never the weight a chosen expert's output gets, so it carries no gradient.
The trainer sums the loads over the ranks and calls ``Transformer.balance_experts``
with them (step.py), so every rank applies the same update to the same bias.

Never: touch the process group itself beyond the one group it is handed (the
all-to-all), or decide the layout.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn


class GroupedExperts(nn.Module):
    """``n_experts`` SwiGLU experts, each ``dim -> hidden -> dim``, as three 3-D weights
    (``w1``, ``w3``: ``[experts, hidden, dim]``; ``w2``: ``[experts, dim, hidden]``).

    Under expert parallelism each weight is a DTensor sharded on dim 0 (the expert
    index) over the expert-parallel ranks: a rank holds the experts
    ``[rank * local, (rank + 1) * local)`` and a checkpoint names each by its global
    index, so it loads at any expert-parallel degree.
    """

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.n_experts = n_experts
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))  # gate
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))  # up
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))  # down
        # Expert parallel (set by parallel/expert_parallel.py): the gradient of a held
        # expert sums every rank's tokens, where FSDP averages the other gradients over
        # the ranks; it is divided by this many ranks on its way back.
        self.grad_divisor = 1

    def _held(self, w: torch.Tensor) -> torch.Tensor:
        if not hasattr(w, "to_local"):
            return w
        return _DivideGrad.apply(w.to_local(), self.grad_divisor)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``x``: rows sorted by local expert, ``counts[e]`` of them for local expert e.

        One matmul per expert over its whole group (groups of no rows included, so
        every expert's weights get a gradient, zero if it saw no token)."""
        w1, w2, w3 = (self._held(w).to(x.dtype) for w in (self.w1, self.w2, self.w3))
        outs = [
            F.linear(F.silu(F.linear(rows, w1[e])) * F.linear(rows, w3[e]), w2[e])
            for e, rows in enumerate(x.split(counts))
        ]
        return torch.cat(outs)


class _DivideGrad(torch.autograd.Function):
    """The identity forward; the gradient divided by ``divisor`` backward."""

    @staticmethod
    def forward(ctx, x, divisor):
        ctx.divisor = divisor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad / ctx.divisor, None


class SharedExpert(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """The feed-forward of an MoE block: ``shared(x) + sum_k gate_k * expert_k(x)``."""

    def __init__(self, args):
        super().__init__()
        self.n_experts, self.top_k = args.n_experts, args.n_active_experts
        self.bias_rate = args.moe_bias_rate
        self.aux_loss_weight = args.moe_aux_loss_weight
        hidden = args.moe_hidden_dim
        self.router = nn.Linear(args.dim, args.n_experts, bias=False)
        self.experts = GroupedExperts(args.n_experts, args.dim, hidden)
        # Every token's expert: one SwiGLU as wide as ``n_shared_experts`` experts.
        self.shared = None
        if args.n_shared_experts:
            self.shared = SharedExpert(args.dim, hidden * args.n_shared_experts)
        self.dropout = nn.Dropout(args.dropout)
        self.output_rng = None  # as FeedForward's (tensor parallel is refused with MoE)
        # The balancing state: in the checkpoint (persistent), the same on every rank.
        self.register_buffer("expert_bias", torch.zeros(args.n_experts))
        # Tokens routed to each expert since step 0, over all data-parallel ranks.
        self.register_buffer("expert_tokens", torch.zeros(args.n_experts, dtype=torch.int64))
        # This rank's tokens per expert in the step so far: not state (reset after each
        # step), and a plain attribute, not a buffer: DDP would broadcast rank 0's.
        self.step_load: torch.Tensor | None = None
        self.aux_loss: torch.Tensor | None = None  # the last training forward's, if any
        # Set by parallel/expert_parallel.py: the group the experts are sharded over.
        self.ep_group = None
        self.ep_size, self.ep_rank = 1, 0

    @torch.no_grad()
    def reset_balance(self):
        """Zero bias and counts (init_weights: a fresh model)."""
        self.expert_bias.zero_()
        self.expert_tokens.zero_()
        self.step_load = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scores [N, E] fp32, chosen experts [N, K], gate weights [N, K] fp32) of tokens
        ``x`` [N, dim]. Each token's choice reads only its own row: routing does not
        depend on the rest of the batch (no capacity, nothing is dropped)."""
        scores = torch.sigmoid(self.router(x).float())
        chosen = torch.topk(scores + self.expert_bias, self.top_k, dim=-1).indices
        gates = scores.gather(-1, chosen)
        return scores, chosen, gates / gates.sum(-1, keepdim=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        scores, chosen, gates = self.route(tokens)
        if self.training and torch._C._current_graph_task_id() == -1:
            # Counted in the forward only, not again when activation checkpointing
            # recomputes it during the backward (a graph task is running then).
            self._count(chosen)
            if self.aux_loss_weight > 0:
                self.aux_loss = self._sequence_aux_loss(scores, chosen, shape[0])
        routed = self._dispatch_and_combine(tokens, chosen, gates)
        out = routed if self.shared is None else self.shared(tokens) + routed
        with _draws(self.output_rng, self.training and self.dropout.p > 0):
            return self.dropout(out.view(shape))

    @torch.no_grad()
    def _count(self, chosen: torch.Tensor):
        load = torch.bincount(chosen.flatten(), minlength=self.n_experts)
        self.step_load = load if self.step_load is None else self.step_load + load

    def _sequence_aux_loss(self, scores: torch.Tensor, chosen: torch.Tensor, batch: int):
        """DeepSeek-V3's sequence-wise balance loss, weight x mean over sequences of
        sum_i f_i P_i: f_i the share of the sequence's choices that went to expert i
        (times E / K), P_i its mean normalized score."""
        E, K = self.n_experts, self.top_k
        per_seq = scores.view(batch, -1, E)
        T = per_seq.shape[1]
        probs = (per_seq / per_seq.sum(-1, keepdim=True)).mean(1)  # [B, E]
        hits = torch.zeros(batch, E, device=scores.device)
        hits.scatter_add_(1, chosen.view(batch, -1), torch.ones(batch, T * K, device=scores.device))
        f = hits * E / (K * T)
        return self.aux_loss_weight * (f * probs).sum(-1).mean()

    def _dispatch_and_combine(self, tokens, chosen, gates) -> torch.Tensor:
        """Each token's rows to its chosen experts (sorted by expert, a stable sort: a
        group keeps token order), the experts run grouped, then each token's K outputs
        weighted by its gates and summed."""
        N, K = chosen.shape
        flat = chosen.flatten()  # slot n * K + k: token n's k-th choice
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.n_experts)
        rows = tokens[order // K]
        if self.ep_size > 1:
            out = self._run_remote(rows, counts)
        else:
            out = self.experts(rows, counts.tolist())
        # Back to slot order: the row sorted to place i came from slot order[i].
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        out = out[back].view(N, K, -1)
        return (out * gates.to(out.dtype).unsqueeze(-1)).sum(1)

    def _run_remote(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows sorted by global expert to the ranks holding those experts, run there,
        and back: two ``all_to_all_single`` of the rows (dispatch, combine) and one of
        the counts. Cost per layer and step: 2 x (rows sent away) x dim x bytes per
        element, both ways."""
        import torch.distributed as dist
        from torch.distributed._functional_collectives import all_to_all_single_autograd as a2a

        ep, local = self.ep_size, self.n_experts // self.ep_size
        # received[r, e]: rows rank r sends to this rank's local expert e.
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.ep_group)
        send = counts.view(ep, local).sum(1).tolist()
        received = received.view(ep, local)
        recv = received.sum(1).tolist()
        got = _waited(a2a(rows, recv, send, self.ep_group))
        back = self.run_received(got, received)
        return _waited(a2a(back, send, recv, self.ep_group))

    def run_received(self, got: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
        """This rank's experts over the rows it received, the outputs in arrival order.
        ``received[r, e]``: the rows source rank ``r`` sent to local expert ``e``. The
        rows arrive grouped by source rank, then expert; the experts want expert, then
        source rank (each expert's group: rank 0's rows, then rank 1's, ...). Pure: no
        collective (tested against the whole layer with the all-to-alls by slicing)."""
        ep, local = received.shape
        by_rank = received.flatten().tolist()
        pieces = got.split(by_rank)
        by_expert = [pieces[r * local + e] for e in range(local) for r in range(ep)]
        out = self.experts(torch.cat(by_expert), received.sum(0).tolist())
        done = out.split([by_rank[r * local + e] for e in range(local) for r in range(ep)])
        return torch.cat([done[e * ep + r] for r in range(ep) for e in range(local)])

    @torch.no_grad()
    def balance(self, load: torch.Tensor):
        """One step's update from ``load`` [E], the tokens each expert received over all
        data-parallel ranks: the sign rule on the bias, the load added to the counts."""
        mean = load.float().mean()
        self.expert_bias += self.bias_rate * torch.sign(mean - load.float())
        self.expert_tokens += load.to(self.expert_tokens.dtype)
        self.step_load = None


def _waited(t: torch.Tensor) -> torch.Tensor:
    """A functional collective's result, waited for (an AsyncCollectiveTensor)."""
    return t.wait() if hasattr(t, "wait") else t


def _draws(rng, drawing: bool):
    return rng() if rng is not None and drawing else contextlib.nullcontext()
