"""Per-round verification maths: tree/chain scoring, acceptance, commit (dense and hybrid tiny targets)."""

import copy
import functools

import pytest
import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import StaticSlidingWindowLayer

from hf_chainflow.testing import tiny_target
from hf_chainflow.generation.tree import DraftTree
from hf_chainflow.generation.acceptance import Acceptance, accept_greedy, accept_sampling, accept_sampling_tree
from hf_chainflow.generation.verification import (
    ancestor_mask,
    build_verify_inputs,
    commit,
    verify_forward,
)
from _trees import PREFIX_LEN, TREE_PARENTS, make_tree, plain, prefilled  # noqa: F401

ATOL = 1e-4
FAMILIES = ("llama", "qwen3", "qwen3_5")
ATTNS = ("sdpa", "eager")
ROOT = 17




@functools.lru_cache(maxsize=None)
def target(family: str, attn: str = "sdpa"):
    return tiny_target(family, attn_implementation=attn)




def cache_tensors(cache):
    out = []
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None:
            out += [layer.keys, layer.values]
        if hasattr(layer, "conv_states"):
            out += [layer.conv_states[0], layer.recurrent_states[0]]
    return out


# ----------------------------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------------------------
def test_inputs_positions_and_mask():
    tree = make_tree()
    inp = build_verify_inputs(ROOT, tree, past_len=5)
    n = tree.num_nodes + 1
    assert inp.input_ids.tolist() == [[ROOT] + tree.tokens.tolist()]
    assert inp.position_ids.tolist() == [[5] + (5 + tree.depths).tolist()]
    assert inp.attention_mask.shape == (1, 1, n, 5 + n) and inp.attention_mask.dtype == torch.bool
    mask = inp.attention_mask[0, 0]
    assert mask[:, :5].all()  # everyone sees the prefix
    for i in range(tree.num_nodes):
        seen = {j - 1 for j in range(1, n) if mask[i + 1, 5 + j]}
        assert seen == set(tree.path_to(i))  # ancestors and self
        assert mask[i + 1, 5]  # and the root
    assert mask[0, 5:].tolist() == [True] + [False] * tree.num_nodes


def test_mask_formats():
    anc = torch.tensor([[True, False], [True, True]])
    bool_mask = ancestor_mask(anc, 3, "sdpa")
    assert bool_mask.dtype == torch.bool
    additive = ancestor_mask(anc, 3, "eager", torch.bfloat16)
    assert additive.dtype == torch.bfloat16
    assert additive[0, 0, 0, :4].eq(0).all() and additive[0, 0, 0, 4] == torch.finfo(torch.bfloat16).min
    for impl in ("flash_attention_2", "flex_attention", "paged|sdpa"):
        with pytest.raises(ValueError, match="not supported"):
            ancestor_mask(anc, 3, impl)


def test_eager_target_gets_additive_mask():
    model = target("llama", "eager")
    cache, seen = prefilled(model), []
    hook = model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["attention_mask"]), with_kwargs=True)
    try:
        verify_forward(model, cache, ROOT, make_tree())
    finally:
        hook.remove()
    assert seen[0].dtype == torch.float32 and seen[0].min() == torch.finfo(torch.float32).min


def test_invalid_trees():
    good = make_tree()
    bad_parent = DraftTree(tokens=good.tokens, parents=good.parents.clone(), depths=good.depths,
                           logprobs=good.logprobs)
    bad_parent.parents[2] = 5
    with pytest.raises(ValueError, match="parents"):
        build_verify_inputs(ROOT, bad_parent, 0)
    bad_depth = DraftTree(tokens=good.tokens, parents=good.parents, depths=good.depths + 1, logprobs=good.logprobs)
    with pytest.raises(ValueError, match="depths"):
        build_verify_inputs(ROOT, bad_depth, 0)


