"""Machine facts of a bench run: the CPU's identity, whether it has native bfloat16 matrix instructions (and the
note printed before bfloat16 runs on one without), the library versions and the load. The facts themselves are
`hf_chainflow.machine`'s (re-exported here); the bfloat16 decisions built on them are the bench's."""

from __future__ import annotations

import torch

# The machine's facts live one layer down (the response corpus records them too); the bench's names stay here.
from hf_chainflow.machine import bf16_matrix_instructions, cpu_identity, machine_info


def lacks_bf16_matrix_instructions(bf16_support: dict[str, bool | None] | None = None) -> bool:
    """Whether this CPU is known to lack every native bfloat16 matrix instruction: `False` when torch has no probe for
    one of them (no claim is made then). Default: `bf16_matrix_instructions()`."""
    bf16_support = bf16_matrix_instructions() if bf16_support is None else bf16_support
    return bool(bf16_support) and all(v is False for v in bf16_support.values())


def demo_dtype(bf16_support: dict[str, bool | None] | None = None) -> str:
    """The dtype `hf-chainflow demo` runs in when none is asked for: bfloat16, unless this CPU is known to lack native
    bfloat16 matrix instructions; there float32 (measured on one such CPU, 40 evaluation prompts: the shipped setting
    1.12x the fastest plain generation in float32, 0.51x in bfloat16; docs/results.md)."""
    return "float32" if lacks_bf16_matrix_instructions(bf16_support) else "bfloat16"


def bf16_hardware_note(bf16_support: dict[str, bool | None] | None = None,
                       capability: str | None = None) -> str | None:
    """The note printed before bfloat16 runs on a CPU known to lack native bfloat16 matrix instructions, else `None`
    (also when torch cannot tell). Defaults: `bf16_matrix_instructions()` and torch's CPU capability string.
    """
    if not lacks_bf16_matrix_instructions(bf16_support):
        return None
    capability = torch.backends.cpu.get_cpu_capability() if capability is None else capability
    return (f"note: this CPU has no native bfloat16 matrix instructions (no AMX, no AVX-512 BF16; torch reports "
            f"{capability}). Here a bfloat16 forward over several tokens costs several single-token steps, so "
            "speculative decoding in bfloat16 is expected to be slower than plain generation. Run it in float32: "
            "the outputs are exact, several tokens cost less in proportion, and on one such CPU the shipped setting "
            "measured faster than the fastest plain generation (docs/results.md, \"A CPU without bfloat16 matrix "
            "instructions\").")


__all__ = ["bf16_hardware_note", "bf16_matrix_instructions", "cpu_identity", "demo_dtype",
           "lacks_bf16_matrix_instructions", "machine_info"]
