"""The proposer interface of hf_chainflow's loop and the extra verify inputs a fused-forward proposer adds (a row's
own inputs scored beside its draft, never seen by it, dropped at commit): at the verification level on tiny dense
targets, and through `generate` with a proposer that adds random extra rows every round (the output stays plain
greedy's); a hybrid target refuses them by name."""

import copy

import pytest
import torch

import hf_chainflow.generation.loop as loop
from hf_chainflow.generation.proposers import Draft, Proposer
from hf_chainflow.generation.tree import DraftTree
from hf_chainflow.generation.verification import (ExtraInputs, RaggedRows, commit_batch, verify_forward,
                                                  verify_forward_batch)
from hf_chainflow.testing import OracleDrafter, tiny_target

import testing_common as common
from _trees import PREFIX_LEN, make_tree, plain, prefilled

ROOT = 17
ATOL = 1e-5


def chain_extra(tree: DraftTree, path: list[int], tokens: list[int]) -> ExtraInputs:
    """Extra inputs continuing `[root] + path` causally: input e sees the root, the path's nodes and extra 0..e."""
    k = len(tokens)
    sees_draft = torch.zeros(k, tree.num_nodes + 1, dtype=torch.bool)
    sees_draft[:, 0] = True
    sees_draft[:, [i + 1 for i in path]] = True
    return ExtraInputs(input_ids=torch.tensor(tokens), positions=len(path) + 1 + torch.arange(k),
                       sees_draft=sees_draft, sees_extra=torch.tril(torch.ones(k, k, dtype=torch.bool)))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_extra_inputs_are_scored_beside_the_draft_and_dropped_at_commit(family):
    model = tiny_target(family)
    tree = make_tree()
    path = tree.path_to(10)  # a root-to-node path of depth 5
    extra = chain_extra(tree, path, [5, 99, 42])
    base = verify_forward(model, copy.deepcopy(cache := prefilled(model)), ROOT, tree)
    rows = RaggedRows([0], [PREFIX_LEN])
    live = copy.deepcopy(cache)
    out = verify_forward_batch(model, live, rows, [ROOT], [tree], extra=[extra])
    n = tree.num_nodes + 1
    assert out.logits.shape[1] == n + 3
    torch.testing.assert_close(out.logits[0, :n], base.logits, atol=ATOL, rtol=0)  # the draft never sees them
    # each extra input is scored as the causal continuation of prefix + root + path
    ref = copy.deepcopy(cache)
    want = plain(model, ref, [ROOT] + tree.tokens[path].tolist() + [5, 99, 42])
    torch.testing.assert_close(out.logits[0, n:], want[-3:], atol=ATOL, rtol=0)
    # commit keeps the root and the accepted path only: the cache is the one a round without extra inputs leaves
    commit_batch(model, live, rows, [path[:2]], out.handle)
    ref = copy.deepcopy(cache)
    plain(model, ref, [ROOT] + tree.tokens[path[:2]].tolist())
    assert live.get_seq_length() == ref.get_seq_length() == PREFIX_LEN + 3
    torch.testing.assert_close(plain(model, live, [7, 8]), plain(model, ref, [7, 8]), atol=ATOL, rtol=0)


def test_extra_inputs_are_checked_and_refused_on_a_hybrid_target():
    with pytest.raises(ValueError, match=r"`ExtraInputs.positions` must have shape \(2,\)"):
        ExtraInputs(torch.tensor([1, 2]), torch.tensor([1]), torch.ones(2, 3, dtype=torch.bool),
                    torch.ones(2, 2, dtype=torch.bool))
    model = tiny_target("llama")
    tree = make_tree()
    bad = ExtraInputs(torch.tensor([1]), torch.tensor([1]), torch.ones(1, 4, dtype=torch.bool),
                      torch.ones(1, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"one column per input of its draft \(\[root\] \+ 12 nodes = 13\), got 4"):
        verify_forward_batch(model, prefilled(model), RaggedRows([0], [PREFIX_LEN]), [ROOT], [tree], extra=[bad])
    hybrid = tiny_target("qwen3_5")
    with pytest.raises(ValueError, match="need an attention-only target: a Gated DeltaNet layer"):
        verify_forward_batch(hybrid, prefilled(hybrid), RaggedRows([0], [PREFIX_LEN]), [ROOT], [tree],
                             extra=[chain_extra(tree, [0], [3])])


class WithExtraRows(Proposer):
    """Wraps a call's proposer: every round, each row also gets 1-4 random extra inputs seeing the root, its first
    drafted branch and each other (a block, bidirectionally); their outputs must come back in `accepted`."""

    def __init__(self, inner, gen):
        self.inner, self.gen, self.seen = inner, gen, []
        self.state_layers = inner.state_layers

    def begin(self, hidden, starts):
        self.inner.begin(hidden, starts)

    def propose(self, rows):
        drafts = self.inner.propose(rows)
        out = []
        for d in drafts:
            k = int(torch.randint(1, 5, (), generator=self.gen))
            sees = torch.zeros(k, d.tree.num_nodes + 1, dtype=torch.bool)
            sees[:, 0] = True
            if d.tree.num_nodes:
                sees[:, 1] = True
            extra = ExtraInputs(torch.randint(3, 256, (k,), generator=self.gen), torch.arange(1, k + 1), sees,
                                torch.ones(k, k, dtype=torch.bool))
            out.append(Draft(d.tree, d.branches, extra))
        return out

    def accepted(self, rows, drafts, counts, extra_out=None):
        self.seen += [(tuple(logits.shape), d.extra.num_inputs) for (logits, _), d in zip(extra_out, drafts)]
        self.inner.accepted(rows, drafts, counts, extra_out)

    def commit(self, rows, kept):
        self.inner.commit(rows, kept)

    def select(self, keep):
        self.inner.select(keep)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_proposer_with_extra_rows_leaves_greedy_output_unchanged(monkeypatch, family):
    target, prompts, refs = common.greedy_setup(family)
    drafter = OracleDrafter(target, error_rate=0.3)
    drafter.generation_config.draft_mode, drafter.generation_config.tree_width = "tree", 3
    gen, made = torch.Generator().manual_seed(0), []
    original = loop.make_proposer

    def make_proposer(*args, **kwargs):
        made.append(WithExtraRows(original(*args, **kwargs), gen))
        return made[-1]

    monkeypatch.setattr(loop, "make_proposer", make_proposer)
    common.assert_equivalent(target, drafter, prompts[1:2], refs[1:2])  # one prompt
    common.assert_equivalent(target, drafter, prompts[2:7], refs[2:7])  # a ragged batch, rows leaving
    assert len(made) == 2 and made[0].seen and all(shape[0] == k for shape, k in made[0].seen + made[1].seen)
