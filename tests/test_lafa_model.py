"""The Lafa drafter and its fused forward (issue 64, item 1), on tiny float32 Llama and Qwen3 targets.

- Exact: the verify rows of a fused forward give a plain forward's logits under a drafter with large random weights,
  and the commit leaves the cache a plain forward of the accepted tokens leaves (`exactness_gaps`); each candidate
  block is scored as the drafter's forward over that block alone after the prefix and its accepted path; the noise
  rows do change with each kind of the drafter's weights (so these checks can fail).
- Mutations, each monkeypatched in, make the exactness check fail: the drafter's weights on every row, a verify
  row that sees a noise row, a commit that keeps a noise row.
- Untouched target: after a fused call (and after one that fails) a plain forward is bitwise the one before, the
  modules are the same objects of the same classes with no hook left, the weights unchanged.
- Files: save/load keeps the file names and every tensor; `push_to_hub` against a mocked Hub; `AutoConfig`.
- Bad input is refused before anything runs: `block_size < 2`, a drafter of another target (both fingerprints
  named), a hybrid Qwen3.5 target (`LafaTargetError`: Gated DeltaNet layers cannot see a block bidirectionally), a
  draft that is not a short chain, lengths out of range.
"""

import copy
import io
import json

import pytest
import torch
from safetensors.torch import load as load_safetensors
from transformers import AutoConfig, AutoModel, DynamicCache

import hf_chainflow.generation.lafa as lafa_gen
from hf_chainflow import LafaConfig, LafaDrafter
from hf_chainflow.generation import verification
from hf_chainflow.generation.lafa import commit_fused, fused_verify_forward, lafa_extra_inputs
from hf_chainflow.generation.tree import DraftTree
from hf_chainflow.generation.verification import RaggedRows
from hf_chainflow.models.lafa.binding_lafa import LafaTargetError
from hf_chainflow.testing import tiny_target

from _trees import PREFIX_LEN as PREFIX, plain, prefilled

ATOL = 1e-5
ROOT = 17
FAMILIES = ["llama", "qwen3"]


@pytest.fixture(scope="module", params=FAMILIES)
def target(request):
    return tiny_target(request.param)


def random_lafa(target, block_size=4, std=0.5, seed=0, **overrides):
    """A drafter bound to `target` with large random weights everywhere (LoRA B, norm modulations, time input)."""
    lafa = LafaDrafter(LafaConfig.for_target(target.config, block_size=block_size, **overrides))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lafa.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    return lafa.bind_target(target)


def draft_of(block_size, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (block_size - 1,), generator=gen)


def exactness_gaps(target, lafa, accepted, num_nodes=None):
    """(verify gap, commit gap): the largest difference between the fused forward's verify rows and a plain forward
    of `[root] + draft`, and between a forward after `commit_fused(accepted)` and one after a plain forward of the
    accepted tokens (inf when the caches' lengths differ)."""
    B = lafa.config.block_size
    draft = draft_of(B)[: B - 1 if num_nodes is None else num_nodes]
    cache = prefilled(target)
    want = plain(target, copy.deepcopy(cache), [ROOT, *draft.tolist()])
    live, rows = copy.deepcopy(cache), RaggedRows([0], [PREFIX])
    out = fused_verify_forward(target, lafa, live, rows, [ROOT], [DraftTree.chain(draft)])
    verify_gap = (out.verify_logits[0] - want).abs().max().item()
    commit_fused(target, live, rows, [accepted], out)
    ref = copy.deepcopy(cache)
    plain(target, ref, [ROOT, *draft[:accepted].tolist()])
    if live.get_seq_length() != ref.get_seq_length() or rows.lengths != [PREFIX + accepted + 1]:
        return verify_gap, float("inf")
    probe = [5, 99, 42]
    return verify_gap, (plain(target, live, probe) - plain(target, ref, probe)).abs().max().item()


# --------------------------------------------------------------------------------------------------------------
# Exact
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [2, 3, 4])
def test_verify_rows_and_commit_are_plain_under_a_large_random_drafter(target, block_size):
    lafa = random_lafa(target, block_size)
    for accepted in range(block_size):
        verify_gap, commit_gap = exactness_gaps(target, lafa, accepted)
        assert verify_gap <= ATOL and commit_gap <= ATOL, (block_size, accepted, verify_gap, commit_gap)
    verify_gap, commit_gap = exactness_gaps(target, lafa, 0, num_nodes=0)  # a first round: the root alone
    assert verify_gap <= ATOL and commit_gap <= ATOL


