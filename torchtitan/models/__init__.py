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


__all__ = [
    "ModelArgs",
    "Transformer",
    "build_model",
    "check_config",
    "count_parameters",
    "llama_configs",
    "model_registry",
]
