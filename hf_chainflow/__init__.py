"""hf_chainflow: ChainFlow speculative decoding as a Hugging Face-native extension.

The public classes and functions import from the package top (`from hf_chainflow import ChainFlowDrafter,
ChainFlowTrainer`). Each is imported on first use (PEP 562), so `import hf_chainflow` alone, and the `hf-chainflow`
command until it runs a subcommand, import neither torch nor transformers.

The `generate` hook (`hf_chainflow.integration.install`: `model.generate(..., assistant_model=drafter)` routed for
ChainFlow drafters only) is installed, and the `chainflow` model type registered with `AutoConfig`/`AutoModel`, the
first time a public name is read from the package top, or a module that defines drafters or their config
(`hf_chainflow.modeling_chainflow`, `hf_chainflow.configuration_chainflow`, `hf_chainflow.testing`) or the hook's
own module is imported, whichever comes first. So a drafter given to `generate` always finds the hook installed,
however it was made.
"""

import sys
import types

from ._lazy import lazy_exports

__version__ = "0.1.0"

# public name -> the submodule that defines it
_EXPORTS = {
    "ChainFlowConfig": "configuration_chainflow",
    "ChainFlowDrafter": "modeling_chainflow",
    "ChainFlowDrafterOutput": "modeling_chainflow",
    "ChainFlowPreTrainedModel": "modeling_chainflow",
    "ChainFlowCandidateGenerator": "candidate_generator",
    "DraftTree": "tree",
    "ContinuationTable": "corpus_lookup",
    "SpeculativeStats": "stats",
    "speculative_generate": "decoding",
    "ChainFlowTrainer": "trainer",
    "ChainFlowTrainingArguments": "trainer",
    "ReplayMixDataset": "trainer",
    "ChainFlowWindowDataset": "data",
    "prepare": "data",
    "evaluate_offline": "evaluation",
    "add_language_adapter": "adapters",
    "load_language_adapter": "adapters",
    "lora_config": "adapters",
    "load_target": "targets",
    "load_model_and_tokenizer": "targets",
    "DFlashTrainer": "dflash_trainer",
    "DFlashTrainingArguments": "dflash_trainer",
    "DFlashWindowDataset": "dflash_data",
    "build_dflash_drafter": "dflash",
    "load_dflash_drafter": "dflash",
}
__all__ = sorted(_EXPORTS)

# Submodules whose import installs the hook: those that define drafters or their config, and the hook's own module.
_HOOK_MODULES = ("modeling_chainflow", "configuration_chainflow", "testing", "integration")


def _install_hook() -> None:
    """Install the `generate` hook (idempotent) and register the `chainflow` model type (`modeling_chainflow`
    registers it with `AutoConfig`/`AutoModel` when imported)."""
    package = sys.modules[__name__]
    for name in ("modeling_chainflow", "integration"):
        if f"{__name__}.{name}" in sys.modules and name not in vars(package):
            return  # still being imported: the import system binds it on the package when done, which calls again
    from . import integration, modeling_chainflow  # noqa: F401  (modeling_chainflow: the registration)

    integration.install()


class _Package(types.ModuleType):
    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        # The import system binds each submodule on its package once the submodule has run (Python's import docs,
        # "Submodules"): this sees every import of a hook module, by whichever path.
        if name in _HOOK_MODULES and isinstance(value, types.ModuleType):
            _install_hook()


sys.modules[__name__].__class__ = _Package
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, on_access=_install_hook)
