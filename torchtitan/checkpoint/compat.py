"""Whether a checkpoint fits this run, decided before any tensor is read.

Owns: comparing what a checkpoint holds (DCP's metadata, the manifest's config) with
what this run would load into: model weight shapes, the optimizer that wrote the
optimizer state. A mismatch is one line naming the entry and the fix, on every rank
(every rank reads the same metadata), instead of DCP's traceback from inside a load.

Cost: the metadata file only (O(entries)), read once per rank.

Never: load tensors or decide what to resume from.
"""

from __future__ import annotations


def model_mismatch(model_state: dict, saved: dict) -> str | None:
    """The first model weight whose shape differs from the checkpoint's (or is absent).

    ``model_state``: this run's model state dict; ``saved``: DCP's metadata of the
    checkpoint's model entries, keyed as ``model_state`` is.
    """
    for name, value in model_state.items():
        have = getattr(saved.get(name), "size", None)
        if have is None or tuple(have) != tuple(value.shape):
            return (
                f"model weight {name} is {'absent' if have is None else tuple(have)} there, "
                f"this model's is {tuple(value.shape)}"
            )
    return None


def optimizer_mismatch(optimizer_state: dict, saved: dict, saved_config: dict) -> str | None:
    """Why this run's optimizer cannot take the checkpoint's optimizer state, or None.

    The kinds of per-parameter state must agree (AdamW's ``exp_avg``/``exp_avg_sq``
    are not SGD's ``momentum_buffer``); an optimizer with the same kinds (AdamW after
    Adam) loads, and the config's hyperparameters win.
    """
    have = {key.rsplit(".", 1)[1] for key in saved if key.startswith("state.")}
    want = {kind for per_param in optimizer_state.get("state", {}).values() for kind in per_param}
    if have == want:
        return None
    old = (saved_config.get("optimizer") or {}).get("name", "another optimizer")
    return (
        f"its optimizer state is {old}'s ({', '.join(sorted(have)) or 'none'}), this run's "
        f"optimizer keeps {', '.join(sorted(want)) or 'none'}"
    )
