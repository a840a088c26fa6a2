"""Speculative generation for a batch of prompts (ragged acceptance) on tiny Llama, Qwen3 and Qwen3.5-hybrid targets.

Every row of a left-padded batch must equal that row's own batch-1 plain greedy output token for token, then the
pad token up to the batch's width (transformers' shape). A common tester runs a grid of drafters (random
ChainFlow, OracleDrafter at error rates 0, 0.3 and 1) x draft shapes (chains 1 and 3, trees 4x3, 5x7 and 8x4 cut to
10 nodes) x batches of 2-8 prompts of 1-40 tokens; half the batches stop on an EOS token that ends one row early, so
rows finish at different rounds. The grid checks 600 rows (`test_the_grid_checks_at_least_500_rows`).
"""

import itertools

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, pipeline

import hf_chainflow  # noqa: F401  (installs the generate hook)
from hf_chainflow import ChainFlowConfig, ChainFlowDrafter
from hf_chainflow.testing import TINY_FAMILIES, OracleDrafter, tiny_target

from _speculative import exact_pair_distribution, random_drafter, set_shape

SHAPES = [("chain", 1), ("chain", 3), ("tree", (4, 3)), ("tree", (5, 7)), ("tree", (8, 4, 10))]
DRAFTERS = ["random", "oracle0", "oracle0.3", "oracle1"]
BATCHES_PER_PAIR = 2
BATCH_SIZES = [2, 3, 4, 5, 6, 7, 8, 5]  # rotated over the grid: mean 5 rows
NUM_PROMPTS = 24
MAX_NEW = 16
PAD = 0


def make_drafter(target, kind):
    if kind == "random":
        return random_drafter(target)
    return OracleDrafter(target, error_rate=float(kind[len("oracle"):]), seed=7)


def left_pad(prompts):
    """Prompts `(L_b,)` -> left-padded ids and attention mask `(B, max L_b)`."""
    width = max(p.shape[0] for p in prompts)
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - p.shape[0]:] = p
        mask[b, width - p.shape[0]:] = 1
    return ids, mask


def expected_rows(refs, eos):
    """Each row's batch-1 greedy continuation, cut after its first `eos` (None: not cut)."""
    out = []
    for r in refs:
        hits = (r == eos).nonzero() if eos is not None else []
        out.append(r[: int(hits[0]) + 1] if len(hits) else r)
    return out


def check_batch(target, drafter, prompts, refs, eos=None, **kwargs):
    """The common tester: one batched speculative call; every row equals its batch-1 reference, then pads; the
    output is as wide as the longest row. Returns the rows checked."""
    ids, mask = left_pad(prompts)
    want = expected_rows(refs, eos)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos,
                          pad_token_id=PAD, assistant_model=drafter, **kwargs)
    L = ids.shape[1]
    assert out.shape == (len(prompts), L + max(w.shape[0] for w in want)), out.shape
    for b, w in enumerate(want):
        assert torch.equal(out[b, :L], ids[b]), b
        assert torch.equal(out[b, L: L + w.shape[0]], w), (b, out[b, L:].tolist(), w.tolist())
        assert bool((out[b, L + w.shape[0]:] == PAD).all()), b
    stats = drafter.last_stats
    assert stats.batch_size == len(prompts) and len(stats.rows) == len(prompts) and stats.speculative
    assert [r.new_tokens for r in stats.rows] == [w.shape[0] for w in want]
    return len(prompts)


@pytest.fixture(scope="module", params=TINY_FAMILIES)
def family_setup(request):
    target = tiny_target(request.param)
    gen = torch.Generator().manual_seed(11)
    lengths = [1, 40] + [int(torch.randint(2, 40, (), generator=gen)) for _ in range(NUM_PROMPTS - 2)]
    prompts = [torch.randint(3, 256, (n,), generator=gen) for n in lengths]
    refs = [target.generate(p[None], max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                            pad_token_id=PAD)[0, p.shape[0]:] for p in prompts]
    return request.param, target, prompts, refs


def grid_cases(drafter_kind):
    """(shape index, prompt indices, stop on an EOS?) for one drafter: every shape, BATCHES_PER_PAIR batches each."""
    offset = DRAFTERS.index(drafter_kind)
    cases = []
    for k, (s, j) in enumerate(itertools.product(range(len(SHAPES)), range(BATCHES_PER_PAIR))):
        n = BATCH_SIZES[(k + offset) % len(BATCH_SIZES)]
        first = (7 * k + 5 * offset) % NUM_PROMPTS
        cases.append((s, [(first + 5 * i) % NUM_PROMPTS for i in range(n)], (k + offset) % 2 == 1))
    return cases


