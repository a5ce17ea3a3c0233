"""The epoch a dataset's random draws follow, in shared memory so that persistent DataLoader
workers see ``set_epoch``: the base of the clip dataset and of the latent cache's."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


def shared_epoch() -> torch.Tensor:
    """An epoch counter in shared memory, so that ``set_epoch`` reaches persistent DataLoader workers."""
    return torch.zeros((), dtype=torch.int64).share_memory_()


class EpochDataset(Dataset):
    """A dataset whose random draws follow the epoch (``self._epoch``, made by ``shared_epoch``)."""

    _epoch: torch.Tensor

    @property
    def epoch(self) -> int:
        return int(self._epoch)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's random draws; call before iterating each epoch."""
        self._epoch.fill_(epoch)