# ----------------------------------------------------------------------------------------------------------------
# Verify forward: one tree forward == each root-to-node path alone
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("attn", ATTNS)
@pytest.mark.parametrize("family", FAMILIES)
def test_tree_logits_match_paths(family, attn):
    model = target(family, attn)
    cache = prefilled(model)
    tree = make_tree()
    out = verify_forward(model, copy.deepcopy(cache), ROOT, tree)
    n = tree.num_nodes + 1
    assert out.logits.shape == (n, model.config.vocab_size)
    assert out.hidden_states.shape == (n, model.config.hidden_size)
    torch.testing.assert_close(model.lm_head(out.hidden_states), out.logits, atol=1e-5, rtol=0)
    leaves = sorted(set(range(tree.num_nodes)) - set(tree.parents.tolist()))
    for leaf in leaves:  # every node lies on some leaf's path
        path = tree.path_to(leaf)
        ref = plain(model, copy.deepcopy(cache), [ROOT] + tree.tokens[path].tolist())
        torch.testing.assert_close(out.logits[[0] + [i + 1 for i in path]], ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_chain_is_plain_forward(family):
    model = target(family)
    cache = prefilled(model)
    chain = DraftTree.chain(torch.tensor([5, 99, 42, 7, 200]))
    out = verify_forward(model, copy.deepcopy(cache), ROOT, chain)
    ref = plain(model, copy.deepcopy(cache), [ROOT] + chain.tokens.tolist())
    torch.testing.assert_close(out.logits, ref, atol=ATOL, rtol=0)


def test_verify_on_empty_cache():
    """No prefix: the root is the first token (dense target, lazily built DynamicCache)."""
    model = target("llama")
    tree = make_tree()
    out = verify_forward(model, DynamicCache(), ROOT, tree)
    path = tree.path_to(10)
    ref = plain(model, DynamicCache(), [ROOT] + tree.tokens[path].tolist())
    torch.testing.assert_close(out.logits[[0] + [i + 1 for i in path]], ref, atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------------------------------------------
# Commit: cache == plain forward over prefix + root + accepted
# ----------------------------------------------------------------------------------------------------------------
COMMIT_CASES = [("sdpa", [1, 4, 11]), ("sdpa", [0, 2, 5, 9]), ("sdpa", [0]), ("sdpa", []), ("eager", [0, 3, 7])]


@pytest.mark.parametrize(("attn", "accepted"), COMMIT_CASES)  # [0] and [] keep contiguous rows (slice path)
@pytest.mark.parametrize("family", FAMILIES)
def test_commit_matches_plain(family, attn, accepted):
    model = target(family, attn)
    cache = prefilled(model)
    tree = make_tree()
    live = copy.deepcopy(cache)
    out = verify_forward(model, live, ROOT, tree)
    commit(model, live, PREFIX_LEN, accepted, out.handle)
    ref = copy.deepcopy(cache)
    plain(model, ref, [ROOT] + tree.tokens[accepted].tolist())
    assert live.get_seq_length() == PREFIX_LEN + 1 + len(accepted)
    for got, want in zip(cache_tensors(live), cache_tensors(ref), strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    torch.testing.assert_close(plain(model, live, [3, 77]), plain(model, ref, [3, 77]), atol=ATOL, rtol=0)


def test_commit_errors():
    model = target("llama")
    tree = make_tree()
    cache = prefilled(model)
    out = verify_forward(model, cache, ROOT, tree)
    with pytest.raises(ValueError, match="root-to-node path"):
        commit(model, cache, PREFIX_LEN, [1, 2], out.handle)  # node 2 hangs under node 0
    with pytest.raises(ValueError, match="past_len"):
        commit(model, cache, PREFIX_LEN + 1, [1], out.handle)
    commit(model, cache, PREFIX_LEN, [1], out.handle)
    with pytest.raises(ValueError, match="commit exactly once"):
        commit(model, cache, PREFIX_LEN, [1], out.handle)


def offloaded_cache(config) -> DynamicCache:
    """An offloaded `DynamicCache`. Its constructor makes a prefetch `torch.Stream()`, which a CUDA build of torch
    cannot make on a machine without a GPU (torch 2.14.1+cu130 and 2.15.0+cu132 raise); there, a `DynamicCache`
    flagged `offloading` the way that constructor flags it."""
    try:
        return DynamicCache(config=config, offloading=True)
    except RuntimeError:
        cache = DynamicCache(config=config)
        cache.offloading = True
        return cache


def test_unsupported_caches():
    model = target("llama")
    tree = make_tree()
    static = StaticCache(config=model.config, max_cache_len=64)  # compiled verification's cache: plain layers only
    static.layers[0] = StaticSlidingWindowLayer(max_cache_len=64, sliding_window=8)
    with pytest.raises(ValueError, match="Layer 0 of the StaticCache is a StaticSlidingWindowLayer"):
        verify_forward(model, static, ROOT, tree)
    hybrid = target("qwen3_5")
    with pytest.raises(ValueError, match="StaticCache"):  # hybrid targets verify on their dynamic cache only
        verify_forward(hybrid, StaticCache(config=hybrid.config, max_cache_len=64), ROOT, tree)
    with pytest.raises(ValueError, match="offloaded"):
        verify_forward(model, offloaded_cache(model.config), ROOT, tree)
    with pytest.raises(ValueError, match="cache"):
        verify_forward(model, None, ROOT, tree)


# ----------------------------------------------------------------------------------------------------------------
# Greedy acceptance on hand-made logits
# ----------------------------------------------------------------------------------------------------------------
def _logits(argmaxes, vocab=10):
    logits = torch.zeros(len(argmaxes), vocab)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


def test_greedy_chain_full_partial_none():
    chain = DraftTree.chain(torch.tensor([4, 5, 6]))
    assert accept_greedy(chain, _logits([4, 5, 6, 9])) == Acceptance([0, 1, 2], 9)  # full accept + bonus
    assert accept_greedy(chain, _logits([4, 5, 1, 9])) == Acceptance([0, 1], 1)  # partial: bonus = correction
    assert accept_greedy(chain, _logits([3, 5, 6, 9])) == Acceptance([], 3)  # none


def test_greedy_branch_among_siblings():
    # root -> {0: tok 1, 1: tok 2}; 0 -> {2: tok 3}; 1 -> {3: tok 3, 4: tok 4}; 4 -> {5: tok 7}
    tree = DraftTree(tokens=torch.tensor([1, 2, 3, 3, 4, 7]), parents=torch.tensor([-1, -1, 0, 1, 1, 4]),
                     depths=torch.tensor([1, 1, 2, 2, 2, 3]), logprobs=torch.zeros(6))
    # rows: root, n0..n5. Root picks token 2 (node 1); node 1 picks 4 (node 4); node 4 picks 7 (node 5)
    assert accept_greedy(tree, _logits([2, 3, 4, 0, 0, 7, 8])) == Acceptance([1, 4, 5], 8)
    # same tokens but node 1's argmax is 3: the sibling with token 3 (node 3) is taken, a leaf
    assert accept_greedy(tree, _logits([2, 3, 3, 0, 6, 7, 8])) == Acceptance([1, 3], 6)
    with pytest.raises(ValueError, match="logits"):
        accept_greedy(tree, _logits([2, 3]))


# ----------------------------------------------------------------------------------------------------------------
# Rejection sampling (chains)
# ----------------------------------------------------------------------------------------------------------------
P = torch.tensor([[0.30, 0.25, 0.20, 0.15, 0.10, 0.00],
                  [0.05, 0.05, 0.50, 0.10, 0.20, 0.10],
                  [0.40, 0.10, 0.10, 0.10, 0.10, 0.20]])
Q = torch.tensor([[0.05, 0.10, 0.40, 0.05, 0.20, 0.20],
                  [0.30, 0.30, 0.10, 0.10, 0.10, 0.10]])


def _tv(samples, p):
    freq = torch.bincount(torch.tensor(samples), minlength=p.numel()).float() / len(samples)
    return 0.5 * (freq - p).abs().sum().item()


def test_rejection_sampling_emits_target_distribution():
    """Thousands of rounds of a 2-node chain drawn from q: the first and second emitted tokens follow p (TV < 0.04;
    the expected TV from sampling noise alone is ~0.015 at 4000 trials)."""
    torch.manual_seed(0)
    trials = 4000
    first, second, accepted_counts = [], [], [0, 0, 0]
    for _ in range(trials):
        tokens = torch.stack([torch.multinomial(Q[0], 1)[0], torch.multinomial(Q[1], 1)[0]])
        chain = DraftTree.chain(tokens, draft_probs=Q)
        nodes, bonus = accept_sampling(chain, P)
        emitted = tokens[nodes].tolist() + [bonus]
        accepted_counts[len(nodes)] += 1
        first.append(emitted[0])
        if len(emitted) > 1:
            second.append(emitted[1])
    assert _tv(first, P[0]) < 0.04
    assert _tv(second, P[1]) < 0.04  # the token after the first is p_1 (here p does not depend on the prefix)
    # acceptance rate of the first node is sum_x min(p, q) = 0.05+0.10+0.20+0.05+0.10+0 = 0.5
    assert abs(1 - accepted_counts[0] / trials - 0.5) < 0.04


def test_rejection_sampling_edge_cases():
    torch.manual_seed(0)
    chain = DraftTree.chain(torch.tensor([2]), draft_probs=P[:1].clone())
    calls = []

    def probs(i):
        calls.append(i)
        return P[i]

    for _ in range(50):  # p == q: always accepted
        assert accept_sampling(chain, probs).nodes == [0]
    assert set(calls) == {0, 1}
    with pytest.raises(ValueError, match="draft_probs"):
        accept_sampling(DraftTree.chain(torch.tensor([5]), draft_probs=P[:1].clone()), P[:2])  # q[5] == 0
    with pytest.raises(ValueError, match="draft_probs"):
        accept_sampling(DraftTree.chain(torch.tensor([2])), P[:2])
    with pytest.raises(ValueError, match="chains only"):
        accept_sampling(make_tree(), P)


def _sampling_tree() -> tuple[DraftTree, torch.Tensor]:
    """A branching tree over 6 tokens with a repeated sibling, and a target distribution per input `(N + 1, 6)`.

    root -> {2: node 0, 4: node 1, 2: node 2 (repeat)}; node 0 -> {1: node 3, 3: node 4}; node 1 -> {5: node 5};
    node 3 -> {0: node 6}. Each input's row is different, so a walk that reads the wrong row shows."""
    parents = [-1, -1, -1, 0, 0, 1, 3]
    tokens = [2, 4, 2, 1, 3, 5, 0]
    depths = [1, 1, 1, 2, 2, 2, 3]
    tree = DraftTree(tokens=torch.tensor(tokens), parents=torch.tensor(parents), depths=torch.tensor(depths),
                     logprobs=torch.zeros(7))
    probs = torch.tensor([[0.20, 0.05, 0.35, 0.10, 0.20, 0.10],   # root
                          [0.10, 0.50, 0.05, 0.20, 0.05, 0.10],   # after node 0 (token 2)
                          [0.20, 0.10, 0.10, 0.10, 0.00, 0.50],   # after node 1 (token 4)
                          [1 / 6] * 6,                              # after node 2 (never reached: a repeat)
                          [0.50, 0.10, 0.10, 0.10, 0.10, 0.10],   # after node 3
                          [0.05, 0.05, 0.05, 0.05, 0.05, 0.75],   # after node 4
                          [0.10, 0.20, 0.30, 0.40, 0.00, 0.00],   # after node 5
                          [0.00, 0.00, 0.00, 0.00, 0.50, 0.50]])  # after node 6
    return tree, probs


def test_tree_sampling_emits_target_distribution():
    """Fixed proposals, tried child by child: at every input the next emitted token follows that input's row of p
    (TV < 0.04 at >= 1,000 samples each; sampling noise alone gives ~0.02), and a child is accepted with the
    probability of the target's mass the children cover."""
    torch.manual_seed(0)
    tree, probs = _sampling_tree()
    tokens = tree.tokens.tolist()
    rows = {-1: 0, 0: 1, 1: 2, 3: 4}  # inputs checked: root, node 0, node 1, node 3
    after: dict[int, list[int]] = {r: [] for r in rows}
    accepted_at_root = 0
    trials = 8000
    for _ in range(trials):
        nodes, bonus = accept_sampling_tree(tree, probs)
        assert nodes == [] or tree.parents[nodes[0]] == -1
        assert all(tree.parents[b] == a for a, b in zip(nodes, nodes[1:]))  # a root-to-node path
        assert 2 not in nodes  # the repeated sibling is never taken: its token's mass went with node 0
        emitted = [tokens[i] for i in nodes] + [bonus]
        accepted_at_root += bool(nodes)
        for k, node in enumerate([-1] + nodes):
            if node in after:
                after[node].append(emitted[k])
    for node, samples in after.items():
        assert len(samples) >= 1000, (node, len(samples))
        assert _tv(samples, probs[rows[node]]) < 0.04, node
    # covered mass at the root: tokens 2 and 4 -> 0.35 + 0.20
    assert abs(accepted_at_root / trials - 0.55) < 0.03


def test_tree_sampling_needs_no_draft_distribution_and_reads_rows_lazily():
    torch.manual_seed(0)
    tree, probs = _sampling_tree()
    calls = []

    def lazy(i):
        calls.append(i)
        return probs[i]

    for _ in range(200):
        calls.clear()
        nodes, _ = accept_sampling_tree(tree, lazy)
        assert calls == [0] + [i + 1 for i in nodes]  # only the inputs the walk reaches, in order
    certain = probs.clone()
    certain[0] = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 0.0])  # the target must emit 4: node 1, always
    certain[2] = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 1.0])  # then 5: node 5
    assert all(accept_sampling_tree(tree, certain).nodes == [1, 5] for _ in range(50))
    chain = DraftTree.chain(torch.tensor([4, 5]))  # a lookup branch: no draft_probs
    assert accept_sampling_tree(chain, certain[[0, 2, 6]]).nodes == [0, 1]
    with pytest.raises(ValueError, match=r"shape \(num_nodes \+ 1, V\) = \(8, V\)"):
        accept_sampling_tree(tree, probs[:3])