def test_the_grid_checks_at_least_500_rows():
    rows = sum(len(p) for kind in DRAFTERS for _, p, _ in grid_cases(kind)) * len(TINY_FAMILIES)
    assert rows >= 500, rows


@pytest.mark.parametrize("drafter_kind", DRAFTERS)
def test_each_row_equals_its_own_batch1_greedy_output(family_setup, drafter_kind):
    family, target, prompts, refs = family_setup
    drafter = make_drafter(target, drafter_kind)
    checked = early = 0
    for shape_index, rows, stop in grid_cases(drafter_kind):
        set_shape(drafter, *SHAPES[shape_index])
        eos = int(refs[rows[0]][3]) if stop else None  # row 0 ends after at most 4 tokens, others when they meet it
        checked += check_batch(target, drafter, [prompts[i] for i in rows], [refs[i] for i in rows], eos=eos)
        early += sum(r.new_tokens < MAX_NEW for r in drafter.last_stats.rows)
    assert checked >= 40 and early >= BATCHES_PER_PAIR * len(SHAPES) // 2  # rows did finish at different rounds


def test_hybrid_fork_back_end_and_lookup_branch_in_a_batch(family_setup):
    family, target, prompts, refs = family_setup
    drafter = make_drafter(target, "oracle0.3")
    set_shape(drafter, "tree", (4, 3))
    if family == "qwen3_5":  # the reference Gated DeltaNet back-end, one tree per row
        check_batch(target, drafter, prompts[:6], refs[:6], gdn_method="fork")
    # a prompt-lookup branch per row (merged, and verified alone when the match is long)
    repeated = [torch.cat([p[:6], p[:6], p[:6]]) if p.shape[0] >= 6 else p for p in prompts[:5]]
    repeated_refs = [target.generate(p[None], max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                                     pad_token_id=PAD)[0, p.shape[0]:] for p in repeated]
    g = drafter.generation_config
    for trust in (None, 2):
        g.lookup_num_tokens, g.lookup_trust_ngram = 3, trust
        check_batch(target, drafter, repeated, repeated_refs)
        assert drafter.last_stats.lookup_rounds > 0
        assert (drafter.last_stats.lookup_only_rounds > 0) == (trust is not None)
    g.lookup_num_tokens = g.lookup_trust_ngram = None


def test_per_row_and_pooled_stats(family_setup):
    family, target, prompts, refs = family_setup
    drafter = make_drafter(target, "oracle0")
    set_shape(drafter, "chain", 3)
    rows = [0, 1, 4, 9]
    check_batch(target, drafter, [prompts[i] for i in rows], [refs[i] for i in rows])
    stats = drafter.last_stats
    assert stats.accepted == [a for r in stats.rows for a in r.accepted]
    assert stats.new_tokens == sum(r.new_tokens for r in stats.rows) == MAX_NEW * len(rows)
    assert stats.forwards == max(r.rounds for r in stats.rows)  # one verify forward per round for the batch
    for r in stats.rows:  # a perfect oracle: every full round accepts the whole chain
        full = [a for a, d in zip(r.accepted, r.drafted_depth) if d == 3]
        assert full and all(a == 3 for a in full)
    d = stats.to_dict()
    assert d["batch_size"] == len(rows) and len(d["rows"]) == len(rows) and d["speculative"] is True


def test_output_is_plain_batched_generate(family_setup):
    """Shape, padding and dict output as plain batched `generate` (which itself equals batch-1 on these targets)."""
    family, target, prompts, refs = family_setup
    drafter = random_drafter(target)
    set_shape(drafter, "tree", (4, 3))
    ids, mask = left_pad(prompts[:5])
    eos = int(refs[0][2])
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos,
                            pad_token_id=PAD)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos,
                          pad_token_id=PAD, assistant_model=drafter, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    assert out.cache is None  # rows left the batch as they finished: no cache of every row to continue from


