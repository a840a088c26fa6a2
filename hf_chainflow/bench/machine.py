"""Machine facts of a bench run: the CPU's identity, whether it has native bfloat16 matrix instructions (and the
note printed before bfloat16 runs on one without), the library versions and the load."""

from __future__ import annotations

import os
import platform

import torch


def bf16_matrix_instructions() -> dict[str, bool | None]:
    """Whether this CPU has native bfloat16 matrix instructions (AMX tiles, AVX-512 BF16), as torch detects them;
    `None` where this torch has no probe for one.

    Without either, a bfloat16 forward over several tokens is far dearer than over one (measured on an AVX2-only
    CPU: 13 tokens cost 4.6 single-token steps; with AVX-512 BF16, 1.2-1.4), which is what speculative
    verification pays for.
    """

    def probe(name: str) -> bool | None:
        fn = getattr(torch.cpu, name, None)
        return bool(fn()) if callable(fn) else None

    return {"amx_tile": probe("_is_amx_tile_supported"), "avx512_bf16": probe("_is_avx512_bf16_supported")}


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


def cpu_identity(cpuinfo: str) -> dict[str, str | int | None]:
    """The first processor's `model name`, `vendor_id`, `cpu family` and `model` in `/proc/cpuinfo` text.

    A virtual machine may show only a masked name ("AMD EPYC"); the family and model numbers still tell the
    microarchitecture (AMD family 25 is Zen 3 / Zen 4, e.g. model 17 Zen 4 "Genoa"), which decides the bfloat16 kernels.
    """
    fields = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break  # end of the first processor's block
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())

    def number(key: str) -> int | None:
        value = fields.get(key, "")
        return int(value) if value.isdigit() else None

    return {"name": fields.get("model name"), "vendor": fields.get("vendor_id"), "family": number("cpu family"),
            "model": number("model")}


def machine_info() -> dict:
    """What the numbers were measured on."""
    import transformers

    identity = cpu_identity("")
    try:
        with open("/proc/cpuinfo") as f:
            identity = cpu_identity(f.read())
    except OSError:
        pass
    info = {"platform": platform.platform(), "cpu": identity["name"] or platform.processor(),
            "cpu_vendor": identity["vendor"], "cpu_family": identity["family"], "cpu_model": identity["model"],
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "bf16_matrix_instructions": bf16_matrix_instructions(),
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    if hasattr(os, "getloadavg"):
        info["load_average_start"] = list(os.getloadavg())
    return info


__all__ = ["bf16_hardware_note", "bf16_matrix_instructions", "cpu_identity", "demo_dtype",
           "lacks_bf16_matrix_instructions", "machine_info"]
