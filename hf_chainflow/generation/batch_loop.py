"""hf_chainflow's speculative loop for a batch of prompts: every row drafts, is verified and commits its own accepted
length each round (ragged acceptance), in one target forward per round for the whole batch.

`speculative_generate` hands a call over to `batch_speculative_generate` when it holds more than one row or a
left-padded prompt. The phases are those of the single-prompt loop (`hf_chainflow.generation.loop`), per row where the
rows differ:

    1. prefill      the padded batch in one forward (its attention mask, positions counted from each row's start)
    2. draft        one drafter pass for every row still drafting (`drafter.draft_batch`), each row's draft cut to
                    the room it has left; plus each row's prompt- and corpus-lookup branches
    3. verify       one target forward over every row's [root] + nodes (`verify_forward_batch`: each row sees its
                    own committed columns and its ancestors)
    4. accept       per row: greedy path matching or rejection sampling on its own processed logits
    5. emit         per row, one token at a time through the stopping criteria
    6. compact      per row: its root + accepted path moved down to its committed length (`commit_batch`);
                    finished rows leave the batch (`select_rows`)

The output has transformers' shape: `(B, L + longest)`, rows that stopped earlier filled with the pad token, as
plain batched `generate` fills them.
"""

from __future__ import annotations

import time

import torch
from transformers.generation.stopping_criteria import MaxLengthCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from hf_chainflow.generation.batch_verification import RaggedRows, commit_batch, select_rows, verify_forward_batch
from hf_chainflow.generation.prompt_lookup import next_lookup_length, round_branches
from hf_chainflow.generation.settings import check_attention_mask
from hf_chainflow.generation.stats import SpeculativeStats
from hf_chainflow.generation.tree import DraftTree
from hf_chainflow.generation.verification import accept_round, choose_token, process_row, processed_rows, select_target_states


def _cut_to_depth(tree: DraftTree, depth: int) -> DraftTree:
    """The nodes of `tree` at depth <= `depth` (a node's ancestors are shallower, so it stays a tree)."""
    if tree.max_depth <= depth:
        return tree
    return tree._take(torch.nonzero(tree.depths <= depth).flatten())


