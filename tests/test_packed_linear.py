"""`PackedLinear` (`hf_chainflow.generation.packed_linear`): the drafting round's head products with the weight packed once for
oneDNN compute `F.linear` bit for bit, eager and compiled, and the drafter's serving tables hold them."""

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

from hf_chainflow import ChainFlowDrafter
from hf_chainflow.generation import serving
from hf_chainflow.generation.packed_linear import PackedLinear
from hf_chainflow.generation.search import search_levels
from hf_chainflow.generation.settings import SearchSettings
from hf_chainflow.testing import tiny_target

from _windows import tiny_drafter_config

BF16_ONEDNN = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _weight(rows, cols, dtype, seed=0):
    return (torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.5).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(300, 64), (1000, 24)])
def test_the_product_is_f_linear_bit_for_bit(dtype, shape):
    weight = _weight(*shape, dtype)
    linear = PackedLinear(weight)
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 3, 8, 17):
        x = torch.randn(rows, shape[1], generator=gen).to(dtype)
        assert torch.equal(linear(x), F.linear(x, weight))
    assert linear.dtype == dtype and linear.weight is weight


def test_only_bfloat16_cpu_weights_are_packed():
    assert PackedLinear(_weight(50, 16, torch.float32)).packed is None
    packed = PackedLinear(_weight(50, 16, torch.bfloat16)).packed
    if BF16_ONEDNN:
        assert packed is not None and packed.is_mkldnn
    else:  # no oneDNN bfloat16 kernels: the plain product
        assert packed is None


def test_copies_and_pickles_pack_again():
    linear = PackedLinear(_weight(200, 32, torch.bfloat16))
    x = _weight(4, 32, torch.bfloat16, seed=5)
    for other in (copy.deepcopy(linear), pickle.loads(pickle.dumps(linear))):
        assert other.weight is not linear.weight and torch.equal(other.weight, linear.weight)
        assert (other.packed is None) == (linear.packed is None)
        assert torch.equal(other(x), linear(x))


@pytest.mark.slow
def test_the_compiled_product_is_the_eager_one():
    linear = PackedLinear(_weight(500, 48, torch.bfloat16))
    x = _weight(6, 48, torch.bfloat16, seed=2)

    def scores(x, linear):  # the product is an opaque kernel: bit for bit; inductor fuses the softmax its own way
        product = linear(x)
        return product, product.float().log_softmax(-1)

    with torch.no_grad():
        compiled = torch.compile(scores, dynamic=False, options={"cpp_wrapper": True})
        (product, logp), (eager_product, eager_logp) = compiled(x, linear), scores(x, linear)
    assert torch.equal(product, eager_product) and torch.equal(product, F.linear(x, linear.weight))
    torch.testing.assert_close(logp, eager_logp)


def _drafter():
    target = tiny_target("llama", num_layers=2)
    torch.manual_seed(0)
    drafter = ChainFlowDrafter(tiny_drafter_config(target, candidate_budget=30)).bind_target(target).eval()
    with torch.no_grad():  # zero-initialised feedback outputs: give them weight so the folded product matters
        for module in (drafter.path_head, drafter.markov_head):
            for param in module.parameters():
                param.copy_(torch.randn(param.shape) * 0.3)
    return drafter


def test_serving_tables_hold_the_packed_products_and_follow_the_weights():
    drafter = _drafter()
    tables = serving.serving_tables(drafter)
    assert tables.head_linear.weight is tables.head and tables.folded_linear.weight is tables.folded[0]
    again = serving.serving_tables(drafter)
    assert again.head_linear is tables.head_linear and again.folded_linear is tables.folded_linear  # cached
    with torch.no_grad():
        drafter.path_head.out.weight.mul_(2.0)  # the folded matrix is rebuilt, and packed again
    moved = serving.serving_tables(drafter)
    assert moved.folded_linear is not tables.folded_linear and moved.folded_linear.weight is moved.folded[0]
    assert moved.head_linear is tables.head_linear


def test_drafts_with_packed_products_are_the_plain_drafts():
    drafter = _drafter()
    cfg = drafter.config
    C, D, V = cfg.context_size, cfg.context_state_size, cfg.vocab_size
    gen = torch.Generator().manual_seed(3)
    settings = SearchSettings(mode="tree", tree_width=5, tree_depth=4, tree_budget=7, max_depth=drafter.max_draft_depth)
    with torch.no_grad():
        for _ in range(10):
            states = drafter.predict_states(torch.randn(2, C, D, generator=gen) * 3.0,
                                            velocity=serving.serving_velocity(drafter))  # as served
            tails = torch.randint(3, V, (2, cfg.path_order), generator=gen)
            tables = serving.serving_tables(drafter)
            packed = search_levels(drafter, tables, states, tails, settings)
            plain = search_levels(drafter, tables._replace(head_linear=None, folded_linear=None), states, tails, settings)
            for a, b in zip(packed[:4], plain[:4]):
                assert torch.equal(a, b)
