"""Hybrid (Gated DeltaNet) state forking: installation, per-node states/windows, read-only verify, commit."""

import copy
import functools

import pytest
import torch
from torch import nn
from transformers import DynamicCache, Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

from hf_chainflow.generation.verification import RaggedRows, commit_batch, select_rows, verify_forward_batch
from hf_chainflow.generation.hybrid import committed_length, gdn_layers, is_hybrid_target, prepare_hybrid_target
from hf_chainflow.testing import tiny_target
from hf_chainflow.generation.verification import build_verify_inputs, commit, verify_forward

from _trees import PREFIX_LEN, TREE_PARENTS, make_tree, plain, prefilled  # noqa: F401

ATOL = 1e-4
ROOT = 17





@functools.lru_cache(maxsize=None)
def qwen35(attn: str = "sdpa"):
    return tiny_target("qwen3_5", attn_implementation=attn)


def linear_states(cache):
    """`{layer_idx: (conv_state, recurrent_state)}` of the cache's linear-attention layers."""
    return {i: (layer.conv_states[0], layer.recurrent_states[0])
            for i, layer in enumerate(cache.layers) if hasattr(layer, "conv_states")}


# ----------------------------------------------------------------------------------------------------------------
# Installation
# ----------------------------------------------------------------------------------------------------------------
def test_prepare_is_local_idempotent_and_transparent():
    model = tiny_target("qwen3_5", seed=3)
    other = tiny_target("qwen3_5", seed=3)
    keys = list(model.state_dict())
    ids = torch.tensor([[5, 9, 33, 120, 7]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
    layers = prepare_hybrid_target(model)
    assert sorted(layers) == [i for i, t in enumerate(model.config.layer_types) if t == "linear_attention"]
    assert all(isinstance(m, Qwen3_5GatedDeltaNet) and type(m) is not Qwen3_5GatedDeltaNet for m in layers.values())
    assert prepare_hybrid_target(model) == layers  # idempotent
    assert gdn_layers(model) == layers
    assert list(model.state_dict()) == keys
    assert all(type(m) is Qwen3_5GatedDeltaNet for m in gdn_layers(other).values())  # nothing global
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, before, atol=0, rtol=0)  # plain forward unchanged
        # plain cached decode, unchanged too
        c1, c2 = DynamicCache(config=model.config), DynamicCache(config=other.config)
        for step in ([5, 9, 33], [120], [7, 8]):
            torch.testing.assert_close(plain(model, c1, step), plain(other, c2, step), atol=0, rtol=0)


def test_hybrid_detection():
    assert is_hybrid_target(qwen35())
    assert not is_hybrid_target(tiny_target("llama"))
    assert prepare_hybrid_target(tiny_target("llama")) == {}

    class FakeRecurrent(nn.Module):  # recurrent layers of a kind we cannot fork
        def __init__(self):
            super().__init__()
            self.config = type("Cfg", (), {"layer_types": ["mamba", "full_attention"]})()

    with pytest.raises(ValueError, match="not Gated DeltaNet"):
        prepare_hybrid_target(FakeRecurrent())


# ----------------------------------------------------------------------------------------------------------------
# Tree-aware GDN maths
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["chunk", "fork"])
def test_every_node_state_and_window_match_its_path(method):
    """For every node, the recorded conv window and the (stored or rebuilt) recurrent state equal the cache of a
    plain forward over prefix + root + the node's path."""
    model = qwen35()
    cache = prefilled(model)
    tree = make_tree()
    out = verify_forward(model, copy.deepcopy(cache), ROOT, tree, method=method)
    records = out.handle.hybrid.records
    assert sorted(records) == sorted(gdn_layers(model))
    for node in [-1] + list(range(tree.num_nodes)):  # -1: the root alone
        path = tree.path_to(node) if node >= 0 else []
        ref = copy.deepcopy(cache)
        plain(model, ref, [ROOT] + tree.tokens[path].tolist())
        for idx, (conv, state) in linear_states(ref).items():
            torch.testing.assert_close(records[idx].window[:, :, node + 1], conv, atol=ATOL, rtol=0)
            torch.testing.assert_close(records[idx].state(node + 1), state, atol=ATOL, rtol=0)


