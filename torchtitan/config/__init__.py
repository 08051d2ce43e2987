"""Job configuration: dataclass sections filled from TOML, then from the command line.

Precedence is command line > TOML file (``--job.config_file``) > dataclass defaults.
Every problem is raised as one ConfigError, during parsing, before anything is built.

Modules, none importing a component: ``errors`` (ConfigError), ``schema`` (the
dataclasses and each field's choices and range), ``validate`` (the field checks, the
rules between sections, and each component's own ``check_config``), ``cli`` (TOML and
``--section.key value`` parsing, ``--help``). Importing this package imports no model,
data or parallel code.
"""

from torchtitan.config.cli import help_text, load_config_or_exit, parse_args, resolve_path
from torchtitan.config.errors import ConfigError
from torchtitan.config.schema import (
    ActivationCheckpoint,
    Checkpoint,
    Comm,
    DatasetEntry,
    Job,
    JobConfig,
    LRScheduler,
    Metrics,
    Model,
    Optimizer,
    Parallelism,
    Profiling,
    Training,
    Validation,
)
from torchtitan.config.validate import validate

__all__ = [
    "ActivationCheckpoint",
    "Checkpoint",
    "Comm",
    "ConfigError",
    "DatasetEntry",
    "Job",
    "JobConfig",
    "LRScheduler",
    "Metrics",
    "Model",
    "Optimizer",
    "Parallelism",
    "Profiling",
    "Training",
    "Validation",
    "help_text",
    "load_config_or_exit",
    "parse_args",
    "resolve_path",
    "validate",
]
