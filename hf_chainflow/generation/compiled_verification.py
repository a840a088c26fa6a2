"""Compiled verification: the target's verification forward compiled, on a static cache, inputs padded to buckets.

On a CPU most of a small target's step is per-operation overhead (hundreds of small kernels per layer), and so is
most of a verification forward over a dozen rows; `torch.compile` (inductor) fuses it away. The forward is compiled
with dynamic shapes (one graph for every number of inputs, cache width and batch size above one; compiling a graph
per shape cost as much per shape as one dynamic graph in all, and measured no faster), on inputs made regular:

- the cache is a transformers `StaticCache` of `max_cache_len` columns (`static_cache_length`: the call's
  `max_length` plus the largest bucket, rounded up to `CACHE_ROUNDING`), so the attention mask and the keys are
  always `max_cache_len` wide; verification writes a round's `n` inputs at columns `[T, T + n)` and the commit moves
  the accepted entries down in place and resets the layers' length (`hf_chainflow.generation.verification`);
- a round's inputs are padded with inert nodes (children of the root that nothing sees) to the smallest of
  `BUCKETS` (multiples of 4) that holds them: never one input (Dynamo specialises sizes 0 and 1, a recompile), and
  the lookup branch's changing length, a tree cut by its budget and Lafa's extra rows land on a few sizes.

A target compiles once per process for one row and once for a batch (transformers' `get_compiled_call`, the path
its own `generate` uses for static caches), at the cost of a warm-up: 52 s (bfloat16) and 41 s (float32) for SmolLM2-135M on a
2-core AMD EPYC Zen 4 in the bench runs of docs/research/results/compiled-verification (`warm_up` does it ahead of
time; the bench does before timing). Rounds that cannot run compiled run
eagerly and are counted (`SpeculativeStats.eager_rounds`, with the reason): a draft larger than the largest bucket,
more graphs than Dynamo recompiles one function (`torch._dynamo.config.recompile_limit`; Dynamo would fall back to
eager silently), or a platform that cannot compile (inductor needs a C++ compiler): the first failure warns once
and the rest of the process runs eagerly. Hybrid (Gated DeltaNet) targets stay eager: their tree kernels are not
compiled (`HYBRID_REASON`).
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["BUCKETS", "CACHE_ROUNDING", "COMPILE_BACKEND", "HYBRID_REASON", "CompiledVerifier", "bucket",
           "make_verifier", "static_cache_length", "verify_compile_config", "warm_up"]

BUCKETS = tuple(range(4, 65, 4))  # inputs per row of a compiled verify forward ([root] + nodes + extra rows)
CACHE_ROUNDING = 64  # a static cache's columns: the call's longest sequence and the largest bucket, rounded up
HYBRID_REASON = ("hybrid target: its Gated DeltaNet tree kernels (`hf_chainflow.generation.hybrid`) are not "
                 "compiled, so verification runs eagerly on its dynamic cache")
COMPILE_BACKEND = "inductor"  # torch.compile's backend for verification
_BROKEN: dict[str, str] = {}  # backend -> why it failed here (the process does not try it again)


def bucket(n: int) -> int | None:
    """The smallest of `BUCKETS` holding `n` inputs; None beyond the largest (that round runs eagerly)."""
    for size in BUCKETS:
        if n <= size:
            return size
    return None


def static_cache_length(max_length: int) -> int:
    """Columns of the static cache of a call generating up to `max_length` tokens (prompt included): room for the
    largest bucket's inputs after the longest committed sequence, rounded up to `CACHE_ROUNDING`. Kept tight: every
    verify forward attends over all of them (the graph is dynamic in this width, so calls of any length share it)."""
    return -(-(int(max_length) + BUCKETS[-1]) // CACHE_ROUNDING) * CACHE_ROUNDING


def verify_compile_config(backend: str = "inductor"):
    """The `CompileConfig` of compiled verification: transformers' defaults but dynamic shapes (`dynamic=True`: one
    graph for every number of inputs and cache width) and no CUDA graphs (`mode="default"`)."""
    from transformers import CompileConfig

    config = CompileConfig(mode="default", dynamic=True, backend=backend)
    config._compile_all_devices = True
    return config


RECOMPILE_LIMIT = 64  # Dynamo's recompile limit is raised to this on first use (its default, 8, is too few)
_SHAPES: set = set()  # (target id, dtype, one row or a batch): the graphs compiled in this process


def _recompile_limit() -> int:
    """How many verify graphs may compile in this process. Every model's compiled call is one function to Dynamo
    (`Module.__call__`), whose recompile limit (default 8) covers all of them: compiled verification raises it to
    `RECOMPILE_LIMIT` on first use and keeps 8 of those for other compiled calls (transformers' compiled plain
    `generate`, a compiled drafting round); past that a round runs eagerly, counted, never silently."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    if int(getattr(config, name)) < RECOMPILE_LIMIT:
        setattr(config, name, RECOMPILE_LIMIT)
    return int(getattr(config, name)) - 8


