"""The data's own rules for a config: `check_config`, run by torchtitan.config.validate.

Owns: that each dataset named (``training.dataset``, a mix's names,
``validation.dataset``) is a registered one or a Hub id, that
``training.batch_size_schedule`` and ``training.skip_steps`` parse, and that ``training.mix_schedule`` is a
schedule (steps increasing, each ramp ending by the next point, weights >= 0 and not
all 0; whether its names are the sources' is known when the sources are resolved:
``order.MixByStep``).

Never: open a source, touch the network or build a loader: whether a Hub dataset or a
local path exists is known only when it is read. Cost: a dictionary look-up per name.
"""

import math

from torchtitan.config.errors import ConfigError
from torchtitan.config.schema import JobConfig
from torchtitan.data.schedule import parse_schedule, parse_skip_steps
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
    try:
        parse_skip_steps(t.skip_steps)
    except ValueError as e:
        raise ConfigError(
            f"training.skip_steps {t.skip_steps!r}: {e}; write it as first-last,... in "
            "training steps, e.g. 101-300,451-460"
        ) from None
    try:
        parse_skip_steps(t.skip_windows, first_index=0)
    except ValueError as e:
        raise ConfigError(
            f"training.skip_windows {t.skip_windows!r}: {e}; write it as first-last,... in "
            "window indices from 0, e.g. 4000-4999"
        ) from None
    check_mix_schedule(t.mix_schedule)


def check_mix_schedule(points) -> None:
    """Raise one ConfigError for the first point of ``training.mix_schedule`` that does
    not make a schedule. Cost: O(points)."""
    key, end = "training.mix_schedule", -1
    for i, p in enumerate(points):
        if p.step < 0 or p.ramp < 0:
            raise ConfigError(f"{key}[{i}]: step {p.step} and ramp {p.ramp} must be >= 0")
        if p.step < end:
            raise ConfigError(
                f"{key}[{i}]: step {p.step} comes before the previous point's ramp ends (step "
                f"{end}); list points by increasing step, each after the ramp before it"
            )
        bad = {n: w for n, w in p.weights.items() if not (math.isfinite(w) and w >= 0)}
        if bad or not any(w > 0 for w in p.weights.values()):
            raise ConfigError(
                f"{key}[{i}].weights {p.weights}: weights must be finite and >= 0, one > 0 "
                "(a source at 0, or not named, is retired from that step)"
            )
        end = p.step + max(p.ramp, 1)


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
