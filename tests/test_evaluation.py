"""Offline acceptance: accounting by hand, batched chains == the serving call, tree acceptance, report files, and the
serving walk (by hand, on a truth-copying drafter, and equal to a walk over per-window accepted lengths)."""

import json

import numpy as np
import pytest
import torch

from hf_chainflow import ChainFlowDrafter, DraftTree
from hf_chainflow.training.evaluation import (
    accepted_lengths,
    draft_batch,
    draft_chains,
    evaluate_offline,
    evaluate_walk,
    paired_walk_difference,
    resampled_walk_taus,
    reference_chain,
    sequence_walks,
    strict_json,
    summarize,
    tree_accepted_length,
    tree_accepted_lengths,
    tree_matching_path,
    walk_rounds,
)
from hf_chainflow.generation import drafting
from hf_chainflow.generation.search import DraftBatch
from hf_chainflow.generation.settings import SearchSettings
from hf_chainflow.testing import tiny_target

from _windows import greedy_sequences, make_windows, one_thread, tiny_drafter_config


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    with one_thread():
        yield


def test_accepted_lengths_and_conditional_acceptance_by_hand():
    drafts = torch.tensor([[5, 6, 7], [5, 9, 7], [1, 6, 7], [5, 6, 7]])
    targets = torch.tensor([[5, 6, 7, 0], [5, 6, 7, 0], [5, 6, 7, 0], [5, 6, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]]).bool()
    acc = accepted_lengths(drafts, targets, mask)
    assert acc.tolist() == [3, 1, 0, 2]  # last window: position 3 lies past the response end
    s = summarize(acc.numpy(), mask[:, :3].numpy(), 3)
    assert s["tau"] == pytest.approx(1 + 6 / 4)
    # acc@1 = 3/4; acc@2: 3 reached, 2 passed; acc@3: 2 reached position 3 but one of them has no position 3
    assert s["acceptance"] == pytest.approx([3 / 4, 2 / 3, 1 / 1])
    assert s["reached_counts"] == [4, 3, 1] and s["accepted_counts"] == [3, 2, 1]


def test_tree_accepts_the_longest_matching_root_path():
    #        root
    #      /      \
    #   0:a(5)   1:b(6)
    #    |         |
    #  2:(7)     3:(8)
    #              |
    #            4:(9)
    tree = DraftTree(tokens=torch.tensor([5, 6, 7, 8, 9]), parents=torch.tensor([-1, -1, 0, 1, 3]),
                     depths=torch.tensor([1, 1, 2, 2, 3]), logprobs=torch.zeros(5))
    ones = torch.ones(4, dtype=torch.bool)
    assert tree_accepted_length(tree, torch.tensor([6, 8, 9, 1]), ones) == 3
    assert tree_accepted_length(tree, torch.tensor([6, 8, 9, 1]), torch.tensor([1, 1, 0, 0]).bool()) == 2
    assert tree_accepted_length(tree, torch.tensor([5, 8, 9, 1]), ones) == 1  # 8 hangs under 6, not under 5
    assert tree_accepted_length(tree, torch.tensor([7, 5, 6, 7]), ones) == 0
    assert tree_matching_path(tree, torch.tensor([6, 8, 9, 1]), ones) == [1, 3, 4]
    assert tree_matching_path(tree, torch.tensor([7, 5, 6, 7]), ones) == []
    # the batched count agrees, window by window, with the per-tree one (a chain is a tree too)
    targets = torch.tensor([[6, 8, 9, 1], [6, 8, 9, 1], [5, 8, 9, 1], [7, 5, 6, 7], [5, 7, 1, 1]])
    masks = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]]).bool()
    batch = DraftBatch(**{k: getattr(tree, k).expand(5, -1) for k in ("tokens", "parents", "depths", "logprobs")})
    assert tree_accepted_lengths(batch, targets, masks).tolist() == [3, 2, 1, 0, 2]
    chain = DraftTree.chain(torch.tensor([5, 7, 1]))
    chains = DraftBatch(**{k: getattr(chain, k).expand(5, -1) for k in ("tokens", "parents", "depths", "logprobs")})
    assert tree_accepted_lengths(chains, targets, masks).tolist() == accepted_lengths(
        chains.tokens, targets, masks).tolist() == [0, 0, 1, 0, 3]


