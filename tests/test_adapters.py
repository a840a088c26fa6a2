"""Per-language LoRA adapters: train, save, reload, switch, and the base drafter stays untouched."""

import pytest
import torch
from peft import PeftModel

from hf_chainflow import ChainFlowDrafter
from hf_chainflow.generation import drafting, serving
from hf_chainflow.training.adapters import add_language_adapter, load_language_adapter, lora_config
from hf_chainflow.training.evaluation import draft_chains
from hf_chainflow.testing import tiny_target
from hf_chainflow.training.trainer import ChainFlowTrainer, unwrap_drafter
from hf_chainflow.training.arguments import ChainFlowTrainingArguments

from _windows import greedy_sequences, make_windows, one_thread, tiny_drafter_config


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    target = tiny_target("llama", num_layers=2)
    windows = make_windows(target, greedy_sequences(target, num_seqs=2, length=20, seed=1))
    torch.manual_seed(0)
    base = ChainFlowDrafter(tiny_drafter_config(target)).bind_target(target)
    with torch.no_grad():  # a "trained" base: non-zero feedback heads
        base.path_head.out.weight.normal_(std=0.3)
        base.markov_head.u2.normal_(std=0.3)
    base_dir = tmp_path_factory.mktemp("base")
    base.save_pretrained(base_dir)
    return target, windows, base_dir


def chains(model, windows):
    drafter = unwrap_drafter(model).eval()
    b = {k: torch.stack([w[k] for w in windows]) for k in windows[0]}
    return draft_chains(drafter, b["context_states"], b["context_mask"], b["prev_tokens"][:, :8], 4)


def train_adapter(model, windows, out, seed):
    args = ChainFlowTrainingArguments(output_dir=str(out), per_device_train_batch_size=8, max_steps=6,
                                      learning_rate=3e-2, save_strategy="no", report_to="none", disable_tqdm=True,
                                      use_cpu=True, seed=seed, logging_steps=3)
    trainer = ChainFlowTrainer(model=model, args=args, train_dataset=windows)
    trainer.train()
    return trainer


def test_lora_adapter_trains_saves_reloads_switches_and_leaves_the_base_alone(setup, tmp_path):
    target, windows, base_dir = setup
    base = ChainFlowDrafter.from_pretrained(base_dir, target=target)
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    base_chains = chains(base, windows)

    model = add_language_adapter(base, "tr", lora_config(r=4))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert any("velocity" in n for n in trainable) and any("path_head" in n for n in trainable)
    assert any("markov_head.u1" in n for n in trainable) and not any(".vae." in n for n in trainable)
    trainer = train_adapter(model, windows, tmp_path / "run", seed=0)
    opt_params = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    assert len(opt_params) == len(trainable)  # only LoRA weights are optimised
    tr_chains = chains(model, windows)
    assert not torch.equal(tr_chains, base_chains)  # the adapter changes the drafts
    # LoRA wraps `path_head.out`: serving must not use the fold of the base weights, and the search still runs
    assert serving.serving_feedback_weight(unwrap_drafter(model)) is None
    w = windows[0]
    tree = drafting.draft(unwrap_drafter(model), w["context_states"][None], w["prev_tokens"][None], mode="tree",
                                       tree_width=4, tree_depth=3, tree_budget=6)
    assert tree.num_nodes == 6
    with model.disable_adapter():
        assert torch.equal(chains(model, windows), base_chains)

    model.save_pretrained(tmp_path / "adapters")
    saved = tmp_path / "adapters" / "tr"
    assert (saved / "adapter_model.safetensors").is_file() and (saved / "adapter_config.json").is_file()

    # A second language next to the first, then switch back and forth without reloading the base drafter.
    model = add_language_adapter(model, "de", lora_config(r=4))
    train_adapter(model, windows[::-1], tmp_path / "run-de", seed=1)
    de_chains = chains(model, windows)
    assert not torch.equal(de_chains, tr_chains)
    model.set_adapter("tr")
    assert torch.equal(chains(model, windows), tr_chains)
    model.set_adapter("de")
    assert torch.equal(chains(model, windows), de_chains)

    # The base drafter's own weights never moved.
    unloaded = model.unload()
    assert isinstance(unloaded, ChainFlowDrafter)
    for k, v in unloaded.state_dict().items():
        assert torch.equal(v, base_state[k]), k
    assert torch.equal(chains(unloaded, windows), base_chains)
    assert serving.serving_feedback_weight(unloaded) is not None  # plain layers again: the fold is back

    # Reload the saved adapter onto a freshly loaded base: the same drafts as after training.
    fresh = ChainFlowDrafter.from_pretrained(base_dir, target=target)
    reloaded = load_language_adapter(fresh, saved, "tr")
    assert isinstance(reloaded, PeftModel) and reloaded.active_adapter == "tr"
    assert torch.equal(chains(reloaded, windows), tr_chains)
    with pytest.raises(ValueError, match="already has an adapter"):
        add_language_adapter(reloaded, "tr")
