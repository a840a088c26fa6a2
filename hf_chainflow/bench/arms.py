"""The bench's arms: one way of generating in one dtype (plain greedy `ar`, the same compiled `ar-compiled`, prompt
lookup `pld` (transformers') or `pld-compiled` (hf_chainflow's loop, compiled verification), a drafter's chain or
tree, eager or with compiled verification, stock transformers' DFlash decoding, or a custom function), and one timed
greedy `generate` call of an arm on one prompt (`Run`)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from hf_chainflow.generation.stats import SpeculativeStats
from hf_chainflow.bench.defaults import BASE_ARMS

logger = logging.getLogger(__name__)


@dataclass
class Arm:
    """One way of generating, in one dtype.

    `kind` is `"ar"`, `"pld"`, `"lookup"` (`PromptLookupDrafter` in hf_chainflow's loop, no drafter model),
    `"chain"`, `"tree"`, `"dflash"` or `"custom"`. Chain/tree arms name their `drafter`
    (a key of the `drafters` given to `run_bench`); a `dflash` arm names a DFlash drafter (`hf_chainflow.training.dflash`) in
    the arm's dtype, run by stock transformers (`speculation_type="dflash"`). A custom arm (tests, experiments)
    calls `fn(model, input_ids, generate_kwargs) -> output ids (1, L)`.

    A plain arm (`kind="ar"`) whose settings hold `"compile": True` (`ar-compiled`) runs greedy `generate` with a
    static cache and the target's forward compiled by transformers' own compile path (`plain_compile_config`); its
    `compile_state` is what `warm_up_compiled_plain` found (`compiled`, `warmup_seconds`, `reason`, and the static
    cache's `max_cache_len`, sized for every prompt of the run so that one compiled graph serves them all).
    """

    name: str
    kind: str
    dtype: str
    drafter: str | None = None
    settings: dict = field(default_factory=dict)
    fn: Callable | None = None
    compile_state: dict = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.name}@{self.dtype}"

    @property
    def speculative(self) -> bool:
        """A ChainFlow drafter's arm (its `last_stats` say what it did)."""
        return self.kind in ("chain", "tree")

    @property
    def uses_drafter(self) -> bool:
        return self.speculative or self.kind == "dflash"

    @property
    def compiled_verification(self) -> bool:
        """An arm of hf_chainflow's loop whose verification forwards run compiled (`compile_verification`)."""
        return self.kind in ("chain", "tree", "lookup") and bool(self.settings.get("compile_verification"))

    @property
    def compiled_plain(self) -> bool:
        """A plain greedy arm with the target's forward compiled (`ar-compiled`)."""
        return self.kind == "ar" and bool(self.settings.get("compile"))


def build_arms(dtypes: list[str], drafters: dict[str, object], *, pld_tokens: int = 10, chain: int | None = None,
               tree: tuple[int, int] | None = None, tree_budget: int | None = None,
               lookup: dict | None = None, default_drafter: str = "chainflow",
               only: list[str] | None = None, dflash: bool = False, compiled_ar: bool = False,
               compile_verification: bool | None = None) -> list[Arm]:
    """The arms of a run: `ar`, `pld`, and chain + tree arms for every drafter, in every dtype.

    `drafters` maps a drafter name to any drafter of that name (its `generation_config` gives the defaults: chain
    length `num_assistant_tokens`, tree shape `tree_width` x `tree_depth` and `tree_budget`; `chain`/`tree`/
    `tree_budget` override them). The
    default drafter's arms are `chain`/`tree`, another drafter's `NAME-chain`/`NAME-tree`. `lookup` (the
    `lookup_*` generation-config fields) adds the default drafter's `tree+lookup` arm. `dflash` adds the `dflash`
    arm (the DFlash drafter named `"dflash"`). `compiled_ar`, or `only` naming it, adds `ar-compiled` (plain greedy
    with a static cache and the target's forward compiled: compiling costs a warm-up, so it runs only when asked
    for); `pld-compiled`, `tree+lookup-compiled` and `tree+lookup-auto` likewise (`OPT_IN_ARMS`). `compile_verification`
    sets every chain/tree arm's verification compiled or eager (None: each drafter's own generation config). `only`
    keeps the arms it names (`select_arms`: `NAME` in every dtype, `NAME@DTYPE` in one).
    """
    asked = {entry.partition("@")[0] for entry in only or []}
    names: list[tuple[str, str, str | None, dict]] = [("ar", "ar", None, {}),
                                                      ("pld", "pld", None, {"prompt_lookup_num_tokens": pld_tokens})]
    if compiled_ar or "ar-compiled" in asked:
        names.insert(1, ("ar-compiled", "ar", None, {"compile": True, "cache_implementation": "static"}))
    if "pld-compiled" in asked:
        names.append(("pld-compiled", "lookup", None, {"lookup_num_tokens": pld_tokens, "compile_verification": True}))
    for dname, drafter in drafters.items():
        g = drafter.generation_config
        compiled = compile_verification if compile_verification is not None else bool(
            getattr(g, "compile_verification", None))
        verify = {"compile_verification": True} if compiled else {}  # (absent: eager, as in journals before it)
        prefix = "" if dname == default_drafter else f"{dname}-"
        n = chain if chain is not None else int(g.num_assistant_tokens)
        width, depth = tree if tree is not None else (int(getattr(g, "tree_width", 8)), int(getattr(g, "tree_depth", 4)))
        names.append((f"{prefix}chain", "chain", dname, {"num_assistant_tokens": n, **verify}))
        budget = tree_budget if tree_budget is not None else getattr(g, "tree_budget", None)
        names.append((f"{prefix}tree", "tree", dname, {"tree_width": width, "tree_depth": depth,
                                                         "tree_budget": budget, **verify}))
        if lookup is not None and dname == default_drafter:
            shape = {"tree_width": width, "tree_depth": depth, "tree_budget": budget, **lookup}
            names.append(("tree+lookup", "tree", dname, {**shape, **verify}))
            if "tree+lookup-compiled" in asked:
                names.append(("tree+lookup-compiled", "tree", dname, {**shape, "compile_verification": True}))
            if "tree+lookup-auto" in asked:
                names.append(("tree+lookup-auto", "tree", dname, {**shape, "tree_budget": "auto",
                                                                   "compile_verification": True}))
    if dflash:
        names.append(("dflash", "dflash", "dflash", {}))
    keep = select_arms(only, [n[0] for n in names], dtypes)
    return [Arm(name, kind, dtype, dname, dict(settings)) for dtype in dtypes for name, kind, dname, settings in names
            if (name, dtype) in keep]


def select_arms(only: list[str] | None, names: list[str], dtypes: list[str]) -> set[tuple[str, str]]:
    """The (arm name, dtype) pairs that `--arms` keeps: `NAME` keeps the arm in every dtype, `NAME@DTYPE` (an arm's
    key, e.g. `ar@bfloat16`) in that dtype alone; `None` keeps every arm. A dtype left with no arm is refused (it
    would load a target copy for nothing)."""
    if only is None:
        return {(n, dt) for n in names for dt in dtypes}
    keep, unknown = set(), []
    for entry in only:
        name, at, dtype = entry.partition("@")
        if name not in names or (at and dtype not in dtypes):
            unknown.append(entry)
        keep |= {(name, dt) for dt in ([dtype] if dtype else dtypes)}
    if unknown:
        raise ValueError(f"`--arms` names unknown arms {unknown}; the arms of this run are {names}, each in every "
                         f"dtype of `--dtypes` ({','.join(dtypes)}) or in one as NAME@DTYPE (e.g. ar@{dtypes[-1]}).")
    idle = [dt for dt in dtypes if not any(d == dt for _, d in keep)]
    if idle:
        raise ValueError(f"`--arms` {','.join(only)} runs nothing in {idle}: drop {'them' if len(idle) > 1 else 'it'} "
                         f"from `--dtypes` or name an arm there (at least its `ar`, the baseline).")
    return keep


def plain_compile_config():
    """The `CompileConfig` of the `ar-compiled` arm: transformers' own compile of the target's forward in `generate`
    (inductor, graphs without CUDA graphs), switched on for every device. transformers compiles automatically only on
    accelerators (`GenerationMixin._valid_auto_compile_criteria` checks the device) unless the config's
    `_compile_all_devices` is set; a static cache is the other condition."""
    from transformers import CompileConfig

    config = CompileConfig(mode="default")
    config._compile_all_devices = True
    return config


def _compiled_generate_kwargs(arm: Arm) -> dict:
    """The `generate` keyword arguments of an `ar-compiled` arm: a static cache (sized by `compile_state`'s
    `max_cache_len`, so that one graph serves every prompt) and the compile config, or compilation switched off where
    the warm-up found that this platform cannot compile (the arm is then reported as not compiled)."""
    kwargs = {"cache_implementation": arm.settings.get("cache_implementation", "static")}
    if arm.compile_state.get("max_cache_len") is not None:
        kwargs["max_cache_len"] = arm.compile_state["max_cache_len"]
    if arm.compile_state.get("compiled", True):
        kwargs["compile_config"] = plain_compile_config()
    else:
        kwargs["disable_compile"] = True
    return kwargs


def warm_up_compiled_plain(arm: Arm, model, input_ids: torch.LongTensor, max_new_tokens: int, *,
                           max_cache_len: int | None = None, eos_token_id=None, pad_token_id=None) -> dict:
    """Compile an `ar-compiled` arm's target forward by one greedy `generate` on `input_ids`, outside any timed
    region, and record in `arm.compile_state` (returned) whether it compiled and what that cost in seconds.

    `max_cache_len`: the static cache's length for every call of the arm (the longest prompt plus the new tokens),
    so the compiled graph's shapes never change. Where the platform cannot compile (inductor needs a C++ compiler)
    or transformers declines to, a one-line warning; the arm then runs eagerly (static cache) and is reported as not
    compiled, never timed eager under the compiled name unsaid."""
    if not arm.compiled_plain:
        raise ValueError(f"Arm {arm.key} is not a compiled plain arm (`ar-compiled`).")
    arm.compile_state = {"compiled": True, "max_cache_len": max_cache_len, "warmup_seconds": None, "reason": None}
    reason = None
    start = time.perf_counter()
    try:
        run_arm(arm, model, input_ids, max_new_tokens, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
        if getattr(model, "_last_compile_config", None) != plain_compile_config() or not hasattr(model,
                                                                                                  "_compiled_call"):
            reason = "transformers did not compile the forward (its compile criteria were not met)"
    except Exception as e:  # noqa: BLE001 -- any failure to compile: reported, the arm runs eager and says so
        root = getattr(e, "inner_exception", None) or e.__cause__ or e  # Dynamo wraps the backend's error
        first = next((line.strip() for line in str(root).splitlines() if line.strip()), "")[:200]
        reason = f"{type(root).__name__}: {first}; inductor needs a working C++ compiler"
    seconds = time.perf_counter() - start
    arm.compile_state.update(warmup_seconds=seconds, compiled=reason is None, reason=reason)
    if reason is not None:
        logger.warning(f"{arm.key}: cannot compile the target's forward on this platform ({reason}); the arm runs "
                       "eager with a static cache and is reported as not compiled.")
    return arm.compile_state


def configure_drafter(drafter, arm: Arm) -> None:
    """Set the drafter's `generation_config` for a chain or tree arm."""
    g = drafter.generation_config
    g.draft_mode = arm.kind
    # Arms share a drafter: the lookup branch only where an arm asks for it.
    g.lookup_num_tokens = g.lookup_trust_ngram = g.lookup_max_tokens = g.corpus_lookup_num_tokens = None
    g.compile_verification = False  # eager unless the arm says otherwise
    for k, v in arm.settings.items():
        setattr(g, k, v)


class _ForwardCounter:
    """Counts calls of a model's forward (a forward hook), for prompt lookup's tau."""

    def __init__(self, model):
        self.count = 0
        self.handle = model.register_forward_hook(self._hook)

    def _hook(self, *args):
        self.count += 1

    def remove(self):
        self.handle.remove()


@dataclass
class Run:
    """What one arm did on one prompt."""

    tokens: list[int]
    seconds: float
    stats: SpeculativeStats | None = None
    forwards: int | None = None

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)


def run_arm(arm: Arm, model, input_ids: torch.LongTensor, max_new_tokens: int, drafter=None,
            eos_token_id=None, pad_token_id=None) -> Run:
    """Generate greedily with one arm on one prompt; time only the `generate` call."""
    kwargs = dict(attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens, do_sample=False)
    if eos_token_id is not None:
        kwargs["eos_token_id"] = eos_token_id
    if pad_token_id is not None:
        kwargs["pad_token_id"] = pad_token_id
    counter = None
    if arm.kind in ("ar", "pld", "dflash"):
        if arm.compiled_plain:  # no forward hook: adding one between calls would recompile the forward (tau is 1)
            kwargs.update(_compiled_generate_kwargs(arm))
        else:
            counter = _ForwardCounter(model)
        if arm.kind == "pld":
            kwargs["prompt_lookup_num_tokens"] = arm.settings["prompt_lookup_num_tokens"]
        if arm.kind == "dflash":  # stock transformers' DFlash candidate generator
            kwargs["assistant_model"], kwargs["speculation_type"] = drafter, "dflash"
    elif arm.speculative:
        configure_drafter(drafter, arm)
        kwargs["assistant_model"] = drafter
    elif arm.kind == "lookup":  # prompt lookup in hf_chainflow's loop: a drafter with no model, made per call
        from hf_chainflow.generation.lookup_drafter import PromptLookupDrafter

        drafter = PromptLookupDrafter(num_tokens=arm.settings["lookup_num_tokens"],
                                      compile_verification=bool(arm.settings.get("compile_verification")))
        kwargs["assistant_model"] = drafter
    elif arm.kind != "custom":
        raise ValueError(f"`Arm.kind` must be one of {BASE_ARMS + ('custom',)}, got {arm.kind!r}.")
    try:
        with torch.inference_mode():
            start = time.perf_counter()
            out = arm.fn(model, input_ids, kwargs) if arm.kind == "custom" else model.generate(input_ids, **kwargs)
            seconds = time.perf_counter() - start
    finally:
        if counter is not None:
            counter.remove()
    tokens = out[0, input_ids.shape[1]:].tolist()
    stats = drafter.last_stats if arm.speculative or arm.kind == "lookup" else None
    return Run(tokens, seconds, stats, counter.count if counter is not None else None)


__all__ = ["Arm", "Run", "build_arms", "configure_drafter", "plain_compile_config", "run_arm", "select_arms",
           "warm_up_compiled_plain"]
