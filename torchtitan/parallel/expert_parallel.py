"""Expert parallelism: a mixture-of-experts model's experts sharded over a mesh
dimension, each rank holding ``n_experts / degree`` whole experts.

Owns: turning each MoE layer's expert weights (models/moe.py ``GroupedExperts``) into
DTensors sharded on the expert dim, so that a checkpoint names every expert by its
global index (DCP reshards between degrees), handing each layer the group its tokens
travel over (the dispatch and combine are ``all_to_all_single`` calls in moe.py), and
the gradient's scale: an expert's gradient on its rank sums the contributions of every
rank's tokens, where FSDP averages the other gradients over the ranks, so it is
divided by the degree (``GroupedExperts.grad_divisor``).

Never: choose the layout (groups.py) or wrap anything in FSDP (wrapping.py leaves
the expert weights to this module).
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor import Shard, distribute_tensor


def apply(model: nn.Module, mesh) -> set:
    """Shard every MoE layer's experts over the 1-D ``mesh`` (on meta: nothing is
    allocated); the expert weights, for FSDP to leave alone. Cost: O(1) per weight."""
    degree = mesh.size()
    held = set()
    for moe in model.moe_layers():
        experts = moe.experts
        for name in ("w1", "w2", "w3"):
            weight = getattr(experts, name)
            sharded = distribute_tensor(weight.data, mesh, [Shard(0)], src_data_rank=None)
            param = nn.Parameter(sharded)
            setattr(experts, name, param)
            held.add(param)
        # Summed over every rank's tokens; the other gradients are FSDP's means.
        experts.grad_divisor = degree
        moe.ep_group = mesh.get_group()
        moe.ep_size, moe.ep_rank = degree, mesh.get_local_rank()
    return held
