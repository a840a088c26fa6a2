"""Drafter models (as transformers' `models/`): each folder holds a configuration and a modeling module, that is
layers, `forward` and loading; nothing that drafts or serves (that lives in `hf_chainflow.generation`)."""
