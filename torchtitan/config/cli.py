"""The command line and TOML files: text in, a validated JobConfig out, and ``--help``.

Owns: reading the TOML file (``--job.config_file``), parsing ``--section.key value``
overrides typed by the schema (bool flags, comma lists, a dataset mix as
``name_or_path:weight,...``), naming unknown sections and keys with the closest valid
one, the ``--help`` text generated from the schema, and resolving a relative path
against the current directory, then the repo root. Precedence is command line > TOML
file > dataclass defaults.

Never: decide whether a value is allowed beyond its type (that is `validate`), or
import model, data or parallel code. Cost: one TOML file read per parse.
"""

import difflib
import json
import math
import sys
from dataclasses import MISSING, asdict, fields
from pathlib import Path

from torchtitan import REPO_ROOT
from torchtitan.config.errors import ConfigError
from torchtitan.config.schema import DatasetEntry, JobConfig, MixPoint, range_text
from torchtitan.config.validate import validate

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

_TRUE, _FALSE = ("true", "1"), ("false", "0")
_PATH_SUFFIXES = (".parquet", ".json", ".jsonl", ".txt", ".arrow")
# A Hugging Face Hub dataset id in a command-line mix: hub:owner/name[/config[/split]]:weight
_HUB_PREFIX = "hub:"


def resolve_path(p: str) -> str:
    """Resolve a relative path against the current directory first, then the repo root.

    Returns `p` unchanged when it is absolute or exists in neither place, so the caller's
    error names the path the user wrote.
    """
    path = Path(p)
    if path.is_absolute():
        return p
    for base in (Path.cwd(), REPO_ROOT):
        if (base / path).exists():
            return str(base / path)
    return p


def _type_name(tp) -> str:
    if tp == list[DatasetEntry]:
        return "list[name_or_path:weight]"
    if tp == list[MixPoint]:
        return "json[{step, weights, ramp}]"
    return tp.__name__ if isinstance(tp, type) else str(tp)


def _lookup(section: str, key: str, where: str):
    """The dataclass field for section.key, or a ConfigError listing what is valid."""
    sections = {f.name: f.type for f in fields(JobConfig)}
    if section not in sections:
        raise ConfigError(
            f"unknown section {section!r} in {where}; valid sections: {', '.join(sections)}"
        )
    by_name = {f.name: f for f in fields(sections[section])}
    if key not in by_name:
        close = difflib.get_close_matches(key, by_name, n=1)
        guess = f"did you mean {section}.{close[0]}? " if close else ""
        raise ConfigError(
            f"unknown key {section}.{key} in {where}; {guess}"
            f"valid keys of [{section}]: {', '.join(by_name)}"
        )
    return by_name[key]


def _parse_dataset_item(key: str, item: str) -> DatasetEntry:
    hub = item.strip().startswith(_HUB_PREFIX)
    source, weight = item.strip().removeprefix(_HUB_PREFIX), 1.0
    if ":" in source:
        source, text = source.rsplit(":", 1)
        try:
            weight = float(text)
        except ValueError:
            raise ConfigError(
                f"{key}: weight {text!r} in {item!r} is not a number; write name_or_path:weight"
            ) from None
    source = source.strip()
    if hub:
        parts = source.split("/")
        if not 2 <= len(parts) <= 4 or not all(parts):
            raise ConfigError(
                f"{key}: {item!r} is not a Hub dataset; write hub:owner/name[/config[/split]]:weight"
            )
        config, split = (parts + ["", "train"][len(parts) - 2 :])[2:4]
        return DatasetEntry(name="/".join(parts[:2]), config=config, split=split, weight=weight)
    if "/" in source or source.endswith(_PATH_SUFFIXES):
        return DatasetEntry(path=source, weight=weight)
    return DatasetEntry(name=source, weight=weight)


def _from_text(key: str, tp, text: str):
    """Convert one command-line string to the field's type."""
    if tp == list[MixPoint]:
        try:
            value = json.loads(text) if text.strip() else []
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"{key}: {text!r} is not JSON ({e.msg}); write "
                '[{"step": 1000, "weights": {"web": 0.5, "code": 0.5}, "ramp": 200}]'
            ) from None
        return _from_toml(key, tp, value)
    items = [s.strip() for s in text.split(",") if s.strip()]
    if tp == list[DatasetEntry]:
        return [_parse_dataset_item(key, item) for item in items]
    if tp == list[str]:
        return items
    if tp is bool:
        if text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
        raise ConfigError(f"{key}: expected bool (true, false, 1 or 0), got {text!r}")
    try:
        value = tp(text)
    except ValueError:
        raise ConfigError(f"{key}: expected {tp.__name__}, got {text!r}") from None
    if tp is float and not math.isfinite(value):
        raise ConfigError(f"{key}: expected a finite float, got {text!r}")
    return value


