"""`ReplayMixDataset`: new windows mixed with a seeded share of earlier ones (language adaptation replays about
20 % of the earlier languages' rows, so the drafter does not forget them)."""

from __future__ import annotations

import numpy as np
from torch.utils.data import Dataset

__all__ = ["ReplayMixDataset"]


class ReplayMixDataset(Dataset):
    """`new` plus a seeded sample of rows of `old` (earlier languages) making up `replay_fraction` of the mix.

    Length `len(new) + round(len(new) * f / (1 - f))`: rows `[0, len(new))` are `new` in order, the rest are
    `old` rows drawn without replacement (with replacement only when `old` is too small).  The Trainer's sampler
    shuffles the mix.  Paper: ~20 % replay.
    """

    def __init__(self, new: Dataset, old: Dataset, replay_fraction: float = 0.2, seed: int = 0):
        if not 0 <= replay_fraction < 1:
            raise ValueError(f"`replay_fraction` must lie in [0, 1), got {replay_fraction!r}.")
        if len(new) == 0:
            raise ValueError("`new` is empty: there is nothing to adapt on.")
        if replay_fraction > 0 and len(old) == 0:
            raise ValueError("`old` is empty but `replay_fraction` > 0; pass earlier-language rows or 0.")
        self.new, self.old, self.replay_fraction = new, old, replay_fraction
        n_old = round(len(new) * replay_fraction / (1 - replay_fraction))
        rng = np.random.default_rng(seed)
        self.old_rows = rng.choice(len(old), size=n_old, replace=n_old > len(old)) if n_old else np.zeros(0, int)

    def __len__(self) -> int:
        return len(self.new) + len(self.old_rows)

    def __getitem__(self, i: int):
        if not -len(self) <= i < len(self):
            raise IndexError(f"index {i} out of range for a ReplayMixDataset of length {len(self)}")
        i = i % len(self)
        return self.new[i] if i < len(self.new) else self.old[int(self.old_rows[i - len(self.new)])]

    def is_replay(self, i: int) -> bool:
        return i >= len(self.new)
