"""Target binding of the ChainFlow drafter: the target's frozen `lm_head` and input embeddings, borrowed.

`ChainFlowTargetBindingMixin` is a base of `modeling_chainflow.ChainFlowDrafter`, in a module of its own to keep the
model class short (one concept per class, issue 63): binding and checking the target (`bind_target`,
`unbind_target`, `check_target`, `is_bound`) and what the drafter reads from the borrowed layers: the head rows of
its draft vocabulary (`draft_head_weight`), the frozen embeddings (`_embed`) and the maps between vocabulary ids and
draft-vocabulary indices (the shortlist). The borrowed layers are never owned or saved.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel


class ChainFlowTargetBindingMixin:
    """The target binding of a `ChainFlowDrafter` (see the module docstring). Expects `self.config` (a
    `ChainFlowConfig`), `self.state_layers`, `self.shortlist_ids`, `self.draft_vocab_size`, `self.dtype` and
    `self._bound` (a dict, empty while unbound)."""

    def bind_target(self, target: PreTrainedModel) -> "ChainFlowTargetBindingMixin":
        """Borrow `target`'s frozen `lm_head` and input embeddings (shared, not copied into the state dict).

        Raises a `ValueError` naming both fingerprints when the target does not match the one the drafter was
        configured for.
        """
        cfg = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
        mine = self.config.target_fingerprint()
        theirs = {"model_type": getattr(cfg, "model_type", None), "hidden_size": getattr(cfg, "hidden_size", None),
                  "vocab_size": getattr(cfg, "vocab_size", None)}
        out_emb = target.get_output_embeddings()
        in_emb = target.get_input_embeddings()
        if out_emb is None or in_emb is None:
            raise ValueError(f"`target` ({type(target).__name__}) must have input and output embeddings (an LM head).")
        mismatched = [k for k in ("hidden_size", "vocab_size") if mine[k] != theirs[k]]
        if mine["model_type"] is not None and mine["model_type"] != theirs["model_type"]:
            mismatched.append("model_type")
        if out_emb.weight.shape != (self.config.vocab_size, self.config.target_hidden_size):
            mismatched.append("lm_head shape")
        num_layers = getattr(cfg, "num_hidden_layers", None)
        if self.state_layers and (not isinstance(num_layers, int) or self.state_layers[-1] >= num_layers - 1):
            raise ValueError(
                f"This drafter reads the outputs of decoder layers `target_layer_ids={list(self.state_layers)}`, but "
                f"the target has num_hidden_layers={num_layers!r}: the layers must lie in [0, num_hidden_layers - 1) "
                f"(the last layer's output is the final state, always read). Train a drafter whose "
                f"`target_layer_ids` fit this target."
            )
        if mismatched:
            raise ValueError(
                f"This drafter was built for target {mine} but was given {theirs} "
                f"(lm_head {tuple(out_emb.weight.shape)}); mismatched: {mismatched}. Train or load a drafter for "
                f"this target (`ChainFlowConfig.for_target(target.config)`)."
            )
        # the target itself, weakly: what sizes drafting by its cost (`hf_chainflow.generation.calibration`) measures
        self._bound = {"lm_head": out_emb, "embed": in_emb, "target_config": target.config,
                       "target": weakref.ref(target)}
        self._draft_head_cache = None
        self.shortlist_ids = self.shortlist_ids.to(out_emb.weight.device)
        return self

    def unbind_target(self) -> "ChainFlowTargetBindingMixin":
        """Forget the borrowed target layers (the inverse of `bind_target`)."""
        self._bound = {}
        self._draft_head_cache = None
        return self

    def check_target(self, target: PreTrainedModel) -> None:
        """Raise a `ValueError` unless this drafter is bound to `target` itself."""
        self._require_bound()
        if self._bound["lm_head"] is not target.get_output_embeddings():
            cfg = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
            raise ValueError(
                f"This drafter is bound to another target ({self._bound['target_config'].__class__.__name__}, "
                f"fingerprint {self.config.target_fingerprint()}) than the one generating "
                f"({type(target).__name__}, hidden_size={getattr(cfg, 'hidden_size', None)}, "
                f"vocab_size={getattr(cfg, 'vocab_size', None)}). Call `drafter.bind_target(target)` first."
            )

    @property
    def is_bound(self) -> bool:
        return bool(self._bound)

    def _require_bound(self):
        if not self._bound:
            raise ValueError(
                "This ChainFlowDrafter is not bound to a target: call `drafter.bind_target(target)` or load it with "
                "`ChainFlowDrafter.from_pretrained(path, target=target)` before drafting or training."
            )

    def draft_head_weight(self) -> torch.Tensor:
        """The target's `lm_head` rows of the draft vocabulary `(S, D)`, detached, in the drafter's dtype.

        A derived cache of the bound target's weight (recomputed on bind and dtype/device change; never saved).
        """
        self._require_bound()
        W = self._bound["lm_head"].weight
        key = (W.data_ptr(), W.dtype, W.device, self.dtype)
        cache = getattr(self, "_draft_head_cache", None)
        if cache is None or cache[0] != key:
            Wd = W.detach()
            if self.config.shortlist is not None:
                Wd = Wd.index_select(0, self.shortlist_ids.to(W.device))
            self._draft_head_cache = (key, Wd.to(self.dtype).contiguous())
        return self._draft_head_cache[1]

    def _token_to_draft_index(self, tokens: torch.Tensor) -> torch.Tensor:
        """Vocabulary ids -> draft-vocabulary indices (`S` for ids outside the shortlist)."""
        if self.config.shortlist is None:
            return tokens
        return self._draft_index_lut(tokens.device)[tokens]

    def _draft_index_lut(self, device) -> torch.Tensor:
        """`(V,)` vocabulary id -> draft index (`S` outside the shortlist), cached per device."""
        lut = getattr(self, "_lut", None)
        if lut is None or lut.device != device:
            lut = torch.full((self.config.vocab_size,), self.draft_vocab_size, dtype=torch.long, device=device)
            lut[self.shortlist_ids.to(device)] = torch.arange(self.draft_vocab_size, device=device)
            self._lut = lut
        return lut

    def _draft_index_to_token(self, index: torch.Tensor) -> torch.Tensor:
        if self.config.shortlist is None:
            return index
        return self.shortlist_ids.to(index.device)[index]

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Frozen target embeddings of `tokens` `(...)` -> `(..., D)` in the drafter's dtype."""
        return F.embedding(tokens, self._bound["embed"].weight.detach()).to(self.dtype)


__all__ = ["ChainFlowTargetBindingMixin"]