# ----------------------------------------------------------------------------------------------------------------
# End to end: greedy tree speculation == plain greedy decoding
# ----------------------------------------------------------------------------------------------------------------
def _noisy_tree(truth: list[int], seed: int) -> DraftTree:
    """A small tree whose first branch follows `truth` then diverges; the second branch is random."""
    gen = torch.Generator().manual_seed(seed)
    cut = int(torch.randint(0, 4, (), generator=gen))
    main = (truth[:cut] + torch.randint(3, 256, (4,), generator=gen).tolist())[:4]
    other = torch.randint(3, 256, (3,), generator=gen).tolist()
    parents = [-1, 0, 1, 2, -1, 4, 1]
    tokens = main + other[:2] + [other[2]]
    depths = [1, 2, 3, 4, 1, 2, 3]
    return DraftTree(tokens=torch.tensor(tokens), parents=torch.tensor(parents), depths=torch.tensor(depths),
                     logprobs=torch.zeros(7))


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_speculative_greedy_equals_plain_greedy(family):
    model = target(family)
    steps = 16
    # plain greedy reference
    ref_cache = prefilled(model)
    tok, reference = ROOT, []
    for _ in range(steps):
        tok = int(plain(model, ref_cache, [tok])[-1].argmax())
        reference.append(tok)
    # tree speculation, drafts partially right
    cache, root, emitted, rnd = prefilled(model), ROOT, [], 0
    while len(emitted) < steps:
        tree = _noisy_tree(reference[len(emitted):len(emitted) + 4], seed=rnd)
        past_len = cache.get_seq_length()
        out = verify_forward(model, cache, root, tree)
        nodes, bonus = accept_greedy(tree, out.logits)
        commit(model, cache, past_len, nodes, out.handle)
        emitted += tree.tokens[nodes].tolist() + [bonus]
        root, rnd = bonus, rnd + 1
    assert emitted[:steps] == reference
    assert rnd < steps  # some drafts were accepted


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_empty_tree_round(family):
    """A round without drafts (N = 0) scores the root alone; the root may be a 0-d tensor."""
    model = target(family)
    cache = prefilled(model)
    ref = copy.deepcopy(cache)
    empty = DraftTree(tokens=torch.zeros(0, dtype=torch.long), parents=torch.zeros(0, dtype=torch.long),
                      depths=torch.zeros(0, dtype=torch.long), logprobs=torch.zeros(0))
    out = verify_forward(model, cache, torch.tensor(ROOT), empty)
    want = plain(model, ref, [ROOT])
    torch.testing.assert_close(out.logits, want, atol=ATOL, rtol=0)
    acc = accept_greedy(empty, out.logits)
    assert acc == Acceptance([], int(want[0].argmax()))
    commit(model, cache, PREFIX_LEN, acc.nodes, out.handle)
    torch.testing.assert_close(plain(model, cache, [6]), plain(model, ref, [6]), atol=ATOL, rtol=0)
