"""What a run was measured or made on: the CPU's identity, its native bfloat16 matrix instructions, the library
versions and the load. One description of the machine, for the bench (`machine_info`, a dict in results.json) and
the response corpus (`describe_machine`, the one line stored with every response); the bfloat16 decisions built on
it (`hf_chainflow.bench.machine`: the demo's dtype, the note before bfloat16 runs) live with the bench."""

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


def _cpu_identity_here() -> dict[str, str | int | None] | None:
    """`cpu_identity` of this machine's `/proc/cpuinfo`; None where it cannot be read (not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            return cpu_identity(f.read())
    except OSError:
        return None


def machine_info() -> dict:
    """What the numbers were measured on."""
    import transformers

    identity = _cpu_identity_here() or cpu_identity("")
    info = {"platform": platform.platform(), "cpu": identity["name"] or platform.processor(),
            "cpu_vendor": identity["vendor"], "cpu_family": identity["family"], "cpu_model": identity["model"],
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "bf16_matrix_instructions": bf16_matrix_instructions(),
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    if hasattr(os, "getloadavg"):
        info["load_average_start"] = list(os.getloadavg())
    return info


def describe_machine(device: str = "cpu") -> str:
    """One line naming the processor the responses were made on (its bfloat16 kernels decide near-ties): the GPU's
    name on `cuda`, else the CPU's identity, torch's CPU capability, its bfloat16 matrix instructions and cores."""
    if str(device).startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} (cuda)"
    cpu = _cpu_identity_here() or {"name": platform.processor(), "family": None, "model": None}
    bf16 = [name for name, has in bf16_matrix_instructions().items() if has]
    return (f"{cpu['name'] or platform.machine()} (family {cpu['family']}, model {cpu['model']}; "
            f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}; bf16 matrix instructions: "
            f"{', '.join(bf16) or 'none'}; {os.cpu_count()} cores)")


__all__ = ["bf16_matrix_instructions", "cpu_identity", "describe_machine", "machine_info"]
