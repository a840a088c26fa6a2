"""Training windows over prepared data (`ChainFlowWindowDataset`; the fields and their alignment:
`hf_chainflow.training.prepared_data`), their batching (`collate`) and the check that they fit a drafter
(`check_windows_fit`)."""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from safetensors import safe_open

from hf_chainflow.checks import check_positive_int
from hf_chainflow.training.prepared_data import WINDOW_KEYS, read_manifest, shard_path

__all__ = ["ChainFlowWindowDataset", "check_windows_fit", "collate"]


def check_windows_fit(config, dataset) -> None:
    """Raise a `ValueError` unless the windows of `dataset` (a `ChainFlowWindowDataset`, or a `torch` `Subset` /
    `ReplayMixDataset` of them) are cut for a drafter of `config`: the same context size `C`, draft positions `K`,
    path order `p` and fused target layers, from a target of its hidden size. Datasets of other kinds are not
    checked."""
    for part in _window_datasets(dataset):
        got = {"context_size": part.C, "num_draft_positions": part.K, "path_order": part.p,
               "target_hidden_size": part.hidden_size, "target_layer_ids": part.target_layers}
        wrong = {k: v for k, v in got.items() if getattr(config, k, v) != v}  # fields the config lacks: not checked
        if wrong:
            want = {k: getattr(config, k) for k in wrong}
            raise ValueError(
                f"The windows of `{part.data_dir}` do not fit this drafter: they have {wrong}, the drafter's config "
                f"{want}. Build them with `ChainFlowWindowDataset.for_drafter(data_dir, drafter.config)`"
                + (" from data prepared with the drafter's target." if "target_hidden_size" in wrong else ".")
            )


def _window_datasets(dataset) -> list:
    if isinstance(dataset, ChainFlowWindowDataset):
        return [dataset]
    inner = [getattr(dataset, name, None) for name in ("dataset", "new", "old")]  # Subset; ReplayMixDataset
    return [part for d in inner if d is not None for part in _window_datasets(d)]


