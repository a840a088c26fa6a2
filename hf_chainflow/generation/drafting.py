"""Drafting with a ChainFlow drafter: one round of drafts from the target's states and the committed tokens.

The model (`hf_chainflow.models.chainflow.modeling_chainflow.ChainFlowDrafter`) keeps its layers, `forward`,
loading and target binding; what drafts with it lives here, as functions taking the drafter first:

- `draft(drafter, hidden_states, input_ids, ...)`: one round for one sequence (the drafter pass, then the candidate
  search, `hf_chainflow.generation.search`), eagerly or compiled (`hf_chainflow.generation.drafting_round`);
- `draft_batch(drafter, hidden_states, committed, context_mask, ...)`: one round for `B` rows in one pass;
- `search(drafter, states, committed, ...)`: the candidate search alone over predicted states;
- `compiled_round(drafter)` and `warm_up_drafting(drafter, settings)`: the compiled rounds and their warm-up;
- `continuation_table(drafter)` and `set_continuation_table(drafter, table)`: the corpus-lookup table saved with the
  drafter (`hf_chainflow.generation.corpus_lookup`).

`draft` and `draft_batch` accept any drafter: a `ChainFlowDrafter` (or a `peft` model around one) drafts here;
another object (the test double `hf_chainflow.testing.OracleDrafter`) is called as `drafter.draft(...)` /
`drafter.draft_batch(...)`. `continuation_table` likewise reads another object's `continuation_table` attribute.
Caches (the compiled rounds, the parsed table) live in the drafter's `_runtime` dict.
"""

from __future__ import annotations

import time

import torch

from hf_chainflow.generation.corpus_lookup import ContinuationTable
from hf_chainflow.generation.drafting_round import CompiledDraftingRound, drafting_round
from hf_chainflow.generation.search import DraftBatch, candidate_search, committed_tails, search_levels
from hf_chainflow.generation.serving import serving_tables
from hf_chainflow.generation.settings import SearchSettings
from hf_chainflow.generation.tree import DraftTree
from hf_chainflow.models.chainflow.configuration_chainflow import ChainFlowConfig
from hf_chainflow.models.chainflow.modeling_chainflow import ChainFlowDrafter


def _chainflow(drafter) -> ChainFlowDrafter | None:
    """The `ChainFlowDrafter` that drafts for `drafter` (itself, or the base model of a `peft` model around one, whose
    attributes it forwards), `None` for another kind of drafter."""
    if isinstance(drafter, ChainFlowDrafter):
        return drafter
    base = drafter.get_base_model() if hasattr(drafter, "get_base_model") else None
    return base if isinstance(base, ChainFlowDrafter) else None


def _settings(drafter: ChainFlowDrafter, mode, num_tokens, tree_width, tree_depth, tree_budget, do_sample,
              temperature) -> SearchSettings:
    return SearchSettings(mode=mode, num_tokens=num_tokens, tree_width=tree_width, tree_depth=tree_depth,
                          tree_budget=tree_budget, do_sample=do_sample, temperature=temperature,
                          max_depth=drafter.max_draft_depth)


def _layers_hint(drafter: ChainFlowDrafter) -> str:
    if not drafter.state_layers:
        return ""
    return (f"; each state is the final state followed by the outputs of decoder layers "
            f"{list(drafter.state_layers)} (`hf_chainflow.generation.verification.select_target_states("
            f"outputs.hidden_states, drafter.state_layers)`)")


