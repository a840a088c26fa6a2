"""`ChainFlowCandidateGenerator`: chain drafting inside transformers' own assisted-decoding loop.

transformers calls `get_candidates(input_ids, model_kwargs, model_outputs, is_first_iteration, n_last_matches)`
before each verification forward.  The first call only lets the prefill run (it returns `input_ids` unchanged),
as transformers' MTP and DFlash generators do.  Afterwards the target's last hidden states of the previous forward
(`model_outputs.hidden_states[-1]`, followed by the outputs of the drafter's `state_layers` when it fuses target
layers) are appended to a rolling buffer of the last `C` committed states:
after prefill all prompt states are valid; after a verification round with `n` matches, the first `n + 1`
(the previous bonus token and the accepted candidates).  The last token of `input_ids` is the new bonus token.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers.generation.candidate_generator import CandidateGenerator

from hf_chainflow.generation import drafting
from hf_chainflow.generation.settings import SpeculativeSettings
from hf_chainflow.generation.stats import SpeculativeStats
from hf_chainflow.generation.verification import select_target_states


class ChainFlowCandidateGenerator(CandidateGenerator):
    """Chain candidates from a ChainFlow drafter (or any object with the same `draft` method), drafted with
    `hf_chainflow.generation.drafting.draft`.

    Args:
        drafter: a bound [`ChainFlowDrafter`] (or `hf_chainflow.testing.OracleDrafter`).
        generation_config: the target's generation config for this call (`max_length`, `do_sample`,
            `temperature`); the chain length is `drafter.generation_config.num_assistant_tokens`.
        settings: the call's `SpeculativeSettings` (`generate` passes those it checked; default: read from
            `drafter.generation_config` and `generation_config`). Chains without a lookup branch only: trees and
            lookup branches run in hf_chainflow's own loop.
    """

    requires_model_outputs: bool = True
    model_kwargs_overrides: dict[str, Any] = {"output_hidden_states": True}

    def __init__(self, drafter, generation_config, logits_processor=None, settings: SpeculativeSettings | None = None,
                 **kwargs):
        if settings is None:
            settings = SpeculativeSettings.from_drafter(drafter, generation_config)
        if settings.mode != "chain" or settings.has_lookup:
            raise ValueError(
                f"`ChainFlowCandidateGenerator` drafts chains in transformers' assisted loop, but the drafter's "
                f"generation config asks for draft_mode={settings.mode!r}, lookup_num_tokens="
                f"{settings.lookup_num_tokens!r}, corpus_lookup_num_tokens={settings.corpus_lookup_num_tokens!r}. "
                f"Call `target.generate(..., assistant_model=drafter)`, which runs trees and lookup branches in "
                f"hf_chainflow's own loop."
            )
        self.drafter = drafter
        self.settings = settings
        self.max_length = generation_config.max_length
        self.context_size = drafter.context_size
        self.states = None  # (1, <=C, D) last committed target states
        self.stats = SpeculativeStats(mode="chain", loop="transformers")
        drafter.last_stats = self.stats
        self._round_start = None
        self._pending_depth = None  # drafted depth of the round being verified; None: no round (the prefill)

    def get_candidates(
        self,
        input_ids: torch.LongTensor,
        model_kwargs: dict[str, Any] | None = None,
        model_outputs=None,
        is_first_iteration: bool = False,
        n_last_matches: int = 0,
        **kwargs,
    ) -> tuple[torch.LongTensor, torch.Tensor | None]:
        if is_first_iteration:
            self._round_start = time.perf_counter()
            return input_ids, None  # let the prefill run first
        now = time.perf_counter()
        if self.states is None:
            self.stats.prefill_time += now - self._round_start
        if model_outputs is None or getattr(model_outputs, "hidden_states", None) is None:
            raise ValueError("ChainFlow drafting needs the target's hidden states in `model_outputs`.")

        # 1. Roll the buffer of committed states forward.
        layers = getattr(self.drafter, "state_layers", ())  # fused target layers; none: the final states
        last = select_target_states(model_outputs.hidden_states, layers)  # (1, T, D or (1 + m) D), previous inputs
        new = last if self.states is None else last[:, : int(n_last_matches) + 1]
        self.states = new if self.states is None else torch.cat([self.states, new], 1)
        self.states = self.states[:, -self.context_size:]

        # 2. Draft a chain, capped so that the verified length never passes `max_length`.
        room = self.max_length - input_ids.shape[1] - 1
        if room <= 0:  # one token left: a plain step, still a target forward (a round of depth 0)
            self._pending_depth = 0
            self._round_start = time.perf_counter()
            return input_ids, None
        start = time.perf_counter()
        draft = self.settings.draft_kwargs(room)
        tree = drafting.draft(self.drafter, self.states, input_ids, **draft)
        self.stats.draft_time += time.perf_counter() - start
        self._pending_depth = draft["num_tokens"]
        candidates = torch.cat([input_ids, tree.tokens.to(input_ids.device)[None]], 1)
        logits = None
        if self.settings.do_sample:
            logits = tree.draft_probs.log()[None]  # (1, n, V): softmax gives back q exactly
        self._round_start = time.perf_counter()
        return candidates, logits

    @property
    def num_drafting_tokens(self) -> int:
        """Tokens drafted per round (the chain length); transformers >= 5.25 reads it before its assisted loop (how
        many recurrent states the cache records for a rollback: none on the dense targets this loop runs)."""
        return self.settings.num_tokens

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        if self._pending_depth is None:
            return  # the prefill
        self.stats.verify_time += time.perf_counter() - self._round_start
        self.stats.record_round(int(num_matches), self._pending_depth)
        self._pending_depth = None
