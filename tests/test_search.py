"""The candidate search (`hf_chainflow.generation.search`) against a plain reference: one window, one beam level at a time.

`reference_search` below is the search as it was written before it was batched (one window, `index_select` on
the candidate rows, Python ranking of the budget cut): the batched search must give the same drafts bit for bit,
tokens, parents, depths, log-probabilities and sampled distributions, for every kind of drafter (folded or
term-by-term feedback, shortlist, candidate budget, bf16 or float32 head rows), chains and trees, with and without a
budget cut, and over many windows.  Batches of windows give each window's own draft.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_chainflow import ChainFlowDrafter, DraftTree
from hf_chainflow.generation import drafting, serving
from hf_chainflow.generation.search import candidate_search
from hf_chainflow.generation.settings import SearchSettings
from hf_chainflow.testing import tiny_target

from _windows import one_thread, tiny_drafter_config


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    with one_thread():
        yield


# ------------------------------------------------------------------------------------------------ the reference
@torch.no_grad()
def reference_search(drafter, states, committed, *, mode="chain", num_tokens=3, tree_width=8, tree_depth=4,
                     tree_budget=None, do_sample=False, temperature=1.0) -> DraftTree:
    """One window: predicted states `(K, D)`, committed tokens `(L,)` (last = root) -> its `DraftTree`."""
    cfg = drafter.config
    p = cfg.path_order
    depth_needed = num_tokens if mode == "chain" else tree_depth
    full = serving.serving_head_weight(drafter)  # (S, D)
    scores = F.linear(states[:depth_needed].to(full.dtype), full).float()  # (d, S)
    if full.shape[0] <= cfg.candidate_budget:
        rows, head = None, scores
    else:
        rows = scores.max(0).values.topk(cfg.candidate_budget).indices  # (M,)
        head = scores.index_select(1, rows)  # (d, M)
    folded = serving.serving_feedback_weight(drafter)
    if folded is not None:
        fused, fused_bias = folded
    else:
        weight = full if rows is None else full[rows]
        markov_u2 = None
        if drafter.markov_head is not None and rows is not None:
            markov_u2 = drafter.markov_head.u2[rows]
    tail = committed[-p:]
    if tail.shape[0] < p:
        tail = torch.cat([tail.new_full((p - tail.shape[0],), cfg.pad_token_id or 0), tail])
    width, branching, depth = (1, 1, num_tokens) if mode == "chain" else (
        tree_width, min(cfg.tree_branching, tree_width), tree_depth)
    beams = tail[None]  # (1, p)
    beam_score = states.new_zeros(1)
    beam_node = torch.full((1,), -1, dtype=torch.long)
    tokens, parents, depths, logps, qs = [], [], [], [], []
    n_nodes = 0
    for d in range(depth):
        n = beams.shape[0]
        if folded is not None:
            feats = []
            if drafter.path_head is not None:
                feats.append(drafter.path_head.hidden(drafter._embed(beams), states[d].expand(n, -1)))
            if drafter.markov_head is not None:
                feats.append(drafter.markov_head.u1(drafter._token_to_draft_index(beams[:, -1])))
            logits = F.linear(torch.cat(feats, -1).to(fused.dtype), fused).float() + fused_bias  # (n, S)
            if rows is not None:
                logits = logits.index_select(1, rows)
            logits = logits + head[d]
        else:
            logits = drafter.feedback_logits(states[d].expand(n, -1), beams, weight, markov_u2,
                                             head_logits=head[d].expand(n, -1))
        if do_sample:
            q = torch.softmax(logits.float() / temperature, -1)  # (1, M)
            choice = torch.multinomial(q, 1)
            logp = q.gather(1, choice).log()
            qs.append(q[0])
        else:
            logp, choice = torch.log_softmax(logits.float(), -1).topk(branching, -1)  # (n, b)
        cum = (beam_score[:, None] + logp).reshape(-1)
        keep = cum.topk(min(width, cum.shape[0])).indices
        src = keep // choice.shape[1]
        idx = choice.reshape(-1)[keep]
        tok = drafter._draft_index_to_token(idx if rows is None else rows[idx])
        tokens.append(tok)
        parents.append(beam_node[src])
        depths.append(torch.full_like(tok, d + 1))
        logps.append(logp.reshape(-1)[keep])
        beam_node = torch.arange(n_nodes, n_nodes + tok.shape[0])
        n_nodes += tok.shape[0]
        beams = torch.cat([beams[src, 1:], tok[:, None]], 1)
        beam_score = cum[keep]
    draft_probs = None
    if do_sample:
        q_rows = torch.stack(qs)
        ids = drafter._draft_index_to_token(rows if rows is not None else torch.arange(q_rows.shape[1]))
        draft_probs = q_rows.new_zeros(q_rows.shape[0], cfg.vocab_size).index_copy_(1, ids, q_rows)
    tree = DraftTree(tokens=torch.cat(tokens), parents=torch.cat(parents), depths=torch.cat(depths),
                     logprobs=torch.cat(logps), draft_probs=draft_probs)
    if mode != "tree" or tree_budget is None or tree_budget >= tree.num_nodes:
        return tree
    cum = tree.logprobs.tolist()  # the budget cut: path log-probability summed in Python, ties breadth-first
    for i, parent in enumerate(tree.parents.tolist()):
        if parent >= 0:
            cum[i] += cum[parent]
    order = torch.sort(torch.tensor(cum, dtype=tree.logprobs.dtype), descending=True, stable=True).indices
    index = order[:tree_budget].sort().values
    remap = {int(old): new for new, old in enumerate(index)}
    return DraftTree(tokens=tree.tokens[index], parents=torch.tensor([remap.get(int(q), -1) for q in
                                                                      tree.parents[index]]),
                     depths=tree.depths[index], logprobs=tree.logprobs[index])


# ------------------------------------------------------------------------------------------------ the drafters
class _Wrapped(nn.Linear):
    """Not a plain `nn.Linear` (as a LoRA layer is not): the search evaluates Eq. 3 term by term."""


VARIANTS = {
    "folded": dict(),
    "folded-float32-rows": dict(serving_head_dtype="float32"),
    "shortlist-candidates": dict(shortlist=list(range(3, 200)), candidate_budget=24, tree_branching=3),
    "candidates": dict(candidate_budget=40, path_order=3),
    "markov-only": dict(feedback="markov", candidate_budget=30),
    "no-feedback": dict(feedback="none", candidate_budget=30),
    "term-by-term": dict(candidate_budget=30, _wrap=True),
    "term-by-term-all-rows": dict(_wrap=True, shortlist=list(range(10, 120))),
}


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", num_layers=2)


def make_drafter(target, name):
    overrides = dict(VARIANTS[name])
    wrap = overrides.pop("_wrap", False)
    torch.manual_seed(0)
    drafter = ChainFlowDrafter(tiny_drafter_config(target, **overrides)).bind_target(target).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the feedback output layers start at zero: give them weight so every term matters
        for module in (drafter.path_head, drafter.markov_head):
            for param in (module.parameters() if module is not None else ()):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    if wrap:
        out = drafter.path_head.out
        wrapped = _Wrapped(out.in_features, out.out_features)
        wrapped.load_state_dict(out.state_dict())
        drafter.path_head.out = wrapped
        assert serving.serving_feedback_weight(drafter) is None
    return drafter


def windows(drafter, n, seed):
    """`n` windows: predicted states `(K, D)` (spread wide: the heads see many candidates) and committed tokens of
    varied lengths (some shorter than `path_order`, so the tail is padded)."""
    gen = torch.Generator().manual_seed(seed)
    K, D, V = drafter.config.num_draft_positions, drafter.config.target_hidden_size, drafter.config.vocab_size
    out = []
    for i in range(n):
        states = torch.randn(K, D, generator=gen) * 3.0
        committed = torch.randint(3, V, (1 + (5 * i) % 13,), generator=gen)
        out.append((states, committed))
    return out


SHAPES = [
    dict(mode="chain", num_tokens=1), dict(mode="chain", num_tokens=4), dict(mode="chain", num_tokens=8),
    dict(mode="tree", tree_width=1, tree_depth=3), dict(mode="tree", tree_width=5, tree_depth=4),
    dict(mode="tree", tree_width=8, tree_depth=8), dict(mode="tree", tree_width=5, tree_depth=4, tree_budget=7),
    dict(mode="tree", tree_width=8, tree_depth=4, tree_budget=12), dict(mode="tree", tree_width=3, tree_depth=2,
                                                                         tree_budget=100),
]


def assert_same_tree(got: DraftTree, want: DraftTree, where):
    for name in ("tokens", "parents", "depths", "logprobs"):
        assert torch.equal(getattr(got, name), getattr(want, name)), (where, name, getattr(got, name),
                                                                     getattr(want, name))
    assert (got.draft_probs is None) == (want.draft_probs is None), where
    if want.draft_probs is not None:
        assert torch.equal(got.draft_probs, want.draft_probs), where


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_the_search_equals_the_reference_on_every_window(target, name):
    drafter = make_drafter(target, name)
    for w, (states, committed) in enumerate(windows(drafter, 12, seed=len(name))):
        for shape in SHAPES:
            want = reference_search(drafter, states, committed, **shape)
            assert_same_tree(drafting.search(drafter, states, committed, **shape), want, (name, w, shape))
        for temperature in (1.0, 0.7):  # sampled chains: the same draws from the same generator state
            torch.manual_seed(100 + w)
            want = reference_search(drafter, states, committed, mode="chain", num_tokens=5, do_sample=True,
                                    temperature=temperature)
            torch.manual_seed(100 + w)
            got = drafting.search(drafter, states, committed, mode="chain", num_tokens=5, do_sample=True,
                                 temperature=temperature)
            assert_same_tree(got, want, (name, w, "sampled", temperature))


@pytest.mark.parametrize("name", ["folded", "shortlist-candidates", "term-by-term"])
def test_a_batch_of_windows_drafts_what_each_window_drafts_alone(target, name):
    drafter = make_drafter(target, name)
    data = windows(drafter, 9, seed=7)
    states = torch.stack([s for s, _ in data])  # (B, K, D)
    p = drafter.config.path_order
    committed = torch.stack([torch.cat([c.new_zeros(max(0, p - c.shape[0])), c])[-p:] for _, c in data])  # (B, p)
    for shape in SHAPES:
        settings = SearchSettings(**shape, max_depth=drafter.max_draft_depth)
        batch = candidate_search(drafter, states, committed, settings)
        N = batch.tokens.shape[1]
        assert batch.tokens.shape == batch.parents.shape == batch.depths.shape == batch.logprobs.shape == (9, N)
        for i, (s, c) in enumerate(data):
            want = reference_search(drafter, s, c, **shape)
            got = batch.tree(i)
            # one GEMM over the batch may round apart from one per window: the same tokens, near log-probabilities
            for field in ("tokens", "parents", "depths"):
                assert torch.equal(getattr(got, field), getattr(want, field)), (name, i, shape, field)
            torch.testing.assert_close(got.logprobs, want.logprobs, rtol=1e-4, atol=1e-4)


def test_level_sizes_are_known_before_the_search():
    from hf_chainflow.generation.search import level_sizes

    assert level_sizes(SearchSettings(mode="chain", num_tokens=3), branching=8) == [1, 1, 1]
    assert level_sizes(SearchSettings(mode="tree", tree_width=8, tree_depth=4), branching=3) == [3, 8, 8, 8]
    assert level_sizes(SearchSettings(mode="tree", tree_width=5, tree_depth=3), branching=8) == [5, 5, 5]
    assert level_sizes(SearchSettings(mode="tree", tree_width=16, tree_depth=3), branching=2) == [2, 4, 8]
