"""The data's own rules for a config: `check_config`, run by torchtitan.config.validate.

Owns: that each dataset named (``training.dataset``, a mix's names,
``validation.dataset``) is a registered one or a Hub id, and that
``training.batch_size_schedule`` parses.

Never: open a source, touch the network or build a loader: whether a Hub dataset or a
local path exists is known only when it is read. Cost: a dictionary look-up per name.
"""

from torchtitan.config.errors import ConfigError
from torchtitan.config.schema import JobConfig
from torchtitan.data.schedule import parse_schedule
from torchtitan.data.sources import DATASET_REGISTRY


def check_config(cfg: JobConfig) -> None:
    """Raise one ConfigError for the first data setting that cannot be read."""
    t = cfg.training
    for i, spec in enumerate(t.datasets):
        if spec.name:
            _check_dataset_name(f"training.datasets[{i}].name", spec.name)
    if not t.datasets and not t.dataset_path:
        _check_dataset_name("training.dataset", t.dataset)
    v = cfg.validation
    if v.enable and not v.dataset_path:
        _check_dataset_name("validation.dataset", v.dataset)
    if t.batch_size_schedule:
        try:
            parse_schedule(t.batch_size_schedule)
        except ValueError as e:
            raise ConfigError(
                f"training.batch_size_schedule {t.batch_size_schedule!r}: {e}; write it as "
                "step:sequences,... from step 0, e.g. 0:256,2000:512"
            ) from None


def dataset_names() -> list[str]:
    """The registered dataset names."""
    return sorted(DATASET_REGISTRY)


def _check_dataset_name(key: str, name: str) -> None:
    if "/" in name:  # a Hub dataset id; whether it exists is known only when it is read
        return
    names = dataset_names()
    if name not in names:
        raise ConfigError(
            f"{key}: unknown dataset {name!r}; choose from {', '.join(names)}, a Hugging Face "
            "Hub dataset id (owner/name), or give a local file with training.dataset_path"
        )