# ----------------------------------------------------------------------------------------------------------------
# Drafting rounds
# ----------------------------------------------------------------------------------------------------------------
def draft(drafter, hidden_states: torch.FloatTensor, input_ids: torch.LongTensor, **kwargs) -> DraftTree:
    """One drafting round (batch size 1): one drafter pass, then candidate search (`hf_chainflow.generation.search`).

    Args:
        drafter: a bound `ChainFlowDrafter` (or a `peft` model around one); any other drafter object is called as
            `drafter.draft(hidden_states, input_ids, **kwargs)`.
        hidden_states (`(1, T, D)`): the target's last states `h_{..t}` (the last `C` are used); `(1, T, (1 + n) D)`
            with `target_layer_ids` (`select_target_states`).
        input_ids (`(1, L)`): committed tokens `x_{..t+1}`; the last one is the bonus token (the tree root).
        mode: `"chain"` (`num_tokens` nodes, default 3) or `"tree"` (`tree_width x tree_depth`, default 8 x 4).
        tree_budget: trees only; keep the `tree_budget` nodes of highest path probability (`None`: all).
        num_flow_steps: Euler steps of the transport (`None`: `config.num_flow_steps`).
        do_sample: chains only; sample each token from the draft distribution (at `temperature`, default 1.0) and
            return the per-position distributions in `DraftTree.draft_probs`.
        compile: run the round compiled (`hf_chainflow.generation.drafting_round`; greedy drafts from a full context
            of `C` states); `None`: `generation_config.compile_drafting` (default False).
    """
    chainflow = _chainflow(drafter)
    if chainflow is None:
        return drafter.draft(hidden_states, input_ids, **kwargs)
    return _draft(chainflow, hidden_states, input_ids, **kwargs)


@torch.no_grad()
def _draft(drafter: ChainFlowDrafter, hidden_states, input_ids, *, mode: str = "chain", num_tokens: int = 3,
           tree_width: int = 8, tree_depth: int = 4, tree_budget: int | None = None,
           num_flow_steps: int | None = None, do_sample: bool = False, temperature: float = 1.0,
           compile: bool | None = None) -> DraftTree:
    drafter._require_bound()
    settings = _settings(drafter, mode, num_tokens, tree_width, tree_depth, tree_budget, do_sample, temperature)
    D = drafter.config.context_state_size
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3 or hidden_states.shape[0] != 1 \
            or hidden_states.shape[1] < 1 or hidden_states.shape[2] != D:
        shape = tuple(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else type(hidden_states)
        raise ValueError(f"`hidden_states` must be the target's last states of shape (1, T, {D}) with T >= 1 "
                         f"(batch size 1){_layers_hint(drafter)}, got {shape}.")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != 1 \
            or input_ids.shape[1] < 1 or input_ids.is_floating_point():
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids)
        raise ValueError(f"`input_ids` must be the committed token ids of shape (1, L) with L >= 1 (batch size "
                         f"1; the last id is the bonus token), got {shape}; e.g. `ids[None]` for a 1-D `ids`.")
    if compile is None:
        compile = getattr(drafter.generation_config, "compile_drafting", False)
    if not isinstance(compile, bool):
        raise ValueError(f"`compile` (or `drafter.generation_config.compile_drafting`) must be True or False, got "
                         f"{compile!r}.")
    C, p = drafter.config.context_size, drafter.config.path_order
    tails = committed_tails(input_ids, p, drafter.config.pad_token_id or 0)  # (1, p)
    if compile and not do_sample and hidden_states.shape[1] >= C:
        rounds = drafter._runtime.get("compiled_round")
        if rounds is None:
            rounds = drafter._runtime["compiled_round"] = CompiledDraftingRound()
        # fresh copies: a view's strides are guards of the compiled graph (a window of a longer buffer would
        # recompile on every new buffer length), and `contiguous()` keeps the stride of a size-1 batch dim
        window = hidden_states[:, -C:]
        out = rounds(drafter, serving_tables(drafter), window.new_empty(window.shape).copy_(window),
                     tails.new_empty(tails.shape).copy_(tails), settings, num_flow_steps)
    else:
        out = drafting_round(drafter, serving_tables(drafter), hidden_states, tails, settings, num_flow_steps)
    return DraftBatch(*out).tree(0)


