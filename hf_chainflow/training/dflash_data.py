"""Training windows of a DFlash drafter, read from data prepared with `target_layers` (`hf-chainflow prepare
--target-layers ...`, `hf_chainflow.training.prepared_data`).

One window per anchor `t` of a stored span `x[0..L-1]` (the anchors of `ChainFlowWindowDataset`: the last
context state; `x[t+1]` is the bonus token, the block's first token), with `C` context states and blocks of `B`
tokens (the bonus and `B - 1` masks):

- `context_states (C, F)`: the cached outputs of the target layers `target_layer_ids`, concatenated in that order
  (`F = len(target_layer_ids) * D`), at span rows `t-C+1 .. t`, zero-left-padded; `context_mask (C,)` True where a
  row exists (the span starts `prompt_tail` tokens before the response, so early anchors have fewer);
- `bonus_token ()`: `x[t+1]`;
- `labels (B-1,)`: `x[t+2 .. t+B]`, the tokens the masks stand for (`pad_token_id` past the span end);
  `label_mask (B-1,)` True where the token exists;
- `position_ids (C + B,)`: the absolute positions (in prompt + response) of the context slots and the block,
  `t-C+1 .. t+B` shifted by the prompt positions not stored (clamped at 0 for padded slots, which are masked);
- `domain ()`: index into the manifest's `domains`.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

from hf_chainflow.checks import is_int
from hf_chainflow.training.windows import ChainFlowWindowDataset
from hf_chainflow.training.prepared_data import read_manifest


class DFlashWindowDataset(ChainFlowWindowDataset):
    """DFlash training windows (module docstring) over the finished shards of `data_dir`; `shards`, `domains`,
    `max_windows`, `shuffle`, `seed`, `max_open_shards` as for `ChainFlowWindowDataset`. Build the windows of a
    drafter with `DFlashWindowDataset.for_drafter(data_dir, drafter.config)`."""

    def __init__(self, data_dir: str | os.PathLike, *, target_layer_ids: Sequence[int], context_len: int = 32,
                 block_size: int = 9, **kwargs):
        if not is_int(block_size) or block_size < 2:
            raise ValueError(f"`block_size` must be an int >= 2 (the bonus token and at least one mask), got "
                             f"{block_size!r}.")
        stored = read_manifest(data_dir).get("target_layers") or []
        layers = list(target_layer_ids) if isinstance(target_layer_ids, (list, tuple)) else None
        if not layers or any(i not in stored for i in layers):
            raise ValueError(f"`target_layer_ids` {target_layer_ids!r} are not all cached in `{data_dir}` (its target "
                             f"layers: {stored or 'none, the final state only'}); prepare the data with "
                             f"`hf-chainflow prepare --target-layers {','.join(map(str, layers or [1]))}`, or choose "
                             f"among the cached layers.")
        super().__init__(data_dir, context_len=context_len, num_draft=block_size - 1, num_parents=1, **kwargs)
        self.target_layer_ids, self.block_size = layers, block_size
        self.feature_size = len(layers) * self.hidden_size

    @classmethod
    def for_drafter(cls, data_dir: str | os.PathLike, config, **kwargs) -> "DFlashWindowDataset":
        """The windows a DFlash drafter of `config` (or the drafter itself) trains on: context `sliding_window`
        states, blocks of `block_size`, its `target_layer_ids`; data of a target of another hidden size is refused."""
        config = getattr(config, "config", config)
        dataset = cls(data_dir, target_layer_ids=config.target_layer_ids, context_len=config.sliding_window,
                      block_size=config.block_size, **kwargs)
        if dataset.hidden_size != config.hidden_size:
            raise ValueError(f"`{data_dir}` holds states of a target of hidden size {dataset.hidden_size}, the DFlash "
                             f"drafter's is {config.hidden_size}: the data belong to another target.")
        return dataset

    def _layer(self, shard: int, name: str):
        return self._shard(shard).get_slice(name)  # the shard file stays open, `max_open_shards` at most

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        seq = self.sequences[int(self.seq_of[k])]
        t, length, C, B = int(self.anchor[k]), seq["length"], self.C, self.block_size
        lo = max(0, t - C + 1)
        n_ctx = t - lo + 1
        a = seq["start"]
        rows = torch.cat([self._layer(seq["shard"], f"layer_{i}")[a + lo: a + t + 1].float()
                          for i in self.target_layer_ids], -1)  # (n_ctx, F)
        context = torch.zeros(C, self.feature_size)  # (C, F)
        context[C - n_ctx:] = rows
        context_mask = torch.zeros(C, dtype=torch.bool)
        context_mask[C - n_ctx:] = True

        n_lab = max(0, min(B - 1, length - 2 - t))  # mask j (1-based) stands for x[t+1+j], if it exists
        labels = torch.full((B - 1,), self.pad_token_id, dtype=torch.long)
        labels[:n_lab] = seq["tokens"][t + 2: t + 2 + n_lab]
        label_mask = torch.zeros(B - 1, dtype=torch.bool)
        label_mask[:n_lab] = True

        offset = seq["prompt_len"] - seq["response_start"]  # absolute position of span row 0
        position_ids = (torch.arange(t - C + 1, t + B + 1) + offset).clamp(min=0)  # (C + B,)
        return {"context_states": context, "context_mask": context_mask, "bonus_token": seq["tokens"][t + 1].clone(),
                "labels": labels, "label_mask": label_mask, "position_ids": position_ids,
                "domain": torch.tensor(seq["domain_index"], dtype=torch.long)}


__all__ = ["DFlashWindowDataset"]
