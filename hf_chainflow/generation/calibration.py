"""The machine's cost curve: what one verification forward of the target costs, by its number of inputs.

`measure_cost_curve(target, ...)` times the real verify path (`verification.verify_forward_batch`, then
`commit_batch` with nothing accepted, the cache put back) over `n` inputs (`[root] + n - 1` nodes of a tree at most 4
deep) after a committed context of `context` tokens, for each `n` of `rows`: the median of `repeats` sweeps over every
`n` after `warmup` untimed ones (interleaved, so that a burst of load elsewhere on the machine hits every count).
With a drafter it also times one drafting round (`drafting.draft` of the drafter's own settings, the tree uncut).
The result is a `CostCurve`: `curve(n)` interpolates linearly between the measured points (beyond the last one it
extends the last segment), and it records what it was measured on (the target's fingerprint,
the dtype, the machine, the threads, torch, the variant: "eager" or "compiled" verification).

Curves are cached per (target, dtype, machine, threads, torch version, variant, drafter), as JSON files under
`$HF_CHAINFLOW_CALIBRATION_DIR`, by default `huggingface_hub.constants.HF_HOME/hf_chainflow/calibration/`
(`calibration_dir`), written atomically (`hf_chainflow.fileio.atomic_write_text`). `HF_CHAINFLOW_CALIBRATION_CACHE=0`
switches the cache off: nothing is read or written, every `load_or_measure` measures. A damaged file is refused with
its path and the fix (delete it). `cost_curve_for_call` is what `tree_budget="auto"` uses (`hf_chainflow.generation
.budget.AutoBudget`): the curve of the call's target, kept in the drafter's `_runtime` dict so that a process
measures (or reads) it once per target and dtype; `set_cost_curve` pins one instead.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import statistics
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_chainflow.fileio import atomic_write_text, read_json
from hf_chainflow.machine import describe_machine

DEFAULT_ROWS = (1, 2, 4, 6, 8, 12, 16, 20, 24, 32, 40, 48, 64)
DEFAULT_CONTEXT = 256
CACHE_ENV, DIR_ENV = "HF_CHAINFLOW_CALIBRATION_CACHE", "HF_CHAINFLOW_CALIBRATION_DIR"
_OFF, _ON = ("0", "false", "no", "off"), ("", "1", "true", "yes", "on")
FORMAT_VERSION = 1


# ----------------------------------------------------------------------------------------------------- the curve
@dataclass(frozen=True)
class CostCurve:
    """Seconds of one verification forward by its number of inputs, and of one drafting round.

    Attributes:
        rows: the measured input counts, increasing. seconds: the median seconds of each.
        draft_seconds: one drafting round (0 when no drafter was timed).
        context: committed tokens before the verified inputs. target: the target's fingerprint
            (`target_fingerprint`). dtype, machine (`hf_chainflow.machine.describe_machine`), torch, threads,
            variant ("eager", "compiled", ...: how verification ran), drafter: the drafter's fingerprint or None.
    """

    rows: tuple[int, ...]
    seconds: tuple[float, ...]
    draft_seconds: float = 0.0
    context: int = DEFAULT_CONTEXT
    target: dict = dataclasses.field(default_factory=dict)
    dtype: str = "float32"
    machine: str = ""
    torch: str = ""
    threads: int = 1
    variant: str = "eager"
    drafter: dict | None = None

    def __post_init__(self):
        rows, seconds = tuple(self.rows), tuple(float(s) for s in self.seconds)
        if not rows or len(rows) != len(seconds):
            raise ValueError(f"`CostCurve.rows` and `seconds` must be non-empty and of one length, got {len(rows)} "
                             f"and {len(seconds)}.")
        if any(not isinstance(r, int) or isinstance(r, bool) or r < 1 for r in rows) or list(rows) != sorted(set(rows)):
            raise ValueError(f"`CostCurve.rows` must be increasing positive integers, got {list(rows)}.")
        if any(not (s > 0 and s < float("inf")) for s in seconds):
            raise ValueError(f"`CostCurve.seconds` must be positive finite numbers, got {list(seconds)}.")
        if not (0 <= float(self.draft_seconds) < float("inf")):
            raise ValueError(f"`CostCurve.draft_seconds` must be a finite number >= 0, got {self.draft_seconds!r}.")
        object.__setattr__(self, "rows", rows)
        object.__setattr__(self, "seconds", seconds)
        object.__setattr__(self, "draft_seconds", float(self.draft_seconds))

    def __call__(self, n: int) -> float:
        """Seconds of a forward over `n` inputs: linear between measured points, the first point's below it, the
        last segment extended beyond the last point (never below the last point's seconds)."""
        rows, secs = self.rows, self.seconds
        if n <= rows[0] or len(rows) == 1:
            return secs[0] if n <= rows[0] else secs[0] * n / rows[0]
        for i in range(1, len(rows)):
            if n <= rows[i]:
                t = (n - rows[i - 1]) / (rows[i] - rows[i - 1])
                return secs[i - 1] + t * (secs[i] - secs[i - 1])
        slope = (secs[-1] - secs[-2]) / (rows[-1] - rows[-2])
        return secs[-1] + max(slope, 0.0) * (n - rows[-1])

    def steps(self, n: int) -> float:
        """The cost of `n` inputs in single-input forwards (`curve(n) / curve(1)`)."""
        return self(n) / self(1)

    def to_dict(self) -> dict:
        return {"format": FORMAT_VERSION, **dataclasses.asdict(self), "rows": list(self.rows),
                "seconds": list(self.seconds)}

    @classmethod
    def from_dict(cls, data: dict) -> "CostCurve":
        """The inverse of `to_dict`; a `ValueError` naming what is missing or wrong."""
        if not isinstance(data, dict):
            raise ValueError(f"a cost curve is a JSON object, got {type(data).__name__}")
        if data.get("format") != FORMAT_VERSION:
            raise ValueError(f"format {data.get('format')!r}, expected {FORMAT_VERSION}")
        names = {f.name for f in dataclasses.fields(cls)}
        missing = sorted({"rows", "seconds"} - set(data))
        if missing:
            raise ValueError(f"missing fields {missing}")
        return cls(**{k: v for k, v in data.items() if k in names})

    def key(self) -> str:
        """The cache key of what the curve was measured on (`curve_key`)."""
        return curve_key(self.target, self.dtype, self.machine, self.threads, self.torch, self.variant,
                         self.context, self.drafter)


def target_fingerprint(target) -> dict:
    """What decides a target's forward cost: its architecture's sizes, attention implementation and name (weights
    do not)."""
    cfg = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    fields = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "vocab_size", "layer_types")
    out = {name: getattr(cfg, name, None) for name in fields}
    out["attn_implementation"] = getattr(target.config, "_attn_implementation", None)
    out["name_or_path"] = str(getattr(target.config, "_name_or_path", "") or "")
    return json.loads(json.dumps(out, default=str))