@pytest.fixture(scope="module")
def setup():
    target = tiny_target("llama", num_layers=2)
    windows = make_windows(target, greedy_sequences(target, num_seqs=2, length=20, seed=3))
    torch.manual_seed(0)
    drafter = ChainFlowDrafter(tiny_drafter_config(target)).bind_target(target).eval()
    with torch.no_grad():  # the feedback heads start at zero: give them weight so every term of Eq. 3 matters
        drafter.path_head.out.weight.normal_(std=0.5)
        drafter.markov_head.u2.normal_(std=0.5)
    return target, windows, drafter


@pytest.mark.parametrize("budget", [8192, 24])  # every row a candidate; a real two-pass candidate set
def test_batched_chains_equal_the_serving_call(setup, budget):
    target, windows, drafter = setup
    drafter.config.candidate_budget = budget
    batch = {k: torch.stack([w[k] for w in windows]) for k in windows[0]}
    batched = draft_chains(drafter, batch["context_states"], batch["context_mask"], batch["prev_tokens"][:, :8], 4)
    reference = torch.stack([reference_chain(drafter, w, 4) for w in windows])
    assert batched.shape == (len(windows), 4)
    assert torch.equal(batched, reference)
    assert len(set(map(tuple, batched.tolist()))) > 5  # the chains actually differ between windows
    drafter.config.candidate_budget = 8192


@pytest.mark.parametrize("budget", [None, 5])
def test_batched_trees_equal_the_serving_call(setup, budget):
    """The batched tree evaluation drafts each window's serving tree: the same nodes, the same accepted length."""
    target, windows, drafter = setup
    drafter.config.candidate_budget = 24
    try:
        batch = {k: torch.stack([w[k] for w in windows]) for k in windows[0]}
        settings = SearchSettings(mode="tree", tree_width=4, tree_depth=3, tree_budget=budget, max_depth=8)
        drafts = draft_batch(drafter, batch["context_states"], batch["context_mask"], batch["prev_tokens"][:, :8],
                             settings)
        lengths = tree_accepted_lengths(drafts, batch["target_tokens"], batch["target_mask"])
        for i, w in enumerate(windows):
            states = w["context_states"][w["context_mask"]][None]
            serving = drafting.draft(drafter, states, w["prev_tokens"][None, :8], **settings.draft_kwargs())
            assert torch.equal(drafts.tree(i).tokens, serving.tokens), i
            assert torch.equal(drafts.tree(i).parents, serving.parents), i
            assert int(lengths[i]) == tree_accepted_length(serving, w["target_tokens"], w["target_mask"]), i
        assert drafts.tokens.shape == (len(windows), 12 if budget is None else budget)
        assert 0 < int(lengths.sum()) and len(set(lengths.tolist())) > 1  # windows accept different lengths
    finally:
        drafter.config.candidate_budget = 8192