def _from_toml(key: str, tp, value):
    """Check and convert one TOML value to the field's type."""
    if tp == list[DatasetEntry]:
        if isinstance(value, str):
            return _from_text(key, tp, value)
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            raise ConfigError(f"{key}: expected an array of tables [[{key}]], got {value!r}")
        types = {f.name: f.type for f in fields(DatasetEntry)}
        specs = []
        for i, table in enumerate(value):
            for name in set(table) - set(types):
                raise ConfigError(f"unknown key {key}[{i}].{name}; valid keys: {', '.join(types)}")
            spec = {n: _from_toml(f"{key}[{i}].{n}", types[n], v) for n, v in table.items()}
            specs.append(DatasetEntry(**spec))
        return specs
    if tp == list[MixPoint]:
        return _mix_points(key, value)
    if tp == list[str]:
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
        raise ConfigError(f"{key}: expected an array of strings, got {value!r}")
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(f"{key}: expected {tp.__name__}, got {value!r}")
    if tp is float and not math.isfinite(value):
        raise ConfigError(f"{key}: expected a finite float, got {value!r}")
    return value


def _mix_points(key: str, value) -> list[MixPoint]:
    """``training.mix_schedule`` from TOML (an array of tables) or parsed JSON: typed
    points; whether they make a schedule is the data's check (``data.checks``)."""
    if isinstance(value, str):
        return _from_text(key, list[MixPoint], value)
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ConfigError(
            f"{key}: expected an array of tables {{step, weights, ramp}}, got {value!r}"
        )
    points = []
    for i, table in enumerate(value):
        for name in set(table) - {"step", "weights", "ramp"}:
            raise ConfigError(f"unknown key {key}[{i}].{name}; valid keys: step, weights, ramp")
        step = _from_toml(f"{key}[{i}].step", int, table.get("step", 0))
        ramp = _from_toml(f"{key}[{i}].ramp", int, table.get("ramp", 0))
        weights = table.get("weights", {})
        if not isinstance(weights, dict):
            raise ConfigError(
                f"{key}[{i}].weights: expected a table name = weight, got {weights!r}"
            )
        weights = {str(n): _from_toml(f"{key}[{i}].weights.{n}", float, w)
                   for n, w in weights.items()}  # fmt: skip
        points.append(MixPoint(step=step, weights=weights, ramp=ramp))
    return points


def _read_toml(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(
            f"job.config_file: file not found: {path!r}; pass an existing TOML file"
        ) from None
    except OSError as e:
        raise ConfigError(f"job.config_file: cannot read {path!r}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        message = str(e).replace("\n", " ")
        raise ConfigError(f"job.config_file: {path!r} is not valid TOML: {message}") from None


def _parse_cli(argv: list[str]) -> list[tuple[str, str, object]]:
    """Split argv into (section, key, typed value) triples, in the order given."""
    overrides, i = [], 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--"):
            raise ConfigError(
                f"unexpected argument {arg!r}; options are written --section.key value"
            )
        name, has_value, text = arg[2:].partition("=")
        section, dot, key = name.partition(".")
        if not dot:
            raise ConfigError(f"option {arg!r} is not of the form --section.key; see --help")
        f = _lookup(section, key, f"--{name}")
        if not has_value:
            following = argv[i] if i < len(argv) else None
            if f.type is bool:
                # A bare flag means true; a following true/false/1/0 is its value.
                text = "true"
                if following is not None and following.lower() in _TRUE + _FALSE:
                    text = following
                    i += 1
            elif following is None or following.startswith("--"):
                raise ConfigError(
                    f"--{name} is missing its value; write --{name} VALUE ({_type_name(f.type)})"
                )
            else:
                text = following
                i += 1
        overrides.append((section, key, _from_text(name, f.type, text)))
    return overrides


def parse_args(argv: list[str] | None = None) -> JobConfig:
    """Build a validated JobConfig from defaults, the TOML file and command-line overrides."""
    argv = sys.argv[1:] if argv is None else list(argv)
    overrides = _parse_cli(argv)
    cfg = JobConfig()
    config_file = next(
        (v for s, k, v in reversed(overrides) if (s, k) == ("job", "config_file")), ""
    )
    if config_file:
        path = resolve_path(config_file)
        for section, table in _read_toml(path).items():
            if not isinstance(table, dict):
                raise ConfigError(
                    f"{section} = {table!r} in {path}: top-level keys must be [section] tables"
                )
            for key, value in table.items():
                f = _lookup(section, key, path)
                setattr(getattr(cfg, section), key, _from_toml(f"{section}.{key}", f.type, value))
    for section, key, value in overrides:
        setattr(getattr(cfg, section), key, value)
    validate(cfg)
    return cfg


def help_text() -> str:
    """Every option with its type, default and one-line help."""
    lines = ["usage: [--job.config_file FILE.toml] [--section.key VALUE ...]", ""]
    for section in fields(JobConfig):
        lines.append(f"[{section.name}]")
        for f in fields(section.type):
            default = f.default if f.default_factory is MISSING else f.default_factory()
            if f.type in (list[DatasetEntry], list[MixPoint]):
                default = [asdict(d) for d in default]
            choices, limits = f.metadata.get("choices"), range_text(f.metadata)
            extra = f" (choices: {', '.join(choices)})" if choices else ""
            extra += f" (range: {limits})" if limits else ""
            lines.append(
                f"  --{section.name}.{f.name} {_type_name(f.type)} "
                f"(default: {json.dumps(default)}): {f.metadata['help']}{extra}"
            )
        lines.append("")
    return "\n".join(lines)


def load_config_or_exit(argv: list[str] | None = None) -> JobConfig:
    """parse_args for scripts: --help prints the options and exits 0; errors exit 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(help_text())
        sys.exit(0)
    try:
        return parse_args(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
