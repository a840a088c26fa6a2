"""ChainFlow drafting inside vLLM: `speculative_config(...)` for `vllm.LLM(..., speculative_config=...)`.

    import vllm, hf_chainflow.vllm
    llm = vllm.LLM(model=target_folder, speculative_config=hf_chainflow.vllm.speculative_config())

vLLM loads `hf_chainflow.vllm.proposer.ChainFlowProposer` by name (its `custom_class` speculative method) and
verifies one chain of `num_speculative_tokens` per request and step; vLLM has no tree verification, so ChainFlow
drafts chains there. Importing this package does not import vLLM; the core package never imports it.
See docs/serving-vllm.md.
"""

from hf_chainflow.vllm.settings import PROPOSER_CLASS, ProposerSettings, check_settings, speculative_config, speculative_config_json

__all__ = ["PROPOSER_CLASS", "ProposerSettings", "check_settings", "speculative_config", "speculative_config_json"]