class CompiledVerifier:
    """Runs a call's verification forwards compiled where it can (one per `speculative_generate` call).

    `pad_to(n)` is the bucket a round of `n` inputs per row is padded to (None: this round runs eagerly);
    `forward(target, cache, **inputs)` runs it and counts it (`compiled_rounds`, `eager_rounds`, `reasons`).
    `backend` is `torch.compile`'s (inductor; tests may use a lighter one). The shapes compiled so far are kept
    for the process (`_SHAPES`), so that a later call knows what is already compiled."""

    def __init__(self, target: nn.Module, *, backend: str = "inductor", enabled: bool = True,
                 reason: str | None = None):
        self.backend = backend
        self.static = enabled  # the call verifies on a static cache (compiled where it can)
        self.enabled = enabled and backend not in _BROKEN
        self.reasons: list[str] = [] if enabled else [reason] if reason else []
        if enabled and backend in _BROKEN:
            self.reasons.append(_BROKEN[backend])
        self.compiled_rounds = 0
        self.eager_rounds = 0
        self.warm_up_seconds = 0.0
        self._target = target

    def cache_for(self, target: nn.Module, cache, batch_size: int, max_length: int):
        """The cache of the call: `cache` (the dynamic cache `generate` prepared) when verification is eager, else
        a new `StaticCache` (`static_cache_length` columns; `cache` must still be empty)."""
        if not self.static:
            return cache
        from transformers import StaticCache

        return StaticCache(config=target.config, max_cache_len=static_cache_length(max_length))

    def for_round(self):
        """What `verify_forward_batch` takes as `compiled` this round: this verifier on a static cache, else None
        (an eager round, counted here)."""
        if self.static:
            return self
        self.eager_rounds += 1
        return None

    def stats_fields(self) -> dict:
        """The call's `SpeculativeStats` fields: rounds verified compiled / eagerly, why any ran eagerly, and the
        seconds of first calls at new shapes (compilation) in this call."""
        return {"compiled_rounds": self.compiled_rounds, "eager_rounds": self.eager_rounds,
                "compile_reasons": list(self.reasons), "compile_time": self.warm_up_seconds}

    def pad_to(self, n: int) -> int | None:
        if not self.enabled:
            return None
        size = bucket(n)
        if size is None:
            self._note(f"a round of {n} inputs per row is beyond the largest bucket ({BUCKETS[-1]})")
        return size

    def _note(self, reason: str) -> None:
        if reason not in self.reasons:
            self.reasons.append(reason)

    def forward(self, target: nn.Module, padded: bool, reset_length, **inputs):
        """One verify forward: compiled when `padded` (the inputs are a bucket's shape) and the shape may still
        compile, else eager. `reset_length()` puts the cache's write position back, for the eager rerun after a
        failed compile."""
        if padded and self.enabled:
            shape = (id(target), target.dtype, int(inputs["input_ids"].shape[0]) == 1)  # a graph's key
            shapes = _SHAPES
            if shape in shapes or len(shapes) < _recompile_limit():
                new = shape not in shapes
                start = time.perf_counter()
                try:
                    out = target.get_compiled_call(verify_compile_config(self.backend))(**inputs)
                except Exception as exc:  # inductor without a C++ compiler, an unsupported op, ...
                    why = f"torch.compile ({self.backend}) failed here: {type(exc).__name__}: {str(exc)[:200]}"
                    _BROKEN[self.backend] = why
                    self.enabled = False
                    self._note(why)
                    _warn_once(f"hf_chainflow: compiled verification is off for this process ({why}); "
                               "verification runs eagerly.")
                    reset_length()
                else:
                    if new:
                        shapes.add(shape)
                        self.warm_up_seconds += time.perf_counter() - start
                    self.compiled_rounds += 1
                    return out
            else:
                self._note(f"more than {_recompile_limit()} verify graphs in this process (Dynamo's recompile "
                           "limit)")
        self.eager_rounds += 1
        return target(**inputs)


