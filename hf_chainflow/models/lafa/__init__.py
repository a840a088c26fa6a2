"""The Lafa drafter: the target drafts its own next block in the verification forward (self-speculative block
flow). `configuration_lafa.LafaConfig`, `modeling_lafa.LafaDrafter` (the position-masked weights of the noise rows)
and `binding_lafa` (which target modules they act on); the fused forward that uses them lives in
`hf_chainflow.generation.lafa`. Import the classes from the package top: `from hf_chainflow import LafaDrafter`."""
