"""The held-out loss of a built model (``Validator``), from the held-out data's own loader
(``data.build_validation_loader``).

Never: touch the training loader or any RNG, save checkpoints, or write logs.
"""

from __future__ import annotations

import torch

from torchtitan import parallel
from torchtitan.loss import BatchLoss
from torchtitan.parallel import tensor_parallel


class Validator:
    """The loss on held-out data: the same first ``validation.steps`` batches every time.

    Each pass rewinds its own loader to the start, runs the model in eval mode (no
    dropout) without gradients, and touches neither the training loader nor any RNG,
    so a resumed run logs the same validation losses as an uninterrupted one.
    """

    def __init__(self, validation, loader, loss: BatchLoss):
        """``validation``: the config section; ``loader``: the held-out data's
        (``data.build_validation_loader``: fixed data, read in order, one micro-batch per
        rank and step)."""
        self.loader = loader
        self.freq, self.steps = validation.freq, validation.steps
        self.loss = loss

    def due(self, step: int, last_step: int) -> bool:
        return step % self.freq == 0 or step == last_step

    @torch.no_grad()
    def run(self, model: torch.nn.Module) -> float:
        """The mean loss over every rank's ``validation.steps`` batches.

        Cost: steps x (one forward of a batch); the loader seeks to the start, O(1)."""
        self.loader.seek()
        model.eval()
        try:
            with self.loss.context():
                total = sum(
                    tensor_parallel.local_value(self.loss(next(self.loader)))
                    for _ in range(self.steps)
                )
        finally:
            model.train()
        return parallel.mean_over_ranks(total / self.steps)
