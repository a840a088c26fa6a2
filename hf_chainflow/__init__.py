"""hf_chainflow: ChainFlow speculative decoding as a Hugging Face-native extension.

`import hf_chainflow` registers the `chainflow` model type with `AutoConfig`/`AutoModel`.
"""

from .configuration_chainflow import ChainFlowConfig
from .modeling_chainflow import ChainFlowDrafter, ChainFlowDrafterOutput
from .tree import DraftTree

__version__ = "0.1.0"

__all__ = ["ChainFlowConfig", "ChainFlowDrafter", "ChainFlowDrafterOutput", "DraftTree"]
