"""The optional prompt-lookup branch: n-gram lookup, merging into a draft tree, lossless generation, refusals.

A tree plus the lookup branch (merged, verified alone, growing) is a column of the equivalence grid
(`tests/test_equivalence_grid.py`, batch 1 and ragged, greedy and sampling); a chain with the branch is checked here.
"""

import pytest
import torch

import hf_chainflow  # noqa: F401  (installs the generate hook)
from hf_chainflow import ChainFlowConfig, ChainFlowDrafter, DraftTree
from hf_chainflow.generation.prompt_lookup import next_lookup_length, prompt_lookup
from hf_chainflow.testing import TINY_FAMILIES, OracleDrafter, tiny_target


def test_prompt_lookup_takes_the_longest_latest_match():
    ids = torch.tensor([5, 6, 7, 8, 9, 5, 6, 1, 2, 5, 6])
    tokens, n = prompt_lookup(ids, num_tokens=3, max_ngram=3)
    assert n == 2 and tokens.tolist() == [1, 2, 5]  # "5 6" last seen at 5..6, followed by 1 2 5
    tokens, n = prompt_lookup(torch.tensor([1, 2, 3, 9, 1, 2, 3]), num_tokens=10, max_ngram=3)
    assert n == 3 and tokens.tolist() == [9, 1, 2, 3]  # the continuation may run up to the last token
    assert prompt_lookup(torch.tensor([1, 2, 3, 4]), num_tokens=3) == (None, 0)
    tokens, n = prompt_lookup(torch.tensor([4, 7, 1, 4]), num_tokens=2, max_ngram=1)
    assert n == 1 and tokens.tolist() == [7, 1]
    with pytest.raises(ValueError, match=r"shape \(L,\), got \(1, 11\); pass `ids\[0\]`"):
        prompt_lookup(ids[None], num_tokens=3)  # a batch of one never matched before: now refused
    for kwargs in (dict(num_tokens=0), dict(num_tokens=2, min_ngram=0), dict(num_tokens=2, max_ngram=1, min_ngram=2)):
        with pytest.raises(ValueError, match="Need 1 <= min_ngram <= max_ngram and num_tokens >= 1"):
            prompt_lookup(ids, **kwargs)


def test_a_round_accepts_between_zero_and_its_depth():
    from hf_chainflow import SpeculativeStats

    stats = SpeculativeStats(mode="chain", loop="chainflow")
    stats.record_round(3, 3)
    for accepted, depth in ((-1, 3), (5, 3)):
        with pytest.raises(ValueError, match="between 0 and its drafted depth"):
            stats.record_round(accepted, depth)
    assert stats.accepted == [3]


def test_next_lookup_length_grows_on_whole_copies_and_shrinks_to_what_held():
    assert next_lookup_length(10, held=10, verified=10, base=10, longest=32) == 20  # accepted whole: double
    assert next_lookup_length(20, held=20, verified=20, base=10, longest=32) == 32  # capped at the longest
    assert next_lookup_length(32, held=25, verified=32, base=10, longest=32) == 26  # in part: what held + 1
    assert next_lookup_length(32, held=3, verified=32, base=10, longest=32) == 10  # never below the base
    assert next_lookup_length(10, held=4, verified=4, base=10, longest=32) == 20  # a short continuation, all taken


def test_with_chain_merges_shared_prefixes_breadth_first():
    tree = DraftTree(tokens=torch.tensor([10, 11, 12, 13]), parents=torch.tensor([-1, -1, 0, 1]),
                     depths=torch.tensor([1, 1, 2, 2]), logprobs=torch.tensor([-0.1, -0.2, -0.3, -0.4]))
    merged = tree.with_chain(torch.tensor([10, 12, 14, 15]))  # follows 10 -> 12, then adds 14, 15
    assert merged.num_nodes == 6
    paths = {tuple(merged.tokens[merged.path_to(i)].tolist()) for i in range(merged.num_nodes)}
    assert (10, 12, 14, 15) in paths and (11, 13) in paths
    assert (merged.depths.diff() >= 0).all() and all(int(merged.parents[i]) < i for i in range(6))
    assert tree.with_chain(torch.tensor([11, 13])) is tree  # nothing new
    added = tree.with_chain(torch.tensor([20]))
    assert added.num_nodes == 5 and added.depths.tolist() == [1, 1, 1, 2, 2]
    assert int(added.tokens[2]) == 20 and float(added.logprobs[2]) == 0.0


@pytest.fixture(scope="module", params=TINY_FAMILIES)
def family_setup(request):
    target = tiny_target(request.param)
    gen = torch.Generator().manual_seed(5)
    prompts = []
    for _ in range(6):  # repeated spans, so that lookups find matches
        span = torch.randint(3, 256, (int(torch.randint(3, 12, (), generator=gen)),), generator=gen)
        prompts.append(torch.cat([span, torch.randint(3, 256, (4,), generator=gen), span])[None])
    refs = [target.generate(p, max_new_tokens=24, do_sample=False) for p in prompts]
    return request.param, target, prompts, refs