def test_each_candidate_block_sees_the_prefix_its_accepted_path_and_itself(target):
    """Block a of a fused round equals the drafter's forward over that block alone (bidirectional) after the prefix
    and `[root] + d_1 .. d_a`, at positions `past + a + 1 ..`."""
    B = 4
    lafa, draft, cache = random_lafa(target, B, std=0.2), draft_of(B), prefilled(target)
    out = fused_verify_forward(target, lafa, copy.deepcopy(cache), RaggedRows([0], [PREFIX]), [ROOT],
                               [DraftTree.chain(draft)])
    assert out.verify.logits.shape[1] == B + B * B  # n = B verify rows, B blocks of B noise rows
    for a in range(B):
        ref = copy.deepcopy(cache)
        plain(target, ref, [ROOT, *draft[:a].tolist()])
        past = PREFIX + a + 1
        with torch.no_grad():
            want = lafa(torch.zeros(1, B, dtype=torch.long), torch.ones(1, B, dtype=torch.bool),
                        attention_mask=torch.ones(1, 1, B, past + B, dtype=torch.bool),
                        position_ids=torch.arange(past, past + B)[None], cache=ref, use_cache=True).logits[0]
        got = out.block_logits(0, a)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        assert torch.equal(out.next_draft(0, a), got[1:].argmax(-1))


def test_a_batch_of_ragged_rows_is_exact_row_by_row(target):
    """Two left-padded rows of different lengths and draft lengths: each row's verify rows are its own plain
    forward, and the commit keeps each row's accepted prefix."""
    B = 3
    lafa = random_lafa(target, B)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (9,), generator=gen), torch.randint(3, 256, (6,), generator=gen)]
    ids = torch.zeros(2, 9, dtype=torch.long)
    mask = torch.zeros(2, 9, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, 9 - len(p):], mask[b, 9 - len(p):] = p, 1
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), cache=cache,
               use_cache=True)
    rows = RaggedRows.from_attention_mask(mask)
    drafts, roots = [torch.tensor([11, 12]), torch.tensor([40])], [ROOT, 23]
    out = fused_verify_forward(target, lafa, cache, rows, roots, [DraftTree.chain(d) for d in drafts])
    assert out.accepted_lengths == [[0, 1, 2], [0, 1]]
    singles = []
    for b, p in enumerate(prompts):
        single = DynamicCache(config=target.config)
        plain(target, single, p.tolist())
        want = plain(target, copy.deepcopy(single), [roots[b], *drafts[b].tolist()])
        torch.testing.assert_close(out.verify_logits[b, : len(want)], want, atol=ATOL, rtol=0)
        singles.append(single)
    commit_fused(target, cache, rows, [2, 0], out)
    for b, keep in enumerate([[ROOT, 11, 12], [23]]):
        plain(target, singles[b], keep)
    probe = torch.tensor([[5, 6], [5, 6]])
    positions = torch.tensor(rows.positions())[:, None] + torch.arange(2)
    full = torch.cat([torch.tensor([[start <= c < length for c in range(rows.cache_length)]
                                    for start, length in zip(rows.starts, rows.lengths)]).long(),
                      torch.ones(2, 2, dtype=torch.long)], 1)
    with torch.no_grad():
        got = target(input_ids=probe, attention_mask=full, position_ids=positions, cache=cache, use_cache=True).logits
    for b in range(2):
        torch.testing.assert_close(got[b], plain(target, singles[b], [5, 6]), atol=ATOL, rtol=0)