def _context(states: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows' committed states `(T_b, D)` -> left-padded `(R, T, D)` and mask `(R, T)` (`None` when none is padded)."""
    T = max(s.shape[0] for s in states)
    if all(s.shape[0] == T for s in states):
        return torch.stack(states), None
    out = states[0].new_zeros(len(states), T, states[0].shape[-1])
    mask = torch.zeros(len(states), T, dtype=torch.bool, device=states[0].device)
    for i, s in enumerate(states):
        out[i, T - s.shape[0]:] = s
        mask[i, T - s.shape[0]:] = True
    return out, mask


@torch.no_grad()
def batch_speculative_generate(model, input_ids, logits_processor, stopping_criteria, generation_config, drafter,
                               settings, cache, attention_mask=None, streamer=None, gdn_method: str = "chunk"):
    """The batched own loop (see the module docstring); `speculative_generate`'s arguments, already checked. Returns
    the sequences `(B, L + longest)` or a `GenerateDecoderOnlyOutput` (its `cache` is `None`: rows left the batch
    as they finished, so the cache no longer holds every row)."""
    B, L = input_ids.shape
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    check_attention_mask(input_ids, mask)
    pad = generation_config._pad_token_tensor
    if B > 1 and pad is None and any(not isinstance(c, MaxLengthCriteria) for c in stopping_criteria):
        raise ValueError("Rows of a batch that stop at different lengths (EOS, stop strings, stopping criteria) are "
                         "filled with the pad token, but neither `pad_token_id` nor `eos_token_id` is set: pass "
                         "`pad_token_id=` to `generate`.")
    if streamer is not None and B > 1:
        raise ValueError(f"A streamer takes one sequence; got a batch of {B}. Generate without `streamer`, or one "
                         f"prompt at a time.")
    do_sample, max_length, C = settings.do_sample, generation_config.max_length, drafter.context_size
    layers = getattr(drafter, "state_layers", ())  # fused target layers (`target_layer_ids`); none: final states
    row_stats = [SpeculativeStats(mode=settings.mode, loop="chainflow") for _ in range(B)]
    stats = SpeculativeStats.pooled(row_stats, 0, mode=settings.mode, loop="chainflow")
    drafter.last_stats = stats
    if streamer is not None:
        streamer.put(input_ids.cpu())

    def stop_now(ids: torch.LongTensor) -> bool:
        return bool(stopping_criteria(ids[None], None).any())

    # 1. Prefill: positions count each row's tokens from its first unpadded one, as `generate` counts them.
    start = time.perf_counter()
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                output_hidden_states=True, logits_to_keep=1)
    rows = RaggedRows.from_attention_mask(mask)
    pads = list(rows.starts)  # left padding of each row in the output
    hidden = select_target_states(out.hidden_states, layers)  # (B, L, D or (1 + m) D)
    seqs, states = [], []
    for b in range(B):
        first = choose_token(process_row(logits_processor, input_ids[b], out.logits[b, -1]), do_sample)
        seqs.append(torch.cat([input_ids[b], input_ids.new_tensor([first])]))
        states.append(hidden[b, pads[b]:][-C:])  # (<=C, D)
    stats.prefill_time = time.perf_counter() - start
    if streamer is not None:
        streamer.put(seqs[0][-1:].cpu())
    done = [stop_now(s) for s in seqs]
    active = [b for b in range(B) if not done[b]]  # rows still generating, in the cache's row order
    if active and len(active) < B:
        select_rows(cache, rows, active)
    lookup_len = [settings.lookup_num_tokens] * B
    table = drafter.continuation_table if settings.corpus_lookup_num_tokens is not None else None

    while active:
        # 2. Draft: one drafter pass for the rows that draft (never past a row's max_length).
        start = time.perf_counter()
        trees, lookups, rooms, to_draft = {}, {}, {}, []
        for b in active:
            room = max_length - seqs[b].shape[0] - 1
            branches = round_branches(seqs[b][pads[b]:], room, lookup_len[b], settings, table)
            lookups[b], rooms[b] = branches, room
            if room < 1:
                trees[b] = DraftTree.empty(input_ids.device)
            elif branches.trusted:
                trees[b] = DraftTree.chain(branches.lookup)
            else:
                to_draft.append(b)
            row_stats[b].record_branches(branches)
        if to_draft:
            context, context_mask = _context([states[b] for b in to_draft])
            drafted = drafter.draft_batch(context, [seqs[b][pads[b]:] for b in to_draft], context_mask,
                                          **settings.draft_kwargs(max(rooms[b] for b in to_draft)))
            for b, tree in zip(to_draft, drafted):
                tree = _cut_to_depth(tree, rooms[b])
                trees[b] = tree if lookups[b].lookup is None else tree.with_chain(lookups[b].lookup)
        for b in active:
            if lookups[b].recalled is not None:
                trees[b] = trees[b].with_chain(lookups[b].recalled)
        stats.draft_time += time.perf_counter() - start

        # 3. Verify: one target forward over every active row's [root] + nodes.
        start = time.perf_counter()
        result = verify_forward_batch(model, cache, rows, [int(seqs[b][-1]) for b in active],
                                      [trees[b] for b in active], method=gdn_method, state_layers=layers)
        stats.forwards += 1
        committed_paths, kept_states = [], []
        for i, b in enumerate(active):
            tree = trees[b]
            rows_b = processed_rows(logits_processor, seqs[b], tree, result.logits[i, : tree.num_nodes + 1])

            # 4. Accept (per row, on its own processed logits).
            acc = accept_round(tree, rows_b, do_sample)

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
            if lookups[b].trusted and settings.lookup_max_tokens is not None:
                lookup_len[b] = next_lookup_length(lookup_len[b], len(acc.nodes), tree.num_nodes,
                                                   settings.lookup_num_tokens, settings.lookup_max_tokens)
            committed = acc.nodes[: emitted - 1]
            committed_paths.append(committed)
            kept_states.append(result.hidden_states[i, [0] + [j + 1 for j in committed]])  # (m + 1, D)
            row_stats[b].record_round(len(acc.nodes), tree.max_depth)

        # 6. Compact: each row keeps its root + the accepted nodes it emitted; finished rows leave the batch.
        commit_batch(model, cache, rows, committed_paths, result.handle)
        for b, kept in zip(active, kept_states):
            if not done[b]:
                states[b] = torch.cat([states[b], kept.to(states[b].dtype)])[-C:]
        keep = [i for i, b in enumerate(active) if not done[b]]
        if keep and len(keep) < len(active):
            select_rows(cache, rows, keep)
        active = [active[i] for i in keep]
        stats.verify_time += time.perf_counter() - start

    width = max(s.shape[0] for s in seqs)
    sequences = input_ids.new_full((B, width), 0 if pad is None else int(pad))
    for b, s in enumerate(seqs):
        sequences[b, : s.shape[0]] = s
        row_stats[b].new_tokens = s.shape[0] - L
    pooled = SpeculativeStats.pooled(row_stats, stats.forwards, mode=settings.mode, loop="chainflow",
                                     draft_time=stats.draft_time, verify_time=stats.verify_time,
                                     prefill_time=stats.prefill_time)
    drafter.last_stats = pooled
    if streamer is not None:
        streamer.end()
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences, cache=None)
    return sequences


__all__ = ["batch_speculative_generate"]
