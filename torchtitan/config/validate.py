"""Validation of a filled JobConfig: `validate` runs every rule, the first broken one
raised as one ConfigError.

Owns: checking each field against its schema metadata (choices, range), the rules
between sections that need nothing but the config (one dataset setting at a time, a
dataset mix's entries, the seed checkpoint, the lease wait against the collective
timeout, the optional metric packages being importable), and the order in which the
components' own rules run.

Each component checks what needs its internals (model flavors and attention backends,
dataset names and the batch-size schedule, parallel degrees) in a function of its own,
``check_config(cfg) -> None``, raising one ConfigError. `COMPONENTS` names the modules
holding them; they are imported when a config is validated, never when this package
is, because they import the config (its schema and ConfigError), never the reverse.

Never: import model, data or parallel code at module level, build anything, or change
the config. Cost: one pass over the fields; the components' checks import their
modules once per process (the first validation) and ask torch which device is present.
"""

import importlib
import math
from dataclasses import fields

from torchtitan.config.errors import ConfigError
from torchtitan.config.schema import DatasetEntry, JobConfig, range_text

# Modules exporting check_config(cfg), run in this order after the rules below.
COMPONENTS = (
    "torchtitan.data.checks",
    "torchtitan.parallel",
    "torchtitan.models",
    "torchtitan.faults.fault_tolerance",
    "torchtitan.spikes",
    "torchtitan.optim",
    "torchtitan.checkpoint.branch",
)


def validate(cfg: JobConfig) -> None:
    """Every rule: each field's choices and range, the rules between sections, then each
    component's `check_config`."""
    for section in fields(cfg):
        for f in fields(section.type):
            value = getattr(getattr(cfg, section.name), f.name)
            check_field(f"{section.name}.{f.name}", value, f.metadata)
    check_rules(cfg)
    for name in COMPONENTS:
        importlib.import_module(name).check_config(cfg)


def check_field(key: str, value, meta) -> None:
    choices = meta.get("choices")
    if choices is not None:
        for item in value if isinstance(value, list) else [value]:
            if item not in choices:
                raise ConfigError(
                    f"{key}: {item!r} is not a valid choice; choose from {', '.join(choices)}"
                )
    ge, gt, le, lt = (meta.get(k) for k in ("ge", "gt", "le", "lt"))
    inside = (
        (ge is None or value >= ge)
        and (gt is None or value > gt)
        and (le is None or value <= le)
        and (lt is None or value < lt)
    )
    if not inside:
        hint = f"; {meta['hint']}" if meta.get("hint") else ""
        raise ConfigError(f"{key}: {value!r} is out of range; must be {range_text(meta)}{hint}")


def check_rules(cfg: JobConfig) -> None:
    """The rules between fields that need nothing but the config itself."""
    t = cfg.training
    if t.datasets and t.dataset_path:
        raise ConfigError(
            f"training.datasets and training.dataset_path are both set "
            f"(dataset_path={t.dataset_path!r}); set only one of them"
        )
    for i, spec in enumerate(t.datasets):
        _check_dataset_spec(f"training.datasets[{i}]", spec)
    if cfg.checkpoint.create_seed_checkpoint and not cfg.checkpoint.enable_checkpoint:
        raise ConfigError(
            "checkpoint.create_seed_checkpoint is true but checkpoint.enable_checkpoint "
            "is false; set --checkpoint.enable_checkpoint"
        )
    ck = cfg.checkpoint
    if ck.enable_checkpoint and ck.lease_wait_seconds >= cfg.comm.init_timeout_seconds:
        # The other ranks wait for rank 0's lease in a collective.
        raise ConfigError(
            f"checkpoint.lease_wait_seconds {ck.lease_wait_seconds:g} is not below "
            f"comm.init_timeout_seconds {cfg.comm.init_timeout_seconds}: the other ranks "
            "would time out while rank 0 waits for the folder; lower the one or raise the other"
        )
    if "://" in cfg.job.dump_folder:
        raise ConfigError(
            f"job.dump_folder {cfg.job.dump_folder!r} is a URL; metrics, logs and the local "
            "checkpoint tier are written locally: keep it a local path and set "
            "--checkpoint.folder to the URL"
        )
    if ck.local_interval and "://" in ck.local_folder:
        raise ConfigError(
            f"checkpoint.local_folder {ck.local_folder!r} is a URL; the local tier is a "
            "local path (set checkpoint.folder to the store)"
        )
    if ck.local_interval and ck.local_folder == ck.folder:
        raise ConfigError(
            f"checkpoint.local_folder and checkpoint.folder are both {ck.folder!r}; give the "
            "local tier a folder of its own"
        )
    if cfg.metrics.enable_tensorboard:
        _check_importable("torch.utils.tensorboard", "metrics.enable_tensorboard", "tensorboard")
    if cfg.metrics.enable_wandb:
        _check_importable("wandb", "metrics.enable_wandb", "wandb")


def _check_dataset_spec(key: str, spec: DatasetEntry) -> None:
    """One entry of a mix; whether its name is a known dataset is the data's check."""
    if bool(spec.name) == bool(spec.path):
        raise ConfigError(
            f"{key}: set exactly one of name and path, got name={spec.name!r} path={spec.path!r}"
        )
    if not spec.weight > 0 or not math.isfinite(spec.weight):
        raise ConfigError(f"{key}.weight: {spec.weight!r} is out of range; must be > 0")


def _check_importable(module: str, option: str, package: str) -> None:
    # Checked here, on every rank before anything is built: otherwise only rank 0 finds
    # out, with a traceback, when the metric logger imports it after the model is built.
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(
            f"{option} is true but {module} cannot be imported ({e}); "
            f"pip install {package}, or drop --{option}"
        ) from None
