"""Run under torchrun: the step-0 weights of the training model, and its compute dtypes.

    torchrun --nproc_per_node=N test/dist/sharded_init.py OUT.pt [--section.key value ...]

Builds the model as train.py does (meta device, FSDP2, each rank initializing only its
shard) and has rank 0 save the full weights to OUT.pt, with the dtypes a block computes
in and the parameters are kept in. Also saves, as a negative control, the weights a
naive sharded init gives: each rank's shard drawn from the global RNG, as though it
were the whole tensor.
"""

import sys

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from torchtitan import parallel
from torchtitan.config import parse_args
from torchtitan.models import build_model


def full_weights(model) -> dict:
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def main():
    out, argv = sys.argv[1], sys.argv[2:]
    cfg = parse_args(argv)
    dims = parallel.init_distributed()
    model = parallel.parallelize(build_model(cfg.model.flavor, 4096, device="meta"), cfg, dims)
    seen = {}

    def record_dtype(module, inputs, output):
        seen["compute"] = output.dtype

    model.layers[0].attention.wq.register_forward_hook(record_dtype)
    model(torch.zeros(1, 8, dtype=torch.long, device=dims.device))
    weights = full_weights(model)

    torch.manual_seed(cfg.training.seed)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0.0, 0.02)
    naive = full_weights(model)
    if dims.is_main:
        param_dtypes = {str(p.dtype) for p in model.parameters()}
        torch.save(
            {"weights": weights, "naive": naive, "compute": str(seen["compute"]),
             "params": sorted(param_dtypes)}, out,
        )  # fmt: skip
    parallel.destroy_distributed()


if __name__ == "__main__":
    main()
