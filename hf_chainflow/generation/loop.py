"""hf_chainflow's own speculative decoding loop (tree drafts, hybrid targets, exact stopping).

It is reached through `target.generate(..., assistant_model=drafter)` when the draft mode or the target needs it
(see `hf_chainflow.generation.hook`), or directly as transformers' `custom_generate` hook:

    target.generate(**inputs, custom_generate=hf_chainflow.speculative_generate, drafter=drafter)

transformers prepares inputs, the cache, logits processors and stopping criteria; the loop then runs:

    1. prefill      the prompt in one forward -> first token (the root of round 1), committed states
    2. draft        one drafter pass -> a chain or a tree (+ optional prompt- and corpus-lookup branches)
    3. verify       one target forward over [root] + draft nodes (ancestor mask, depth positions)
    4. accept       greedy path matching / rejection sampling on processed logits: a sampled chain against its
                    draft distribution q, any other draft (a tree, a lookup branch) child by child as fixed proposals
    5. emit         accepted tokens + the target's bonus token, one at a time through the stopping criteria
    6. compact      the cache keeps the committed prefix + accepted path; hybrid states of the last accepted node

The per-round maths live in `hf_chainflow.generation.verification`; this module only sequences them.
"""

from __future__ import annotations

import time

import torch
from transformers import GenerationConfig
from transformers.generation.utils import GenerateDecoderOnlyOutput

from hf_chainflow.generation.batch_loop import batch_speculative_generate
from hf_chainflow.generation.prompt_lookup import next_lookup_length, round_branches
from hf_chainflow.generation.settings import SpeculativeSettings, validate_speculative_call
from hf_chainflow.generation.stats import SpeculativeStats
from hf_chainflow.generation.tree import DraftTree
from hf_chainflow.generation.verification import (accept_round, choose_token, commit, process_row, processed_rows, select_target_states,
                           verify_forward)


_process, _processed_rows = process_row, processed_rows  # the loop's names (profiling scripts wrap them)