def test_evaluate_offline_reports_and_paths_agree(setup, tmp_path):
    target, windows, drafter = setup
    fast = evaluate_offline(drafter, windows, num_tokens=3, batch_size=16, tree=(4, 3), output_dir=tmp_path,
                            progress=False)
    slow = evaluate_offline(drafter, windows, num_tokens=3, tree=(4, 3), batched=False, progress=False)
    assert fast["tau"] == slow["tau"] and fast["acceptance"] == pytest.approx(slow["acceptance"], nan_ok=True)
    assert strict_json(fast["tree"]) == strict_json(slow["tree"])  # trees too: batched drafts are the serving call's
    assert fast["num_windows"] == len(windows) and set(fast["per_domain"]) == {"0", "1"}
    assert sum(d["num_windows"] for d in fast["per_domain"].values()) == len(windows)
    assert 1.0 <= fast["tau"] <= 4.0 and fast["tree"]["shape"] == [4, 3] and 1.0 <= fast["tree"]["tau"] <= 4.0
    saved = json.loads((tmp_path / "offline_eval.json").read_text())
    assert saved["tau"] == fast["tau"]
    assert (tmp_path / "acceptance.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="num_assistant_tokens"):
        evaluate_offline(drafter, windows, num_tokens=9, progress=False)


def test_a_drafter_that_copies_the_truth_reaches_full_acceptance(setup, monkeypatch):
    """The accounting end to end: drafts equal to the target's tokens give tau = 1 + k (where positions exist)."""
    target, windows, drafter = setup
    import hf_chainflow.training.evaluation as ev

    tokens = torch.stack([w["target_tokens"][:3] for w in windows])  # (B, 3)
    chain = dict(parents=torch.arange(-1, 2).expand_as(tokens), depths=torch.arange(1, 4).expand_as(tokens),
                 logprobs=torch.zeros(tokens.shape))
    truth = iter([ev.DraftBatch(tokens=tokens, **chain)])
    monkeypatch.setattr(ev, "draft_batch", lambda *a, **k: next(truth))
    out = evaluate_offline(drafter, windows, num_tokens=3, batch_size=len(windows), progress=False)
    valid = np.stack([w["target_mask"][:3].numpy() for w in windows])
    assert out["tau"] == pytest.approx(1 + valid.sum(1).mean())
    assert out["acceptance"] == [1.0, 1.0, 1.0]


class _Responses(list):
    """`make_windows` output with the response/anchor bookkeeping of `ChainFlowWindowDataset` (`seq_of`, `anchor`)."""

    def __init__(self, windows, num_seqs):
        super().__init__(windows)
        per = len(windows) // num_seqs  # make_windows: response s, then anchors 0..L-3
        self.seq_of = np.repeat(np.arange(num_seqs), per)
        self.anchor = np.tile(np.arange(per), num_seqs)


def test_walk_rounds_jump_past_what_each_round_commits():
    lengths = {0: 2, 3: 0, 4: 1, 6: 3}  # any other anchor is never visited
    visited = []

    def accepted_at(i):
        visited.append(i)
        return lengths[i]

    assert walk_rounds(accepted_at, 7) == [2, 0, 1, 3]  # a round at i accepting a commits a + 1: next round i + a + 1
    assert visited == [0, 3, 4, 6]
    assert walk_rounds(accepted_at, 0) == []
    with pytest.raises(ValueError, match="at least 0"):
        walk_rounds(lambda i: -1, 3)


def test_sequence_walks_orders_anchors_and_needs_all_of_them():
    class Fake(list):
        seq_of = np.array([1, 0, 1, 0, 1])
        anchor = np.array([5, 3, 4, 4, 6])

    walks = sequence_walks(Fake([0] * 5))
    assert [w.tolist() for w in walks] == [[1, 3], [2, 0, 4]]
    Fake.anchor = np.array([5, 3, 4, 4, 7])  # response 1 lacks anchor 6
    with pytest.raises(ValueError, match="Response 1 .* lacks some anchors"):
        sequence_walks(Fake([0] * 5))
    with pytest.raises(ValueError, match="records each window's response and anchor"):
        sequence_walks([{}, {}])
    Fake.anchor = np.array([5, 3, 4, 4, 6])
    Fake.sequences = [{"response_start": 4, "length": 9}, {"response_start": 5, "length": 9}]  # spans 3..6, 4..6
    with pytest.raises(ValueError, match=r"Response 0 .* between 3 and 4, of 3..6"):
        sequence_walks(Fake([0] * 5))  # response 0 lacks its last anchors 5 and 6: no gap, but short of its span


def test_walk_of_a_drafter_that_copies_the_truth(setup, monkeypatch):
    target, windows, drafter = setup
    import hf_chainflow.training.evaluation as ev

    monkeypatch.setattr(ev, "reference_chain", lambda d, w, k, steps=None: w["target_tokens"][:k])
    out = evaluate_walk(drafter, _Responses(windows, 2), num_tokens=3, progress=False)
    # 20 tokens, 18 anchors a response: rounds at anchors 0, 4, 8, 12 accept 3; at 16 only 2 targets remain
    chain = out["chain"]
    assert out["num_sequences"] == 2 and chain["rounds"] == 10 and chain["tokens"] == 2 * (4 * 4 + 3)
    assert chain["tau"] == pytest.approx(19 / 5)
    assert chain["acceptance_per_depth"] == pytest.approx([1.0, 1.0, 0.8])
    assert chain["per_domain"] == {"0": {"tau": pytest.approx(3.8), "rounds": 5},
                                   "1": {"tau": pytest.approx(3.8), "rounds": 5}}
    assert chain["per_sequence"] == {"seq": [0, 1], "rounds": [5, 5], "tokens": [19, 19]}


def _walk(rounds, tokens, seq=None):
    return {"per_sequence": {"seq": list(range(len(rounds))) if seq is None else seq, "rounds": rounds,
                             "tokens": tokens}}


def test_paired_walk_difference_pools_tokens_over_rounds_and_resamples_responses_together():
    a = _walk([10, 10, 20], [20, 20, 40])  # tau 2.0 on every response
    same = paired_walk_difference(a, a, num_resamples=200)
    assert same["difference"] == 0.0 and same["ci95"] == [0.0, 0.0] and same["p_not_above"] == 1.0
    up = paired_walk_difference(a, _walk([10, 10, 20], [21, 21, 42]), num_resamples=200)  # +0.1 on every response
    assert up["tau_a"] == pytest.approx(2.0) and up["tau_b"] == pytest.approx(2.1)
    assert up["ci95"] == pytest.approx([0.1, 0.1]) and up["p_not_above"] == 0.0  # paired: no noise left
    mixed = paired_walk_difference(a, _walk([10, 10, 20], [30, 15, 40]), num_resamples=2000)
    assert mixed["difference"] == pytest.approx(85 / 40 - 2.0)
    assert mixed["ci95"][0] < 0 < mixed["ci95"][1] and 0 < mixed["p_not_above"] < 1
    with pytest.raises(ValueError, match="walks covered different responses"):
        paired_walk_difference(a, _walk([10, 10, 20], [20, 20, 40], seq=[0, 1, 5]))
    with pytest.raises(ValueError, match="walk 1 must be one mode of an `evaluate_walk` result .* keys \\['tau'\\]"):
        paired_walk_difference(a, {"tau": 2.0})
    with pytest.raises(ValueError, match="`num_resamples` must be a positive integer, got 0"):
        paired_walk_difference(a, a, num_resamples=0)
    with pytest.raises(ValueError, match="`size` must be a positive integer .* got 0"):
        resampled_walk_taus([a], size=0)
    spread = resampled_walk_taus([a, _walk([10, 10, 20], [30, 15, 40])], num_resamples=50, size=2)
    assert spread.shape == (50, 2) and np.all(spread[:, 0] == 2.0)  # every draw of a: tau 2.0


def test_walk_equals_a_walk_over_per_window_lengths(setup):
    """`evaluate_offline(walk_sequences=...)`: the chain walk agrees with per-window serving calls, walked by hand."""
    target, windows, drafter = setup
    data = _Responses(windows, 2)
    out = evaluate_offline(drafter, data, num_tokens=3, tree=(4, 3), walk_sequences=5, progress=False)
    lengths = [int(accepted_lengths(reference_chain(drafter, w, 3)[None], w["target_tokens"][None],
                                    w["target_mask"][None])[0]) for w in windows]
    per = len(windows) // 2
    rounds = walk_rounds(lambda i: lengths[i], per) + walk_rounds(lambda i: lengths[per + i], per)
    walk = out["walk"]
    assert walk["num_sequences"] == 2 and out["settings"]["walk_sequences"] == 5
    assert walk["chain"]["rounds"] == len(rounds) and walk["chain"]["tokens"] == sum(a + 1 for a in rounds)
    assert walk["chain"]["tau"] == pytest.approx(sum(a + 1 for a in rounds) / len(rounds))
    assert 1.0 <= walk["tree"]["tau"] <= 4.0 and len(walk["tree"]["acceptance_per_depth"]) == 3
    assert sum(d["rounds"] for d in walk["tree"]["per_domain"].values()) == walk["tree"]["rounds"]
    one = evaluate_walk(drafter, data, num_tokens=3, max_sequences=1, progress=False)
    assert one["num_sequences"] == 1 and one["chain"]["rounds"] < walk["chain"]["rounds"]
    with pytest.raises(ValueError, match="records each window's response and anchor"):
        evaluate_offline(drafter, windows, num_tokens=3, walk_sequences=2, progress=False)
    with pytest.raises(ValueError, match="`max_sequences` must be a positive integer"):
        evaluate_walk(drafter, data, max_sequences=0, progress=False)
    with pytest.raises(ValueError, match="`walk_sequences` must be a positive integer .* got 0"):
        evaluate_offline(drafter, data, num_tokens=3, walk_sequences=0, progress=False)
    with pytest.raises(ValueError, match="num_assistant_tokens"):
        evaluate_walk(drafter, data, num_tokens=9, progress=False)


def test_num_flow_steps_is_none_or_positive(setup):
    """0 is not "the drafter's default" (None is): refused before any drafting, as are negatives and non-integers."""
    target, windows, drafter = setup
    for bad in (0, -2, "x", True):
        with pytest.raises(ValueError, match=rf"`num_flow_steps` must be None .* or a positive integer .* got {bad!r}"):
            evaluate_offline(drafter, windows, num_flow_steps=bad, progress=False)
        with pytest.raises(ValueError, match=rf"`num_flow_steps` must be None .* got {bad!r}"):
            evaluate_walk(drafter, windows, num_flow_steps=bad, progress=False)
    out = evaluate_offline(drafter, windows, num_flow_steps=2, max_windows=4, progress=False)
    assert out["settings"]["num_flow_steps"] == 2
    assert evaluate_offline(drafter, windows, max_windows=4, progress=False)["settings"]["num_flow_steps"] == (
        drafter.config.num_flow_steps)


@pytest.mark.parametrize("evaluate", ["offline", "walk"])
def test_a_failing_evaluation_gives_the_drafter_back_in_its_training_mode(setup, monkeypatch, evaluate):
    target, windows, drafter = setup
    import hf_chainflow.training.evaluation as ev

    seen = []

    def broken(d, w, k, steps=None):
        seen.append(d.training)
        raise RuntimeError("drafting failed")

    monkeypatch.setattr(ev, "reference_chain", broken)
    drafter.train()
    try:
        with pytest.raises(RuntimeError, match="drafting failed"):
            if evaluate == "offline":
                evaluate_offline(drafter, windows, num_tokens=3, batched=False, progress=False)
            else:
                evaluate_walk(drafter, _Responses(windows, 2), num_tokens=3, progress=False)
        assert seen == [False]  # drafted in eval mode ...
        assert drafter.training  # ... and handed back in training mode despite the error
    finally:
        drafter.eval()


def test_walk_comparison_scripts_print_differences_and_intervals(tmp_path):
    """`docs/research/scripts/compare_walks.py` and `compare_walk_gains.py` on three stages' walk records."""
    import subprocess
    import sys
    from pathlib import Path

    examples = Path(__file__).resolve().parents[1] / "docs" / "research" / "scripts"
    rounds = [10, 12, 8, 20]
    files = []
    for name, extra in (("a", 0), ("b", 2), ("c", 3)):  # tokens per response: 2 * rounds + extra
        walk = {m: _walk(rounds, [2 * r + extra for r in rounds]) for m in ("chain", "tree")}
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"walk": {"num_sequences": len(rounds), **walk}}))
        files.append(str(path))
    run = lambda *args: subprocess.run([sys.executable, *args], capture_output=True, text=True, check=True).stdout  # noqa: E731
    out = run(str(examples / "compare_walks.py"), files[0], files[1], "--resamples", "200")
    assert "walk tree: A 2.0000  B 2.1600  B - A +0.1600" in out  # tokens 100 + 8 over 50 rounds
    out = run(str(examples / "compare_walks.py"), files[0], files[1], "--subset", "2", "--resamples", "200")
    assert out.startswith("2 responses") and "A's walk tree tau over random 2-response draws: SD" in out
    out = run(str(examples / "compare_walk_gains.py"), *files, "--resamples", "200")
    assert "B - A +0.1600, C - B +0.0800, (B - A) - (C - B) +0.0800" in out


def test_reports_are_strict_json(tmp_path):
    from hf_chainflow.training.evaluation import strict_json, write_report

    assert strict_json({"a": [1.0, float("nan")], "b": {"c": float("inf"), "d": (2, "x")}}) == \
        '{"a": [1.0, null], "b": {"c": null, "d": [2, "x"]}}'
    result = {"tau": 1.5, "acceptance": [0.5, float("nan")], "num_windows": 2,
              "per_domain": {"code": {"tau": 1.5, "acceptance": [0.5, float("nan")], "num_windows": 2}}}
    json_path, _ = write_report(result, tmp_path)

    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    loaded = json.loads(json_path.read_text(), parse_constant=refuse)  # a position no window reached: null
    assert loaded["acceptance"] == [0.5, None] and loaded["per_domain"]["code"]["acceptance"] == [0.5, None]