def test_chunk_and_fork_agree():
    model = qwen35()
    cache = prefilled(model)
    tree = make_tree(seed=4)
    chunk = verify_forward(model, copy.deepcopy(cache), ROOT, tree, method="chunk")
    fork = verify_forward(model, copy.deepcopy(cache), ROOT, tree, method="fork")
    torch.testing.assert_close(chunk.logits, fork.logits, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="method"):
        verify_forward(model, copy.deepcopy(cache), ROOT, tree, method="scan")


def test_verify_reads_but_never_writes_linear_states():
    model = qwen35()
    cache = prefilled(model)
    before = {i: (c.clone(), s.clone(), c.data_ptr(), s.data_ptr()) for i, (c, s) in linear_states(cache).items()}
    out = verify_forward(model, cache, ROOT, make_tree())
    for i, (c, s) in linear_states(cache).items():
        assert torch.equal(c, before[i][0]) and torch.equal(s, before[i][1])
    commit(model, cache, PREFIX_LEN, [0, 2], out.handle)
    for i, (c, s) in linear_states(cache).items():  # committed in place: same storage
        assert (c.data_ptr(), s.data_ptr()) == before[i][2:]
        assert not torch.equal(s, before[i][1])


def test_stock_gdn_under_tree_mask_is_wrong():
    """Control: the 4-D mask alone (stock GDN layers treat the flattened tree as a chain) gives different logits,
    so the tree-vs-path checks are sensitive to the GDN path."""
    model = tiny_target("qwen3_5")  # never prepared
    cache = prefilled(model)
    tree = make_tree()
    inp = build_verify_inputs(ROOT, tree, PREFIX_LEN)
    with torch.no_grad():
        stock = model(input_ids=inp.input_ids, position_ids=inp.position_ids, attention_mask=inp.attention_mask,
                      cache=copy.deepcopy(cache), use_cache=True).logits[0]
    tree_logits = verify_forward(model, copy.deepcopy(cache), ROOT, tree).logits
    assert (stock - tree_logits).abs().max() > 100 * ATOL


@pytest.mark.parametrize("method", ["chunk", "fork"])
def test_hybrid_empty_prefix(method):
    """No prefix: the GDN layers start from zero states and the commit initialises the cache's states."""
    model = qwen35()
    tree = make_tree()
    live = DynamicCache(config=model.config)
    out = verify_forward(model, live, ROOT, tree, method=method)
    accepted = [1, 4, 11]
    commit(model, live, 0, accepted, out.handle)
    ref = DynamicCache(config=model.config)
    plain(model, ref, [ROOT] + tree.tokens[accepted].tolist())
    for (c1, s1), (c2, s2) in zip(linear_states(live).values(), linear_states(ref).values(), strict=True):
        torch.testing.assert_close(c1, c2, atol=ATOL, rtol=0)
        torch.testing.assert_close(s1, s2, atol=ATOL, rtol=0)
    torch.testing.assert_close(plain(model, live, [3, 4]), plain(model, ref, [3, 4]), atol=ATOL, rtol=0)


def test_two_rounds_then_decode():
    """Round 1 on a tree (branch path), round 2 on a chain, then plain decode: equals the straight-line run."""
    model = qwen35("eager")
    cache = prefilled(model)
    ref = copy.deepcopy(cache)
    tree = make_tree()
    out = verify_forward(model, cache, ROOT, tree)
    commit(model, cache, PREFIX_LEN, [1, 4], out.handle)
    chain = make_tree(parents=[-1, 0, 1, 2], seed=9)
    out = verify_forward(model, cache, 50, chain, method="fork")
    commit(model, cache, PREFIX_LEN + 3, [0, 1], out.handle)
    plain(model, ref, [ROOT] + tree.tokens[[1, 4]].tolist() + [50] + chain.tokens[[0, 1]].tolist())
    torch.testing.assert_close(plain(model, cache, [8]), plain(model, ref, [8]), atol=ATOL, rtol=0)


