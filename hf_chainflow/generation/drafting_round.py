"""One drafting round as one tensor function, compiled once per drafter and shape.

A round: target states `(B, T, D)` and committed tails `(B, p)` in -> VAE encode of the last `C` states, flow
source, Euler step(s), decode (`ChainFlowDrafter.predict_states`) -> two-pass head, feedback heads, chain or tree
search with its budget cut (`hf_chainflow.generation.search.search_levels`) -> the `DraftBatch` fields `(B, N)`. Every shape
is fixed by the settings and `T`, and nothing in it reads a tensor's value in Python, so `torch.compile` (inductor)
traces it into one graph.

`CompiledDraftingRound` keeps one compiled round per key (settings, flow steps, input shapes and dtypes); the
first call of a key compiles it (`compile_time` adds up those seconds; call `drafting.warm_up_drafting`
before timing). Where the platform cannot compile (inductor's backend fails, e.g. no C++ compiler), it warns once
and runs the same function eagerly.
"""

from __future__ import annotations

import time
import types
import warnings

import torch

from hf_chainflow.generation.search import ServingTables, search_levels
from hf_chainflow.generation.settings import SearchSettings


def drafting_round(drafter, tables: ServingTables, hidden_states: torch.Tensor, tails: torch.LongTensor,
                   settings: SearchSettings, num_flow_steps: int | None) -> tuple:
    """`hidden_states` `(B, T, D)` (`(B, T, (1 + n) D)` with `target_layer_ids`), `tails` `(B, p)` (the last `p` committed tokens, the root last) -> `(tokens,
    parents, depths, logprobs, draft_probs)`, each `(B, N)` (`draft_probs` `(B, N, V)` or `None`)."""
    states = drafter.predict_states(hidden_states, num_flow_steps=num_flow_steps, bonus_tokens=tails[:, -1],
                                    velocity=tables.velocity)  # (B, K, D); the bonus token read with `bonus_embedding`
    return search_levels(drafter, tables, states, tails, settings)


def _own_copy(fn):
    """`fn` with a code object of its own (equal to `fn`'s, not the same object)."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


class CompiledDraftingRound:
    """`drafting_round` compiled with `torch.compile` (inductor, static shapes, C++ wrapper), one entry per key.

    Args:
        cpp_wrapper (`bool`, *optional*, defaults to `True`): inductor's C++ wrapper: the compiled graph calls its
            ~100 kernels from C++ instead of a generated Python wrapper (about a tenth of a tree round on a 2-core
            CPU; docs/results.md, "The compiled drafting round"). `False`: the Python wrapper, compiled sooner.

    Attributes:
        compile_time (`float`): seconds spent in first calls (tracing and compiling) so far.
        keys (`list`): the keys compiled so far. eager_reason (`str | None`): why rounds run eagerly (the
            platform could not compile), `None` while compiling works.
    """

    def __init__(self, cpp_wrapper: bool = True):
        self.cpp_wrapper = cpp_wrapper
        self._rounds: dict = {}
        self.compile_time = 0.0
        self.eager_reason: str | None = None

    @property
    def keys(self) -> list:
        return list(self._rounds)

    def __call__(self, drafter, tables: ServingTables, hidden_states, tails, settings: SearchSettings,
                 num_flow_steps: int | None) -> tuple:
        args = (drafter, tables, hidden_states, tails, settings, num_flow_steps)
        if self.eager_reason is not None:
            return drafting_round(*args)
        key = (settings, num_flow_steps, tuple(hidden_states.shape), hidden_states.dtype, tuple(tails.shape),
               drafter.dtype, tables.head.dtype, type(tables.velocity), tables.folded is None)
        fn = self._rounds.get(key)
        if fn is not None:
            return fn(*args)
        # Each key compiles its own copy of `drafting_round` (a new code object): Dynamo keeps its cache per code
        # object, so a call checks the guards of its own key's graph only, and the keys of every drafter in the
        # process do not share Dynamo's recompile limit (8 graphs per code object, beyond which it runs eagerly).
        fn = torch.compile(_own_copy(drafting_round), dynamic=False, options={"cpp_wrapper": self.cpp_wrapper})
        start = time.perf_counter()
        try:
            out = fn(*args)
        except torch._dynamo.exc.BackendCompilerFailed as error:  # the platform cannot compile: eager from now on
            self.eager_reason = str(error).strip().splitlines()[0][:200]
            warnings.warn(f"hf_chainflow: cannot compile the drafting round ({self.eager_reason}); drafting "
                          f"eagerly (set `drafter.generation_config.compile_drafting = False` to skip the attempt).",
                          stacklevel=3)
            return drafting_round(*args)
        self.compile_time += time.perf_counter() - start
        self._rounds[key] = fn
        return out


def compare_drafts(want, got, tie: float = 1e-3) -> str:
    """Two `DraftTree`s of one round (e.g. eager `want`, compiled `got`): `"same"` (same tokens and parents),
    `"near-tie"` (they part at a node where the drafter's two path scores, `want`'s and `got`'s cumulative
    log-probabilities there, are within `tie`: a swap of two near-equal candidates), else `"different"`."""
    n = min(want.num_nodes, got.num_nodes)
    part = [i for i in range(n) if int(want.tokens[i]) != int(got.tokens[i])
            or int(want.parents[i]) != int(got.parents[i])]
    if not part and want.num_nodes == got.num_nodes:
        return "same"
    if not part:
        return "different"
    i = part[0]
    gap = abs(float(want.cumulative_logprobs()[i]) - float(got.cumulative_logprobs()[i]))
    return "near-tie" if gap <= tie else "different"


__all__ = ["CompiledDraftingRound", "compare_drafts", "drafting_round"]
