"""Model registry: maps config `model.name` to its flavors and builder.

The config validates `model.flavor` against `model_registry`, and the attention
settings, through `check_config` (run by torchtitan.config.validate); the trainer
builds through the registered builder and never imports a model module directly.
"""

from torchtitan.config.errors import ConfigError
from torchtitan.models import attention
from torchtitan.models.llama import (
    ModelArgs,
    Transformer,
    build_model,
    count_parameters,
    llama_configs,
)

# name -> (flavor name -> ModelArgs, builder(flavor, vocab_size, max_seq_len, dropout, device))
model_registry = {"llama": (llama_configs, build_model)}


def check_config(cfg) -> None:
    """One ConfigError for the first model setting that cannot be built or trained here."""
    flavors = model_registry[cfg.model.name][0]
    if cfg.model.flavor not in flavors:
        raise ConfigError(
            f"model.flavor: {cfg.model.flavor!r} is not a valid choice; "
            f"choose from {', '.join(flavors)}"
        )
    attention.check_config(cfg)
    check_moe_config(cfg, flavors[cfg.model.flavor])


def check_moe_config(cfg, args: ModelArgs) -> None:
    """What a mixture-of-experts flavor cannot be combined with (yet), and expert
    parallelism's own rules that need no world size (parallel.apply_layout checks that
    the degree is the data-parallel shard degree)."""
    p, ep = cfg.parallelism, cfg.parallelism.expert_parallel_degree
    if not args.is_moe:
        if ep > 1:
            raise ConfigError(
                f"parallelism.expert_parallel_degree {ep}: model.flavor {cfg.model.flavor!r} "
                "has no experts; use an MoE flavor (e.g. debug_moe) or degree 1"
            )
        return
    refused = [
        (p.tensor_parallel_degree > 1, f"parallelism.tensor_parallel_degree {p.tensor_parallel_degree}",
         "the TP plan splits dense feed-forwards, not experts; use expert parallelism"),
        (p.pipeline_parallel_degree > 1, f"parallelism.pipeline_parallel_degree {p.pipeline_parallel_degree}",
         "the balancing loads are not gathered over stages yet; use 1"),
        (cfg.fault_tolerance.enable, "fault_tolerance.enable",
         "replica groups would each update their own balancing bias; turn it off"),
        (ep > 1 and cfg.training.data_parallel == "ddp", "training.data_parallel ddp",
         "expert parallelism composes with FSDP; use --training.data_parallel fsdp"),
        (ep > 1 and p.data_parallel_replicate_degree > 1,
         f"parallelism.data_parallel_replicate_degree {p.data_parallel_replicate_degree}",
         "experts replicated over HSDP groups are not reduced yet; use 1"),
        (args.n_experts % ep != 0, f"parallelism.expert_parallel_degree {ep}",
         f"it must divide the flavor's {args.n_experts} experts"),
    ]  # fmt: skip
    for broken, key, why in refused:
        if broken:
            raise ConfigError(f"{key} with MoE flavor {cfg.model.flavor!r}: {why}")


__all__ = [
    "ModelArgs",
    "Transformer",
    "build_model",
    "check_config",
    "count_parameters",
    "llama_configs",
    "model_registry",
]
