"""The package's import structure: public names at the package top (imported lazily), a command line that parses
without torch, the `generate` hook installed by every way to a drafter, no hybrid modeling for dense targets, and
no library module importing a command module."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_chainflow"


def _run(code: str) -> dict:
    """Run `code` in a fresh interpreter on this checkout; it prints one JSON object last, which is returned."""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(result.pop("package")).resolve().is_relative_to(PACKAGE), "imported another checkout"
    return result


REPORT = ("import json, sys, hf_chainflow\n"
          "print(json.dumps({'package': hf_chainflow.__file__, **state}))\n")


def test_help_and_usage_errors_import_neither_torch_nor_transformers():
    commands = ("generate-responses", "prepare", "train", "eval-offline", "bench", "demo")
    argvs = [["--help"], [], ["--version"], ["generate-responses", "--prompts", "p.jsonl"], ["prepare"],
             ["train", "--bogus"], ["bench", "--threads", "0"], ["demo", "--dtype", "int8"],
             ["eval-offline", "--data", "d"], *[[name, "--help"] for name in commands]]
    code = (f"import sys\nfrom hf_chainflow.commands import main\nstate = {{'codes': []}}\n"
            f"for argv in {argvs!r}:\n"
            "    try:\n        main(argv)\n    except SystemExit as err:\n        state['codes'].append(err.code)\n"
            "state['loaded'] = sorted({'torch', 'transformers'} & set(sys.modules))\n" + REPORT)
    result = _run(code)
    assert result["codes"] == [0] + [2] * 8 + [0] * len(commands)  # every argv exits through argparse
    assert result["loaded"] == []


@pytest.mark.parametrize("module", ["hf_chainflow.commands", "hf_chainflow.cli", "hf_chainflow.vllm"])
def test_module_entry_points_print_help_without_torch_or_transformers(module):
    """`python -m hf_chainflow.commands --help` (the `torchrun -m` path), the `hf_chainflow.cli` alias and
    `python -m hf_chainflow.vllm --help` (which prints the config for `vllm serve`) run their `__main__` and import
    neither torch nor transformers (`-X importtime` lists every module imported; tests/test_layout.py checks the same
    statically, module by module)."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", module, "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and "usage:" in out.stdout, out.stderr[-2000:]
    imported = {line.rpartition("|")[2].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "hf_chainflow" in imported
    assert not imported & {"torch", "transformers"}, sorted(imported & {"torch", "transformers"})


# `from hf_chainflow.models.chainflow.modeling_chainflow import ChainFlowDrafter`: the next test
DRAFTER_PATHS = [
    "import hf_chainflow\nassert 'torch' not in sys.modules\nhf_chainflow.ChainFlowDrafter",
    "from hf_chainflow.models.chainflow.configuration_chainflow import ChainFlowConfig",
    "from hf_chainflow.testing import OracleDrafter, tiny_target\nOracleDrafter(tiny_target())",  # made, not imported
    "import hf_chainflow.generation.hook",  # the hook's own module (it imports decoding, settings, ...)
]
HOOK_STATE = ("from transformers import AutoConfig, AutoModel\n"
              "from transformers.generation.utils import GenerationMixin\n"
              "config = AutoConfig.for_model('chainflow')\n"
              "hook = {'hooked': getattr(GenerationMixin.generate, '_chainflow', False),\n"
              "        'config': type(config).__name__, 'model': AutoModel._model_mapping[type(config)].__name__}\n")
HOOKED = {"hooked": True, "config": "ChainFlowConfig", "model": "ChainFlowDrafter"}


@pytest.mark.parametrize("first", DRAFTER_PATHS)
def test_every_way_to_a_drafter_installs_the_generate_hook(first):
    assert _run("import sys\n" + first + "\n" + HOOK_STATE + "state = hook\n" + REPORT) == HOOKED


def test_the_testing_module_installs_no_hook_until_an_oracle_drafter_is_made():
    """`hf_chainflow.testing` is imported for `tiny_target` alone by many tests and scripts: importing it, and building
    a target, leave `generate` as transformers ships it; making an `OracleDrafter` installs the hook."""
    code = ("import sys\nfrom transformers.generation.utils import GenerationMixin\n"
            "from hf_chainflow.testing import OracleDrafter, tiny_target\ntarget = tiny_target()\n"
            "state = {'before': getattr(GenerationMixin.generate, '_chainflow', False),\n"
            "         'hook_module': 'hf_chainflow.generation.hook' in sys.modules}\n"
            "OracleDrafter(target)\nstate['after'] = getattr(GenerationMixin.generate, '_chainflow', False)\n" + REPORT)
    assert _run(code) == {"before": False, "hook_module": False, "after": True}


def test_a_drafter_from_the_modeling_module_drafts_in_generate_without_hybrid_modeling():
    """Nothing but `hf_chainflow.models.chainflow.modeling_chainflow` imported from the package: the model type is registered, and
    `generate(assistant_model=drafter)` drafts (tree mode, hf_chainflow's own loop) and equals plain greedy; no
    Qwen3.5 / Qwen3-Next modeling is loaded for this dense target."""
    code = """import sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from hf_chainflow.models.chainflow.modeling_chainflow import ChainFlowDrafter
""" + HOOK_STATE + """
ChainFlowConfig = type(config)

torch.manual_seed(0)
target = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)).eval()
config = ChainFlowConfig.for_target(target.config, num_blocks=1, num_heads=2, ffn_multiplier=2, vae_num_layers=1,
                                    vae_num_heads=2, path_hidden_size=16, markov_rank=8)
drafter = ChainFlowDrafter(config).bind_target(target).eval()
drafter.generation_config.draft_mode = 'tree'
ids = torch.randint(3, 128, (1, 6))
kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
with torch.inference_mode():
    plain = target.generate(ids, **kwargs)
    speculative = target.generate(ids, assistant_model=drafter, **kwargs)
state = {**hook, 'equal': torch.equal(plain, speculative), 'rounds': drafter.last_stats.rounds,
         'hybrid_modeling': sorted(m for m in sys.modules if m.startswith(('transformers.models.qwen3_5',
                                                                          'transformers.models.qwen3_next')))}
""" + REPORT
    result = _run(code)
    assert {k: result[k] for k in HOOKED} == HOOKED
    assert result["equal"] and result["rounds"] > 0
    assert result["hybrid_modeling"] == []


def test_public_names_import_from_the_package_top():
    import hf_chainflow
    import hf_chainflow.bench as bench
    from hf_chainflow import ChainFlowTrainer, ChainFlowTrainingArguments, ChainFlowWindowDataset, prepare
    from hf_chainflow.training.windows import ChainFlowWindowDataset as defined_dataset
    from hf_chainflow.training.prepare import prepare as defined_prepare
    from hf_chainflow.training.trainer import ChainFlowTrainer as defined_trainer
    from hf_chainflow.training.arguments import ChainFlowTrainingArguments as defined_arguments

    assert (ChainFlowTrainer, ChainFlowTrainingArguments) == (defined_trainer, defined_arguments)
    assert (ChainFlowWindowDataset, prepare) == (defined_dataset, defined_prepare)
    for package in (hf_chainflow, bench):
        for name in package.__all__:
            value = getattr(package, name)
            assert getattr(sys.modules[f"{package.__name__}.{package._EXPORTS[name]}"], name) is value, name
        assert set(package.__all__) <= set(dir(package))
        with pytest.raises(AttributeError, match="has no attribute 'NoSuchName'"):
            package.NoSuchName


def _imports(path: Path) -> set[str]:
    """The modules `path` imports (relative imports resolved), at any depth of the file."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            name = ".".join(p for p in (base, node.module) if p)
            found.add(name)
            found.update(f"{name}.{alias.name}" for alias in node.names)
    return found


def test_no_library_module_imports_a_command_module():
    commands = {"hf_chainflow.commands", "hf_chainflow.cli"}
    library = [p for p in PACKAGE.rglob("*.py") if "commands" not in p.parts and p.name != "cli.py"]
    assert len(library) > 20
    offenders = {str(p.relative_to(ROOT)): sorted(m for m in _imports(p) if m.split(".__")[0] in commands
                                                  or m.startswith("hf_chainflow.commands."))
                 for p in library}
    assert {p: m for p, m in offenders.items() if m} == {}