def test_batched_commit_and_row_cut_keep_the_cache_length():
    """`commit_batch` and `select_rows` leave `cache.get_seq_length()` (from transformers 5.25 it reads layer 0, a
    linear-attention layer with its own token count) equal to the attention layers' length, so a plain forward with
    default positions afterwards equals the straight-line run."""
    model = qwen35()
    ids = torch.randint(3, 256, (2, PREFIX_LEN), generator=torch.Generator().manual_seed(4))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
    rows = RaggedRows.from_attention_mask(torch.ones(2, PREFIX_LEN, dtype=torch.long))
    trees = [make_tree(), make_tree(parents=[-1, 0, 1], seed=2)]
    out = verify_forward_batch(model, cache, rows, [ROOT, 50], trees)
    commit_batch(model, cache, rows, [[1, 4], [0]], out.handle)
    assert committed_length(cache) == cache.get_seq_length() == rows.cache_length == PREFIX_LEN + 3
    select_rows(cache, rows, [1])
    assert committed_length(cache) == cache.get_seq_length() == rows.cache_length == PREFIX_LEN + 2
    ref = DynamicCache(config=model.config)
    plain(model, ref, ids[1].tolist() + [50, int(trees[1].tokens[0])])
    torch.testing.assert_close(plain(model, cache, [8]), plain(model, ref, [8]), atol=ATOL, rtol=0)


def test_commit_refuses_a_mutated_state():
    model = qwen35()
    cache = prefilled(model)
    out = verify_forward(model, cache, ROOT, make_tree())
    next(iter(linear_states(cache).values()))[1].mul_(1.0)  # someone wrote the state after verify
    with pytest.raises(ValueError, match="changed between"):
        commit(model, cache, PREFIX_LEN, [0], out.handle)


# ----------------------------------------------------------------------------------------------------------------
# Qwen3-Next (same GDN maths, fused head-interleaved projections)
# ----------------------------------------------------------------------------------------------------------------
def tiny_qwen3_next():
    config = Qwen3NextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        layer_types=["linear_attention", "full_attention"] * 2, max_position_embeddings=512,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen3NextForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def test_qwen3_next_tree_and_commit():
    model = tiny_qwen3_next()
    cache = prefilled(model)
    tree = make_tree()
    live = copy.deepcopy(cache)
    out = verify_forward(model, live, ROOT, tree)
    for leaf in (10, 11, 6, 7):
        path = tree.path_to(leaf)
        ref = plain(model, copy.deepcopy(cache), [ROOT] + tree.tokens[path].tolist())
        torch.testing.assert_close(out.logits[[0] + [i + 1 for i in path]], ref, atol=ATOL, rtol=0)
    commit(model, live, PREFIX_LEN, [0, 3, 7], out.handle)
    ref_cache = copy.deepcopy(cache)
    plain(model, ref_cache, [ROOT] + tree.tokens[[0, 3, 7]].tolist())
    torch.testing.assert_close(plain(model, live, [9]), plain(model, ref_cache, [9]), atol=ATOL, rtol=0)


def test_inference_mode_round():
    """Caches built under `torch.inference_mode` (as some loops do) verify and commit too."""
    model = qwen35()
    tree = make_tree()
    with torch.inference_mode():
        cache = prefilled(model)
        ref = copy.deepcopy(cache)
        out = verify_forward(model, cache, ROOT, tree)
        commit(model, cache, PREFIX_LEN, [0, 2, 5], out.handle)
        plain(model, ref, [ROOT] + tree.tokens[[0, 2, 5]].tolist())
        torch.testing.assert_close(plain(model, cache, [4]), plain(model, ref, [4]), atol=ATOL, rtol=0)
