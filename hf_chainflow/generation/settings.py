"""The settings of a speculative call, read and checked once, and the checks of the call itself.

- `SearchSettings`: what one drafting pass drafts (a chain of `num_tokens`, or a `tree_width x tree_depth` tree cut to
  `tree_budget` nodes; sampled chains). `hf_chainflow.generation.drafting.draft` / `search`, the offline evaluation and
  `hf_chainflow.generation.search.candidate_search` take it.
- `SpeculativeSettings`: what a `generate(assistant_model=drafter)` call drafts with, read from
  `drafter.generation_config` (`draft_mode`, `num_assistant_tokens`, `tree_width`, `tree_depth`, `tree_budget`,
  `num_flow_steps`, the prompt-lookup branch `lookup_*`, the corpus-lookup branch `corpus_lookup_num_tokens`) and
  the call's sampling. Built once per call (`SpeculativeSettings.from_drafter`) and used by both loops: transformers'
  assisted loop (`ChainFlowCandidateGenerator`) and hf_chainflow's own (`speculative_generate`).
- `validate_speculative_call`: every check of a ChainFlow `generate` call (target, batch, beams, caches, attention,
  ...); `SpeculativeSettings.needs_own_loop` says which loop runs it.

Both dataclasses are frozen and check their fields when built: a bad value is a `ValueError` naming the field, the
value, the rule and the fix. This module imports neither torch nor transformers at import time (the command line
checks its options with it before loading anything).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from hf_chainflow.checks import is_int
from hf_chainflow.models.chainflow.validation_chainflow import check_num_flow_steps  # noqa: F401  (re-exported)

DRAFT_MODES = ("chain", "tree")
AUTO_BUDGET = "auto"  # `tree_budget`: sized each round by the machine's cost curve (`hf_chainflow.generation.budget`)
# Tree verification needs an arbitrary 4-D attention mask: flash attention cannot take one, flex attention needs a
# `BlockMask`.
SUPPORTED_ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
_UNSUPPORTED_CACHES = ("static", "offloaded", "offloaded_static", "quantized", "sliding_window", "hybrid",
                       "mamba", "hybrid_chunked", "paged")  # paged: transformers would switch to continuous batching
# Assistant settings transformers takes from the assistant's generation config only; given to `generate` they would
# be ignored without a word.
_ASSISTANT_CONFIG_FIELDS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
                            "assistant_lookbehind", "target_lookbehind")
_CONFIG = "drafter.generation_config."


def _has_continuation_table(drafter) -> bool:
    """Whether `drafter` holds a corpus-lookup table (`hf_chainflow.generation.drafting.continuation_table` reads
    it): a ChainFlow drafter's config counts its entries (`continuation_table_size`, 0 without one); another drafter
    object (`hf_chainflow.testing.OracleDrafter`) has a `continuation_table` attribute."""
    size = getattr(getattr(drafter, "config", None), "continuation_table_size", None)
    if is_int(size):
        return size > 0
    return getattr(drafter, "continuation_table", None) is not None


def parse_tree_shape(text: str, name: str = "--tree") -> tuple[int, int]:
    """`"WIDTHxDEPTH"` (e.g. `"8x4"`) -> `(width, depth)`, two positive integers; a `ValueError` naming `name`."""
    parts = text.lower().split("x") if isinstance(text, str) else []
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"{name} needs a positive width and depth as WIDTHxDEPTH (e.g. 8x4), got {text!r}.")
    return int(parts[0]), int(parts[1])


def check_trust_ngram(trust, ngram, name: str) -> None:
    """The rule of a trusted prompt-lookup match, wherever it is set (a drafter's generation config, the vLLM
    proposer's settings): `lookup_trust_ngram` (None: off) cannot exceed `lookup_ngram`, the longest n-gram looked
    up. `name` starts the message (e.g. "`drafter.generation_config.")."""
    if trust is not None and trust > ngram:
        raise ValueError(f"{name}lookup_trust_ngram` ({trust}) cannot exceed `lookup_ngram` ({ngram}), the longest "
                         f"n-gram looked up.")


def lookup_settings(g) -> dict:
    """The prompt-lookup fields of a drafter's generation config (`lookup_num_tokens`, `lookup_ngram`,
    `lookup_trust_ngram`, `lookup_max_tokens`; see `hf_chainflow.generation.prompt_lookup`), validated (`ValueError` naming the
    field)."""
    out = {"lookup_num_tokens": getattr(g, "lookup_num_tokens", None), "lookup_ngram": getattr(g, "lookup_ngram", 3),
           "lookup_trust_ngram": getattr(g, "lookup_trust_ngram", None),
           "lookup_max_tokens": getattr(g, "lookup_max_tokens", None)}
    for name, value in out.items():
        if value is None and name != "lookup_ngram":
            continue
        if not is_int(value) or value < 1:
            raise ValueError(f"`{_CONFIG}{name}` must be a positive integer"
                             f"{'' if name == 'lookup_ngram' else ' or None (off)'}, got {value!r}.")
    trust = out["lookup_trust_ngram"]
    check_trust_ngram(trust, out["lookup_ngram"], f"`{_CONFIG}")
    longest = out["lookup_max_tokens"]
    if longest is not None and out["lookup_num_tokens"] is not None:
        if longest < out["lookup_num_tokens"]:
            raise ValueError(f"`{_CONFIG}lookup_max_tokens` ({longest}) cannot be smaller than "
                             f"`lookup_num_tokens` ({out['lookup_num_tokens']}); use None to keep the branch length "
                             "fixed.")
        if trust is None:
            raise ValueError(f"`{_CONFIG}lookup_max_tokens` ({longest}) needs `lookup_trust_ngram`: "
                             "only branches verified alone grow. Set `lookup_trust_ngram` (e.g. 2) or "
                             "`lookup_max_tokens=None`.")
    return out


def check_draft_shape(mode, depths: dict, tree_width=None, tree_budget=None, max_depth=None,
                      prefix: str = "", allow_auto: bool = False) -> None:
    """The one rule of a draft's shape, for a pass (`SearchSettings`) and a call (`SpeculativeSettings`): `mode` in
    `DRAFT_MODES`; each of `depths` (field name -> value) an integer in [1, `max_depth`]; `tree_width` a positive
    integer and `tree_budget` None, a positive integer or, for a call (`allow_auto`), `AUTO_BUDGET` (chosen each
    round from the machine's cost curve, `hf_chainflow.generation.budget`); skipped when None is passed as
    `tree_width`, i.e. a chain. `prefix` goes before the field names in the messages (e.g.
    `drafter.generation_config.`)."""
    if mode not in DRAFT_MODES:
        raise ValueError(f"`{prefix}draft_mode` must be one of {DRAFT_MODES}, got {mode!r}.")
    K = max_depth
    for name, value in depths.items():
        if not is_int(value) or value < 1 or (K is not None and value > K):
            rule = "a positive integer" if K is None else (
                f"an integer in [1, {K}] (the drafter predicts K={K} positions per pass)")
            raise ValueError(f"`{prefix}{name}` must be {rule}, got {value!r}.")
    if tree_width is None:
        return
    if not is_int(tree_width) or tree_width < 1:
        raise ValueError(f"`{prefix}tree_width` must be a positive integer, got {tree_width!r}.")
    if isinstance(tree_budget, str) and tree_budget == AUTO_BUDGET:
        if not allow_auto:
            raise ValueError(f"`{prefix}tree_budget={AUTO_BUDGET!r}` is chosen round by round by the speculative "
                             f"loop from the machine's cost curve; one drafting pass takes None (keep every node) or a "
                             f"positive integer. Set `drafter.generation_config.tree_budget = {AUTO_BUDGET!r}` for "
                             f"`generate`, or pass a number here.")
        return
    if tree_budget is not None and (not is_int(tree_budget) or tree_budget < 1):
        auto = f" or {AUTO_BUDGET!r} (chosen each round from the machine's cost curve)" if allow_auto else ""
        raise ValueError(f"`{prefix}tree_budget` must be None (keep every node) or a positive integer{auto}, got "
                         f"{tree_budget!r} (the number of nodes of highest path probability kept).")


# ----------------------------------------------------------------------------------------------------- one pass
@dataclass(frozen=True)
class SearchSettings:
    """What one drafting pass drafts; checked when built.

    Args:
        mode: `"chain"` (`num_tokens` nodes) or `"tree"` (`tree_width` nodes per level, `tree_depth` levels).
        tree_budget: trees only; keep the `tree_budget` nodes of highest path probability (`None`: all).
        do_sample: chains only; draw each token from the draft distribution at `temperature` (a positive number).
        max_depth: positions the drafter predicts per pass (`config.num_draft_positions`); `None`: no limit.
    """

    mode: str = "chain"
    num_tokens: int = 3
    tree_width: int = 8
    tree_depth: int = 4
    tree_budget: int | None = None
    do_sample: bool = False
    temperature: float = 1.0
    max_depth: int | None = None

    def __post_init__(self):
        name = "num_assistant_tokens" if self.mode == "chain" else "tree_depth"
        tree = self.mode == "tree"
        check_draft_shape(self.mode, {name: self.depth},
                          self.tree_width if tree else None, self.tree_budget, self.max_depth)
        if tree:
            if self.do_sample:
                raise ValueError("`do_sample=True` draws chains only: a tree keeps the `tree_width` best tokens per "
                                 "beam. Draft the tree with `do_sample=False`; `generate(do_sample=True)` samples "
                                 "over it losslessly (`accept_sampling_tree`).")
        t = self.temperature
        if self.do_sample and not (isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t)
                                   and t > 0):
            raise ValueError(f"`temperature` must be a positive finite number when `do_sample=True`, got {t!r}.")

    @property
    def depth(self) -> int:
        """Levels drafted: `num_tokens` for a chain, `tree_depth` for a tree."""
        return self.num_tokens if self.mode == "chain" else self.tree_depth

    @property
    def width(self) -> int:
        """Nodes kept per level: 1 for a chain, `tree_width` for a tree."""
        return 1 if self.mode == "chain" else self.tree_width

    @property
    def budget(self) -> int | None:
        """Nodes kept after the budget cut (`None`: no cut; chains are never cut)."""
        return self.tree_budget if self.mode == "tree" else None

    def draft_kwargs(self) -> dict:
        """These settings as the arguments of `drafting.draft`."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "max_depth"}


# ----------------------------------------------------------------------------------------------------- one call
def _compile_field(g):
    """`compile_verification` of a drafter's generation config: unset (None) is off; anything else is checked."""
    value = getattr(g, "compile_verification", None)
    return False if value is None else value


@dataclass(frozen=True)
class SpeculativeSettings:
    """What one `generate(assistant_model=drafter)` call drafts with; checked when built (fields named as the
    `drafter.generation_config` fields they are read from). Build it with `SpeculativeSettings.from_drafter`."""

    mode: str = "chain"
    num_tokens: int = 3
    tree_width: int = 8
    tree_depth: int = 4
    tree_budget: int | str | None = None  # or AUTO_BUDGET
    num_flow_steps: int | None = None
    lookup_num_tokens: int | None = None
    lookup_ngram: int = 3
    lookup_trust_ngram: int | None = None
    lookup_max_tokens: int | None = None
    corpus_lookup_num_tokens: int | None = None
    do_sample: bool = False
    temperature: float = 1.0
    max_depth: int | None = None
    max_batch_size: int | None = None
    compile_verification: bool = False
    fused_forward: bool = False  # a Lafa drafter: the target drafts its next block in the verify forward

    def __post_init__(self):
        if not isinstance(self.compile_verification, bool):
            raise ValueError(f"`{_CONFIG}compile_verification` must be True (the target's verification forward "
                             f"compiled, `hf_chainflow.generation.compiled_verification`) or False (eager), got "
                             f"{self.compile_verification!r}.")
        if self.fused_forward:
            _check_fused_forward(self)
        limit = self.max_batch_size
        if limit is not None and (not is_int(limit) or limit < 1):
            raise ValueError(f"`{_CONFIG}max_speculative_batch_size` must be None (draft at every batch size) or a "
                             f"positive integer (a larger batch decodes without drafting), got {limit!r}.")
        lookup_settings(self)
        corpus = self.corpus_lookup_num_tokens
        if corpus is not None and (not is_int(corpus) or corpus < 1):
            raise ValueError(f"`{_CONFIG}corpus_lookup_num_tokens` must be a positive integer or None (off), got "
                             f"{corpus!r}.")
        check_num_flow_steps(self.num_flow_steps, f"{_CONFIG}num_flow_steps")
        # both depths and the tree fields in every mode: the config may be switched to trees
        check_draft_shape(self.mode, {"num_assistant_tokens": self.num_tokens, "tree_depth": self.tree_depth},
                          self.tree_width, self.tree_budget, self.max_depth, prefix=_CONFIG, allow_auto=True)

    @classmethod
    def from_drafter(cls, drafter, generation_config=None) -> "SpeculativeSettings":
        """The settings of `drafter.generation_config`, with the sampling of `generation_config` (the call's
        generation config; `None`: greedy). Refuses transformers' assistant knobs a ChainFlow drafter does not
        implement (`num_assistant_tokens_schedule` other than `"constant"`, `assistant_confidence_threshold`)."""
        g = drafter.generation_config
        schedule = getattr(g, "num_assistant_tokens_schedule", None)
        if schedule not in (None, "constant"):
            raise ValueError(
                f"`{_CONFIG}num_assistant_tokens_schedule` is {schedule!r}, but a ChainFlow drafter drafts a fixed "
                f"`num_assistant_tokens` ({g.num_assistant_tokens}) every round. Set it to 'constant' and choose "
                f"`num_assistant_tokens` (or `draft_mode='tree'` with `tree_budget`)."
            )
        threshold = getattr(g, "assistant_confidence_threshold", None)
        if threshold is not None:
            raise ValueError(
                f"`{_CONFIG}assistant_confidence_threshold` is {threshold!r}, but a ChainFlow drafter does not stop "
                f"a draft on its own confidence. Set it to None (a tree with `tree_budget` keeps the drafter's most "
                f"probable nodes instead)."
            )
        corpus = getattr(g, "corpus_lookup_num_tokens", None)
        if corpus is not None and not _has_continuation_table(drafter):
            raise ValueError(
                f"`{_CONFIG}corpus_lookup_num_tokens` is {corpus!r}, but this drafter holds no corpus-lookup table. "
                f"Add one (`hf-chainflow corpus-lookup --drafter DIR --corpus CORPUS`, or "
                f"`hf_chainflow.generation.drafting.set_continuation_table(drafter, ContinuationTable.build(...))`) "
                f"or set it to None."
            )
        do_sample = bool(generation_config is not None and generation_config.do_sample)
        return cls(mode=getattr(g, "draft_mode", "chain"), num_tokens=g.num_assistant_tokens,
                   tree_width=getattr(g, "tree_width", 8), tree_depth=getattr(g, "tree_depth", 4),
                   tree_budget=getattr(g, "tree_budget", None), num_flow_steps=getattr(g, "num_flow_steps", None),
                   **lookup_settings(g), do_sample=do_sample,
                   corpus_lookup_num_tokens=getattr(g, "corpus_lookup_num_tokens", None),
                   temperature=float(generation_config.temperature or 1.0) if do_sample else 1.0,
                   max_depth=drafter.max_draft_depth,
                   max_batch_size=getattr(g, "max_speculative_batch_size", None),
                   compile_verification=_compile_field(g), fused_forward=is_fused_drafter(drafter))

    @property
    def sample_drafts(self) -> bool:
        """Whether the drafter samples its draft from `q`: plain chains only (accepted with `min(1, p/q)`). Trees,
        lookup branches (prompt or corpus) and a fused-forward drafter's blocks (Lafa: the previous round's greedy
        candidate block) are fixed proposals, accepted child by child (`accept_sampling_tree`), which needs no `q`."""
        return self.do_sample and self.mode == "chain" and not self.has_lookup and not self.fused_forward

    @property
    def auto_budget(self) -> bool:
        """Whether a tree's budget is chosen each round from the machine's cost curve (`tree_budget="auto"`; the
        drafter drafts the whole tree, `hf_chainflow.generation.budget.AutoBudget` cuts it)."""
        return self.mode == "tree" and self.tree_budget == AUTO_BUDGET

    @property
    def has_lookup(self) -> bool:
        """Whether rounds may add looked-up branches (prompt lookup or corpus lookup) to the draft."""
        return self.lookup_num_tokens is not None or self.corpus_lookup_num_tokens is not None

    def draft_kwargs(self, room: int) -> dict:
        """The arguments of `drafting.draft` for a round with `room >= 1` tokens left before `max_length` (a round
        adds its accepted tokens + 1); with `tree_budget="auto"` the whole tree (the loop cuts it)."""
        return {"mode": self.mode, "num_tokens": min(self.num_tokens, room), "tree_width": self.tree_width,
                "tree_depth": min(self.tree_depth, room),
                "tree_budget": None if self.tree_budget == AUTO_BUDGET else self.tree_budget,
                "num_flow_steps": self.num_flow_steps, "do_sample": self.sample_drafts,
                "temperature": self.temperature}

    def needs_own_loop(self, model, generation_config, stopping_criteria) -> bool:
        """Whether the call runs in hf_chainflow's own loop (`speculative_generate`) rather than transformers'
        assisted loop: trees, a lookup branch (prompt or corpus), stateful targets, stop strings and custom stopping
        criteria (a multi-token commit in transformers' loop could overshoot them), compiled verification
        (transformers' assisted loop runs the target eagerly on a dynamic cache) and a fused-forward drafter (Lafa:
        its draft comes out of the verify forward itself)."""
        return (self.mode == "tree" or self.has_lookup or self.compile_verification or self.fused_forward
                or is_stateful_target(model) or generation_config.stop_strings is not None or bool(stopping_criteria))

    def replace(self, **changes) -> "SpeculativeSettings":
        """A copy with `changes` (checked again)."""
        return dataclasses.replace(self, **changes)


def is_fused_drafter(drafter) -> bool:
    """A drafter whose drafts come out of the target's own verify forward (`LafaDrafter`: `is_lafa_drafter`)."""
    return getattr(drafter, "is_lafa_drafter", False) is True


def _check_fused_forward(s: "SpeculativeSettings") -> None:
    """What a Lafa call refuses among the drafting settings (before anything runs)."""
    if s.mode != "chain":
        raise ValueError(f"`{_CONFIG}draft_mode` is {s.mode!r}, but a Lafa drafter drafts one chain per round: the "
                         f"candidate block of the accepted length (block_size - 1 tokens), drafted in the previous "
                         f"round's verify forward. Set `{_CONFIG}draft_mode = 'chain'`.")
    for name in ("lookup_num_tokens", "corpus_lookup_num_tokens"):
        if getattr(s, name) is not None:
            raise ValueError(f"`{_CONFIG}{name}` is {getattr(s, name)!r}, but a Lafa drafter takes no lookup branch: "
                             f"a branch would turn the round's chain into a tree, and the fused forward drafts "
                             f"candidate blocks for a chain's accepted lengths only. Set it to None.")
    if s.compile_verification:
        raise ValueError(f"`{_CONFIG}compile_verification` is True, but a Lafa drafter verifies eagerly: its noise-row "
                         f"weights act through forward hooks on the target's modules during the fused forward, which "
                         f"a compiled graph would trace in (and keep after the round) or skip. Set it to False.")


# ----------------------------------------------------------------------------------------------------- the call
def is_stateful_target(model) -> bool:
    """The target keeps recurrent (linear-attention / state-space) state, so hf_chainflow's own loop runs it (it forks
    and commits that state itself) rather than transformers' assisted loop (`hf_chainflow.generation.hybrid.is_hybrid_target`
    asks whether a model has recurrent layers at all, conv-only ones included).

    transformers <= 5.24 marks these models `_is_stateful` (and refuses assisted generation for them); that mark is
    read as is. 5.25 removed the attribute (its assisted loop now restores recurrent states from a recorded history,
    which hf_chainflow neither uses nor has validated); there the model's layers decide
    (`hf_chainflow.generation.hybrid.has_recurrent_state`)."""
    from transformers import PreTrainedModel

    if hasattr(PreTrainedModel, "_is_stateful"):  # transformers <= 5.24
        return bool(getattr(model, "_is_stateful", False))
    from hf_chainflow.generation.hybrid import has_recurrent_state

    return has_recurrent_state(model)


def check_attention_mask(input_ids, attention_mask) -> None:
    """A speculative call's `attention_mask` must match `input_ids` `(B, L)`, hold only 0 and 1, pad on the left only
    (every row ends on a token) and leave every row at least one token. Raises `ValueError`; pure."""
    shape = tuple(getattr(attention_mask, "shape", ()))
    if shape != tuple(input_ids.shape):
        raise ValueError(f"`attention_mask` has shape {shape} but `input_ids` has shape {tuple(input_ids.shape)}; "
                         f"pass the mask the tokenizer returned with these ids (one entry per token).")
    if bool(((attention_mask != 0) & (attention_mask != 1)).any()):
        raise ValueError("`attention_mask` must hold only 0 (padding) and 1 (a token); pass the tokenizer's mask.")
    keep = attention_mask != 0
    empty = (~keep.any(1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"`attention_mask` rows {empty} hold no token (all padding); every prompt needs at least "
                         f"one token.")
    bad = (keep[:, :-1] & ~keep[:, 1:]).any(1).nonzero().flatten().tolist()  # a token followed by padding
    if bad:
        raise ValueError(f"`attention_mask` rows {bad} are padded on the right (or inside); speculative generation "
                         f"takes left-padded batches, as `generate` does for decoder-only models. Set "
                         f"`tokenizer.padding_side = 'left'` before tokenizing.")


def validate_speculative_call(model, drafter, generation_config, input_ids, kwargs: dict, own_loop: bool) -> None:
    """Every check of a ChainFlow `generate` call but the drafting settings (`SpeculativeSettings`), before anything
    runs: `generation_config` is the one `generate` will use, `kwargs` the call's other arguments. Raises
    `ValueError`."""
    from transformers import DynamicCache

    drafter.check_target(model)
    if is_fused_drafter(drafter) and input_ids is not None and input_ids.dim() == 2:
        mask = kwargs.get("attention_mask")
        if input_ids.shape[0] > 1:
            raise ValueError(f"`input_ids` is a batch of {input_ids.shape[0]} prompts, but a Lafa drafter decodes one "
                             f"prompt per call for now (its rounds are built and tested at batch 1). Generate one "
                             f"prompt at a time.")
        if mask is not None and not bool((mask != 0).all()):
            raise ValueError("`attention_mask` pads the prompt, but a Lafa drafter decodes one unpadded prompt per "
                             "call for now. Pass the prompt without padding (or no `attention_mask`).")
    if input_ids is not None and input_ids.dim() == 2:
        mask = kwargs.get("attention_mask")
        if mask is None and input_ids.shape[0] > 1 and generation_config.pad_token_id is not None:
            pad = generation_config.pad_token_id
            pad = pad if isinstance(pad, int) else int(pad.reshape(-1)[0])
            if bool((input_ids == pad).any()):
                raise ValueError(
                    f"`input_ids` is a batch of {input_ids.shape[0]} holding the pad token id {pad} but no "
                    f"`attention_mask` was given, so padding cannot be told from text. Pass the attention mask the "
                    f"tokenizer returns (`tokenizer(prompts, padding=True, return_tensors='pt')` with "
                    f"`tokenizer.padding_side = 'left'`): `generate(**inputs, assistant_model=drafter)`."
                )
        if mask is not None:
            check_attention_mask(input_ids, mask)
        if input_ids.shape[0] > 1 and kwargs.get("streamer") is not None:
            raise ValueError(f"A streamer takes one sequence; got a batch of {input_ids.shape[0]}. Generate without "
                             f"`streamer`, or one prompt at a time.")
    if (generation_config.num_beams or 1) > 1:
        raise ValueError(
            f"`num_beams` must be 1 with a ChainFlow drafter (speculative decoding is greedy or sampling), "
            f"got {generation_config.num_beams}."
        )
    if generation_config.prompt_lookup_num_tokens is not None:
        raise ValueError(
            f"`prompt_lookup_num_tokens` ({generation_config.prompt_lookup_num_tokens}) cannot be combined with "
            f"`assistant_model`: choose prompt lookup or the ChainFlow drafter."
        )
    if generation_config.assistant_early_exit is not None or getattr(generation_config, "use_mtp", False):
        name = "assistant_early_exit" if generation_config.assistant_early_exit is not None else "use_mtp"
        raise ValueError(
            f"`{name}={getattr(generation_config, name)!r}` (from the call or the target's generation config) selects "
            f"transformers' own self-speculative drafting, which cannot be combined with a ChainFlow `assistant_model`. "
            f"Leave `{name}` unset for ChainFlow drafting, or call `generate` without `assistant_model`."
        )
    if kwargs.get("assistant_tokenizer") is not None:
        raise ValueError(
            "`assistant_tokenizer` is not used by a ChainFlow drafter: it is bound to the target and drafts in the "
            "target's own vocabulary. Omit `assistant_tokenizer`."
        )
    for name in _ASSISTANT_CONFIG_FIELDS:  # transformers reads these from the assistant's config, never the call's
        if kwargs.get(name) is not None:
            raise ValueError(
                f"`{name}={kwargs[name]!r}` was passed to `generate`, where an assistant model ignores it: the drafter "
                f"reads its drafting settings from its own generation config (as transformers' assistants do). Set "
                f"`{_CONFIG}{name}` instead."
            )
    if (generation_config.num_return_sequences or 1) > 1:
        raise ValueError(
            f"`num_return_sequences` must be 1 with a ChainFlow drafter, got {generation_config.num_return_sequences}."
        )
    if generation_config.use_cache is False or kwargs.get("use_cache") is False:
        raise ValueError(
            "`use_cache=False` cannot be combined with a ChainFlow drafter: verification scores the drafts against "
            "the target's cache and then crops it. Leave `use_cache` unset (True)."
        )
    cache_impl = generation_config.cache_implementation
    if cache_impl is not None and cache_impl in _UNSUPPORTED_CACHES:
        raise ValueError(
            f"`cache_implementation={cache_impl!r}` is not supported with a ChainFlow drafter: verification crops "
            f"and gathers the cache. Use the default dynamic cache (leave `cache_implementation` unset)."
        )
    if generation_config.guidance_scale is not None and generation_config.guidance_scale != 1:
        raise ValueError(
            f"`guidance_scale={generation_config.guidance_scale}` cannot be combined with a ChainFlow drafter: "
            f"classifier-free guidance keeps a per-call state that scoring several draft positions at once would "
            f"corrupt. Leave `guidance_scale` unset (or 1), or generate without `assistant_model`."
        )
    stateful = is_stateful_target(model)
    if stateful or own_loop:
        from hf_chainflow.generation.hybrid import check_forkable_target, is_hybrid_target

        if stateful or is_hybrid_target(model):
            check_forkable_target(model)  # the own loop forks recurrent state per node: Gated DeltaNet layers only
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is not None and type(cache) is not DynamicCache and not stateful:
        raise ValueError(
            f"A ChainFlow drafter needs a `DynamicCache`, got {type(cache).__name__}. Pass no cache, or a "
            f"`DynamicCache`."
        )
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError(
            f"The cache passed to `generate` already holds {cache.get_seq_length()} tokens; ChainFlow speculative "
            f"generation prefills the whole prompt itself. Pass an empty cache (or none) with the full prompt."
        )
    if own_loop and kwargs.get("inputs_embeds") is not None:
        raise ValueError(
            f"`inputs_embeds` (shape {tuple(kwargs['inputs_embeds'].shape)}) is not supported by hf_chainflow's own "
            f"speculative loop (tree mode, a lookup branch, hybrid targets, stop strings); pass `input_ids`."
        )
    gdn_method = kwargs.get("gdn_method", "chunk")
    if gdn_method != "chunk":
        from hf_chainflow.generation.hybrid import GDN_METHODS

        if gdn_method not in GDN_METHODS:
            raise ValueError(f"`gdn_method` must be one of {GDN_METHODS} (the Gated DeltaNet tree back-end), got "
                             f"{gdn_method!r}.")
    attn = model.config._attn_implementation
    if own_loop and attn not in SUPPORTED_ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"Tree verification and hybrid targets need an attention implementation that takes a 4-D mask, one of "
            f"{SUPPORTED_ATTN_IMPLEMENTATIONS}; the target uses {attn!r}. Load it with `attn_implementation='sdpa'`."
        )
    if own_loop:
        for flag in ("output_scores", "output_logits", "output_attentions", "output_hidden_states"):
            if getattr(generation_config, flag, False):
                raise ValueError(
                    f"`{flag}=True` is not supported by hf_chainflow's own speculative loop (tree mode, hybrid "
                    f"targets, stop strings); `return_dict_in_generate=True` returns `sequences`."
                )


__all__ = ["AUTO_BUDGET", "DRAFT_MODES", "SUPPORTED_ATTN_IMPLEMENTATIONS", "SearchSettings", "SpeculativeSettings",
           "check_attention_mask", "check_draft_shape", "check_num_flow_steps", "check_trust_ngram",
           "is_fused_drafter", "is_stateful_target", "lookup_settings", "parse_tree_shape",
           "validate_speculative_call"]