def test_the_noise_rows_change_with_each_kind_of_weight(target):
    """The noise rows' logits move with the LoRA, the norm modulations and the mask embedding (so the exactness
    checks above compare rows that the drafter does reach); the verify rows stay bitwise the same."""
    B = 3
    draft, cache = DraftTree.chain(draft_of(B)), prefilled(target)

    def run(lafa):
        return fused_verify_forward(target, lafa, copy.deepcopy(cache), RaggedRows([0], [PREFIX]), [ROOT], [draft])

    base = run(random_lafa(target, B))
    variants = {"lora": lambda m: [lo.lora_B.zero_() for layer in m.layers for lo in layer.lora.values()],
                "norms": lambda m: [p.zero_() for n, p in m.named_parameters() if "norm" in n],
                "mask embedding": lambda m: m.mask_embedding.mul_(-1.0)}
    for name, change in variants.items():
        lafa = random_lafa(target, B)
        with torch.no_grad():
            change(lafa)
        out = run(lafa)
        assert torch.equal(out.verify_logits, base.verify_logits), name
        moved = (out.verify.logits[0, B:] - base.verify.logits[0, B:]).abs().max().item()
        assert moved > 1e-2, (name, moved)
    fresh = LafaDrafter(LafaConfig.for_target(target.config, block_size=B)).bind_target(target)
    assert torch.equal(run(fresh).verify_logits, base.verify_logits)


# --------------------------------------------------------------------------------------------------------------
# Mutations: each makes the exactness check fail
# --------------------------------------------------------------------------------------------------------------
def test_mutation_the_weights_on_every_row_fails(target, monkeypatch):
    lafa = random_lafa(target, 3)
    monkeypatch.setattr(lafa_gen, "extra_row_mask",
                        lambda extra, extra_start, width, device=None: torch.ones(len(extra), width,
                                                                                  dtype=torch.bool, device=device))
    verify_gap, _ = exactness_gaps(target, lafa, 1)
    assert verify_gap > 1e-2


def test_mutation_a_verify_row_that_sees_a_noise_row_fails(target, monkeypatch):
    lafa = random_lafa(target, 3)
    original = verification.build_batch_verify_inputs

    def leaky(rows, roots, trees, **kwargs):
        inputs = original(rows, roots, trees, **kwargs)
        n, T = 1 + max(t.num_nodes for t in trees), rows.cache_length
        inputs.attention_mask[:, :, 1:n, T + n] = True  # every verify row but the root sees the first noise row
        return inputs

    monkeypatch.setattr(verification, "build_batch_verify_inputs", leaky)
    verify_gap, _ = exactness_gaps(target, lafa, 1)
    assert verify_gap > 1e-2


def test_mutation_a_commit_that_keeps_a_noise_row_fails(target, monkeypatch):
    lafa = random_lafa(target, 3)
    original = verification.commit_batch

    def keeps_noise(target_, cache, rows, accepted, handle):
        T, n = handle.cache_length, 1 + max(len(p) for p in handle.node_parents)
        for layer in cache.layers:  # the first noise row's K/V over the last kept verify row's
            last = T + len(accepted[0])
            layer.keys[:, :, last] = layer.keys[:, :, T + n]
            layer.values[:, :, last] = layer.values[:, :, T + n]
        original(target_, cache, rows, accepted, handle)

    monkeypatch.setattr(verification, "commit_batch", keeps_noise)
    verify_gap, commit_gap = exactness_gaps(target, lafa, 1)
    assert verify_gap <= ATOL and commit_gap > 1e-2


