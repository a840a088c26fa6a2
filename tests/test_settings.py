"""`hf_chainflow.generation.settings`: the drafting rules in one place, each refusal naming the field, the value and the fix;
the settings read once per `generate` call and handed to whichever loop runs it."""

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig

import hf_chainflow
import hf_chainflow.generation.loop as decoding
import hf_chainflow.generation.hook as integration
from hf_chainflow import ChainFlowCandidateGenerator
from hf_chainflow.generation.settings import (
    SearchSettings,
    SpeculativeSettings,
    is_stateful_target,
    lookup_settings,
    parse_tree_shape,
)
from hf_chainflow.testing import OracleDrafter, tiny_target

PROMPT = torch.tensor([[5, 17, 99, 42, 7, 130, 64]])


def test_search_settings_rules():
    assert SearchSettings().depth == 3 and SearchSettings(mode="tree").depth == 4
    assert SearchSettings(mode="tree", tree_width=5).width == 5 and SearchSettings(tree_width=5).width == 1
    assert SearchSettings(mode="chain", tree_budget=3).budget is None  # chains are never cut
    assert SearchSettings(mode="chain", tree_width=0, tree_depth=99).num_tokens == 3  # tree fields unused by a chain
    cases = [
        (dict(mode="beam"), r"`draft_mode` must be one of \('chain', 'tree'\), got 'beam'"),
        (dict(num_tokens=9, max_depth=8), r"`num_assistant_tokens` must be an integer in \[1, 8\] \(the drafter "
                                          r"predicts K=8 positions per pass\), got 9"),
        (dict(num_tokens=0), r"`num_assistant_tokens` must be a positive integer, got 0"),
        (dict(mode="tree", tree_depth=True, max_depth=8), r"`tree_depth` must be an integer in \[1, 8\]"),
        (dict(mode="tree", tree_width=0), r"`tree_width` must be a positive integer, got 0"),
        (dict(mode="tree", tree_budget=2.0), r"`tree_budget` must be None \(keep every node\) or a positive integer"),
        (dict(mode="tree", do_sample=True), r"`do_sample=True` draws chains only"),
        (dict(do_sample=True, temperature=float("inf")), r"`temperature` must be a positive finite number"),
    ]
    for kwargs, needle in cases:
        with pytest.raises(ValueError, match=needle):
            SearchSettings(**kwargs)
    with pytest.raises(dataclasses.FrozenInstanceError):
        SearchSettings().num_tokens = 5
    settings = SearchSettings(mode="tree", tree_width=3, tree_depth=2, tree_budget=4, max_depth=8)
    assert settings.draft_kwargs() == dict(mode="tree", num_tokens=3, tree_width=3, tree_depth=2, tree_budget=4,
                                           do_sample=False, temperature=1.0)