@pytest.mark.parametrize("mode,trust,longest", [("chain", None, None)])  # with a tree: the grid's lookup cells
def test_lookup_branch_is_lossless(family_setup, mode, trust, longest):
    family, target, prompts, refs = family_setup
    torch.manual_seed(0)
    random = ChainFlowDrafter(ChainFlowConfig.for_target(target.config, num_blocks=1, path_hidden_size=32,
                                                         markov_rank=16)).eval().bind_target(target)
    for drafter in (random, OracleDrafter(target, error_rate=0.3, seed=3)):
        g = drafter.generation_config
        g.draft_mode, g.tree_width, g.tree_depth, g.num_assistant_tokens = mode, 4, 3, 3
        g.lookup_num_tokens, g.lookup_ngram, g.lookup_trust_ngram, g.lookup_max_tokens = 6, 3, trust, longest
        lookups = trusted = branch = 0
        for prompt, ref in zip(prompts, refs):
            out = target.generate(prompt, max_new_tokens=24, do_sample=False, assistant_model=drafter)
            assert torch.equal(out, ref), (family, mode, trust, type(drafter).__name__)
            assert drafter.last_stats.loop == "chainflow"  # lookup always runs in the own loop
            lookups += drafter.last_stats.lookup_rounds
            trusted += drafter.last_stats.lookup_only_rounds
            branch = max(branch, drafter.last_stats.longest_lookup)
        assert lookups > 0
        assert (trusted > 0) == (trust is not None)
        assert branch >= 1 and (longest is not None or branch <= 6), branch


def test_lookup_refusals():
    target = tiny_target("llama")
    drafter = OracleDrafter(target)
    prompt = torch.randint(3, 256, (1, 8))
    drafter.generation_config.lookup_num_tokens = 0
    with pytest.raises(ValueError, match=r"`drafter.generation_config.lookup_num_tokens` must be a positive integer "
                                         r"or None \(off\), got 0"):
        target.generate(prompt, max_new_tokens=4, assistant_model=drafter)
    drafter.generation_config.lookup_num_tokens, drafter.generation_config.lookup_trust_ngram = 4, 5
    with pytest.raises(ValueError, match=r"generation_config.lookup_trust_ngram` \(5\) cannot exceed `lookup_ngram` \(3\)"):
        target.generate(prompt, max_new_tokens=4, assistant_model=drafter)
    drafter.generation_config.lookup_trust_ngram, drafter.generation_config.lookup_max_tokens = 2, 3
    with pytest.raises(ValueError, match=r"`drafter.generation_config.lookup_max_tokens` \(3\) cannot be smaller than "
                                         r"`lookup_num_tokens` \(4\)"):
        target.generate(prompt, max_new_tokens=4, assistant_model=drafter)
    drafter.generation_config.lookup_trust_ngram, drafter.generation_config.lookup_max_tokens = None, 8
    with pytest.raises(ValueError, match=r"generation_config.lookup_max_tokens` \(8\) needs `lookup_trust_ngram`"):
        target.generate(prompt, max_new_tokens=4, assistant_model=drafter)
    drafter.generation_config.lookup_max_tokens = "8"
    with pytest.raises(ValueError, match=r"`drafter.generation_config.lookup_max_tokens` must be a positive integer "
                                         r"or None \(off\), got '8'"):
        target.generate(prompt, max_new_tokens=4, assistant_model=drafter)


@pytest.mark.parametrize("longest", [None, 16])
def test_trusted_branches_grow_in_the_loop_while_accepted_whole(monkeypatch, longest):
    """With a lookup that always proposes the target's own continuation, every trusted branch is accepted whole:
    the branch doubles 4 -> 8 -> 16 with `lookup_max_tokens=16`, and stays at 4 without it; output unchanged."""
    import hf_chainflow.generation.prompt_lookup as lookup

    target = tiny_target("llama")
    prompt = torch.randint(3, 256, (1, 10), generator=torch.Generator().manual_seed(2))
    ref = target.generate(prompt, max_new_tokens=40, do_sample=False)

    def oracle_lookup(committed, num_tokens, max_ngram=3, min_ngram=1):
        tokens = ref[0, committed.shape[0]: committed.shape[0] + num_tokens]
        return (tokens, max_ngram) if tokens.numel() else (None, 0)

    monkeypatch.setattr(lookup, "prompt_lookup", oracle_lookup)  # what `round_branches` calls
    drafter = OracleDrafter(target)
    g = drafter.generation_config
    g.draft_mode, g.lookup_num_tokens, g.lookup_trust_ngram, g.lookup_max_tokens = "tree", 4, 2, longest
    out = target.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=drafter)
    assert torch.equal(out, ref)
    stats = drafter.last_stats
    assert stats.lookup_only_rounds == stats.rounds  # every round took the looked-up branch alone
    assert stats.longest_lookup == (16 if longest else 4)


def test_draft_tree_fields_are_checked_when_built():
    with pytest.raises(ValueError, match=r"1-D tensors of one length N .*'tokens': \(1, 3\).* pass `tokens\[0\]`"):
        DraftTree.chain(torch.tensor([[3, 4, 5]]))
    with pytest.raises(ValueError, match="1-D tensors of one length N"):
        DraftTree(tokens=torch.tensor([1, 2]), parents=torch.tensor([-1]), depths=torch.tensor([1, 2]),
                  logprobs=torch.zeros(2))
    with pytest.raises(ValueError, match=r"`DraftTree.tokens` must hold integers, got torch.float32"):
        DraftTree.chain(torch.tensor([3.0, 4.0]))
    with pytest.raises(ValueError, match=r"`DraftTree.draft_probs` must have shape \(N=2, V\), got \(3, 10\)"):
        DraftTree.chain(torch.tensor([3, 4]), draft_probs=torch.zeros(3, 10))
    assert DraftTree.chain(torch.tensor([3, 4])).num_nodes == 2