def make_verifier(target: nn.Module, compile_verification: bool) -> CompiledVerifier:
    """The verifier of one call: compiled on a static cache when `compile_verification` and the target is dense;
    eager (with `HYBRID_REASON`) for a hybrid target, which warns once."""
    from hf_chainflow.generation.hybrid import is_hybrid_target

    if not compile_verification:
        return CompiledVerifier(target, enabled=False)
    if is_hybrid_target(target):
        _warn_once(f"hf_chainflow: `compile_verification` is on but the {HYBRID_REASON}.")
        return CompiledVerifier(target, enabled=False, reason=HYBRID_REASON)
    return CompiledVerifier(target, backend=COMPILE_BACKEND)


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)


@torch.no_grad()
def warm_up(target: nn.Module, max_length: int, *, batch_size: int = 1, state_layers=(),
            buckets=(16, BUCKETS[-1])) -> dict:
    """Compile the verify forward ahead of time (outside any timed region; `buckets`: the sizes run, the first
    compiles, the others confirm the graph serves them) for calls generating up to
    `max_length` tokens at `batch_size` rows, on a throwaway static cache; `state_layers` as the drafter's (they
    select the hidden states the forward returns, part of the graph). Run it under the grad mode the calls will
    use (`torch.inference_mode()` for a bench's). Returns `{"seconds", "cache_length", "compiled_rounds",
    "compiled", "reasons"}`: `compiled` False (with the reasons) where this platform or target cannot compile."""
    from hf_chainflow.generation.tree import DraftTree
    from hf_chainflow.generation.verification import RaggedRows, _set_length, verify_forward_batch

    start = time.perf_counter()
    verifier = make_verifier(target, True)
    cache_length = static_cache_length(max_length)
    if verifier.static:
        cache = verifier.cache_for(target, None, batch_size, max_length)
        device = target.get_input_embeddings().weight.device
        prefix = 8
        target(input_ids=torch.zeros(batch_size, prefix, dtype=torch.long, device=device), cache=cache,
               use_cache=True, logits_to_keep=1)
        for size in buckets:
            rows = RaggedRows([0] * batch_size, [prefix] * batch_size)
            trees = [DraftTree.chain(torch.zeros(size - 1, dtype=torch.long, device=device))] * batch_size
            verify_forward_batch(target, cache, rows, [0] * batch_size, trees, state_layers=tuple(state_layers),
                                 compiled=verifier)
            _set_length(cache, prefix)
    return {"seconds": time.perf_counter() - start, "cache_length": cache_length,
            "compiled_rounds": verifier.compiled_rounds,
            "compiled": verifier.enabled and verifier.static, "reasons": list(verifier.reasons)}
