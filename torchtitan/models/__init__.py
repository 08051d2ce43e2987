"""Model registry: maps config `model.name` to its flavors and builder.

The trainer validates `model.name` / `model.flavor` against `model_registry`
and builds through the registered builder; it never imports a model module
directly.
"""

from torchtitan.models.llama import (
    ModelArgs,
    Transformer,
    build_model,
    count_parameters,
    llama_configs,
)

# name -> (flavor name -> ModelArgs, builder(flavor, vocab_size, max_seq_len, dropout, device))
model_registry = {"llama": (llama_configs, build_model)}

__all__ = [
    "ModelArgs",
    "Transformer",
    "build_model",
    "count_parameters",
    "llama_configs",
    "model_registry",
]