class ChainFlowWindowDataset(torch.utils.data.Dataset):
    """Training windows (see the module docstring for the exact fields) over the finished shards of `data_dir`.

    Hidden states stay on disk: each item reads its `C + K` rows through safetensors slices (memory-mapped), with
    at most `max_open_shards` shard files open per process; token ids (small) are held in memory.

    - `shards`: restrict to these shard numbers (e.g. a held-out split); `domains`: to these domain names.
    - `max_windows`: keep a random subset of this many anchors (seeded by `seed`); `shuffle`: put the anchors in a
      random (seeded) order, for readers without a shuffling sampler.
    - `target_layers`: decoder layers (stored by `prepare(target_layers=...)`) whose outputs follow the final state
      in every context state, `(C, (1 + n) D)`, for a drafter with `target_layer_ids`; `None`: the final states.
    - Data prepared with `target_labels` gives the target's own labels as `target_tokens` (the module docstring).
    """

    def __init__(self, data_dir: str | os.PathLike, *, context_len: int = 8, num_draft: int = 8,
                 num_parents: int = 8, shards: Sequence[int] | None = None, domains: Sequence[str] | None = None,
                 max_windows: int | None = None, shuffle: bool = False, seed: int = 0,
                 max_open_shards: int = 8, target_layers: Sequence[int] | None = None):
        for name, value in (("context_len", context_len), ("num_draft", num_draft), ("num_parents", num_parents),
                            ("max_open_shards", max_open_shards)):
            check_positive_int(name, value)
        check_positive_int("max_windows", max_windows, optional=True)
        for name, value, kind in (("shards", shards, int), ("domains", domains, str)):
            if value is None:
                continue
            if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value or any(
                    not isinstance(v, kind) or isinstance(v, bool) for v in value):
                raise ValueError(f"`{name}` must be None (all) or a non-empty list of {kind.__name__}s, got "
                                 f"{value!r}; e.g. `{name}=[{'0, 1' if kind is int else repr('math')}]`.")
        self.data_dir = Path(data_dir)
        manifest = read_manifest(data_dir, require=WINDOW_KEYS)
        self.C, self.K, self.p = context_len, num_draft, num_parents
        self.hidden_size = manifest["hidden_size"]
        self.pad_token_id = manifest["pad_token_id"]
        self.domains = manifest["domains"]
        stored = manifest.get("target_layers") or []
        if target_layers is not None and (isinstance(target_layers, (str, bytes)) or not isinstance(
                target_layers, Sequence) or not target_layers or any(i not in stored for i in target_layers)):
            raise ValueError(f"`target_layers` must be None (the final states) or a non-empty list of the layers "
                             f"`{data_dir}` stores ({stored or 'none'}), got {target_layers!r}; prepare the data with "
                             f"`--target-layers` naming them (`prepare(..., target_layers=...)`).")
        self.target_layers = None if target_layers is None else list(target_layers)
        self.labelled = bool(manifest.get("target_labels"))
        finished = manifest["finished"]
        if shards is not None:
            missing = sorted(set(shards) - set(finished))
            if missing:
                raise ValueError(f"`shards` {missing} are not finished in `{data_dir}` (finished: {finished}).")
            finished = sorted(set(shards))
        if domains is not None and set(domains) - set(self.domains):
            raise ValueError(f"`domains` {sorted(set(domains) - set(self.domains))} do not occur in `{data_dir}`; "
                             f"known: {self.domains}.")
        self.max_open_shards = max_open_shards
        self._open: OrderedDict[int, Any] = OrderedDict()
        self.sequences: list[dict] = []  # record + shard + global start row + tokens
        seq_ids, anchors = [], []
        for shard in finished:
            path = shard_path(data_dir, shard)
            if not path.is_file():
                raise ValueError(f"Shard {shard} is listed as finished in `{data_dir}` but {path} is missing; rerun "
                                 f"the same `hf-chainflow prepare` command to redo it.")
            with safe_open(str(path), framework="pt") as f:
                records = json.loads(f.metadata()["sequences"])
                tokens, offsets = f.get_tensor("tokens"), f.get_tensor("offsets")
                labels = f.get_tensor("labels") if self.labelled else None
            for n, rec in enumerate(records):
                if domains is not None and rec["domain"] not in domains:
                    continue
                a, length, rs = int(offsets[n]), rec["length"], rec["response_start"]
                first, last = rs - 1, length - 3
                if last >= first:
                    anchors.append(np.arange(first, last + 1, dtype=np.int32))
                    seq_ids.append(np.full(last - first + 1, len(self.sequences), dtype=np.int32))
                self.sequences.append({**rec, "shard": shard, "start": a, "tokens": tokens[a:a + length].clone(),
                                       "domain_index": self.domains.index(rec["domain"])})
                if labels is not None:
                    self.sequences[-1]["labels"] = labels[a:a + length].clone()
        self.seq_of = np.concatenate(seq_ids) if seq_ids else np.zeros(0, np.int32)  # (W,)
        self.anchor = np.concatenate(anchors) if anchors else np.zeros(0, np.int32)  # (W,)
        rng = np.random.default_rng(seed)
        if max_windows is not None and max_windows < len(self.anchor):
            keep = np.sort(rng.choice(len(self.anchor), size=max_windows, replace=False))
            self.seq_of, self.anchor = self.seq_of[keep], self.anchor[keep]
        if shuffle:
            perm = rng.permutation(len(self.anchor))
            self.seq_of, self.anchor = self.seq_of[perm], self.anchor[perm]

    @classmethod
    def for_drafter(cls, data_dir: str | os.PathLike, config, **kwargs) -> "ChainFlowWindowDataset":
        """The windows a drafter of `config` (a `ChainFlowConfig`, or the drafter itself) trains and is evaluated
        on: its context size, draft positions, path order and fused layers (`target_layer_ids`); `kwargs` as for
        the constructor (`shards`, `max_windows`, ...). Data prepared with a target of another hidden size is
        refused."""
        config = getattr(config, "config", config)  # a drafter: its config
        dataset = cls(data_dir, context_len=config.context_size, num_draft=config.num_draft_positions,
                      num_parents=config.path_order, target_layers=getattr(config, "target_layer_ids", None),
                      **kwargs)
        check_windows_fit(config, dataset)
        return dataset

    def __len__(self) -> int:
        return len(self.anchor)

    def __getstate__(self):  # open file handles stay in their process
        state = self.__dict__.copy()
        state["_open"] = OrderedDict()
        return state

    def _shard(self, shard: int):
        handle = self._open.pop(shard, None)
        if handle is None:
            handle = safe_open(str(shard_path(self.data_dir, shard)), framework="pt")
            if len(self._open) >= self.max_open_shards:
                self._open.popitem(last=False)
        self._open[shard] = handle
        return handle

    def _rows(self, shard: int, a: int, b: int) -> torch.Tensor:
        """Stored rows `a..b-1` of `shard`, float32: the final states `(b - a, D)`, followed along the features by
        the outputs of `target_layers` (`(b - a, (1 + n) D)`)."""
        handle = self._shard(shard)
        rows = handle.get_slice("hidden")[a:b].float()
        if not self.target_layers:
            return rows
        return torch.cat([rows, *(handle.get_slice(f"layer_{i}")[a:b].float() for i in self.target_layers)], -1)

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        seq = self.sequences[int(self.seq_of[k])]
        t, length, C, K, p = int(self.anchor[k]), seq["length"], self.C, self.K, self.p
        lo, hi = max(0, t - C + 1), min(length - 1, t + K)  # stored states needed: h[lo..hi]
        rows = self._rows(seq["shard"], seq["start"] + lo, seq["start"] + hi + 1)  # (hi - lo + 1, (1 + n) D)
        D, W = self.hidden_size, rows.shape[-1]

        context = torch.zeros(C, W)  # (C, (1 + n) D)
        n_ctx = t - lo + 1
        context[C - n_ctx:] = rows[: n_ctx]
        context_mask = torch.zeros(C, dtype=torch.bool)
        context_mask[C - n_ctx:] = True

        n_tgt = max(0, min(K, length - 2 - t))  # draft position i is valid iff x[t+1+i] exists
        target_states = torch.zeros(K, D)  # (K, D)
        target_states[:n_tgt] = rows[n_ctx: n_ctx + n_tgt, :D]
        target_tokens = torch.full((K,), self.pad_token_id, dtype=torch.long)
        if self.labelled:  # the target's own choice after x[..t+1+i], where the text holds x[t+2+i]
            target_tokens[:n_tgt] = seq["labels"][t + 1: t + 1 + n_tgt]
        else:
            target_tokens[:n_tgt] = seq["tokens"][t + 2: t + 2 + n_tgt]
        target_mask = torch.zeros(K, dtype=torch.bool)
        target_mask[:n_tgt] = True

        prev = torch.full((p - 1 + K,), self.pad_token_id, dtype=torch.long)  # x[t+2-p .. t+K]
        a, b = max(0, t + 2 - p), min(length - 1, t + K)
        prev[a - (t + 2 - p): b - (t + 2 - p) + 1] = seq["tokens"][a: b + 1]
        return {"context_states": context, "context_mask": context_mask, "target_states": target_states,
                "target_tokens": target_tokens, "target_mask": target_mask, "prev_tokens": prev,
                "domain": torch.tensor(seq["domain_index"], dtype=torch.long)}


def collate(items: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack window dicts into a batch: `context_states (B, C, D)`, `context_mask (B, C)`, `target_states
    (B, K, D)`, `target_tokens (B, K)`, `target_mask (B, K)`, `prev_tokens (B, p-1+K)`, `domain (B,)`."""
    if not items:
        raise ValueError("`collate` got an empty list of windows.")
    return {key: torch.stack([item[key] for item in items]) for key in items[0]}