def test_speculative_settings_read_the_drafter_config_once():
    target = tiny_target("llama", num_layers=1)
    drafter = OracleDrafter(target)
    g = drafter.generation_config
    g.draft_mode, g.tree_width, g.tree_depth, g.tree_budget, g.num_flow_steps = "tree", 5, 6, 12, 2
    g.lookup_num_tokens, g.lookup_trust_ngram = 4, 2
    settings = SpeculativeSettings.from_drafter(drafter, GenerationConfig(do_sample=True, temperature=0.7))
    assert (settings.mode, settings.tree_width, settings.tree_depth, settings.tree_budget) == ("tree", 5, 6, 12)
    assert (settings.num_flow_steps, settings.lookup_num_tokens, settings.lookup_trust_ngram) == (2, 4, 2)
    assert settings.do_sample and settings.temperature == 0.7 and settings.max_depth == drafter.max_draft_depth
    assert not settings.sample_drafts  # a tree with a lookup branch is drafted greedily, accepted child by child
    assert settings.draft_kwargs(room=3) == dict(mode="tree", num_tokens=3, tree_width=5, tree_depth=3, tree_budget=12,
                                                 num_flow_steps=2, do_sample=False, temperature=0.7)
    assert SpeculativeSettings.from_drafter(drafter).do_sample is False  # no call config: greedy
    g.draft_mode, g.lookup_num_tokens, g.lookup_trust_ngram = "chain", None, None
    chain = SpeculativeSettings.from_drafter(drafter, GenerationConfig(do_sample=True, temperature=0.7))
    assert chain.sample_drafts and chain.draft_kwargs(room=1)["num_tokens"] == 1
    assert chain.needs_own_loop(target, GenerationConfig(), None) is False
    assert chain.needs_own_loop(target, GenerationConfig(stop_strings=["x"]), None)
    assert chain.replace(mode="tree").needs_own_loop(target, GenerationConfig(), None)
    assert not is_stateful_target(target) and is_stateful_target(tiny_target("qwen3_5", num_layers=2))
    with pytest.raises(ValueError, match=r"`drafter.generation_config.tree_depth` must be an integer in \[1, 64\] "
                                         r"\(the drafter predicts K=64 positions per pass\), got 99"):
        chain.replace(tree_depth=99)  # checked in every mode: the config may be switched to trees
    for field, value, needle in (
            ("mode", "beam", r"`drafter.generation_config.draft_mode` must be one of \('chain', 'tree'\), got 'beam'"),
            ("tree_width", 0, r"`drafter.generation_config.tree_width` must be a positive integer, got 0"),
            ("tree_budget", -1, r"`drafter.generation_config.tree_budget` must be None \(keep every node\)"),
            ("num_flow_steps", 0, r"`drafter.generation_config.num_flow_steps` must be None"),
            ("lookup_ngram", None, r"`drafter.generation_config.lookup_ngram` must be a positive integer, got None")):
        with pytest.raises(ValueError, match=needle):
            chain.replace(**{field: value})
    assert lookup_settings(GenerationConfig()) == {"lookup_num_tokens": None, "lookup_ngram": 3,
                                                   "lookup_trust_ngram": None, "lookup_max_tokens": None}


def test_tree_shapes_are_parsed_in_one_place():
    assert parse_tree_shape("8x4") == (8, 4) and parse_tree_shape("16X2") == (16, 2)
    for bad in ("8x", "x4", "0x4", "8x-1", "8x4x2", "eight", "8*4"):
        with pytest.raises(ValueError, match=rf"--tree needs a positive width and depth as WIDTHxDEPTH \(e.g. 8x4\), "
                                             rf"got '{re.escape(bad)}'"):
            parse_tree_shape(bad)
    with pytest.raises(ValueError, match=r"--shape needs"):
        parse_tree_shape("1", "--shape")


def test_the_settings_module_imports_neither_torch_nor_transformers():
    """The command line checks its options with it before loading a model; importing torch alone takes seconds."""
    path = Path(hf_chainflow.__file__).parent / "generation" / "settings.py"
    code = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('chainflow_settings', {str(path)!r})\n"
            "module = sys.modules['chainflow_settings'] = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(module)\n"
            "module.SearchSettings(mode='tree', tree_width=3); module.parse_tree_shape('8x4')\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------- once per call
@pytest.fixture(scope="module")
def llama():
    return tiny_target("llama")


@pytest.fixture
def counted(monkeypatch):
    """Counts the reads of a drafter's settings and the checks of a call, wherever they happen."""
    counts = {"settings": 0, "checks": 0}
    read, check = SpeculativeSettings.from_drafter.__func__, integration.validate_speculative_call

    def counting_read(cls, *a, **k):
        counts["settings"] += 1
        return read(cls, *a, **k)

    def counting_check(*a, **k):
        counts["checks"] += 1
        return check(*a, **k)

    monkeypatch.setattr(SpeculativeSettings, "from_drafter", classmethod(counting_read))
    for module in (integration, decoding):
        monkeypatch.setattr(module, "validate_speculative_call", counting_check)
    return counts