@torch.no_grad()
def speculative_generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor=None,
    stopping_criteria=None,
    generation_config: GenerationConfig | None = None,
    drafter=None,
    chainflow_streamer=None,
    gdn_method: str = "chunk",
    chainflow_settings: SpeculativeSettings | None = None,
    **model_kwargs,
):
    """Speculative generation with a ChainFlow drafter in hf_chainflow's own loop (a batch of more than one row, or
    a left-padded prompt, runs in `hf_chainflow.generation.batch_loop`).

    Args:
        model: the target (`transformers` causal LM; dense or Qwen3.5/Qwen3-Next hybrid).
        drafter: a `ChainFlowDrafter` bound to `model` (`generate` binds an unbound one), or an `OracleDrafter`;
            drafting settings come from `drafter.generation_config` (`draft_mode`, `num_assistant_tokens`,
            `tree_width`, `tree_depth`, `tree_budget`, `num_flow_steps`, and the prompt-lookup branch
            `lookup_num_tokens`, `lookup_ngram`, `lookup_trust_ngram`, `lookup_max_tokens`: see `hf_chainflow.generation.prompt_lookup`;
            the corpus-lookup branch `corpus_lookup_num_tokens`: see `hf_chainflow.generation.corpus_lookup`).
        chainflow_streamer: a transformers streamer (passed as `streamer=` to `generate`).
        gdn_method: hybrid targets' Gated DeltaNet tree back-end, `"chunk"` or `"fork"`.
        chainflow_settings: the call's drafting settings, read and checked by hf_chainflow's `generate` with the
            rest of the call (set by `generate`; without them, the loop reads and checks them itself).

    Returns the sequences `(B, L')`, or a `GenerateDecoderOnlyOutput` with `sequences` when
    `return_dict_in_generate=True`.  Statistics are left in `drafter.last_stats`.
    """
    # 0. Inputs, checked up front.
    if logits_processor is None or stopping_criteria is None or generation_config is None:
        raise ValueError(
            "`speculative_generate` is a `custom_generate` loop: it takes the logits processors, stopping criteria "
            "and generation config that `generate` prepares (max length, EOS, temperature, ...), and called on its "
            "own it would ignore them. Call `target.generate(**inputs, custom_generate=hf_chainflow."
            "speculative_generate, drafter=drafter)` or `target.generate(**inputs, assistant_model=drafter)`."
        )
    if drafter is None:
        raise ValueError("`speculative_generate` needs `drafter=` (a ChainFlowDrafter).")
    settings = chainflow_settings
    if settings is None:  # reached without hf_chainflow's `generate` (which checks the call and passes the settings)
        settings = SpeculativeSettings.from_drafter(drafter, generation_config)
        validate_speculative_call(model, drafter, generation_config, input_ids,
                                  {**model_kwargs, "gdn_method": gdn_method}, own_loop=True)
    mask = model_kwargs.get("attention_mask")
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is None:
        raise ValueError("`speculative_generate` needs the cache that `generate` prepares (use_cache=True).")
    if input_ids.shape[0] > 1 or (mask is not None and not bool(mask.all())):  # a batch, or a left-padded prompt
        return batch_speculative_generate(model, input_ids, logits_processor, stopping_criteria, generation_config,
                                          drafter, settings, cache, attention_mask=mask,
                                          streamer=chainflow_streamer, gdn_method=gdn_method)
    do_sample = settings.do_sample
    max_length = generation_config.max_length
    context_size = drafter.context_size
    layers = getattr(drafter, "state_layers", ())  # fused target layers (`target_layer_ids`); none: final states
    stats = SpeculativeStats(mode=settings.mode, loop="chainflow")
    drafter.last_stats = stats
    streamer = chainflow_streamer
    if streamer is not None:
        streamer.put(input_ids.cpu())

    def stop_now(ids: torch.LongTensor) -> bool:
        return bool(stopping_criteria(ids, None).any())  # generate's criteria: max length, EOS, stop strings, ...

    # 1. Prefill.
    start = time.perf_counter()
    # Logits of the last position only, as `generate` does: a full (L, V) projection of the prompt is wasted work
    # that grows with the prompt.
    out = model(input_ids=input_ids, cache=cache, use_cache=True, output_hidden_states=True, logits_to_keep=1)
    states = select_target_states(out.hidden_states, layers)[:, -context_size:]  # (1, <=C, D or (1 + m) D)
    first = choose_token(_process(logits_processor, input_ids[0], out.logits[0, -1]), do_sample)
    ids = torch.cat([input_ids, input_ids.new_tensor([[first]])], 1)
    stats.prefill_time = time.perf_counter() - start
    if streamer is not None:
        streamer.put(ids[:, -1:].cpu())
    done = stop_now(ids)

    lookup_len = settings.lookup_num_tokens  # grows on fully accepted trusted branches (`lookup_max_tokens`)
    table = drafter.continuation_table if settings.corpus_lookup_num_tokens is not None else None
    while not done:
        # 2. Draft (never past max_length: a round adds accepted + 1 tokens).
        start = time.perf_counter()
        room = max_length - ids.shape[1] - 1
        branches = round_branches(ids[0], room, lookup_len, settings, table)
        lookup, trusted = branches.lookup, branches.trusted
        if room < 1:
            tree = DraftTree.empty(ids.device)
        elif trusted:  # a long match: verify the looked-up branch alone, no drafter pass
            tree = DraftTree.chain(lookup)
        else:
            tree = drafter.draft(states, ids, **settings.draft_kwargs(room))
            if lookup is not None:
                tree = tree.with_chain(lookup)
        if branches.recalled is not None:
            tree = tree.with_chain(branches.recalled)
        stats.record_branches(branches)
        stats.draft_time += time.perf_counter() - start

        # 3. Verify: one target forward over [root] + nodes.
        start = time.perf_counter()
        past_len = ids.shape[1] - 1
        result = verify_forward(model, cache, ids[0, -1], tree, method=gdn_method, state_layers=layers)
        rows = _processed_rows(logits_processor, ids[0], tree, result.logits)  # (n, V)

        # 4. Accept.
        acc = accept_round(tree, rows, do_sample)

        # 5. Emit accepted tokens and the bonus, one at a time through the stopping criteria.
        new_tokens = [int(t) for t in tree.tokens[acc.nodes].tolist()] + [int(acc.bonus)]
        emitted = 0
        for token in new_tokens:
            ids = torch.cat([ids, ids.new_tensor([[token]])], 1)
            emitted += 1
            if stop_now(ids):
                done = True
                break
        if streamer is not None:
            streamer.put(ids[:, -emitted:].cpu())

        if trusted and settings.lookup_max_tokens is not None:  # a copy that held: try a longer one next time
            lookup_len = next_lookup_length(lookup_len, len(acc.nodes), tree.num_nodes,
                                            settings.lookup_num_tokens, settings.lookup_max_tokens)

        # 6. Compact the cache to prefix + root + the accepted nodes that were emitted (all of them unless a stop
        #    came first), so that the cache always holds the sequence but its last token, as after plain `generate`;
        #    roll the committed states forward.
        committed = acc.nodes[: emitted - 1]
        commit(model, cache, past_len, committed, result.handle)
        if not done:
            kept = result.hidden_states[[0] + [i + 1 for i in committed]][None]  # (1, m+1, D)
            states = torch.cat([states, kept.to(states.dtype)], 1)[:, -context_size:]
        stats.verify_time += time.perf_counter() - start
        # A round with an empty draft (one token left before max_length) is still a target forward: it counts in
        # tau with 0 accepted tokens and drafted depth 0 (so per-depth acceptance is unchanged).
        stats.record_round(len(acc.nodes), tree.max_depth)

    stats.new_tokens = ids.shape[1] - input_ids.shape[1]
    if streamer is not None:
        streamer.end()
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=ids, cache=cache)
    return ids


__all__ = ["speculative_generate"]
