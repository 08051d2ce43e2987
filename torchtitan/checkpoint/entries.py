"""Checkpoints are data, not code: how the project's own entries are stored, and how
DCP is made to read a checkpoint without executing anything from it.

Owns: the encoding of the project's own non-tensor entries (the Python and numpy RNG
states; the loader position's is the data side's, data/state.py, in the same format)
as UTF-8 JSON in a 1-D ``uint8`` tensor, which DCP stores and reads as a tensor
(``torch.load(weights_only=True)``); and ``DataOnlyLoadPlanner``,
DCP's default load planner with one change: a non-tensor entry (the optimizer's
hyperparameters, the LR scheduler's counters, or anything planted in a folder) is
read with torch's weights-only unpickler, which builds containers, numbers, strings
and tensors and refuses every other global. Torch 2.13's ``DefaultLoadPlanner``
reads them with ``torch.load(weights_only=False)``: a full unpickle.

What remains trusted: DCP's ``.metadata`` file, which ``FileSystemReader`` reads with
``pickle.load`` (README, "What a checkpoint may hold").

Cost: O(entry bytes) to encode or decode; nothing per tensor.

Never: call ``pickle.loads``/``torch.load(weights_only=False)`` on a checkpoint's bytes.
"""

from __future__ import annotations

import io
import pickle
import re

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner

from torchtitan.checkpoint.folder import CheckpointError
from torchtitan.io import tensor_json

to_tensor = tensor_json.to_tensor


def from_tensor(value) -> object:
    """The object ``to_tensor`` encoded; anything but a uint8 tensor is refused."""
    if not tensor_json.is_encoded(value):
        raise CheckpointError(
            f"a checkpoint entry is {type(value).__name__}, not JSON in a uint8 tensor: it was "
            "written by an older version (pickled); resume it with the version that wrote it"
        )
    return tensor_json.from_tensor(value)


def empty_like_saved(metadata) -> torch.Tensor:
    """A tensor for DCP to load a saved tensor entry into (its size and dtype)."""
    return torch.empty(tuple(metadata.size), dtype=metadata.properties.dtype)


class DataOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner whose non-tensor entries are read with the weights-only
    unpickler: a pickle that would call anything is refused, in one line, before it runs."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
            what = f"it calls {found.group(1)}" if found else "it is not plain data"
            raise CheckpointError(
                f"checkpoint entry {fqn} is a pickle that would run code ({what}); this "
                "version loads data only: restore the folder from a trusted copy"
            ) from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element

            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
