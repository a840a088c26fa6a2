"""hf_chainflow's own speculative decoding loop: one loop over a batch of rows, a single prompt being a batch of one.

It is reached through `target.generate(..., assistant_model=drafter)` when the draft mode, the target or the batch
needs it (see `hf_chainflow.generation.hook`), or directly as transformers' `custom_generate` hook:

    target.generate(**inputs, custom_generate=hf_chainflow.speculative_generate, drafter=drafter)

transformers prepares inputs, the cache, logits processors and stopping criteria; the loop then runs, every row
drafting, being verified and committing its own accepted length each round (ragged acceptance):

    1. prefill      the (left-padded) batch in one forward -> each row's first token (its round-1 root) and states
    2. draft        the proposer: one draft per row still generating (a chain or a tree, plus prompt- and
                    corpus-lookup branches; `hf_chainflow.generation.proposers`), each within the row's room
    3. verify       one target forward over every row's [root] + nodes (`verification.verify_forward_batch`);
                    with `compile_verification`, compiled on a static cache at a bucketed shape
                    (`hf_chainflow.generation.compiled_verification`)
    4. accept       per row, on its own processed logits: greedy path matching, or rejection sampling (a sampled
                    chain against its draft distribution q, any other draft child by child as fixed proposals)
    5. emit         per row, accepted tokens + the target's bonus token, one at a time through the stopping criteria
    6. commit       per row, the cache keeps its root + accepted path (hybrid states of the last accepted node);
                    the proposer keeps their states; finished rows leave the batch

The per-round maths live in `hf_chainflow.generation.verification` and `hf_chainflow.generation.acceptance`; this
module only sequences them. The output has transformers' shape: `(B, L + longest)`, rows that stopped earlier filled
with the pad token, as plain batched `generate` fills them.
"""

from __future__ import annotations

import time

import torch
from transformers import GenerationConfig
from transformers.generation.stopping_criteria import MaxLengthCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from hf_chainflow.generation import acceptance, verification
from hf_chainflow.generation.compiled_verification import make_verifier
from hf_chainflow.generation.proposers import Row, make_proposer
from hf_chainflow.generation.settings import SpeculativeSettings, validate_speculative_call
from hf_chainflow.generation.stats import SpeculativeStats
from hf_chainflow.generation.verification import RaggedRows, select_target_states