def test_decode_batch_cutoff(family_setup):
    family, target, prompts, refs = family_setup
    drafter = make_drafter(target, "oracle0.3")
    set_shape(drafter, "tree", (4, 3))
    drafter.generation_config.max_speculative_batch_size = 2
    try:
        check_batch(target, drafter, prompts[:2], refs[:2])  # at the cutoff: drafts
        ids, mask = left_pad(prompts[:3])
        out = target.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                              pad_token_id=PAD, assistant_model=drafter)
        plain = target.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False,
                                eos_token_id=None, pad_token_id=PAD)
        assert torch.equal(out, plain)
        stats = drafter.last_stats
        assert stats.speculative is False and stats.batch_size == 3 and stats.rounds == 0
        assert "max_speculative_batch_size=2" in stats.reason and stats.new_tokens == 3 * MAX_NEW
        drafter.generation_config.max_speculative_batch_size = 0
        with pytest.raises(ValueError, match=r"max_speculative_batch_size` must be None .* got 0"):
            target.generate(ids, attention_mask=mask, max_new_tokens=4, assistant_model=drafter)
    finally:
        drafter.generation_config.max_speculative_batch_size = None


# ---------------------------------------------------------------------------------------------- bad input
@pytest.fixture(scope="module")
def llama():
    return tiny_target("llama")


def test_bad_batches_are_refused_and_change_nothing(llama):
    cfg = ChainFlowConfig.for_target(llama.config, num_blocks=1, num_heads=4, path_hidden_size=32, markov_rank=16)
    torch.manual_seed(0)
    drafter = ChainFlowDrafter(cfg).eval()  # unbound: a refused call must leave it unbound
    drafter.generation_config.draft_mode = "tree"
    before = drafter.generation_config.to_dict()
    drafter.last_stats = sentinel = object()
    ids, mask = left_pad([torch.tensor([5, 6, 7, 8]), torch.tensor([9, 10])])
    right = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    cases = [
        (dict(input_ids=ids), r"holding the pad token id 0 but no `attention_mask`.*padding_side = 'left'"),
        (dict(input_ids=ids, attention_mask=right), r"rows \[1\] are padded on the right.*padding_side = 'left'"),
        (dict(input_ids=ids, attention_mask=mask[:, 1:]), r"`attention_mask` has shape \(2, 3\) but `input_ids` has "
                                                          r"shape \(2, 4\)"),
        (dict(input_ids=ids, attention_mask=mask * 2), r"only 0 \(padding\) and 1"),
        (dict(input_ids=ids, attention_mask=torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]])), r"rows \[1\] hold no token"),
    ]
    for mode in ("chain", "tree"):
        drafter.generation_config.draft_mode = mode
        for kwargs, needle in cases:
            with pytest.raises(ValueError, match=needle):
                llama.generate(**kwargs, max_new_tokens=4, pad_token_id=PAD, assistant_model=drafter)
            assert not drafter.is_bound and drafter.last_stats is sentinel
    drafter.generation_config.draft_mode = "tree"
    assert drafter.generation_config.to_dict() == before
    # the same batch, well formed, runs (and binds the drafter)
    out = llama.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=PAD, assistant_model=drafter)
    assert out.shape[0] == 2 and drafter.is_bound


# ---------------------------------------------------------------------------------------------- pipeline
def word_tokenizer(vocab_size=256):
    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", pad_token="w0", eos_token="w2",
                                   padding_side="left")


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_text_generation_pipeline_with_batch_size(family):
    target = tiny_target(family)
    drafter = random_drafter(target)
    drafter.generation_config.draft_mode = "tree"
    tok = word_tokenizer()
    texts = ["w5 w17 w99 w42 w7 w130", "w8 w9", "w200 w3 w4 w77", "w61"]
    plain = pipeline("text-generation", model=target, tokenizer=tok, device="cpu")
    refs = [plain(t, max_new_tokens=10, do_sample=False) for t in texts]  # one at a time
    assisted = pipeline("text-generation", model=target, tokenizer=tok, assistant_model=drafter, device="cpu")
    drafter.last_stats = None
    assert assisted(texts, batch_size=4, max_new_tokens=10, do_sample=False) == refs
    assert drafter.last_stats.batch_size == 4 and drafter.last_stats.forwards > 0