# --------------------------------------------------------------------------------------------------------------
# The target stays untouched
# --------------------------------------------------------------------------------------------------------------
def _hooks(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_a_plain_forward_after_a_fused_call_is_bitwise_the_one_before(target):
    ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        before = target(input_ids=ids).logits
    modules = [(name, m, type(m)) for name, m in target.named_modules()]
    weights = {k: v.clone() for k, v in target.state_dict().items()}
    hooks = _hooks(target)
    lafa = random_lafa(target, 4)
    exactness_gaps(target, lafa, 2)
    with pytest.raises(ValueError, match="cache"):  # a fused call that fails after the hooks went in
        fused_verify_forward(target, lafa, DynamicCache(config=target.config), RaggedRows([0], [PREFIX]), [ROOT],
                             [DraftTree.chain(draft_of(4))])
    with torch.no_grad():
        after = target(input_ids=ids).logits
    assert torch.equal(before, after)
    assert [(name, m, type(m)) for name, m in target.named_modules()] == modules
    assert _hooks(target) == hooks and lafa._active is None
    state = target.state_dict()
    assert state.keys() == weights.keys() and all(torch.equal(state[k], weights[k]) for k in weights)


# --------------------------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------------------------
FILES = {"config.json", "model.safetensors"}


def _same_tensors(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_save_and_load_keep_the_files_and_every_tensor(target, tmp_path):
    lafa = random_lafa(target, 3, lora_rank=4)
    lafa.save_pretrained(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == FILES
    saved = load_safetensors((tmp_path / "model.safetensors").read_bytes())
    assert _same_tensors(saved, lafa.state_dict())
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["model_type"], config["block_size"], config["lora_rank"]) == ("lafa", 3, 4)
    loaded = LafaDrafter.from_pretrained(tmp_path, target=target)
    assert loaded.is_bound and loaded.dtype == torch.float32 and _same_tensors(loaded.state_dict(), lafa.state_dict())
    fields = [{k: v for k, v in m.config.to_dict().items() if k != "_name_or_path"} for m in (loaded, lafa)]
    assert fields[0] == fields[1]
    assert isinstance(AutoConfig.from_pretrained(tmp_path), LafaConfig)
    assert _same_tensors(AutoModel.from_pretrained(tmp_path).state_dict(), lafa.state_dict())
    draft, cache = DraftTree.chain(draft_of(3)), prefilled(target)
    outs = [fused_verify_forward(target, m, copy.deepcopy(cache), RaggedRows([0], [PREFIX]), [ROOT], [draft])
            for m in (lafa, loaded)]
    assert torch.equal(outs[0].verify.logits, outs[1].verify.logits)


def test_push_to_hub_uploads_the_config_and_the_weights(tmp_path, monkeypatch):
    import transformers.utils.hub as hub

    target = tiny_target("llama")
    lafa = random_lafa(target, 3, lora_rank=4)
    uploaded = {}

    class Api:
        def create_repo(self, repo_id, **kwargs):
            return type("Repo", (), {"repo_id": repo_id})()

        def create_commit(self, repo_id, operations, **kwargs):
            for op in operations:
                with open(op.path_or_fileobj, "rb") as f:
                    uploaded[op.path_in_repo] = f.read()
            uploaded["repo_id"] = repo_id
            return "commit-url"

    class Card:
        def save(self, path):
            with open(path, "w") as f:
                f.write("card")

    monkeypatch.setattr(hub, "hf_api", Api)
    monkeypatch.setattr(hub, "create_and_tag_model_card", lambda *a, **k: Card())
    assert lafa.push_to_hub("me/lafa") == "commit-url"
    assert uploaded.pop("repo_id") == "me/lafa" and set(uploaded) == FILES | {"README.md"}
    assert json.load(io.BytesIO(uploaded["config.json"]))["model_type"] == "lafa"
    assert _same_tensors(load_safetensors(uploaded["model.safetensors"]), lafa.state_dict())


# --------------------------------------------------------------------------------------------------------------
# Bad input, refused before anything runs
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [1, 0, -3])
def test_a_block_size_below_two_is_refused(value):
    with pytest.raises(ValueError, match=rf"`block_size` must be an integer >= 2 .* got {value}\. Use e\.g\."):
        LafaConfig(block_size=value)
    with pytest.raises(ValueError, match="`block_size` must be an integer >= 2"):
        lafa_extra_inputs(value, 0)


@pytest.mark.parametrize("fields, message", [
    ({"time_embedding_size": 7}, "`time_embedding_size` must be even"),
    ({"lora_target_modules": ["qkv"]}, "`lora_target_modules` must be a non-empty list of distinct names"),
    ({"lora_target_modules": []}, "`lora_target_modules` must be a non-empty list"),
    ({"lora_rank": 0}, "`lora_rank` must be a positive integer"),
    ({"noise_std": -1.0}, "`noise_std` must be a non-negative finite number"),
])
def test_bad_config_fields_are_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        LafaConfig(**fields)


def test_a_drafter_saved_for_another_target_is_refused_naming_both(tmp_path):
    llama, qwen3 = tiny_target("llama"), tiny_target("qwen3")
    LafaDrafter(LafaConfig.for_target(llama.config, block_size=3)).save_pretrained(tmp_path)
    with pytest.raises(LafaTargetError, match=r"made for target \{'model_type': 'llama'.* but was given "
                                              r"Qwen3ForCausalLM \{'model_type': 'qwen3'.*mismatched: \['model_type'\]"):
        LafaDrafter.from_pretrained(tmp_path, target=qwen3)
    smaller = tiny_target("llama", hidden_size=32)
    with pytest.raises(LafaTargetError, match=r"mismatched: \['hidden_size'.*LafaConfig.for_target"):
        LafaDrafter.from_pretrained(tmp_path, target=smaller)
    llama.save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match="model_type='llama', not 'lafa': it is not a Lafa drafter"):
        LafaDrafter.from_pretrained(tmp_path / "llama")


