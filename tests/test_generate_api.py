"""Everything `generate` users rely on keeps working with a ChainFlow drafter; bad input gets a clear error;
other `generate` calls are untouched."""

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (DynamicCache, GenerationConfig, PreTrainedTokenizerFast, StoppingCriteria,
                          StoppingCriteriaList, pipeline)
from transformers.generation.candidate_generator import AssistedCandidateGenerator
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerationMixin

import hf_chainflow
from hf_chainflow import ChainFlowCandidateGenerator, ChainFlowConfig, ChainFlowDrafter, ContinuationTable
from hf_chainflow.generation import drafting
from hf_chainflow.testing import OracleDrafter, tiny_target

from _speculative import exact_pair_distribution
from testing_common import tv_test


@pytest.fixture(scope="module")
def llama():
    return tiny_target("llama")


@pytest.fixture(scope="module")
def hybrid():
    return tiny_target("qwen3_5")


def drafter_for(target, **overrides):
    cfg = ChainFlowConfig.for_target(target.config, num_blocks=1, num_heads=4, path_hidden_size=32, markov_rank=16,
                                     **overrides)
    torch.manual_seed(0)
    return ChainFlowDrafter(cfg).eval().bind_target(target)


PROMPT = torch.tensor([[5, 17, 99, 42, 7, 130, 64]])
RIGHT_PADDED = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0]])  # a mask for PROMPT.repeat(2, 1)


class Collect(BaseStreamer):
    def __init__(self):
        self.tokens, self.ended = [], False

    def put(self, value):
        self.tokens += value.reshape(-1).tolist()

    def end(self):
        self.ended = True


