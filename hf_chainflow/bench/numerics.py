"""Numerics of the bench: where an arm's output first differs from plain greedy `ar`, and whether that difference
is a near-tie of a low-precision forward or a bug.

Speculative decoding is exact in float32: every arm must equal `ar` token for token, so every float32
difference is `unexplained` (a bug). In bfloat16, scoring several tokens in one forward rounds differently from
scoring one at a time and flips near-ties. At the first diverging position the plain model of that dtype scores the
common prefix in one forward; when its logits for the two tokens (ar's and the arm's) lie within
`--tie-tolerance` of each other the difference is a `near_tie`, else it is `unexplained`.

Default tolerance (`DEFAULT_TIE_TOLERANCE` = 0.5 logits), measured on SmolLM2-135M-Instruct in bfloat16:
- rounding moves: on 8 evaluation prompts (one per domain, 400 generated positions) the gap between the two top
  logits of one-token-at-a-time scoring moved, when the same positions were scored in one full forward / in chunks
  of 4 / in chunks of 33 tokens, by a median of 0.05-0.06, p99 0.25-0.375 and at most 0.75 / 0.5 / 0.375 logits;
- genuine flips: bfloat16 PLD-10 differed from bfloat16 `ar` on 20 of 32 other evaluation prompts (96 tokens);
  this classifier's reference gap at the first divergence was 0 on 8, 0.0625 on 2, 0.125-0.1875 on 7 and 0.25 on 3.
0.5 is twice the largest genuine flip and covers p99.9 of chunked scoring; a wrong token sits whole logits away
(6-8 on the tiny test model); and float32, where every difference is unexplained, stays the exactness check.

One exception: a row of a left-padded batch against its own batch-1 output (the batched bench, `padded=True`).
Padding changes the shapes of the products, so float32 is not bit-identical there; a float32 difference is a
`near_tie` within `PADDED_FLOAT32_TIE_TOLERANCE` (1e-3 logits, 2.6 times the largest change padding made to a
logit of the real target, `hf_chainflow.bench.defaults`), else `unexplained`.
"""

from __future__ import annotations

import torch

from hf_chainflow.bench.defaults import DEFAULT_TIE_TOLERANCE, PADDED_FLOAT32_TIE_TOLERANCE


def first_divergence(reference: list[int], other: list[int]) -> int | None:
    """First position where two token lists differ (a length difference counts at the shorter length); None when
    they are equal."""
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


def classify_divergence(logits: torch.Tensor, expected: int | None, got: int | None, dtype: str,
                        tolerance: float = DEFAULT_TIE_TOLERANCE, *, padded: bool = False) -> dict:
    """Classify one difference from the reference logits `(V,)` of the common prefix.

    `expected` is ar's token, `got` the arm's (None where that output had already ended). The difference is a
    `near_tie` when `dtype` is not float32 and both tokens' logits lie within `tolerance` of each other and of the
    reference's top logit (`top_gap`: top minus the higher of the two; a third token may be the reference's argmax
    when several tie); otherwise `unexplained` (float32 is exact; a gap beyond the rounding of a low-precision
    forward, two tokens tied far below the top, or a length difference, is a bug). With `padded` (a row of a
    left-padded batch against batch 1) a float32 difference is judged like a low-precision one, with
    `PADDED_FLOAT32_TIE_TOLERANCE` in place of `tolerance`.
    """
    top = int(logits.argmax())
    if expected is None or got is None:
        return {"kind": "unexplained", "gap": None, "top_gap": None, "reference_top": top,
                "reason": "output length differs"}
    gap = float(logits[expected].float() - logits[got].float())
    top_gap = float(logits[top].float() - torch.maximum(logits[expected], logits[got]).float())
    if dtype == "float32" and padded:
        tolerance = PADDED_FLOAT32_TIE_TOLERANCE
    if dtype == "float32" and not padded:
        kind, reason = "unexplained", "float32 must match exactly"
    elif abs(gap) > tolerance:
        kind, reason = "unexplained", f"|gap| > {tolerance}"
    elif top_gap > tolerance:
        kind, reason = "unexplained", f"both tokens more than {tolerance} below the reference's top"
    else:
        kind, reason = "near_tie", f"|gap| <= {tolerance} and top_gap <= {tolerance}"
    return {"kind": kind, "gap": gap, "top_gap": top_gap, "reference_top": top, "reason": reason}


@torch.inference_mode()
def explain_mismatch(model, prompt_ids: torch.LongTensor, reference: list[int], other: list[int], dtype: str,
                     tolerance: float, *, padded: bool = False) -> dict | None:
    """None when `other == reference`; else the first diverging position, both tokens and their classification
    from the plain `model` (of that dtype) scoring prompt + common prefix in one forward (`padded`: see
    `classify_divergence`)."""
    pos = first_divergence(reference, other)
    if pos is None:
        return None
    prefix = torch.tensor([reference[:pos]], dtype=prompt_ids.dtype, device=prompt_ids.device)
    ids = torch.cat([prompt_ids, prefix], 1)
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, -1]
    expected = reference[pos] if pos < len(reference) else None
    got = other[pos] if pos < len(other) else None
    return {"position": pos, "ar_token": expected, "arm_token": got,
            **classify_divergence(logits, expected, got, dtype, tolerance, padded=padded)}


__all__ = ["DEFAULT_TIE_TOLERANCE", "classify_divergence", "explain_mismatch", "first_divergence"]
