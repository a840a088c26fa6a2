"""hf_chainflow: ChainFlow speculative decoding as a Hugging Face-native extension.

`import hf_chainflow` registers the `chainflow` model type with `AutoConfig`/`AutoModel` and hooks
`model.generate(..., assistant_model=drafter)` for ChainFlow drafters only (see `hf_chainflow.integration`).
"""

from .configuration_chainflow import ChainFlowConfig
from .modeling_chainflow import ChainFlowDrafter, ChainFlowDrafterOutput
from .tree import DraftTree
from .candidate_generator import ChainFlowCandidateGenerator
from .stats import SpeculativeStats
from . import integration as _integration
from .decoding import speculative_generate

_integration.install()

__version__ = "0.1.0"

__all__ = [
    "ChainFlowConfig",
    "ChainFlowDrafter",
    "ChainFlowDrafterOutput",
    "ChainFlowCandidateGenerator",
    "DraftTree",
    "SpeculativeStats",
    "speculative_generate",
]