# ---------------------------------------------------------------------------------------------- sampling
def tv_test(counts, exact, gen) -> tuple[float, float]:
    """The batch-1 test (`tests/test_generate_api.py::test_sampling_keeps_target_distribution`): the total variation
    of the empirical distribution from `exact`, and the tolerance, 1.5x the largest TV of 30 simulated exact
    samplers of the same size. Passes when `tv < tolerance`."""
    n = int(counts.sum())
    tv = 0.5 * (counts / n - exact).abs().sum().item()
    null = []
    for _ in range(30):
        draw = torch.multinomial(exact.float(), n, replacement=True, generator=gen)
        null.append(0.5 * (torch.bincount(draw, minlength=exact.numel()).double() / n - exact).abs().sum().item())
    return tv, 1.5 * max(null)


def distorted(exact, eps=0.05):
    """`exact` with `eps` of its mass moved from its most probable cells (the top half of the mass) to the rest of its
    support, in proportion: a sampler off by total variation `eps`, too flat (as a wrong temperature would be)."""
    order = exact.argsort(descending=True)
    top = torch.zeros_like(exact, dtype=torch.bool)
    top[order[exact[order].cumsum(0) <= 0.5]] = True
    top[order[0]] = True
    low = ~top & (exact > 0)
    out = exact.clone()
    out[top] -= eps * exact[top] / exact[top].sum()
    out[low] += eps * exact[low] / exact[low].sum()
    return out


@pytest.mark.parametrize("family,drafter_kind,mode", [
    ("llama", "chainflow", "tree"),   # greedy tree, children tried as fixed proposals, per row
    ("qwen3_5", "chainflow", "chain"),  # q-sampled chain, min(1, p/q), per row, on the hybrid
])
def test_sampling_keeps_each_rows_distribution(family, drafter_kind, mode):
    """64 rows per call: 48 copies of a short prompt (left-padded) and 16 of a longer one, 300 calls; each prompt's
    rows pass the batch-1 test, which rejects samplers distorted by 5 % at the short prompt's sample size (14,400)."""
    vocab = 12
    target = tiny_target(family, vocab_size=vocab, hidden_size=32, num_layers=2, seed=4)
    with torch.no_grad():
        target.lm_head.weight.mul_(2.0)  # peaked: few (prompt, token 2, token 3) cells, so 5 % is measurable
    if drafter_kind == "oracle":
        drafter = OracleDrafter(target, error_rate=0.5, seed=1)
    else:
        drafter = random_drafter(target, candidate_budget=8)
    g = drafter.generation_config
    g.num_assistant_tokens, g.draft_mode = 2, mode
    g.tree_width, g.tree_depth, g.tree_budget = 3, 2, 4
    short, long = torch.tensor([3, 7, 5, 9, 3, 7]), torch.tensor([4, 8, 10, 6, 11, 3, 9, 5, 4])
    prompts = [short] * 48 + [long] * 16
    ids, mask = left_pad(prompts)
    temperature, top_p = 0.8, 0.9
    exact = {name: exact_pair_distribution(target, p[None], temperature, top_p, vocab).reshape(-1)
             for name, p in (("short", short), ("long", long))}
    counts = {name: torch.zeros(vocab * vocab, dtype=torch.float64) for name in exact}
    torch.manual_seed(0)
    accepted = 0
    for _ in range(300):
        out = target.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=True, temperature=temperature,
                              top_p=top_p, top_k=0, assistant_model=drafter, eos_token_id=None, pad_token_id=PAD)
        cells = out[:, -2] * vocab + out[:, -1]
        counts["short"] += torch.bincount(cells[:48], minlength=vocab * vocab).double()
        counts["long"] += torch.bincount(cells[48:], minlength=vocab * vocab).double()
        accepted += sum(drafter.last_stats.accepted)
    assert accepted > 0, "no draft token was ever accepted: the test would not exercise rejection sampling"
    gen = torch.Generator().manual_seed(1)
    for name in exact:
        tv, tolerance = tv_test(counts[name], exact[name], gen)
        assert tv < tolerance, (name, tv, tolerance)
    # the same test, at the short prompt's sample size, fails on samplers distorted by 5 %
    n = int(counts["short"].sum())
    bad = distorted(exact["short"])
    assert abs(0.5 * (bad - exact["short"]).abs().sum().item() - 0.05) < 1e-9
    for _ in range(10):
        draw = torch.bincount(torch.multinomial(bad.float(), n, replacement=True, generator=gen),
                              minlength=vocab * vocab).double()
        tv, tolerance = tv_test(draw, exact["short"], gen)
        assert tv >= tolerance, (tv, tolerance)
