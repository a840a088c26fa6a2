"""The ChainFlow drafter: `configuration_chainflow.ChainFlowConfig` and `modeling_chainflow.ChainFlowDrafter`
(import them from the package top: `from hf_chainflow import ChainFlowDrafter`)."""
