"""The bench's arms: one way of generating in one dtype (plain greedy `ar`, prompt lookup `pld`, a drafter's
chain or tree, stock transformers' DFlash decoding, or a custom function), and one timed greedy `generate` call of an
arm on one prompt (`Run`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from hf_chainflow.generation.stats import SpeculativeStats
from hf_chainflow.bench.defaults import BASE_ARMS


@dataclass
class Arm:
    """One way of generating, in one dtype.

    `kind` is `"ar"`, `"pld"`, `"chain"`, `"tree"`, `"dflash"` or `"custom"`. Chain/tree arms name their `drafter`
    (a key of the `drafters` given to `run_bench`); a `dflash` arm names a DFlash drafter (`hf_chainflow.training.dflash`) in
    the arm's dtype, run by stock transformers (`speculation_type="dflash"`). A custom arm (tests, experiments)
    calls `fn(model, input_ids, generate_kwargs) -> output ids (1, L)`.
    """

    name: str
    kind: str
    dtype: str
    drafter: str | None = None
    settings: dict = field(default_factory=dict)
    fn: Callable | None = None

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


def build_arms(dtypes: list[str], drafters: dict[str, object], *, pld_tokens: int = 10, chain: int | None = None,
               tree: tuple[int, int] | None = None, tree_budget: int | None = None,
               lookup: dict | None = None, default_drafter: str = "chainflow",
               only: list[str] | None = None, dflash: bool = False) -> list[Arm]:
    """The arms of a run: `ar`, `pld`, and chain + tree arms for every drafter, in every dtype.

    `drafters` maps a drafter name to any drafter of that name (its `generation_config` gives the defaults: chain
    length `num_assistant_tokens`, tree shape `tree_width` x `tree_depth` and `tree_budget`; `chain`/`tree`/
    `tree_budget` override them). The
    default drafter's arms are `chain`/`tree`, another drafter's `NAME-chain`/`NAME-tree`. `lookup` (the
    `lookup_*` generation-config fields) adds the default drafter's `tree+lookup` arm. `dflash` adds the `dflash`
    arm (the DFlash drafter named `"dflash"`). `only` keeps the arms it names (`select_arms`: `NAME` in every
    dtype, `NAME@DTYPE` in one).
    """
    names: list[tuple[str, str, str | None, dict]] = [("ar", "ar", None, {}),
                                                      ("pld", "pld", None, {"prompt_lookup_num_tokens": pld_tokens})]
    for dname, drafter in drafters.items():
        g = drafter.generation_config
        prefix = "" if dname == default_drafter else f"{dname}-"
        n = chain if chain is not None else int(g.num_assistant_tokens)
        width, depth = tree if tree is not None else (int(getattr(g, "tree_width", 8)), int(getattr(g, "tree_depth", 4)))
        names.append((f"{prefix}chain", "chain", dname, {"num_assistant_tokens": n}))
        budget = tree_budget if tree_budget is not None else getattr(g, "tree_budget", None)
        names.append((f"{prefix}tree", "tree", dname, {"tree_width": width, "tree_depth": depth,
                                                         "tree_budget": budget}))
        if lookup is not None and dname == default_drafter:
            names.append(("tree+lookup", "tree", dname, {"tree_width": width, "tree_depth": depth,
                                                          "tree_budget": budget, **lookup}))
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


def configure_drafter(drafter, arm: Arm) -> None:
    """Set the drafter's `generation_config` for a chain or tree arm."""
    g = drafter.generation_config
    g.draft_mode = arm.kind
    # Arms share a drafter: the lookup branch only where an arm asks for it.
    g.lookup_num_tokens = g.lookup_trust_ngram = g.lookup_max_tokens = g.corpus_lookup_num_tokens = None
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
        counter = _ForwardCounter(model)
        if arm.kind == "pld":
            kwargs["prompt_lookup_num_tokens"] = arm.settings["prompt_lookup_num_tokens"]
        if arm.kind == "dflash":  # stock transformers' DFlash candidate generator
            kwargs["assistant_model"], kwargs["speculation_type"] = drafter, "dflash"
    elif arm.speculative:
        configure_drafter(drafter, arm)
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
    stats = drafter.last_stats if arm.speculative else None
    return Run(tokens, seconds, stats, counter.count if counter is not None else None)


__all__ = ["Arm", "Run", "build_arms", "configure_drafter", "run_arm", "select_arms"]
