"""ChainFlowConfig validation, drafter shapes, Hub-format save/load, target binding, variants, alignment."""

import copy
import inspect
import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import AutoConfig, AutoModel

import hf_chainflow  # noqa: F401  (registers the `chainflow` model type)
from hf_chainflow import ChainFlowConfig, ChainFlowDrafter, DraftTree
from hf_chainflow.generation import drafting, serving
from hf_chainflow.generation.search import folded_feedback_logits
from hf_chainflow.training.resize import resize_markov_head, resize_path_head
from hf_chainflow.testing import tiny_target

SMALL = dict(num_blocks=1, num_heads=4, path_hidden_size=32, markov_rank=16)


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama")


@pytest.fixture(scope="module")
def context(target):
    ids = torch.randint(3, 256, (1, 14), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states[-1]
    return ids, hidden


def make(target, **overrides):
    torch.manual_seed(0)
    return ChainFlowDrafter(ChainFlowConfig.for_target(target.config, **{**SMALL, **overrides})).eval()


# ---------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("kwargs,needle", [
    (dict(source="gaussian"), "`source` must be one of"),
    (dict(feedback="path"), "`feedback` must be one of"),
    (dict(attention="sliding"), "`attention` must be one of"),
    (dict(num_blocks=0), "`num_blocks` must be a positive integer, got 0"),
    (dict(num_experts=3), r"`num_draft_positions` \(8\) must be divisible by `num_experts` \(3\)"),
    (dict(num_heads=5), r"`flow_hidden_size` \(144\) must be divisible by `num_heads` \(5\)"),
    (dict(use_vae=False, latent_size=100), "latent_size` must equal `target_hidden_size`"),
    (dict(context_size=20), "at most `vae_window`"),
    (dict(source="extrapolate", context_size=1), "needs two context latents"),
    (dict(shortlist=[]), "at least one token id"),
    (dict(shortlist=[1, 60000]), r"ids must lie in \[0, vocab_size=49152\)"),
    (dict(shortlist=[7, 5, 5, 6, 7]), r"distinct .* got \[5, 7\] more than once. Pass `sorted\(set\(shortlist\)\)`"),
    (dict(candidate_budget=-1), "`candidate_budget` must be a positive integer"),
    (dict(initializer_range=-1.0), r"`initializer_range` is the std .* must be a positive number .* got -1.0"),
    (dict(initializer_range=0), r"`initializer_range` .* must be a positive number .* got 0\."),
    (dict(use_vae="no"), r"`use_vae` must be True or False, got 'no' \(str\)"),
    (dict(tie_word_embeddings=1), r"`tie_word_embeddings` must be True or False, got 1 \(int\)"),
    (dict(shortlist="abc"), r"`shortlist` must be None .* or a list of integer token ids, got str 'abc'"),
    (dict(shortlist=[3, 4.0]), r"`shortlist` must hold integer token ids, got 4.0 \(float\) at index 1"),
])
def test_config_validation_errors(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        ChainFlowConfig(**kwargs)


def test_config_defaults_and_for_target(target):
    cfg = ChainFlowConfig()
    assert (cfg.latent_size, cfg.context_size, cfg.num_draft_positions, cfg.num_experts, cfg.num_blocks) == (
        576 // 4, 8, 8, 2, 8)
    assert cfg.expert_size == 4 and cfg.source == "extrapolate" and cfg.feedback == "markov+path"
    cfg = ChainFlowConfig.for_target(target.config, num_blocks=3)
    assert cfg.target_hidden_size == 64 and cfg.vocab_size == 256 and cfg.latent_size == 16
    assert cfg.target_fingerprint()["model_type"] == "llama" and cfg.num_blocks == 3
    with pytest.raises(ValueError, match="integer `hidden_size` and `vocab_size`"):
        ChainFlowConfig.for_target(object())


def test_for_target_copies_the_special_token_ids(target):
    # transformers' pipelines accept an assistant as sharing the target's tokenizer only when vocab_size and the
    # bos/eos/pad ids are equal; `for_target` copies them as the target states them (None included).
    tc = copy.deepcopy(target.config)
    tc.bos_token_id, tc.eos_token_id, tc.pad_token_id = 1, [2, 5], None
    cfg = ChainFlowConfig.for_target(tc)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, [2, 5], None)
    tc.pad_token_id = 3
    assert ChainFlowConfig.for_target(tc).pad_token_id == 3
    tc.pad_token_id = tc.vocab_size + 10  # a pad outside the lm_head's vocabulary is not a drafter token
    assert ChainFlowConfig.for_target(tc).pad_token_id is None


# ---------------------------------------------------------------------------------------------------- shapes
def test_training_forward_shapes(target):
    drafter = make(target).bind_target(target).train()
    B, C, K, p, D = 3, 8, 8, 8, 64
    out = drafter(context_states=torch.randn(B, C, D), target_states=torch.randn(B, K, D),
                  target_tokens=torch.randint(0, 256, (B, K)), prev_tokens=torch.randint(0, 256, (B, p - 1 + K)))
    Z, N = drafter.config.latent_size, drafter.config.train_flow_steps
    assert out.velocity.shape == out.velocity_target.shape == (B, K, Z)
    assert out.predicted_states.shape == (B, N, K, D) and out.corrected_states.shape == (B, K, D)
    assert out.logits.shape == out.marginal_logits.shape == (B, K, 256) and out.labels.shape == (B, K)
    assert out.reconstructed_states.shape == (B, C + K, D) and out.kl.dim() == 0
    loss = out.logits.logsumexp(-1).mean() + out.velocity.pow(2).mean()
    loss.backward()
    assert all(p.grad is not None for n, p in drafter.named_parameters() if n.startswith("velocity"))
    assert target.lm_head.weight.grad is None  # the target is never trained through the drafter


def test_chain_and_tree_shapes(target, context):
    ids, hidden = context
    drafter = make(target).bind_target(target)
    chain = drafting.draft(drafter, hidden, ids, mode="chain", num_tokens=5)
    assert isinstance(chain, DraftTree) and chain.num_nodes == 5 and chain.is_chain
    assert chain.depths.tolist() == [1, 2, 3, 4, 5]
    tree = drafting.draft(drafter, hidden, ids, mode="tree", tree_width=6, tree_depth=4)
    assert tree.num_nodes == 6 * 4 and tree.max_depth == 4
    assert all(tree.parents[i] < i for i in range(tree.num_nodes))
    for i in range(tree.num_nodes):  # parent is one level up; root children at depth 1
        parent = int(tree.parents[i])
        assert int(tree.depths[i]) == (1 if parent < 0 else int(tree.depths[parent]) + 1)
    # cumulative log-probabilities: each level's kept nodes are the best W among its candidates
    assert torch.isfinite(tree.logprobs).all() and (tree.logprobs <= 0).all()
    sampled = drafting.draft(drafter, hidden, ids, mode="chain", num_tokens=3, do_sample=True)
    assert sampled.draft_probs.shape == (3, 256)
    assert torch.allclose(sampled.draft_probs.sum(-1), torch.ones(3), atol=1e-5)
    q_of_token = sampled.draft_probs.gather(1, sampled.tokens[:, None])[:, 0]
    assert (q_of_token > 0).all()
    with pytest.raises(ValueError, match="tree_depth"):
        drafting.draft(drafter, hidden, ids, mode="tree", tree_width=2, tree_depth=9)
    with pytest.raises(ValueError, match="draws chains only"):
        drafting.draft(drafter, hidden, ids, mode="tree", do_sample=True)


def test_one_drafter_pass_per_round(target, context):
    """Whatever the draft shape, the flow runs once per round; only the feedback heads run per node."""
    ids, hidden = context
    drafter = make(target).bind_target(target)
    calls = {"velocity": 0, "path": 0}
    # the first expert's time embedding runs once per velocity evaluation (stacked or expert by expert)
    h1 = drafter.velocity.experts[0].time_mlp.register_forward_hook(
        lambda *a: calls.__setitem__("velocity", calls["velocity"] + 1))
    h2 = drafter.path_head.mlp.register_forward_hook(lambda *a: calls.__setitem__("path", calls["path"] + 1))
    drafting.draft(drafter, hidden, ids, mode="tree", tree_width=8, tree_depth=4)
    h1.remove(), h2.remove()
    assert calls == {"velocity": drafter.config.num_flow_steps, "path": 4}  # one batched call per level


def test_draft_inputs_are_checked_before_drafting(target, context):
    ids, hidden = context
    drafter = make(target).bind_target(target)
    D = hidden.shape[-1]
    cases = [
        (dict(input_ids=ids[0]), r"`input_ids` must be .* shape \(1, L\).* got \(14,\); e.g. `ids\[None\]`"),
        (dict(input_ids=ids.repeat(2, 1)), r"`input_ids` must be .* got \(2, 14\)"),
        (dict(input_ids=ids[:, :0]), r"`input_ids` must be .* L >= 1"),
        (dict(input_ids=ids.float()), r"`input_ids` must be"),
        (dict(hidden_states=hidden[..., : D // 2]), rf"`hidden_states` must be .* \(1, T, {D}\).* got \(1, 14, {D // 2}\)"),
        (dict(hidden_states=hidden[0]), r"`hidden_states` must be .* got \(14, 64\)"),
        (dict(do_sample=True, temperature=-1.0), r"`temperature` must be a positive finite number .* got -1.0"),
        (dict(do_sample=True, temperature=0), r"`temperature` must be a positive finite number"),
        (dict(num_tokens=True), r"`num_assistant_tokens` must be an integer in \[1, 8\]"),
        (dict(mode="tree", tree_width=True), r"`tree_width` must be a positive integer, got True"),
    ]
    for override, needle in cases:
        kwargs = dict(hidden_states=hidden, input_ids=ids) | override
        with pytest.raises(ValueError, match=needle):
            drafting.draft(drafter, kwargs.pop("hidden_states"), kwargs.pop("input_ids"), **kwargs)


def _randomise_feedback(drafter):
    """The feedback output layers start at zero; give them values so that folding them is a real test."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for t in (drafter.path_head.out.weight, drafter.path_head.out.bias, drafter.markov_head.u2):
            t.copy_(torch.randn(t.shape, generator=gen) * 0.3)


@pytest.mark.parametrize("feedback", ["markov+path", "markov"])
def test_folded_feedback_equals_term_by_term(target, context, feedback):
    """Serving folds `W·out` and `U2` into one matrix; the logits equal Eq. 3 evaluated term by term."""
    ids, hidden = context
    drafter = make(target, serving_head_dtype="float32", feedback=feedback).bind_target(target)
    if drafter.path_head is None:
        with torch.no_grad():
            drafter.markov_head.u2.normal_(0, 0.3)
    else:
        _randomise_feedback(drafter)
    states = drafter.predict_states(hidden)[0]  # (K, D)
    parents = torch.randint(3, 256, (5, drafter.config.path_order), generator=torch.Generator().manual_seed(2))
    fused, bias = serving.serving_feedback_weight(drafter)
    folded = folded_feedback_logits(drafter, serving.serving_tables(drafter), states[1].expand(5, -1), parents, fused,
                                    bias) + F.linear(states[1], drafter.draft_head_weight())  # (5, S)
    reference = drafter.feedback_logits(states[1].expand(5, -1), parents)  # (5, S)
    torch.testing.assert_close(folded, reference, rtol=1e-4, atol=1e-4)
    # the cache follows the weights: an in-place update (what an optimizer step does) refreshes the fold
    with torch.no_grad():
        drafter.markov_head.u2.mul_(2.0)
    refreshed, _ = serving.serving_feedback_weight(drafter)
    assert not torch.equal(refreshed, fused)
    torch.testing.assert_close(refreshed[:, -drafter.config.markov_rank:], drafter.markov_head.u2)


def test_eval_refolds_feedback_after_fused_optimizer_steps(target, context):
    """The fused AdamW (the trainer's default) updates in place without bumping `_version`: `.eval()` refolds."""
    ids, hidden = context
    drafter = make(target, serving_head_dtype="float32").bind_target(target)
    drafting.draft(drafter, hidden, ids, mode="tree", tree_width=4, tree_depth=3)  # fills the fold with zero-init heads
    drafter.train()
    params = [drafter.path_head.out.weight, drafter.path_head.out.bias, drafter.markov_head.u2]
    optimizer = torch.optim.AdamW(params, lr=0.1, fused=True)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer.step()
    drafter.eval()
    fused, bias = serving.serving_feedback_weight(drafter)
    W = drafter.draft_head_weight()
    torch.testing.assert_close(fused, torch.cat([W @ params[0], params[2]], 1).detach())
    torch.testing.assert_close(bias, (W @ params[1]).detach())


@pytest.mark.parametrize("overrides", [{}, dict(bonus_embedding=True, attention="bidirectional", num_blocks=2),
                                       dict(latent_size=48, flow_hidden_size=32)], ids=["default", "bonus", "skip"])
def test_stacked_experts_compute_the_module_velocity(target, overrides):
    """Serving runs the experts stacked (`serving_velocity`): the same velocity as the module, bit for bit, with and
    without a context mask; rebuilt after an in-place update; the module itself in training mode or under LoRA."""
    from hf_chainflow.generation.serving import StackedExperts

    drafter = make(target, **overrides).bind_target(target)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in drafter.velocity.parameters():  # zero-initialised projections (bonus, skip) too
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    stacked = serving.serving_velocity(drafter)
    assert isinstance(stacked, StackedExperts)
    cfg = drafter.config
    B, K, Z, C = 3, cfg.num_draft_positions, cfg.latent_size, cfg.context_size
    z, context = torch.randn(B, K, Z, generator=gen), torch.randn(B, C, Z, generator=gen)
    s, bonus = torch.rand(B, generator=gen), torch.randn(B, cfg.target_hidden_size, generator=gen)
    mask = torch.ones(B, C, dtype=torch.bool)
    mask[1, :3] = False
    with torch.no_grad():
        for m in (None, mask):
            assert torch.equal(stacked(z, s, context, m, bonus), drafter.velocity(z, s, context, m, bonus))
        drafter.velocity.experts[1].blocks[0].mlp[2].weight.mul_(2.0)
        assert serving.serving_velocity(drafter) is not stacked
        assert torch.equal(serving.serving_velocity(drafter)(z, s, context, mask, bonus),
                           drafter.velocity(z, s, context, mask, bonus))
    drafter.train()
    assert serving.serving_velocity(drafter) is drafter.velocity
    drafter.eval()
    class Wrapper(torch.nn.Module):  # another module type around a linear, as a LoRA adapter's
        def __init__(self, base):
            super().__init__()
            self.base_layer = base

        def forward(self, x):
            return self.base_layer(x)

    drafter.velocity.experts[0].in_proj = Wrapper(drafter.velocity.experts[0].in_proj)
    drafter.eval()
    assert serving.serving_velocity(drafter) is drafter.velocity


def test_tree_budget_keeps_the_most_probable_nodes(target, context):
    ids, hidden = context
    drafter = make(target).bind_target(target)
    _randomise_feedback(drafter)
    full = drafting.draft(drafter, hidden, ids, mode="tree", tree_width=6, tree_depth=4)
    pruned = drafting.draft(drafter, hidden, ids, mode="tree", tree_width=6, tree_depth=4, tree_budget=9)
    assert pruned.num_nodes == 9
    cum_full, cum_pruned = full.cumulative_logprobs(), pruned.cumulative_logprobs()
    # the kept path probabilities are the 9 best of the full tree, and the order stays breadth-first
    torch.testing.assert_close(cum_pruned.sort(descending=True).values, cum_full.sort(descending=True).values[:9])
    assert (pruned.depths.diff() >= 0).all()
    for i in range(pruned.num_nodes):  # parents remapped: a kept node hangs under its own kept ancestor
        parent = int(pruned.parents[i])
        assert parent < i and int(pruned.depths[i]) == (1 if parent < 0 else int(pruned.depths[parent]) + 1)
        if parent >= 0:
            torch.testing.assert_close(cum_pruned[i], cum_pruned[parent] + pruned.logprobs[i])
    assert drafting.draft(drafter, hidden, ids, mode="tree", tree_width=6, tree_depth=4,
                          tree_budget=100).num_nodes == 24
    with pytest.raises(ValueError, match="`tree_budget` must be None .* or a positive integer, got 0"):
        drafting.draft(drafter, hidden, ids, mode="tree", tree_budget=0)


def test_top_nodes_ties_keep_ancestors():
    """Equal path probabilities (a zero log-probability child) resolve breadth-first: never an orphan."""
    tree = DraftTree(tokens=torch.tensor([5, 6, 7, 8, 9]), parents=torch.tensor([-1, -1, 0, 0, 2]),
                     depths=torch.tensor([1, 1, 2, 2, 3]), logprobs=torch.tensor([-1.0, -0.5, 0.0, -3.0, 0.0]))
    kept = tree.top_nodes(3)  # cumulative: -1, -0.5, -1, -4, -1 -> nodes 1, then 0, 2 (tie with 4 broken by index)
    assert kept.tokens.tolist() == [5, 6, 7] and kept.parents.tolist() == [-1, -1, 0]
    assert tree.top_nodes(4).tokens.tolist() == [5, 6, 7, 9] and tree.top_nodes(4).parents.tolist() == [-1, -1, 0, 2]


# ---------------------------------------------------------------------------------------------------- save/load
def test_save_load_round_trip(target, context, tmp_path):
    ids, hidden = context
    drafter = make(target, shortlist=list(range(3, 200)), candidate_budget=64).bind_target(target)
    with torch.no_grad():  # make every head active so the round trip covers them
        drafter.markov_head.u2.normal_(std=0.1)
        drafter.path_head.out.weight.normal_(std=0.1)
    drafter.generation_config.tree_width = 5
    drafter.save_pretrained(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "generation_config.json", "model.safetensors"]
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
        saved = {k: f.get_tensor(k) for k in keys}
    assert not any("lm_head" in k or "embed_tokens" in k for k in keys)
    assert all(t.shape != target.lm_head.weight.shape for t in saved.values())  # no copy of W or E
    assert json.load(open(tmp_path / "config.json"))["model_type"] == "chainflow"
    assert type(AutoConfig.from_pretrained(tmp_path)).__name__ == "ChainFlowConfig"
    loaded = AutoModel.from_pretrained(tmp_path)
    assert isinstance(loaded, ChainFlowDrafter) and not loaded.is_bound
    for k, v in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    assert torch.equal(loaded.shortlist_ids, drafter.shortlist_ids)
    loaded = ChainFlowDrafter.from_pretrained(tmp_path, target=target).eval()
    assert loaded.generation_config.tree_width == 5
    for mode in ("chain", "tree"):
        a = drafting.draft(drafter, hidden, ids, mode=mode, num_tokens=4, tree_width=5, tree_depth=3)
        b = drafting.draft(loaded, hidden, ids, mode=mode, num_tokens=4, tree_width=5, tree_depth=3)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
        assert torch.allclose(a.logprobs, b.logprobs)


def test_resizing_feedback_heads_keeps_outputs_and_trains_the_new_units(target, context, tmp_path):
    """Growing the feedback heads of a trained drafter changes nothing it computes; the new units then learn."""
    ids, hidden = context
    drafter = make(target, serving_head_dtype="float32").bind_target(target)
    _randomise_feedback(drafter)
    B, C, K, p, D = 2, 8, 8, 8, 64
    gen = torch.Generator().manual_seed(3)
    batch = dict(context_states=torch.randn(B, C, D, generator=gen), target_states=torch.randn(B, K, D, generator=gen),
                 target_tokens=torch.randint(0, 256, (B, K), generator=gen),
                 prev_tokens=torch.randint(0, 256, (B, p - 1 + K), generator=gen))
    torch.manual_seed(0)
    before = drafter(**batch)
    chains = [drafting.draft(drafter, hidden, ids, mode=m, num_tokens=4, tree_width=4, tree_depth=3)
              for m in ("chain", "tree")]
    old_out = drafter.path_head.out.weight.clone()

    assert resize_path_head(drafter, 48) is drafter
    assert resize_markov_head(drafter, 24) is drafter
    assert drafter.config.path_hidden_size == 48 and drafter.config.markov_rank == 24
    assert drafter.markov_head.u1.weight.shape[1] == drafter.markov_head.u2.shape[1] == 24
    assert not drafter.markov_head.u2[:, 16:].any() and drafter.markov_head.u1.weight[:, 16:].any()
    assert drafter.path_head.offset_proj.shape == (p, D, 48) and drafter.path_head.out.weight.shape == (D, 48)
    assert torch.equal(drafter.path_head.out.weight[:, :32], old_out)
    assert not drafter.path_head.out.weight[:, 32:].any() and drafter.path_head.offset_proj[:, :, 32:].any()
    torch.manual_seed(0)
    after = drafter(**batch)
    for field in ("corrected_states", "logits", "marginal_logits"):
        torch.testing.assert_close(getattr(after, field), getattr(before, field), rtol=1e-5, atol=1e-5)
    for mode, old in zip(("chain", "tree"), chains):  # served through the refolded feedback weights
        new = drafting.draft(drafter, hidden, ids, mode=mode, num_tokens=4, tree_width=4, tree_depth=3)
        assert torch.equal(new.tokens, old.tokens) and torch.equal(new.parents, old.parents)
        torch.testing.assert_close(new.logprobs, old.logprobs, rtol=1e-5, atol=1e-5)

    drafter.train()
    drafter(**batch).logits.logsumexp(-1).mean().backward()
    assert drafter.path_head.out.weight.grad[:, 32:].abs().sum() > 0  # the new columns receive gradient
    assert drafter.markov_head.u2.grad[:, 16:].abs().sum() > 0

    drafter.save_pretrained(tmp_path)
    loaded = ChainFlowDrafter.from_pretrained(tmp_path)
    assert loaded.config.path_hidden_size == 48 and loaded.config.markov_rank == 24
    for k, v in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_resizing_feedback_heads_errors_change_nothing(target):
    drafter = make(target).bind_target(target)
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    for width, needle in [(32, r"larger than the current `path_hidden_size` \(32\), got 32"),
                          (16, "got 16"), (40.0, "got 40.0"), (True, "got True")]:
        with pytest.raises(ValueError, match=needle):
            resize_path_head(drafter, width)
    with pytest.raises(ValueError, match="`feedback='markov'`"):
        resize_path_head(make(target, feedback="markov"), 64)
    with pytest.raises(ValueError, match=r"larger than the current `markov_rank` \(16\), got 8"):
        resize_markov_head(drafter, 8)
    with pytest.raises(ValueError, match="`feedback='none'`"):
        resize_markov_head(make(target, feedback="none"), 64)
    assert drafter.config.path_hidden_size == 32 and drafter.config.markov_rank == 16
    assert all(torch.equal(v, before[k]) for k, v in drafter.state_dict().items())
    from hf_chainflow.training.adapters import add_language_adapter

    peft_model = add_language_adapter(drafter, "de")
    with pytest.raises(ValueError, match=r"path head.s layers .* are wrapped, .* Merge the adapter"):
        resize_path_head(peft_model.base_model.model, 64)
    with pytest.raises(ValueError, match=r"layers {.u1.: .*} are wrapped"):
        resize_markov_head(peft_model.base_model.model, 64)
    assert drafter.config.path_hidden_size == 32 and drafter.config.markov_rank == 16


def test_generation_config_subfolder_hub_cache_and_main_process(target, tmp_path):
    drafter = make(target)
    drafter.generation_config.draft_mode, drafter.generation_config.tree_budget = "tree", 12
    drafter.save_pretrained(tmp_path / "sub")
    loaded = ChainFlowDrafter.from_pretrained(tmp_path, subfolder="sub", target=target)
    assert (loaded.generation_config.draft_mode, loaded.generation_config.tree_budget) == ("tree", 12)
    # a Hub repo id served from the local cache, offline
    cache, sha = tmp_path / "hub", "0" * 40
    drafter.save_pretrained(cache / "models--me--drafter" / "snapshots" / sha)
    (cache / "models--me--drafter" / "refs").mkdir()
    (cache / "models--me--drafter" / "refs" / "main").write_text(sha)
    loaded = ChainFlowDrafter.from_pretrained("me/drafter", cache_dir=cache, local_files_only=True)
    assert (loaded.generation_config.draft_mode, loaded.generation_config.tree_budget) == ("tree", 12)
    # without the file the defaults stay
    os.remove(tmp_path / "sub" / "generation_config.json")
    assert ChainFlowDrafter.from_pretrained(tmp_path / "sub").generation_config.draft_mode == "chain"
    # only the main process writes it
    drafter.save_pretrained(tmp_path / "rank1", is_main_process=False)
    assert not (tmp_path / "rank1" / "generation_config.json").exists()


def test_push_to_hub_uploads_the_generation_config(target, tmp_path, monkeypatch):
    import transformers.modeling_utils as modeling_utils

    class Api:
        def create_repo(self, repo_id, **kwargs):
            return type("Repo", (), {"repo_id": repo_id})()

    uploaded = []

    def upload(self, working_dir, repo_id, files_timestamps, **kwargs):  # the files transformers would upload
        uploaded.extend(f for f in os.listdir(working_dir)
                        if f not in files_timestamps or os.path.getmtime(working_dir / f) > files_timestamps[f])

    monkeypatch.setattr(modeling_utils, "hf_api", Api)
    monkeypatch.setattr(modeling_utils, "create_and_tag_model_card",
                        lambda *a, **k: type("Card", (), {"save": lambda self, path: None})())
    monkeypatch.setattr(ChainFlowDrafter, "_upload_modified_files", upload)
    make(target).save_pretrained(tmp_path, push_to_hub=True, repo_id="me/drafter")
    assert "generation_config.json" in uploaded and "model.safetensors" in uploaded


def test_from_pretrained_refuses_a_folder_of_another_model_type(target, tmp_path):
    target.save_pretrained(tmp_path / "llama")
    make(target).save_pretrained(tmp_path / "drafter")
    with pytest.raises(ValueError, match=r"`pretrained_model_name_or_path` \(.*llama'\) holds a config with "
                                         r"model_type='llama', not 'chainflow': it is not a ChainFlow drafter"):
        ChainFlowDrafter.from_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match="model_type='llama'"):
        ChainFlowDrafter.from_pretrained(tmp_path, subfolder="llama")
    with pytest.raises(ValueError, match=r"`config` \(.*llama'\) holds a config with model_type='llama'"):
        ChainFlowDrafter.from_pretrained(tmp_path / "drafter", config=str(tmp_path / "llama"))
    # a ChainFlow config given explicitly is the caller's choice
    config = ChainFlowConfig.from_pretrained(tmp_path / "drafter")
    assert ChainFlowDrafter.from_pretrained(tmp_path / "drafter", config=config).config.model_type == "chainflow"


def test_from_pretrained_dtype(target, tmp_path):
    make(target).save_pretrained(tmp_path)
    assert ChainFlowDrafter.from_pretrained(tmp_path).dtype == torch.float32  # the default
    assert ChainFlowDrafter.from_pretrained(tmp_path, torch_dtype=torch.bfloat16).dtype == torch.bfloat16
    assert ChainFlowDrafter.from_pretrained(tmp_path, dtype=torch.float16, torch_dtype=torch.bfloat16).dtype == (
        torch.float16)


def test_binding_errors(target, context, tmp_path):
    ids, hidden = context
    drafter = make(target)
    with pytest.raises(ValueError, match="not bound"):
        drafting.draft(drafter, hidden, ids)
    with pytest.raises(ValueError, match="not bound"):
        drafter(context_states=torch.randn(1, 8, 64), target_states=torch.randn(1, 8, 64),
                target_tokens=torch.zeros(1, 8, dtype=torch.long), prev_tokens=torch.zeros(1, 15, dtype=torch.long))
    other = tiny_target("qwen3", hidden_size=32, vocab_size=300)
    with pytest.raises(ValueError) as err:
        drafter.bind_target(other)
    message = str(err.value)
    assert "'hidden_size': 64" in message and "'hidden_size': 32" in message and "vocab_size" in message
    drafter.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="mismatched"):
        ChainFlowDrafter.from_pretrained(tmp_path, target=other)


# ---------------------------------------------------------------------------------------------------- variants
VARIANTS = {
    "flashmap": dict(source="noise", use_vae=False, attention="bidirectional", feedback="none", num_flow_steps=1,
                     context_size=1),
    "source_repeat": dict(source="repeat"),
    "source_noise": dict(source="noise"),
    "experts_1": dict(num_experts=1),
    "experts_4": dict(num_experts=4),
    "feedback_none": dict(feedback="none"),
    "feedback_markov": dict(feedback="markov"),
    "serve_2_steps": dict(num_flow_steps=2),
    "serve_4_steps": dict(num_flow_steps=4),
    "bidirectional": dict(attention="bidirectional"),
    "no_vae": dict(use_vae=False),
    "shortlist": dict(shortlist=list(range(10, 120)), candidate_budget=32),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_variant_builds_trains_and_drafts(name, target, context):
    ids, hidden = context
    drafter = make(target, **VARIANTS[name]).bind_target(target)
    out = drafter(context_states=torch.randn(2, drafter.config.context_size, 64), target_states=torch.randn(2, 8, 64),
                  target_tokens=torch.randint(0, 256, (2, 8)), prev_tokens=torch.randint(0, 256, (2, 15)))
    assert out.logits.shape[:2] == (2, 8)
    drafter.eval()
    chain = drafting.draft(drafter, hidden, ids, mode="chain", num_tokens=3)
    tree = drafting.draft(drafter, hidden, ids, mode="tree", tree_width=4, tree_depth=3)
    assert chain.num_nodes == 3 and tree.num_nodes == 12
    if "shortlist" in VARIANTS[name]:
        allowed = set(VARIANTS[name]["shortlist"])
        assert set(tree.tokens.tolist()) <= allowed


# ---------------------------------------------------------------------------------------------------- alignment
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_5"])
def test_oracle_states_reproduce_greedy_continuation(family):
    """Handed the target's true future states h_{t+1..t+K} (bypassing the flow), the drafter's chain equals the
    target's greedy continuation x_{t+2..t+K+1}: states and tokens are aligned as SPEC.md says."""
    tgt = tiny_target(family)
    drafter = make(tgt).bind_target(tgt)
    K = drafter.config.num_draft_positions
    prompt = torch.randint(3, 256, (1, 9), generator=torch.Generator().manual_seed(2))
    full = tgt.generate(prompt, max_new_tokens=K + 1, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        states = tgt(full, output_hidden_states=True).hidden_states[-1][0]  # (L, D)
    t = prompt.shape[1]  # committed x_1..x_{t+1}: the prompt plus the bonus token
    committed = full[0, : t + 1]
    future = states[t: t + K]  # h_{t+1..t+K} (0-based rows t..t+K-1)
    chain = drafting.search(drafter, future, committed, mode="chain", num_tokens=K)
    assert chain.tokens.tolist() == full[0, t + 1: t + 1 + K].tolist()


def test_state_statistics_are_saved_and_validated(target, tmp_path):
    drafter = make(target)
    mean, std = torch.randn(64), torch.rand(64) + 0.5
    drafter.set_state_statistics(mean, std)
    drafter.save_pretrained(tmp_path)
    loaded = ChainFlowDrafter.from_pretrained(tmp_path)
    assert torch.equal(loaded.state_mean, mean) and torch.equal(loaded.state_std, std)
    h = torch.randn(2, 3, 64)
    assert torch.allclose(loaded.denormalize(loaded.normalize(h)), h, atol=1e-5)
    with pytest.raises(ValueError, match="must have shape"):
        drafter.set_state_statistics(torch.zeros(3), torch.ones(3))
    with pytest.raises(ValueError, match="positive"):
        drafter.set_state_statistics(torch.zeros(64), torch.zeros(64))
    for bad_mean, bad_std in ((torch.full((64,), float("nan")), torch.ones(64)), (torch.zeros(64), torch.full((64,), float("inf")))):
        with pytest.raises(ValueError, match="must be finite"):
            drafter.set_state_statistics(bad_mean, bad_std)
    with pytest.raises(ValueError, match="must be tensors"):
        drafter.set_state_statistics([0.0] * 64, [1.0] * 64)
    assert torch.equal(drafter.state_mean, mean) and torch.equal(drafter.state_std, std)  # refused: unchanged


# ---------------------------------------------------------------------------------------------------- one job per class
# What moved off the model class (issue 63): drafting (hf_chainflow.generation.drafting), serving
# (hf_chainflow.generation.serving) and head resizing (hf_chainflow.training.resize).
MOVED = ("draft", "draft_batch", "search", "compiled_round", "warm_up_drafting", "_layers_hint",
         "continuation_table", "set_continuation_table", "serving_head_weight", "serving_feedback_weight",
         "serving_velocity", "serving_tables", "_packed", "StackedExperts", "resize_path_head", "resize_markov_head",
         "_check_resize")



def test_the_model_class_defines_no_drafting_serving_or_resizing_method():
    for cls in ChainFlowDrafter.__mro__:
        assert not set(vars(cls)) & set(MOVED), (cls.__name__, sorted(set(vars(cls)) & set(MOVED)))
    lines, _ = inspect.getsourcelines(ChainFlowDrafter)
    assert len(lines) <= 400, len(lines)


# The layering (models/ imports nothing from generation/ or training/) and the module and class sizes are checked
# for every module by tests/test_layout.py.