def test_a_hybrid_target_is_refused_by_name(tmp_path):
    hybrid = tiny_target("qwen3_5")
    why = r"recurrent layers \['linear_attention'\].*cannot see itself bidirectionally"
    with pytest.raises(LafaTargetError, match=why):
        LafaConfig.for_target(hybrid.config)
    lafa = LafaDrafter(LafaConfig.for_target(tiny_target("llama").config, block_size=3))
    with pytest.raises(LafaTargetError, match=why):  # before the fingerprint: the reason is the layers
        lafa.bind_target(hybrid)
    assert not lafa.is_bound
    lafa.save_pretrained(tmp_path)
    with pytest.raises(LafaTargetError, match=why):  # before the weights load
        LafaDrafter.from_pretrained(tmp_path, target=hybrid)


def test_bad_fused_calls_are_refused_before_the_forward(target):
    lafa = random_lafa(target, 3)
    cache = prefilled(target)
    rows = RaggedRows([0], [PREFIX])
    cases = [
        (DraftTree.chain(torch.tensor([4, 5, 6])), {}, "at most block_size - 1 = 2"),
        (DraftTree(tokens=torch.tensor([4, 5]), parents=torch.tensor([-1, -1]), depths=torch.tensor([1, 1]),
                   logprobs=torch.zeros(2)), {}, "a Lafa draft is a chain"),
        (DraftTree.chain(torch.tensor([4, 5])), {"accepted_lengths": [0, 3]},
         "distinct increasing integers in 0 .. 2"),
        (DraftTree.chain(torch.tensor([4, 5])), {"accepted_lengths": [1, 0]}, "distinct increasing"),
    ]
    for tree, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            fused_verify_forward(target, lafa, cache, rows, [ROOT], [tree], **kwargs)
    unbound = LafaDrafter(LafaConfig.for_target(target.config, block_size=3))
    with pytest.raises(ValueError, match="not bound to a target"):
        fused_verify_forward(target, unbound, cache, rows, [ROOT], [DraftTree.chain(torch.tensor([4]))])
    assert cache.get_seq_length() == PREFIX and rows.lengths == [PREFIX] and lafa._active is None


def test_the_extra_inputs_and_a_subset_of_blocks():
    extra = lafa_extra_inputs(3, 2, accepted_lengths=[0, 2], noise_token_id=7)
    assert extra.input_ids.tolist() == [7] * 6 and extra.positions.tolist() == [1, 2, 3, 3, 4, 5]
    assert extra.sees_draft.tolist() == [[True, False, False]] * 3 + [[True, True, True]] * 3
    assert torch.equal(extra.sees_extra, torch.block_diag(torch.ones(3, 3), torch.ones(3, 3)).bool())
    target = tiny_target("llama")
    lafa, cache, tree = random_lafa(target, 3), prefilled(target), DraftTree.chain(torch.tensor([4, 5]))
    full = fused_verify_forward(target, lafa, copy.deepcopy(cache), RaggedRows([0], [PREFIX]), [ROOT], [tree])
    some = fused_verify_forward(target, lafa, copy.deepcopy(cache), RaggedRows([0], [PREFIX]), [ROOT], [tree],
                                accepted_lengths=[0, 2])
    assert some.verify.logits.shape[1] == 3 + 6
    torch.testing.assert_close(some.block_logits(0, 2), full.block_logits(0, 2), rtol=1e-5, atol=1e-3)
    with pytest.raises(ValueError, match=r"drafted candidate blocks for accepted lengths \[0, 2\], not 1"):
        some.block_logits(0, 1)
