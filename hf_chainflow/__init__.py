"""hf_chainflow: ChainFlow speculative decoding as a Hugging Face-native extension.

The public classes and functions import from the package top (`from hf_chainflow import ChainFlowDrafter,
ChainFlowTrainer`). Each is imported on first use (PEP 562), so `import hf_chainflow` alone, and the `hf-chainflow`
command until it runs a subcommand, import neither torch nor transformers.

The `generate` hook (`hf_chainflow.generation.hook.install`: `model.generate(..., assistant_model=drafter)` routed for
ChainFlow drafters only) is installed, and the `chainflow` and `lafa` model types registered with `AutoConfig`/`AutoModel`, the
first time a public name is read from the package top, or a module that defines drafters or their config
(`hf_chainflow.models.chainflow.modeling_chainflow`, `...configuration_chainflow`) or the hook's own module is
imported, whichever comes first (once the outermost import running is done); the test double
`hf_chainflow.testing.OracleDrafter` installs it when made. So a drafter given to `generate` always finds the hook
installed, however it was made.
"""

import sys
import types

from hf_chainflow._lazy import lazy_exports

__version__ = "0.1.0"

# public name -> the submodule that defines it
_EXPORTS = {
    "ChainFlowConfig": "models.chainflow.configuration_chainflow",
    "ChainFlowDrafter": "models.chainflow.modeling_chainflow",
    "ChainFlowDrafterOutput": "models.chainflow.modeling_chainflow",
    "ChainFlowPreTrainedModel": "models.chainflow.modeling_chainflow",
    "LafaConfig": "models.lafa.configuration_lafa",
    "LafaDrafter": "models.lafa.modeling_lafa",
    "ChainFlowCandidateGenerator": "generation.candidate_generator",
    "DraftTree": "generation.tree",
    "ContinuationTable": "generation.corpus_lookup",
    "SpeculativeStats": "generation.stats",
    "speculative_generate": "generation.loop",
    "PromptLookupDrafter": "generation.lookup_drafter",
    "ChainFlowTrainer": "training.trainer",
    "ChainFlowTrainingArguments": "training.arguments",
    "ReplayMixDataset": "training.replay",
    "ChainFlowWindowDataset": "training.windows",
    "prepare": "training.prepare",
    "evaluate_offline": "training.evaluation",
    "add_language_adapter": "training.adapters",
    "load_language_adapter": "training.adapters",
    "lora_config": "training.adapters",
    "load_target": "targets",
    "load_model_and_tokenizer": "targets",
    "DFlashTrainer": "training.dflash_trainer",
    "DFlashTrainingArguments": "training.dflash_trainer",
    "DFlashWindowDataset": "training.dflash_data",
    "build_dflash_drafter": "training.dflash",
    "load_dflash_drafter": "training.dflash",
}
__all__ = sorted(_EXPORTS)

# Modules whose import installs the hook: those that define drafters or their config, and the hook's own module.
_HOOK_MODULES = ("hf_chainflow.models.chainflow.modeling_chainflow",
                 "hf_chainflow.models.chainflow.configuration_chainflow", "hf_chainflow.generation.hook")
_pending = False  # a hook module (or a public name) was imported; the hook is installed once no import is running


def _importing() -> bool:
    """Whether a module of this package is still running its import (it is in `sys.modules` but not yet bound on its
    package, which the import system does when it is done)."""
    for name, module in list(sys.modules.items()):
        parent, _, leaf = name.rpartition(".")
        if parent.startswith(__name__) and module is not None and leaf not in vars(sys.modules.get(parent, module)):
            return True
    return False


def _install_hook() -> None:
    """Install the `generate` hook (idempotent) and register the `chainflow` model type (`modeling_chainflow`
    registers it with `AutoConfig`/`AutoModel` when imported), as soon as no import of this package is running (an
    import nested in another one waits for the outermost, whose completion calls again)."""
    global _pending
    _pending = True
    if _importing():
        return
    _pending = False
    from hf_chainflow.generation import hook
    from hf_chainflow.models.chainflow import modeling_chainflow  # noqa: F401  (the registration)
    from hf_chainflow.models.lafa import modeling_lafa  # noqa: F401  (the `lafa` model type's registration)

    hook.install()


class _Package(types.ModuleType):
    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        # The import system binds each submodule on its package once the submodule has run (Python's import docs,
        # "Submodules"): this sees every import of a hook module, by whichever path, and the end of every import
        # (subpackages are watched the same way: each is bound on its parent before its submodules are imported).
        if isinstance(value, types.ModuleType) and value.__name__ == f"{self.__name__}.{name}":
            if hasattr(value, "__path__") and type(value) is types.ModuleType:
                value.__class__ = _Package
            if value.__name__ in _HOOK_MODULES or _pending:
                _install_hook()


sys.modules[__name__].__class__ = _Package
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, on_access=_install_hook)
