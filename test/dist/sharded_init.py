"""Run under torchrun with 4 ranks: the step-0 weights of the training model on 4 and on
2 ranks, and its compute dtypes.

    torchrun --nproc_per_node=4 test/dist/sharded_init.py OUT.pt [--section.key value ...]

Builds the model as train.py does (meta device, FSDP2 over all ranks, each rank
initializing only its shard), and again sharded over pairs of ranks (a 2 x 2 mesh: each
pair holds a whole copy, as a 2-rank job would); rank 0 saves both sets of full weights
to OUT.pt with the dtype a block computes in, the dtype its RoPE rotation arrives in, and the dtypes the parameters are kept in.
As a negative control it also saves the weights a naive sharded init gives: each rank's
shard drawn from the global RNG, as though it were the whole tensor.
"""

import sys

import torch
from torch.distributed.device_mesh import init_device_mesh

from torchtitan import parallel
from torchtitan.config import parse_args
from torchtitan.models import build_model


def full_weights(model) -> dict:
    return {name: p.full_tensor() for name, p in model.named_parameters()}


def main():
    out, argv = sys.argv[1], sys.argv[2:]
    cfg = parse_args(argv)
    dims = parallel.init_distributed()
    model = parallel.parallelize(build_model(cfg.model.flavor, 4096, device="meta"), cfg, dims)
    seen = {}

    def record_dtype(module, inputs, output):
        seen["compute"] = output.dtype

    model.layers[0].attention.wq.register_forward_hook(record_dtype)
    model.layers[0].register_forward_pre_hook(
        lambda module, args: seen.setdefault("rope", args[1].dtype) and None
    )
    model(torch.zeros(1, 8, dtype=torch.long, device=dims.device))
    model.reshard()  # the root keeps its parameters gathered after a forward
    weights = full_weights(model)

    pairs = build_model(cfg.model.flavor, 4096, device="meta")
    mesh = init_device_mesh(dims.device.type, (2, 2), mesh_dim_names=("copy", "shard"))
    parallel.apply_fsdp(pairs, torch.float32, torch.float32, mesh=mesh["shard"])
    pairs.to_empty(device=dims.device)
    pairs.init_weights(cfg.training.seed)
    on_two = full_weights(pairs)

    torch.manual_seed(cfg.training.seed)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0.0, 0.02)
    naive = full_weights(model)
    if dims.is_main:
        param_dtypes = {str(p.dtype) for p in model.parameters()}
        torch.save(
            {"weights": weights, "on_two": on_two, "naive": naive,
             "compute": str(seen["compute"]), "rope": str(seen["rope"]),
             "params": sorted(param_dtypes)}, out,
        )  # fmt: skip
    parallel.destroy_distributed()


if __name__ == "__main__":
    main()