class StopOnToken(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def word_tokenizer(vocab_size=256):
    vocab = {f"w{i}": i for i in range(vocab_size)}
    vocab["abcdef"] = vocab_size  # transformers' StopStringCriteria probes the vocabulary with this prefix
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", pad_token="w0", eos_token="w2")


# ---------------------------------------------------------------------------------------------- generate features
@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_max_length_eos_streamer_and_dict(family, mode, request):
    target = request.getfixturevalue("llama" if family == "llama" else "hybrid")
    drafter = OracleDrafter(target, error_rate=0.0)
    drafter.generation_config.draft_mode = mode
    drafter.generation_config.num_assistant_tokens = 8
    drafter.generation_config.tree_width, drafter.generation_config.tree_depth = 4, 8
    # max_new_tokens reached inside a draft
    for n in (1, 2, 5, 11):
        ref = target.generate(PROMPT, max_new_tokens=n, do_sample=False)
        out = target.generate(PROMPT, max_new_tokens=n, do_sample=False, assistant_model=drafter)
        assert torch.equal(out, ref) and out.shape[1] == PROMPT.shape[1] + n
    # EOS inside a draft: make the 4th greedy token the EOS
    free = target.generate(PROMPT, max_new_tokens=12, do_sample=False, eos_token_id=None)
    eos = int(free[0, PROMPT.shape[1] + 3])
    ref = target.generate(PROMPT, max_new_tokens=12, do_sample=False, eos_token_id=eos)
    out = target.generate(PROMPT, max_new_tokens=12, do_sample=False, eos_token_id=eos, assistant_model=drafter)
    assert torch.equal(out, ref) and int(out[0, -1]) == eos
    # streamer sees the same tokens; return_dict_in_generate gives sequences
    s_ref, s_out = Collect(), Collect()
    target.generate(PROMPT, max_new_tokens=10, do_sample=False, streamer=s_ref)
    res = target.generate(PROMPT, max_new_tokens=10, do_sample=False, streamer=s_out, assistant_model=drafter,
                          return_dict_in_generate=True)
    assert s_out.tokens == s_ref.tokens and s_out.ended
    assert torch.equal(res.sequences[0], torch.tensor(s_ref.tokens))


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_text_generation_pipeline_with_the_drafter_as_assistant(family, mode, request):
    # transformers' pipelines take `assistant_model` when built or called; when built, they compare the assistant's
    # vocab_size and bos/eos/pad ids with the target's and refuse one that differs ("different tokenizer").
    target = request.getfixturevalue("llama" if family == "llama" else "hybrid")
    drafter = drafter_for(target)
    drafter.generation_config.draft_mode = mode
    tok = word_tokenizer()
    text = "w5 w17 w99 w42 w7 w130"
    plain = pipeline("text-generation", model=target, tokenizer=tok, device="cpu")
    ref = plain(text, max_new_tokens=12, do_sample=False)
    assisted = pipeline("text-generation", model=target, tokenizer=tok, assistant_model=drafter, device="cpu")
    for run in (lambda: assisted(text, max_new_tokens=12, do_sample=False),
                lambda: plain(text, max_new_tokens=12, do_sample=False, assistant_model=drafter)):
        drafter.last_stats = None
        assert run() == ref
        assert drafter.last_stats is not None and drafter.last_stats.rounds > 0 and drafter.last_stats.mode == mode


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_stopping_criteria_and_stop_strings(family, request):
    target = request.getfixturevalue("llama" if family == "llama" else "hybrid")
    drafter = OracleDrafter(target, error_rate=0.0)
    drafter.generation_config.num_assistant_tokens = 8
    free = target.generate(PROMPT, max_new_tokens=14, do_sample=False, eos_token_id=None)
    stop_token = int(free[0, PROMPT.shape[1] + 4])
    crit = StoppingCriteriaList([StopOnToken(stop_token)])
    ref = target.generate(PROMPT, max_new_tokens=14, do_sample=False, stopping_criteria=crit)
    out = target.generate(PROMPT, max_new_tokens=14, do_sample=False, stopping_criteria=crit, assistant_model=drafter)
    assert torch.equal(out, ref) and int(out[0, -1]) == stop_token
    assert drafter.last_stats.loop == "chainflow"
    tok = word_tokenizer()
    stop = f"w{stop_token}"
    ref = target.generate(PROMPT, max_new_tokens=14, do_sample=False, stop_strings=[stop], tokenizer=tok)
    out = target.generate(PROMPT, max_new_tokens=14, do_sample=False, stop_strings=[stop], tokenizer=tok,
                          assistant_model=drafter)
    assert torch.equal(out, ref)
    assert out.shape[1] < free.shape[1]
    # the direct `custom_generate` route builds the stop-string criterion too (transformers drops `tokenizer` there)
    direct = target.generate(PROMPT, max_new_tokens=14, do_sample=False, stop_strings=[stop], tokenizer=tok,
                             custom_generate=hf_chainflow.speculative_generate, drafter=drafter)
    assert torch.equal(direct, ref)
    # a stop string from the model's own generation config, with a GenerationConfig given by the caller
    target.generation_config.stop_strings = [stop]
    try:
        config = GenerationConfig(max_new_tokens=14, do_sample=False)
        ref = target.generate(PROMPT, generation_config=config, tokenizer=tok)
        out = target.generate(PROMPT, generation_config=config, tokenizer=tok, assistant_model=drafter)
    finally:
        target.generation_config.stop_strings = None
    assert torch.equal(out, ref) and drafter.last_stats.loop == "chainflow"


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
@pytest.mark.parametrize("stop", ["max_length", "eos"])
def test_returned_cache_is_the_cache_of_the_returned_sequence(family, stop, request):
    """Stopped inside a round, the own loop still compacts the cache: it holds the sequence but its last token, as
    after plain `generate`, and continuing from it gives plain's next-token logits."""
    target = request.getfixturevalue("llama" if family == "llama" else "hybrid")
    drafter = OracleDrafter(target, error_rate=0.0)
    g = drafter.generation_config
    g.draft_mode, g.tree_width, g.tree_depth = "tree", 4, 8
    kwargs = dict(max_new_tokens=10, do_sample=False, return_dict_in_generate=True)
    if stop == "eos":
        free = target.generate(PROMPT, max_new_tokens=12, do_sample=False, eos_token_id=None)
        kwargs.update(max_new_tokens=12, eos_token_id=int(free[0, PROMPT.shape[1] + 5]))
    ref = target.generate(PROMPT, **kwargs)
    out = target.generate(PROMPT, assistant_model=drafter, **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    assert out.cache.get_seq_length() == ref.cache.get_seq_length() == out.sequences.shape[1] - 1
    last, pos = out.sequences[:, -1:], torch.tensor([[out.sequences.shape[1] - 1]])
    with torch.no_grad():
        want = target(input_ids=last, cache=ref.cache, position_ids=pos).logits[0, -1]
        got = target(input_ids=last, cache=out.cache, position_ids=pos).logits[0, -1]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_tau_counts_every_target_forward(family, mode, request):
    """tau = tokens per target forward after the prefill, the last one-token round (no room to draft) included:
    with no stop inside a round, sum(accepted) + rounds is exactly the new tokens after the first."""
    target = request.getfixturevalue("llama" if family == "llama" else "hybrid")
    drafter = OracleDrafter(target, error_rate=0.0)
    g = drafter.generation_config
    g.draft_mode, g.num_assistant_tokens, g.tree_width, g.tree_depth = mode, 3, 2, 3
    empty_rounds = 0
    for n in range(2, 12):
        target.generate(PROMPT, max_new_tokens=n, do_sample=False, eos_token_id=None, assistant_model=drafter)
        stats = drafter.last_stats
        assert sum(stats.accepted) + stats.rounds == n - 1, (n, stats.accepted)
        empty_rounds += stats.drafted_depth.count(0)
    assert empty_rounds > 0  # some lengths end on a one-token round: the case this test is about


# ---------------------------------------------------------------------------------------------- sampling
# Without a corpus-lookup branch (q-sampled chains in transformers' loop and the own loop, trees, trees with a
# prompt-lookup branch, on every family and drafter kind): the sampling cells of tests/test_equivalence_grid.py,
# which run this check (`testing_common.check_sampling`).
@pytest.mark.parametrize("family,drafter_kind,mode,lookup,corpus", [
    ("llama", "chainflow", "chain", None, True),    # a greedy chain plus a corpus-lookup branch (own loop)
    ("qwen3", "chainflow", "tree", 3, True),        # tree, prompt- and corpus-lookup branches
    ("qwen3_5", "oracle", "tree", None, True),      # ... on the hybrid target
])
def test_sampling_keeps_target_distribution(family, drafter_kind, mode, lookup, corpus):
    vocab = 12
    target = tiny_target(family, vocab_size=vocab, hidden_size=32, num_layers=2, seed=4)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.4)  # moderate peakedness: several tokens matter
    if drafter_kind == "oracle":
        drafter = OracleDrafter(target, error_rate=0.5, seed=1)
    else:
        drafter = drafter_for(target, candidate_budget=8)
    g = drafter.generation_config
    g.num_assistant_tokens, g.draft_mode, g.lookup_num_tokens = 2, mode, lookup
    g.tree_width, g.tree_depth, g.tree_budget = 3, 2, 4
    if corpus:  # a table of random text over the tiny vocabulary: its branches are often wrong, sometimes right
        table = ContinuationTable.build([torch.randint(0, vocab, (400,), generator=torch.Generator().manual_seed(2))
                                         .tolist()], vocab_size=vocab, max_ngram=3, min_count=1)
        if drafter_kind == "oracle":
            drafter.continuation_table = table
        else:
            drafting.set_continuation_table(drafter, table)
        g.corpus_lookup_num_tokens = 3
    prompt = torch.tensor([[3, 7, 5, 9, 3, 7]])  # "... 3 7" repeats: the lookup finds "5 9 ..."
    temperature, top_p = 0.8, 0.9
    exact = exact_pair_distribution(target, prompt, temperature, top_p, vocab)
    n = 1200
    torch.manual_seed(0)
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    accepted = lookup_rounds = corpus_rounds = 0
    for _ in range(n):
        out = target.generate(prompt, max_new_tokens=3, do_sample=True, temperature=temperature, top_p=top_p,
                              top_k=0, assistant_model=drafter, eos_token_id=None, pad_token_id=0)
        counts[out[0, -2], out[0, -1]] += 1
        accepted += sum(drafter.last_stats.accepted)
        lookup_rounds += drafter.last_stats.lookup_rounds
        corpus_rounds += drafter.last_stats.corpus_lookup_rounds
    # the TV from `exact`, and the tolerance: 1.5x the largest TV of 30 simulated exact samplers of n tokens
    tv, tolerance = tv_test(counts.reshape(-1), exact.reshape(-1), torch.Generator().manual_seed(1))
    assert accepted > 0, "no draft token was ever accepted: the test would not exercise rejection sampling"
    assert (lookup_rounds > 0) == (lookup is not None)
    assert (corpus_rounds > 0) == corpus
    assert tv < tolerance, (tv, tolerance)


# ---------------------------------------------------------------------------------------------- bad input
def test_bad_inputs_raise_clear_errors(llama):
    drafter = drafter_for(llama)
    before = dict(drafter.generation_config.to_dict())
    cases = [
        (dict(num_beams=2), "num_beams"),
        (dict(prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens"),
        (dict(cache_implementation="static"), "cache_implementation"),
        (dict(num_beams=2, _tree=True), "num_beams"),
        (dict(cache_implementation="paged"), "cache_implementation='paged'"),
        (dict(cache_implementation="paged", _tree=True), "cache_implementation='paged'"),
        (dict(use_cache=False), r"`use_cache=False` cannot be combined with a ChainFlow drafter"),  # chain: transformers'
        (dict(use_cache=False, _tree=True), r"`use_cache=False` cannot be combined"),  # loop, tree: ours; the same error
    ]
    # transformers' other speculative modes, and assistant settings it would ignore on the call: refused in both loops
    for tree in (False, True):
        cases += [
            (dict(assistant_early_exit=1, _tree=tree), r"`assistant_early_exit=1` .* self-speculative"),
            (dict(use_mtp=True, _tree=tree), r"`use_mtp=True` .* Leave `use_mtp` unset"),
            (dict(assistant_tokenizer=object(), tokenizer=object(), _tree=tree), r"Omit `assistant_tokenizer`"),
            (dict(num_assistant_tokens=5, _tree=tree),
             r"`num_assistant_tokens=5` was passed to `generate`.* Set `drafter.generation_config.num_assistant_tokens`"),
            (dict(assistant_confidence_threshold=0.3, _tree=tree), r"`assistant_confidence_threshold=0.3` was passed"),
            (dict(target_lookbehind=3, _tree=tree), r"`target_lookbehind=3` was passed"),
        ]
    for kwargs, needle in cases:
        tree = kwargs.pop("_tree", False)
        drafter.generation_config.draft_mode = "tree" if tree else "chain"
        with pytest.raises(ValueError, match=needle):
            llama.generate(PROMPT, max_new_tokens=4, assistant_model=drafter, **kwargs)
    drafter.generation_config.draft_mode = "chain"
    with pytest.raises(ValueError, match="padded on the right"):  # batches: tests/test_batch_generation.py
        llama.generate(PROMPT.repeat(2, 1), attention_mask=RIGHT_PADDED, max_new_tokens=4, assistant_model=drafter)
    drafter.generation_config.draft_mode = "beam"
    with pytest.raises(ValueError, match="draft_mode"):
        llama.generate(PROMPT, max_new_tokens=4, assistant_model=drafter)
    drafter.generation_config.draft_mode = "chain"
    drafter.generation_config.num_assistant_tokens = 9
    with pytest.raises(ValueError, match=r"an integer in \[1, 8\] \(the drafter predicts K=8 positions per pass\)"):
        llama.generate(PROMPT, max_new_tokens=4, assistant_model=drafter)
    drafter.generation_config.num_assistant_tokens = before["num_assistant_tokens"]
    # transformers' assistant schedule and confidence stop are not implemented: refused, in both loops
    for mode in ("chain", "tree"):
        drafter.generation_config.draft_mode = mode
        for field, value, needle in (("num_assistant_tokens_schedule", "heuristic", "Set it to 'constant'"),
                                     ("assistant_confidence_threshold", 0.4, "Set it to None")):
            setattr(drafter.generation_config, field, value)
            with pytest.raises(ValueError, match=rf"`drafter.generation_config.{field}` is {value!r}.*{needle}"):
                llama.generate(PROMPT, max_new_tokens=4, assistant_model=drafter)
            setattr(drafter.generation_config, field, before[field])
    drafter.generation_config.draft_mode = "chain"
    for steps in (0, -2, "x"):  # 0 is not "the default": None is
        drafter.generation_config.num_flow_steps = steps
        with pytest.raises(ValueError, match=r"`drafter.generation_config.num_flow_steps` must be None \(use the "
                                             rf"drafter's `config.num_flow_steps`\) or a positive integer .* got "
                                             rf"{steps!r}"):
            llama.generate(PROMPT, max_new_tokens=4, assistant_model=drafter)
        with pytest.raises(ValueError, match=r"`num_flow_steps` must be None"):  # the drafter's own API too
            drafting.draft(drafter, torch.randn(1, 4, 64), PROMPT, num_flow_steps=steps)
    drafter.generation_config.num_flow_steps = before["num_flow_steps"]
    # nothing else changed: the drafter's settings are as before and generation still works and is lossless
    assert drafter.generation_config.to_dict() == before
    ref = llama.generate(PROMPT, max_new_tokens=6, do_sample=False)
    assert torch.equal(llama.generate(PROMPT, max_new_tokens=6, do_sample=False, assistant_model=drafter), ref)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_inputs_the_loops_cannot_honour_are_refused_before_any_forward(family, request):
    target = request.getfixturevalue("llama" if family == "llama" else "hybrid")
    drafter = OracleDrafter(target, error_rate=0.0)
    prefilled = DynamicCache(config=target.config)
    with torch.no_grad():
        target(input_ids=PROMPT[:, :5], cache=prefilled, use_cache=True)
    embeds = target.get_input_embeddings()(PROMPT)
    cases = [
        ("chain", dict(past_key_values=prefilled), r"already holds 5 tokens; .* Pass an empty cache"),
        ("tree", dict(past_key_values=prefilled), r"already holds 5 tokens"),
        ("chain", dict(guidance_scale=3.0), r"`guidance_scale=3.0` cannot be combined .* Leave `guidance_scale`"),
        ("tree", dict(guidance_scale=3.0), r"`guidance_scale=3.0`"),
        ("tree", dict(inputs_embeds=embeds), r"`inputs_embeds` \(shape \(1, 7, 64\)\) .* pass `input_ids`"),
        ("tree", dict(gdn_method="scan"), r"`gdn_method` must be one of \('chunk', 'fork'\) .* got 'scan'"),
    ]
    forwards = []
    hook = target.register_forward_hook(lambda *args: forwards.append(1))
    try:
        for mode, kwargs, needle in cases:
            drafter.generation_config.draft_mode = mode
            inputs = {} if "inputs_embeds" in kwargs else {"inputs": PROMPT}
            with pytest.raises(ValueError, match=needle):
                target.generate(**inputs, max_new_tokens=4, do_sample=False, assistant_model=drafter, **kwargs)
            assert not forwards, (mode, kwargs.keys())
    finally:
        hook.remove()
    assert prefilled.get_seq_length() == 5  # the caller's cache is untouched


def test_the_own_loop_called_outside_generate_is_refused(llama):
    """Called as a plain function it would ignore max_new_tokens, EOS and sampling settings: refused, untouched."""
    drafter = OracleDrafter(llama, error_rate=0.0)
    drafter.last_stats = marker = object()
    cache = DynamicCache(config=llama.config)
    for kwargs in (dict(generation_config=GenerationConfig(max_new_tokens=6)), dict()):
        with pytest.raises(ValueError, match=r"is a `custom_generate` loop.*custom_generate=hf_chainflow"):
            hf_chainflow.speculative_generate(llama, PROMPT, drafter=drafter, cache=cache, **kwargs)
    assert cache.get_seq_length() == 0 and drafter.last_stats is marker


@pytest.mark.parametrize("kind", ["mamba", "lfm2"])
def test_recurrent_layers_hf_chainflow_cannot_fork_are_refused_up_front(kind):
    """Mamba (stateful: every mode goes to the own loop) and LFM2 conv layers (own loop in tree mode) have recurrent
    state that is not Gated DeltaNet: refused before the prefill, with the layers named."""
    from transformers import Lfm2Config, Lfm2ForCausalLM, MambaConfig, MambaForCausalLM

    torch.manual_seed(0)
    if kind == "mamba":
        target = MambaForCausalLM(MambaConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2,
                                              state_size=4)).eval()
    else:
        config = Lfm2Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention"])
        config._attn_implementation = "sdpa"
        target = Lfm2ForCausalLM(config).eval()
    drafter = OracleDrafter(target, error_rate=0.0)
    drafter.generation_config.draft_mode = "tree"
    forwards = []
    hook = target.register_forward_hook(lambda *args: forwards.append(1))
    try:
        with pytest.raises(ValueError, match=r"keeps recurrent state in layers \[0.*\] \(config.layer_types\), which "
                                             r"hf_chainflow cannot fork .* without `assistant_model`"):
            target.generate(PROMPT, max_new_tokens=4, do_sample=False, assistant_model=drafter)
    finally:
        hook.remove()
    assert not forwards


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
@pytest.mark.parametrize("route", ["chain", "tree", "custom_generate"])
def test_an_unbound_drafter_is_bound_to_the_generating_target(family, route, request):
    target = request.getfixturevalue("llama" if family == "llama" else "hybrid")
    reference = drafter_for(target)
    unbound = ChainFlowDrafter(reference.config).eval()
    unbound.load_state_dict(reference.state_dict())
    unbound.generation_config.draft_mode = "tree" if route == "tree" else "chain"
    ref = target.generate(PROMPT, max_new_tokens=10, do_sample=False)
    assert not unbound.is_bound
    if route == "custom_generate":
        out = target.generate(PROMPT, max_new_tokens=10, do_sample=False,
                              custom_generate=hf_chainflow.speculative_generate, drafter=unbound)
    else:
        out = target.generate(PROMPT, max_new_tokens=10, do_sample=False, assistant_model=unbound)
    assert torch.equal(out, ref)
    assert unbound.is_bound
    unbound.check_target(target)  # bound to this very target (another object would raise)
    # a refused call leaves the drafter unbound: a refusal of hf_chainflow's, and one of transformers' own
    # (an unused model kwarg, after them) unbinds it again
    fresh = ChainFlowDrafter(reference.config).eval()
    fresh.generation_config.draft_mode = unbound.generation_config.draft_mode
    with pytest.raises(ValueError, match="padded on the right"):
        target.generate(PROMPT.repeat(2, 1), attention_mask=RIGHT_PADDED, max_new_tokens=4, assistant_model=fresh)
    assert not fresh.is_bound
    with pytest.raises(ValueError, match="not used by the model"):
        target.generate(PROMPT, max_new_tokens=4, assistant_model=fresh, not_a_model_kwarg=1)
    assert not fresh.is_bound
    with pytest.raises(ValueError, match="padded on the right"):  # the direct route binds and unbinds the same way
        target.generate(PROMPT.repeat(2, 1), attention_mask=RIGHT_PADDED, max_new_tokens=4,
                        custom_generate=hf_chainflow.speculative_generate, drafter=fresh)
    assert not fresh.is_bound


def test_unbound_and_mismatched_drafters(llama):
    unbound = ChainFlowDrafter(ChainFlowConfig.for_target(llama.config, num_blocks=1, num_heads=4)).eval()
    other = tiny_target("qwen3", hidden_size=32)
    with pytest.raises(ValueError, match="mismatched: \\['hidden_size'"):
        other.generate(PROMPT, max_new_tokens=4, assistant_model=unbound)  # a drafter for another target
    assert not unbound.is_bound
    with pytest.raises(ValueError, match="mismatched: \\['hidden_size'"):
        unbound.bind_target(other)
    assert not unbound.is_bound  # a refused bind leaves the drafter unbound
    wrong_vocab = tiny_target("llama", vocab_size=300)
    with pytest.raises(ValueError, match="vocab_size"):
        unbound.bind_target(wrong_vocab)
    twin = tiny_target("llama", seed=5)  # same fingerprint, another model object
    bound_to_twin = drafter_for(twin)
    with pytest.raises(ValueError, match="bound to another target"):
        llama.generate(PROMPT, max_new_tokens=4, assistant_model=bound_to_twin)


def test_unsupported_attention_in_own_loop():
    target = tiny_target("llama")
    target.config._attn_implementation = "flex_attention"
    drafter = drafter_for(target)
    drafter.generation_config.draft_mode = "tree"
    with pytest.raises(ValueError, match="attention implementation"):
        target.generate(PROMPT, max_new_tokens=4, assistant_model=drafter)


# ---------------------------------------------------------------------------------------------- untouched
# transformers' signatures the `generate` hook binds its arguments against (transformers 5.24): name, kind, default
# (`...`: none). The hook passes every argument on by these names; a change in transformers fails here first.
GENERATE_PARAMETERS = [
    ("self", "POSITIONAL_OR_KEYWORD", ...), ("inputs", "POSITIONAL_OR_KEYWORD", None),
    ("generation_config", "POSITIONAL_OR_KEYWORD", None), ("logits_processor", "POSITIONAL_OR_KEYWORD", None),
    ("stopping_criteria", "POSITIONAL_OR_KEYWORD", None), ("prefix_allowed_tokens_fn", "POSITIONAL_OR_KEYWORD", None),
    ("synced_gpus", "POSITIONAL_OR_KEYWORD", None), ("assistant_model", "POSITIONAL_OR_KEYWORD", None),
    ("streamer", "POSITIONAL_OR_KEYWORD", None), ("negative_prompt_ids", "POSITIONAL_OR_KEYWORD", None),
    ("negative_prompt_attention_mask", "POSITIONAL_OR_KEYWORD", None), ("custom_generate", "POSITIONAL_OR_KEYWORD", None),
    ("kwargs", "VAR_KEYWORD", ...),
]
GET_CANDIDATE_GENERATOR_PARAMETERS = [
    ("self", "POSITIONAL_OR_KEYWORD", ...), ("generation_config", "POSITIONAL_OR_KEYWORD", ...),
    ("input_ids", "POSITIONAL_OR_KEYWORD", ...), ("inputs_tensor", "POSITIONAL_OR_KEYWORD", ...),
    ("logits_processor", "POSITIONAL_OR_KEYWORD", ...), ("model_kwargs", "POSITIONAL_OR_KEYWORD", ...),
    ("assistant_model", "POSITIONAL_OR_KEYWORD", None), ("target_tokenizer", "POSITIONAL_OR_KEYWORD", None),
    ("assistant_tokenizer", "POSITIONAL_OR_KEYWORD", None),
]


def _parameters(fn):
    import inspect

    return [(p.name, p.kind.name, ... if p.default is inspect.Parameter.empty else p.default)
            for p in inspect.signature(fn).parameters.values()]


def test_transformers_generate_signature_is_the_one_the_hook_was_written_against():
    integration = hf_chainflow.generation.hook
    assert _parameters(integration._original_generate) == GENERATE_PARAMETERS, (
        "transformers' `GenerationMixin.generate` signature changed: check what hf_chainflow.generation.hook._generate "
        "reads and passes on, then update GENERATE_PARAMETERS")
    assert _parameters(integration._original_get_candidate_generator) == GET_CANDIDATE_GENERATOR_PARAMETERS, (
        "transformers' `GenerationMixin._get_candidate_generator` signature changed: check "
        "hf_chainflow.generation.hook._get_candidate_generator, then update GET_CANDIDATE_GENERATOR_PARAMETERS")
    # the wrappers show (and bind against) transformers' own signatures
    assert _parameters(GenerationMixin.generate) == GENERATE_PARAMETERS
    assert _parameters(GenerationMixin._get_candidate_generator) == GET_CANDIDATE_GENERATOR_PARAMETERS
    assert set(integration._GENERATE_PARAMETERS_USED) <= {name for name, _, _ in GENERATE_PARAMETERS}


def test_other_generate_calls_are_untouched(llama):
    assert getattr(GenerationMixin.generate, "_chainflow", False)
    ref = hf_chainflow.generation.hook._original_generate(llama, PROMPT, max_new_tokens=10, do_sample=False)
    assert torch.equal(llama.generate(PROMPT, max_new_tokens=10, do_sample=False), ref)
    assert torch.equal(llama.generate(PROMPT, max_new_tokens=10, do_sample=False, prompt_lookup_num_tokens=3), ref)
    seen = []
    original = hf_chainflow.generation.hook._original_get_candidate_generator

    def spy(self, *args, **kwargs):
        gen = hf_chainflow.generation.hook._get_candidate_generator(self, *args, **kwargs)
        seen.append(type(gen))
        return gen

    assistant = tiny_target("llama", num_layers=1, seed=9)
    GenerationMixin._get_candidate_generator = spy
    try:
        out = llama.generate(PROMPT, max_new_tokens=10, do_sample=False, assistant_model=assistant)
        llama.generate(PROMPT, max_new_tokens=10, do_sample=False, assistant_model=drafter_for(llama))
    finally:
        GenerationMixin._get_candidate_generator = hf_chainflow.generation.hook._get_candidate_generator
    assert torch.equal(out, ref)
    assert seen == [AssistedCandidateGenerator, ChainFlowCandidateGenerator]
    assert original is not hf_chainflow.generation.hook._get_candidate_generator