def draft_batch(drafter, hidden_states: torch.FloatTensor, committed: list[torch.LongTensor],
                context_mask: torch.BoolTensor | None = None, **kwargs) -> list[DraftTree]:
    """One drafting round for `B` rows in one drafter pass (the batched speculative loop).

    Args:
        drafter: a bound `ChainFlowDrafter` (or a `peft` model around one); any other drafter object is called as
            `drafter.draft_batch(hidden_states, committed, context_mask, **kwargs)`.
        hidden_states (`(B, T, D)`): each row's last committed target states, left-padded where a row has fewer
            than `T` (`context_mask` `(B, T)`, True = a state; `None`: every state is one).
        committed: each row's committed tokens `(L_b,)`, unpadded; the last one is the row's root.
        The keyword arguments are `draft`'s (`mode`, `num_tokens`, `tree_width`, `tree_depth`, `tree_budget`,
        `num_flow_steps`, `do_sample`, `temperature`; not `compile`), shared by every row. Returns one `DraftTree`
        per row.
    """
    chainflow = _chainflow(drafter)
    if chainflow is None:
        return drafter.draft_batch(hidden_states, committed, context_mask, **kwargs)
    return _draft_batch(chainflow, hidden_states, committed, context_mask, **kwargs)


@torch.no_grad()
def _draft_batch(drafter: ChainFlowDrafter, hidden_states, committed, context_mask=None, *, mode: str = "chain",
                 num_tokens: int = 3, tree_width: int = 8, tree_depth: int = 4, tree_budget: int | None = None,
                 num_flow_steps: int | None = None, do_sample: bool = False,
                 temperature: float = 1.0) -> list[DraftTree]:
    drafter._require_bound()
    settings = _settings(drafter, mode, num_tokens, tree_width, tree_depth, tree_budget, do_sample, temperature)
    B, D = len(committed), drafter.config.context_state_size
    if hidden_states.dim() != 3 or hidden_states.shape[0] != B or hidden_states.shape[2] != D:
        raise ValueError(f"`hidden_states` must have shape ({B}, T, {D}) (one row per committed sequence"
                         f"{_layers_hint(drafter)}), got {tuple(hidden_states.shape)}.")
    if context_mask is not None and tuple(context_mask.shape) != tuple(hidden_states.shape[:2]):
        raise ValueError(f"`context_mask` must have shape {tuple(hidden_states.shape[:2])}, got "
                         f"{tuple(context_mask.shape)}.")
    p, pad = drafter.config.path_order, drafter.config.pad_token_id or 0
    tails = torch.cat([committed_tails(ids[None], p, pad) for ids in committed])  # (B, p)
    tables = serving_tables(drafter)
    states = drafter.predict_states(hidden_states, context_mask=context_mask, num_flow_steps=num_flow_steps,
                                    bonus_tokens=tails[:, -1], velocity=tables.velocity)
    batch = DraftBatch(*search_levels(drafter, tables, states, tails, settings))
    return [batch.tree(i) for i in range(B)]


@torch.no_grad()
def search(drafter: ChainFlowDrafter, states, committed, *, mode="chain", num_tokens=3, tree_width=8, tree_depth=4,
           tree_budget=None, do_sample=False, temperature=1.0) -> DraftTree:
    """Candidate search alone over predicted states `(K, D)` given committed tokens `(L,)` (last = root); the
    arguments are `draft`'s."""
    settings = _settings(drafter, mode, num_tokens, tree_width, tree_depth, tree_budget, do_sample, temperature)
    return candidate_search(drafter, states[None], committed[None], settings).tree(0)


# ----------------------------------------------------------------------------------------------------------------
# Compiled rounds
# ----------------------------------------------------------------------------------------------------------------
def compiled_round(drafter: ChainFlowDrafter) -> CompiledDraftingRound | None:
    """The compiled drafting rounds of `drafter` (`hf_chainflow.generation.drafting_round.CompiledDraftingRound`: its
    `compile_time` and keys), `None` before the first compiled round."""
    return drafter._runtime.get("compiled_round")