__all__ = ["speculative_generate"]


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
    """Speculative generation with a ChainFlow drafter in hf_chainflow's own loop, for one prompt or a batch.

    Args:
        model: the target (`transformers` causal LM; dense or Qwen3.5/Qwen3-Next hybrid).
        drafter: a `ChainFlowDrafter` bound to `model` (`generate` binds an unbound one), or an `OracleDrafter`;
            drafting settings come from `drafter.generation_config` (`draft_mode`, `num_assistant_tokens`,
            `tree_width`, `tree_depth`, `tree_budget`, `num_flow_steps`, and the prompt-lookup branch
            `lookup_num_tokens`, `lookup_ngram`, `lookup_trust_ngram`, `lookup_max_tokens`: see
            `hf_chainflow.generation.prompt_lookup`; the corpus-lookup branch `corpus_lookup_num_tokens`: see
            `hf_chainflow.generation.corpus_lookup`).
        chainflow_streamer: a transformers streamer (passed as `streamer=` to `generate`; one prompt only).
        gdn_method: hybrid targets' Gated DeltaNet tree back-end, `"chunk"` or `"fork"`.
        chainflow_settings: the call's drafting settings, read and checked by hf_chainflow's `generate` with the
            rest of the call (set by `generate`; without them, the loop reads and checks the call itself).

    Returns the sequences `(B, L')`, or a `GenerateDecoderOnlyOutput` with `sequences` (and, for one unpadded
    prompt, the `cache`: a batch's rows leave it as they finish; a `StaticCache` with compiled verification) when
    `return_dict_in_generate=True`. Statistics are left in `drafter.last_stats`.
    """
    # 0. Inputs: the call is checked once, by `generate` (or here when the loop is called without it).
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
                                  {**model_kwargs, "gdn_method": gdn_method, "streamer": chainflow_streamer},
                                  own_loop=True)
    mask = model_kwargs.get("attention_mask")
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is None:
        raise ValueError("`speculative_generate` needs the cache that `generate` prepares (use_cache=True).")
    B, L = input_ids.shape
    padded = mask is not None and not bool(mask.all())
    single = B == 1 and not padded  # one unpadded prompt: its cache stays whole, its stats are the row's own
    pad = generation_config._pad_token_tensor
    if B > 1 and pad is None and any(not isinstance(c, MaxLengthCriteria) for c in stopping_criteria):
        raise ValueError("Rows of a batch that stop at different lengths (EOS, stop strings, stopping criteria) are "
                         "filled with the pad token, but neither `pad_token_id` nor `eos_token_id` is set: pass "
                         "`pad_token_id=` to `generate`.")
    do_sample, max_length = settings.do_sample, generation_config.max_length
    verifier = make_verifier(model, settings.compile_verification)
    cache = verifier.cache_for(model, cache, B, max_length)  # a StaticCache when compiled
    proposer = make_proposer(drafter, settings, single)
    row_stats = [SpeculativeStats(mode=settings.mode, loop="chainflow") for _ in range(B)]
    stats = SpeculativeStats(mode=settings.mode, loop="chainflow")  # the call's times
    drafter.last_stats = row_stats[0] if single else SpeculativeStats.pooled(row_stats, 0, mode=settings.mode,
                                                                             loop="chainflow")
    streamer = chainflow_streamer
    if streamer is not None:
        streamer.put(input_ids.cpu())

    def stop_now(ids: torch.LongTensor) -> bool:  # generate's criteria: max length, EOS, stop strings, ...
        return bool(stopping_criteria(ids[None], None).any())

    # 1. Prefill: a padded batch counts each row's positions from its first token, as `generate` does; logits of
    #    the last position only (a full (L, V) projection of the prompt is wasted work).
    start = time.perf_counter()
    padding = {}
    if padded:
        padding = {"attention_mask": mask, "position_ids": (mask.long().cumsum(-1) - 1).clamp(min=0)}
    out = model(input_ids=input_ids, cache=cache, use_cache=True, output_hidden_states=True, logits_to_keep=1,
                **padding)
    rows = RaggedRows.from_attention_mask(torch.ones_like(input_ids) if mask is None else mask)
    pads = list(rows.starts)  # left padding of each row in the output
    proposer.begin(select_target_states(out.hidden_states, proposer.state_layers), pads)  # (B, L, D')
    seqs = []
    for b in range(B):
        row = acceptance.process_row(logits_processor, input_ids[b], out.logits[b, -1])
        seqs.append(torch.cat([input_ids[b], input_ids.new_tensor([acceptance.choose_token(row, do_sample)])]))
    stats.prefill_time = time.perf_counter() - start
    if streamer is not None:
        streamer.put(seqs[0][-1:].cpu())
    done = [stop_now(s) for s in seqs]
    active = [b for b in range(B) if not done[b]]  # rows still generating, in the cache's row order
    if active and len(active) < B:
        verification.select_rows(cache, rows, active)
        proposer.select(active)

    while active:
        # 2. Draft: one draft per active row, never past its max_length (a round adds accepted + 1 tokens).
        start = time.perf_counter()
        round_rows = [Row(b, seqs[b][pads[b]:], max_length - seqs[b].shape[0] - 1) for b in active]
        drafts = proposer.propose(round_rows)
        for r, d in zip(round_rows, drafts):
            row_stats[r.index].record_branches(d.branches)
        stats.draft_time += time.perf_counter() - start

        # 3. Verify: one target forward over every active row's [root] + nodes.
        start = time.perf_counter()
        trees = [d.tree for d in drafts]
        extra = [d.extra for d in drafts] if any(d.extra is not None for d in drafts) else None
        result = verification.verify_forward_batch(model, cache, rows, [int(seqs[b][-1]) for b in active], trees,
                                                   method=gdn_method, state_layers=proposer.state_layers,
                                                   extra=extra, compiled=verifier.for_round(),
                                                   around_forward=proposer.forward_context(drafts))
        stats.forwards += 1
        paths, counts, kept = [], [], []
        for i, b in enumerate(active):
            tree = trees[i]
            processed = acceptance.processed_rows(logits_processor, seqs[b], tree,
                                                  result.logits[i, : tree.num_nodes + 1])

            # 4. Accept (per row, on its own processed logits).
            acc = acceptance.accept_round(tree, processed, do_sample)

            # 5. Emit, one token at a time through the stopping criteria.
            new_tokens = [int(t) for t in tree.tokens[acc.nodes].tolist()] + [int(acc.bonus)]
            emitted = 0
            for token in new_tokens:
                seqs[b] = torch.cat([seqs[b], seqs[b].new_tensor([token])])
                emitted += 1
                if stop_now(seqs[b]):
                    done[b] = True
                    break
            if streamer is not None:
                streamer.put(seqs[b][-emitted:].cpu())
            # The cache keeps the root + the accepted nodes that were emitted (all of them unless a stop came
            # first), so that it always holds the sequence but its last token, as after plain `generate`. A round
            # with an empty draft (one token left before max_length) is still a target forward: it counts in tau
            # with 0 accepted tokens and drafted depth 0 (so per-depth acceptance is unchanged).
            paths.append(acc.nodes[: emitted - 1])
            counts.append(len(acc.nodes))
            kept.append(result.hidden_states[i, [0] + [j + 1 for j in paths[-1]]])  # (m + 1, D')
            row_stats[b].record_round(len(acc.nodes), tree.max_depth)
        extra_out = None
        if extra is not None:  # a fused-forward proposer's own rows: after the largest draft's inputs
            n = result.handle.extra_start
            extra_out = [None if e is None else (result.logits[i, n : n + e.num_inputs],
                                                 result.hidden_states[i, n : n + e.num_inputs])
                         for i, e in enumerate(extra)]
        proposer.accepted(round_rows, drafts, counts, extra_out)

        # 6. Commit: each row keeps its root + accepted path, the proposer their states; finished rows leave.
        verification.commit_batch(model, cache, rows, paths, result.handle)
        proposer.commit(round_rows, kept)
        keep = [i for i, b in enumerate(active) if not done[b]]
        if keep and len(keep) < len(active):
            verification.select_rows(cache, rows, keep)
            proposer.select(keep)
        active = [active[i] for i in keep]
        stats.verify_time += time.perf_counter() - start

    # 7. Output: transformers' shape, rows that stopped earlier filled with the pad token.
    width = max(s.shape[0] for s in seqs)
    sequences = input_ids.new_full((B, width), 0 if pad is None else int(pad))
    for b, s in enumerate(seqs):
        sequences[b, : s.shape[0]] = s
        row_stats[b].new_tokens = s.shape[0] - L
    times = {"draft_time": stats.draft_time, "verify_time": stats.verify_time, "prefill_time": stats.prefill_time,
             **verifier.stats_fields(), "auto_budgets": proposer.chosen_budgets()}
    if single:
        for name, value in times.items():
            setattr(row_stats[0], name, value)
        drafter.last_stats = row_stats[0]
    else:
        drafter.last_stats = SpeculativeStats.pooled(row_stats, stats.forwards, mode=settings.mode,
                                                     loop="chainflow", **times)
    if streamer is not None:
        streamer.end()
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences, cache=cache if single else None)
    return sequences