def round_kwargs(drafter) -> dict:
    """The `drafting.draft` arguments of the drafting round a curve times: the drafter's own settings, the tree
    uncut (as `tree_budget="auto"` drafts it; the cut itself costs next to nothing)."""
    from hf_chainflow.generation.settings import SpeculativeSettings

    return {**SpeculativeSettings.from_drafter(drafter).draft_kwargs(10 ** 6), "tree_budget": None}


def drafter_fingerprint(drafter, draft_kwargs: dict) -> dict | None:
    """What decides a drafting round's cost: the ChainFlow drafter's configuration (hashed) and the round's
    settings; None for a drafter of another kind (not timed)."""
    from hf_chainflow.generation.drafting import _chainflow

    chainflow = _chainflow(drafter)
    if chainflow is None:
        return None
    config = json.dumps(chainflow.config.to_dict(), sort_keys=True, default=str)
    return {"config": hashlib.sha256(config.encode()).hexdigest()[:16],
            "round": json.loads(json.dumps(draft_kwargs, sort_keys=True, default=str)),
            "compile_drafting": bool(getattr(chainflow.generation_config, "compile_drafting", False))}


def curve_key(target: dict, dtype: str, machine: str, threads: int, torch_version: str, variant: str,
              context: int, drafter: dict | None) -> str:
    """The file name stem of a curve: the target's type, the dtype and variant, and a hash of everything else."""
    what = json.dumps([target, dtype, machine, threads, torch_version, variant, context, drafter], sort_keys=True)
    digest = hashlib.sha256(what.encode()).hexdigest()[:16]
    return f"{target.get('model_type') or 'model'}-{dtype}-{variant}-{digest}"