def warm_up_drafting(drafter: ChainFlowDrafter, settings) -> float:
    """Compile the drafting round for `settings` (a `SpeculativeSettings` or `SearchSettings`-like object with
    `draft_kwargs`) at a full context and every depth a round can be capped to, outside any timed region;
    returns the seconds it took (0 when `compile_drafting` is off)."""
    if not getattr(drafter.generation_config, "compile_drafting", False):
        return 0.0
    start = time.perf_counter()
    C, D = drafter.config.context_size, drafter.config.context_state_size
    drafter._require_bound()
    # The states arrive in the target's dtype (a key of the compiled round).
    states = torch.zeros(1, C, D, device=drafter.device, dtype=drafter._bound["lm_head"].weight.dtype)
    ids = torch.zeros(1, drafter.config.path_order + 1, dtype=torch.long, device=drafter.device)
    kwargs = settings.draft_kwargs(10 ** 6)
    if not kwargs["do_sample"]:
        depth = kwargs["num_tokens"] if kwargs["mode"] == "chain" else kwargs["tree_depth"]
        for room in range(1, depth + 1):
            draft(drafter, states, ids, **settings.draft_kwargs(room), compile=True)
    return time.perf_counter() - start


# ----------------------------------------------------------------------------------------------------------------
# Corpus lookup
# ----------------------------------------------------------------------------------------------------------------
def continuation_table(drafter) -> ContinuationTable | None:
    """The corpus-lookup table saved with `drafter` (`hf_chainflow.generation.corpus_lookup`), or None without one.

    A `ChainFlowDrafter` keeps the table as two buffers (`continuation_keys`, `continuation_next_tokens`, saved and
    loaded with its weights) and its sizes in its config; the `ContinuationTable` read from them is cached once per
    loaded or moved buffer. Another drafter object's `continuation_table` attribute is returned as it is (None
    without one).
    """
    chainflow = _chainflow(drafter)
    if chainflow is None:
        return getattr(drafter, "continuation_table", None)
    config = chainflow.config
    if not config.continuation_table_size:
        return None
    cached = chainflow._runtime.get("continuation_table")  # (the buffer it was read from, the table)
    if cached is None or cached[0] is not chainflow.continuation_keys:
        table = ContinuationTable(chainflow.continuation_keys.cpu(), chainflow.continuation_next_tokens.cpu(),
                                  vocab_size=config.vocab_size, min_ngram=config.continuation_min_ngram,
                                  max_ngram=config.continuation_max_ngram)
        cached = chainflow._runtime["continuation_table"] = (chainflow.continuation_keys, table)
    return cached[1]


def set_continuation_table(drafter: ChainFlowDrafter, table: ContinuationTable | None) -> ChainFlowDrafter:
    """Keep `table` (a `ContinuationTable` of this drafter's target's responses; None removes it) in `drafter`: its
    buffers and sizes are saved by `save_pretrained` and loaded by `from_pretrained`. Turn the branch on with
    `drafter.generation_config.corpus_lookup_num_tokens`. Returns `drafter`."""
    if table is not None:
        if not isinstance(table, ContinuationTable):
            raise ValueError(f"`table` must be a `hf_chainflow.ContinuationTable` or None, got "
                             f"{type(table).__name__}.")
        if table.vocab_size != drafter.config.vocab_size:
            raise ValueError(f"`table` was built for a {table.vocab_size}-token vocabulary, but this drafter's "
                             f"target has {drafter.config.vocab_size}; build it from this target's responses.")
        if len(table) == 0:
            raise ValueError("`table` is empty (no n-gram was seen `min_count` times); build it from more "
                             "responses or with a smaller `min_count`, or pass None to remove the table.")
    for name in ("continuation_keys", "continuation_next_tokens"):
        drafter._buffers.pop(name, None)
    drafter._runtime.pop("continuation_table", None)
    if table is None:  # the config's defaults again
        drafter.config.continuation_table_size = 0
        drafter.config.continuation_min_ngram = ChainFlowConfig.continuation_min_ngram
        drafter.config.continuation_max_ngram = ChainFlowConfig.continuation_max_ngram
        return drafter
    device = drafter.state_mean.device
    drafter.register_buffer("continuation_keys", table.keys.to(device))
    drafter.register_buffer("continuation_next_tokens", table.next_tokens.to(device=device, dtype=torch.int32))
    drafter.config.continuation_table_size = len(table)
    drafter.config.continuation_min_ngram, drafter.config.continuation_max_ngram = table.min_ngram, table.max_ngram
    return drafter


__all__ = ["compiled_round", "continuation_table", "draft", "draft_batch", "search", "set_continuation_table",
           "warm_up_drafting"]