@pytest.mark.parametrize("route", ["chain", "tree", "lookup", "custom_generate"])
def test_a_call_reads_its_settings_and_is_checked_once(llama, counted, route):
    drafter = OracleDrafter(llama, error_rate=0.3, seed=1)
    g = drafter.generation_config
    g.draft_mode = "tree" if route in ("tree", "lookup") else "chain"
    g.lookup_num_tokens = 3 if route == "lookup" else None
    ref = llama.generate(PROMPT, max_new_tokens=12, do_sample=False)
    if route == "custom_generate":
        out = llama.generate(PROMPT, max_new_tokens=12, do_sample=False, drafter=drafter,
                             custom_generate=hf_chainflow.speculative_generate)
    else:
        out = llama.generate(PROMPT, max_new_tokens=12, do_sample=False, assistant_model=drafter)
    assert torch.equal(out, ref)
    assert drafter.last_stats.loop == ("transformers" if route == "chain" else "chainflow")
    assert drafter.last_stats.rounds > 1  # several rounds, one reading of the settings
    assert counted == {"settings": 1, "checks": 1}


def test_positional_arguments_reach_transformers_as_given(llama):
    drafter = OracleDrafter(llama, error_rate=0.3, seed=1)
    config = GenerationConfig(max_new_tokens=9, do_sample=False)
    ref = llama.generate(PROMPT, config)
    for mode in ("chain", "tree"):
        drafter.generation_config.draft_mode = mode
        assert torch.equal(llama.generate(PROMPT, config, None, None, None, None, drafter), ref)
        assert drafter.last_stats.mode == mode
    with pytest.raises(TypeError):  # what transformers' own signature refuses, the wrapper refuses the same way
        llama.generate(PROMPT, config, generation_config=config, assistant_model=drafter)


def test_the_own_loop_without_the_generate_hook_reads_and_checks_the_call_itself(llama):
    """`custom_generate=speculative_generate` through transformers' unwrapped `generate` (as before the hook is
    installed): the loop reads the settings and runs every check itself."""
    drafter = OracleDrafter(llama, error_rate=0.3, seed=1)
    drafter.generation_config.draft_mode = "tree"
    ref = llama.generate(PROMPT, max_new_tokens=10, do_sample=False)
    out = integration._original_generate(llama, PROMPT, max_new_tokens=10, do_sample=False, drafter=drafter,
                                         custom_generate=hf_chainflow.speculative_generate)
    assert torch.equal(out, ref) and drafter.last_stats.mode == "tree"
    with pytest.raises(ValueError, match="padded on the right"):
        integration._original_generate(llama, PROMPT.repeat(2, 1), max_new_tokens=4, drafter=drafter,
                                       attention_mask=torch.tensor([[1] * 7, [1] * 5 + [0] * 2]),
                                       custom_generate=hf_chainflow.speculative_generate)
    drafter.generation_config.tree_width = 0
    with pytest.raises(ValueError, match=r"`drafter.generation_config.tree_width` must be a positive integer"):
        integration._original_generate(llama, PROMPT, max_new_tokens=4, drafter=drafter,
                                       custom_generate=hf_chainflow.speculative_generate)


def test_settings_are_generate_s_own(llama):
    drafter = OracleDrafter(llama)
    with pytest.raises(ValueError, match=r"`chainflow_settings` is set by `generate` itself"):
        llama.generate(PROMPT, max_new_tokens=4, drafter=drafter, custom_generate=hf_chainflow.speculative_generate,
                       chainflow_settings=SpeculativeSettings())
    drafter.generation_config.draft_mode = "tree"
    with pytest.raises(ValueError, match=r"`ChainFlowCandidateGenerator` drafts chains in transformers' assisted "
                                         r"loop, but the drafter's generation config asks for draft_mode='tree'"):
        ChainFlowCandidateGenerator(drafter, GenerationConfig(max_length=20))