# ----------------------------------------------------------------------------------------------------- measuring
def _tree(n: int, tokens: torch.LongTensor):
    """A tree of `n` nodes at most 4 levels deep (levels of `ceil(n / 4)` nodes, each hanging under a node of the
    level above), as a budget-cut beam tree is."""
    from hf_chainflow.generation.tree import DraftTree

    if n == 0:
        return DraftTree.empty()
    width = -(-n // 4)
    parents, depths, level = [], [], []
    for i in range(n):
        d = i // width
        parents.append(-1 if d == 0 else level[d - 1][(i - d * width) % len(level[d - 1])])
        depths.append(d + 1)
        if len(level) <= d:
            level.append([])
        level[d].append(i)
    return DraftTree(tokens=tokens[:n].clone(), parents=torch.tensor(parents), depths=torch.tensor(depths),
                     logprobs=torch.zeros(n))


def _median_seconds(fn, repeats: int, warmup: int) -> float:
    times = []
    for i in range(warmup + repeats):
        start = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.no_grad()
def measure_cost_curve(target, *, rows=DEFAULT_ROWS, context: int = DEFAULT_CONTEXT, repeats: int = 5,
                       warmup: int = 2, drafter=None, variant: str = "eager", verify_kwargs: dict | None = None,
                       cache_factory=None, seed: int = 0) -> CostCurve:
    """Measure the cost curve of `target` on this machine (see the module docstring).

    Args:
        rows: the input counts to time (increasing). context: committed tokens before them.
        repeats, warmup: timed and untimed runs per count (the median is kept).
        drafter: a bound ChainFlow drafter: its drafting round is timed too (`CostCurve.draft_seconds`).
        variant: recorded with the curve and in its cache key: how `verify_kwargs` runs verification.
        verify_kwargs: passed to `verify_forward_batch` as they are (e.g. a compiled-verification option).
        cache_factory: `target -> cache` for the prefill (default: `DynamicCache(config=target.config)`).
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    from hf_chainflow.generation import drafting
    from hf_chainflow.generation.hybrid import is_hybrid_target
    from hf_chainflow.generation.verification import RaggedRows, _set_length, commit_batch, is_static, \
        select_target_states, verify_forward_batch

    rows = tuple(int(n) for n in rows)
    if not rows or any(n < 1 for n in rows) or list(rows) != sorted(set(rows)):
        raise ValueError(f"`rows` must be increasing positive input counts, got {list(rows)}.")
    for name, value in (("context", context), ("repeats", repeats)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
    device = target.get_input_embeddings().weight.device
    vocab = target.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (context + 1 + max(rows),), generator=gen)
    cache = DynamicCache(config=target.config) if cache_factory is None else cache_factory(target)
    state_layers = tuple(getattr(drafter, "state_layers", ()) or ()) if drafter is not None else ()
    out = target(input_ids=ids[None, :context].to(device), cache=cache, use_cache=True, logits_to_keep=1,
                 output_hidden_states=drafter is not None)
    static = is_static(cache)  # compiled verification's cache: put back by its length (a copy would recompile)
    croppable = static or (not is_hybrid_target(target) and type(cache) is DynamicCache and all(
        type(layer) is DynamicLayer for layer in cache.layers))
    pristine = None if croppable else copy.deepcopy(cache)  # put back by a copy (recurrent state, other caches)
    kwargs = dict(verify_kwargs or {})
    live = [cache]

    def verify(n: int):
        ragged = RaggedRows([0], [context])
        result = verify_forward_batch(target, live[0], ragged, [int(ids[context])], [_tree(n - 1, ids[context + 1:])],
                                      **kwargs)
        commit_batch(target, live[0], ragged, [[]], result.handle)

    def reset():
        if static:
            _set_length(live[0], context)
        elif pristine is None:  # the committed root cut off again, as `commit_batch` cuts rejected columns
            for layer in live[0].layers:
                layer.keys, layer.values = layer.keys[..., :context, :], layer.values[..., :context, :]
        else:
            live[0] = copy.deepcopy(pristine)

    times: dict[int, list[float]] = {n: [] for n in rows}
    for sweep in range(warmup + repeats):  # sweeps over every count: a burst of load hits them all alike
        for n in rows:
            start = time.perf_counter()
            verify(n)
            if sweep >= warmup:
                times[n].append(time.perf_counter() - start)
            reset()
    seconds = tuple(statistics.median(times[n]) for n in rows)
    draft_seconds, drafter_print = 0.0, None
    if drafter is not None and drafting._chainflow(drafter) is not None:
        draft_kwargs = round_kwargs(drafter)
        states = select_target_states(out.hidden_states, state_layers)[:, -drafter.context_size:]
        committed = ids[None, : context].to(device)
        draft_seconds = _median_seconds(lambda: drafting.draft(drafter, states, committed, **draft_kwargs),
                                        repeats, warmup)
        drafter_print = drafter_fingerprint(drafter, draft_kwargs)
    return CostCurve(rows=rows, seconds=seconds, draft_seconds=draft_seconds, context=context,
                     target=target_fingerprint(target), dtype=str(target.dtype).removeprefix("torch."),
                     machine=describe_machine(str(device)), torch=torch.__version__,
                     threads=torch.get_num_threads(), variant=variant, drafter=drafter_print)


# ----------------------------------------------------------------------------------------------------- the cache
def cache_enabled() -> bool:
    """Whether curves are read from and written to `calibration_dir()` (`HF_CHAINFLOW_CALIBRATION_CACHE`, default
    on; `0`, `false`, `no` or `off` switch it off)."""
    value = os.environ.get(CACHE_ENV, "").strip().lower()
    if value in _OFF:
        return False
    if value in _ON:
        return True
    raise ValueError(f"`{CACHE_ENV}` must be 1 (on, the default) or 0 (off: measure every time, write nothing), got "
                     f"{os.environ[CACHE_ENV]!r}.")


def calibration_dir() -> Path:
    """Where cost curves are cached: `$HF_CHAINFLOW_CALIBRATION_DIR`, else `HF_HOME/hf_chainflow/calibration`."""
    override = os.environ.get(DIR_ENV)
    if override:
        return Path(override).expanduser()
    from huggingface_hub import constants

    return Path(constants.HF_HOME) / "hf_chainflow" / "calibration"


def load_curve(path: str | os.PathLike) -> CostCurve:
    """A cached curve; a `ValueError` naming the file and the fix when it is damaged."""
    path = Path(path)
    try:
        return CostCurve.from_dict(read_json(path, what="cost curve"))
    except (ValueError, TypeError) as error:
        raise ValueError(f"The cached cost curve {path} is damaged ({error}). Delete it (it is measured again on "
                         f"next use: `hf-chainflow calibrate`), or set {CACHE_ENV}=0 to skip the cache.") from None


@dataclass
class Calibration:
    """A curve and where it came from: `path` (None with the cache off), `measured` (False: read from `path`)."""

    curve: CostCurve
    path: Path | None
    measured: bool


def expected_key(target, *, variant: str = "eager", context: int = DEFAULT_CONTEXT, drafter=None) -> str:
    """The cache key a curve of `target` measured here and now would have (before measuring it)."""
    device = target.get_input_embeddings().weight.device
    drafter_print = None
    if drafter is not None:
        drafter_print = drafter_fingerprint(drafter, round_kwargs(drafter))
    return curve_key(target_fingerprint(target), str(target.dtype).removeprefix("torch."),
                     describe_machine(str(device)), torch.get_num_threads(), torch.__version__, variant, context,
                     drafter_print)


def load_or_measure(target, *, drafter=None, variant: str = "eager", verify_kwargs: dict | None = None,
                    refresh: bool = False, cache: bool | None = None, **measure_kwargs) -> Calibration:
    """The cached curve of `target` (measured and stored on first use), or a fresh one with the cache off
    (`cache=False`; None: `cache_enabled()`). `refresh`: measure again and overwrite. `measure_kwargs` go to
    `measure_cost_curve` (`context` is in the key; `rows`, `repeats`, `warmup` are not)."""
    if not (cache_enabled() if cache is None else cache):
        curve = measure_cost_curve(target, drafter=drafter, variant=variant, verify_kwargs=verify_kwargs,
                                   **measure_kwargs)
        return Calibration(curve, None, True)
    key = expected_key(target, variant=variant, context=measure_kwargs.get("context", DEFAULT_CONTEXT),
                       drafter=drafter)
    path = calibration_dir() / f"{key}.json"
    if path.is_file() and not refresh:
        return Calibration(load_curve(path), path, False)
    curve = measure_cost_curve(target, drafter=drafter, variant=variant, verify_kwargs=verify_kwargs,
                               **measure_kwargs)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(curve.to_dict(), indent=1) + "\n")
    return Calibration(curve, path, True)


# ----------------------------------------------------------------------------------------------------- one call
def call_target(drafter):
    """The target a drafter is bound to (a `ChainFlowDrafter` keeps a weak reference when bound; another drafter
    object its `target` attribute); a `ValueError` when there is none."""
    from hf_chainflow.generation.drafting import _chainflow

    chainflow = _chainflow(drafter)
    ref = getattr(chainflow, "_bound", {}).get("target") if chainflow is not None else None
    target = ref() if ref is not None else getattr(drafter, "target", None)
    if target is None:
        raise ValueError("`tree_budget='auto'` measures the target's cost curve, but the drafter is not bound to a "
                         "target. Call `target.generate(..., assistant_model=drafter)` (it binds the drafter), or "
                         "pin a curve with `hf_chainflow.generation.calibration.set_cost_curve(drafter, curve)`.")
    return target


def verification_variant(settings, target) -> tuple[str, dict]:
    """How the call's verification forward runs, as a curve variant and the `measure_cost_curve` keyword arguments
    that measure it so: `"eager"`, or `"compiled"` with `compile_verification` on a dense target (the compiled
    verifier and a static cache; the curve is then a staircase, every round padded to its bucket)."""
    from hf_chainflow.generation.compiled_verification import make_verifier

    verifier = make_verifier(target, bool(getattr(settings, "compile_verification", False)))
    if not verifier.static:
        return "eager", {}
    return "compiled", {"verify_kwargs": {"compiled": verifier},
                        "cache_factory": lambda t: verifier.cache_for(t, None, 1, DEFAULT_CONTEXT + 1)}


def runtime_of(drafter) -> dict:
    """The drafter's `_runtime` dict of generation caches (made for a drafter object without one)."""
    runtime = getattr(drafter, "_runtime", None)
    if runtime is None:
        runtime = {}
        setattr(drafter, "_runtime", runtime)
    return runtime


def set_cost_curve(drafter, curve: CostCurve | None) -> None:
    """Pin `curve` for `drafter`'s `tree_budget="auto"` rounds whatever the target (None: measure or read the
    cache again)."""
    if curve is not None and not isinstance(curve, CostCurve):
        raise ValueError(f"`curve` must be a `CostCurve` or None, got {type(curve).__name__}.")
    runtime_of(drafter)["pinned_cost_curve"] = curve


def cost_curve_for_call(drafter, settings) -> CostCurve:
    """The cost curve `tree_budget="auto"` sizes a call's rounds with: a pinned one (`set_cost_curve`), else the
    bound target's from the drafter's `_runtime` dict, else `load_or_measure` (once per process per target object,
    dtype, threads and variant)."""
    runtime = runtime_of(drafter)
    pinned = runtime.get("pinned_cost_curve")
    if pinned is not None:
        return pinned
    target = call_target(drafter)
    variant, measure_kwargs = verification_variant(settings, target)
    curves = runtime.setdefault("cost_curves", {})
    key = (id(target), str(target.dtype), torch.get_num_threads(), variant)
    found = curves.get(key)
    if found is not None and found[0]() is target:
        return found[1]
    curve = load_or_measure(target, drafter=drafter, variant=variant, **measure_kwargs).curve
    curves[key] = (weakref.ref(target), curve)
    return curve


__all__ = ["CACHE_ENV", "DEFAULT_CONTEXT", "DEFAULT_ROWS", "DIR_ENV", "Calibration", "CostCurve", "cache_enabled",
           "calibration_dir", "call_target", "cost_curve_for_call", "curve_key", "drafter_fingerprint",
           "expected_key", "load_curve", "load_or_measure", "measure_cost_curve", "round_kwargs", "runtime_of",
           "set_cost_curve", "target_fingerprint", "verification_variant"]
