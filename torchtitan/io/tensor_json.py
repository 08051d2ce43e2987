"""JSON in a 1-D uint8 tensor: how the project's own checkpoint entries are stored
(the loader's position, the train state), so that loading them unpickles nothing.

Owns: the encoding alone. Each caller refuses what is not encoded with its own error
(the checkpoint's, the data's), naming the fix. Never: import the checkpoint or data
packages (both use it).
"""

from __future__ import annotations

import json

import torch


def to_tensor(obj) -> torch.Tensor:
    """``obj`` (JSON-serializable) as a 1-D uint8 tensor of its UTF-8 JSON."""
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).clone()


def is_encoded(value) -> bool:
    """Whether ``value`` is what ``to_tensor`` makes (an older version pickled entries)."""
    return isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1


def from_tensor(value) -> object:
    """The object ``to_tensor`` encoded (``is_encoded(value)`` must hold)."""
    return json.loads(value.numpy().tobytes().decode())
