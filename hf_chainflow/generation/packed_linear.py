"""Read-only bfloat16 weights packed once for oneDNN's CPU matrix product.

Each drafting round multiplies a few states by the same large bfloat16 matrices: the two-pass head `(S, D)` and
the folded feedback heads `(S, R + r)` (`hf_chainflow.generation.serving.serving_head_weight`,
`serving_feedback_weight`).
`F.linear` hands such a product to oneDNN, which reorders the weight into its blocked layout on every call: for a
handful of rows that reorder costs as much as the product. `PackedLinear` reorders once
(`torch.ops.mkldnn._reorder_linear_weight`) and multiplies with the packed weight from then on.

Packing changes no result: a weight is packed only where the packed product equals `F.linear` bit for bit on a
probe (checked once, when the weight is packed: a CPU tensor in bfloat16 with oneDNN's bfloat16 kernels); elsewhere
`PackedLinear` computes `F.linear` itself. The packed product is the custom op `hf_chainflow::packed_linear`, so that
`torch.compile` (the compiled drafting round) calls it as one opaque kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.library.custom_op("hf_chainflow::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """`x` `(..., K)` against a weight `(out_features, K)` packed by `torch.ops.mkldnn._reorder_linear_weight` ->
    `(..., out_features)`, as `F.linear(x, weight)` (no bias)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [None], "")


@packed_linear.register_fake
def _(x, packed, out_features):
    return x.new_empty(x.shape[:-1] + (out_features,))


_PACKED_FOR_ROWS = 8  # the row count oneDNN tunes the packed layout for: a round's products have 1 to 8 rows a prompt


def _can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and not weight.requires_grad and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear:
    """`x -> F.linear(x, weight)` for a fixed weight `(N, K)`, with the weight packed for oneDNN where that computes
    the same product bit for bit (see the module docstring) on random probes of each of `probe_rows` rows.

    Attributes:
        weight (`(N, K)`): the weight as given. packed (`torch.Tensor | None`): its oneDNN-packed copy, `None` where
            the plain product is used.
    """

    def __init__(self, weight: torch.Tensor, probe_rows: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8, 16, 64)):
        self.weight = weight
        self.packed = None
        if _can_pack(weight):
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACKED_FOR_ROWS)
            generator = torch.Generator().manual_seed(0)
            probes = [torch.randn(m, weight.shape[1], generator=generator).to(weight.dtype) for m in probe_rows]
            if all(torch.equal(F.linear(x, weight), packed_linear(x, packed, weight.shape[0])) for x in probes):
                self.packed = packed

    def __reduce__(self):  # copies and pickles pack again (oneDNN's packed tensor has no storage to copy)
        return (PackedLinear, (self.weight,))

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """`x` `(..., K)` in the weight's dtype -> `(..., N)`."""
        if self.packed is None:
            return F.linear(x, self.weight)
        return packed_linear(x, self.packed, self.weight.shape[0])


__all__ = ["PackedLinear", "packed_linear"]
