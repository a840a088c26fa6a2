"""The target's passes over whole sequences that training data caches: its hidden states at every position
(`target_hidden_states`, `final_hidden_states`) and its own next-token choice there (`target_argmax`)."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from transformers import PreTrainedModel

from hf_chainflow.training.responses import batches_by_length

__all__ = ["final_hidden_states", "target_argmax", "target_hidden_states"]


@torch.no_grad()
def target_hidden_states(model: PreTrainedModel, sequences: Sequence[Sequence[int]], *, pad_token_id: int,
                         layers: Sequence[int] = (), max_batch_tokens: int = 4096,
                         max_batch: int = 32) -> list[torch.Tensor]:
    """The target's hidden states at every position of each sequence, each `(1 + len(layers), L, D)`: first the last
    hidden state (after the final norm), then the output of each decoder layer in `layers` (0-based; layer `i`'s
    output is transformers' `hidden_states[i + 1]`).

    Sequences of similar length share a right-padded batch (right padding leaves a causal model's real positions
    unchanged); the model runs in whatever dtype and on whatever device it has, without computing full-vocabulary
    logits. The states come back on the CPU.
    """
    results: list[Any] = [None] * len(sequences)
    picks = [-1] + [i + 1 for i in layers]
    for batch in batches_by_length([len(s) for s in sequences], max_batch, max_batch_tokens):
        width = max(len(sequences[i]) for i in batch)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)  # (B, L)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, i in enumerate(batch):
            ids[r, : len(sequences[i])] = torch.tensor(sequences[i])
            mask[r, : len(sequences[i])] = 1
        out = model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), output_hidden_states=True,
                    logits_to_keep=1, use_cache=False)
        hidden = torch.stack([out.hidden_states[k] for k in picks], 1).cpu()  # (B, 1 + len(layers), L, D)
        for r, i in enumerate(batch):
            results[i] = hidden[r, :, : len(sequences[i])].clone()
    return results


def final_hidden_states(model: PreTrainedModel, sequences: Sequence[Sequence[int]], *, pad_token_id: int,
                        max_batch_tokens: int = 4096, max_batch: int = 32) -> list[torch.Tensor]:
    """The target's last hidden state (after the final norm) at every position of each sequence, each `(L, D)`
    (`target_hidden_states` without extra layers)."""
    return [h[0] for h in target_hidden_states(model, sequences, pad_token_id=pad_token_id,
                                               max_batch_tokens=max_batch_tokens, max_batch=max_batch)]


@torch.no_grad()
def target_argmax(model: PreTrainedModel, states: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """The target's own next-token choice at each of its final states `states` `(L, D)` (after the final norm): the
    argmax of its `lm_head`, `(L,)` int64 on the CPU, `chunk` rows at a time (never all `(L, V)` logits at once).
    What greedy decoding picks (a monotone logit transform such as soft-capping does not move the argmax)."""
    head = model.get_output_embeddings()
    weight = head.weight
    parts = [head(part.to(device=weight.device, dtype=weight.dtype)).argmax(-1).cpu() for part in states.split(chunk)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

