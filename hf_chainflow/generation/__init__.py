"""Speculative generation (as transformers' `generation/`): the call's settings and their one check, the `generate`
hook, the candidate generator for transformers' assisted loop, drafting rounds and candidate search, prompt and
corpus lookup, the draft tree, verification (with the hybrid targets' state forks), hf_chainflow's own loop and
its statistics. See docs/layout.md for the map."""
