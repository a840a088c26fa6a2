"""`hf-chainflow bench`: wall-clock speed and exactness of plain, prompt-lookup and ChainFlow decoding.

One run, arms interleaved prompt by prompt (every arm runs on a prompt before the next prompt starts), so machine
noise hits all arms alike. Arms (each in every requested dtype, with its own target copy in that dtype):

    ar           plain greedy `generate`
    pld          transformers' prompt lookup (`prompt_lookup_num_tokens=N`)
    chain, tree  the ChainFlow drafter (`generate(assistant_model=drafter)`), chain / tree drafting
    tree+lookup  the tree arm plus a prompt-lookup branch (`--lookup-tokens K`, see `hf_chainflow.lookup`)
    NAME-chain, NAME-tree   any extra drafter (`--drafter NAME=PATH`, e.g. a FlashMap-style drafter)

Arm keys are `NAME@DTYPE` (`ar@float32`, `tree@bfloat16`). Each finished prompt is journaled (`runs.jsonl`, see
`bench_journal`), so a long run can stop and continue with `--resume`. Reported per arm and per domain:

- `tokens_per_second`: pooled new tokens / pooled wall time of the `generate` calls;
- `speedup`: tokens/s over the same-dtype `ar` arm of the same run (= the ratio of pooled times whenever the two
  arms emit the same number of tokens, which greedy decoding does unless outputs differ);
  `speedup_vs_fastest_ar`: the same against the fastest `ar` arm over all dtypes;
- `same_length` (top level): the speedups again on the prompts where every arm of a dtype emitted as many tokens as
  `ar` (`bench_report.same_length_summary`), so that bf16 texts of different lengths do not move a domain's figure;
- `tau`: tokens per target forward after the prefill, bonus included (`ar`: 1; `pld`: counted with a forward hook;
  drafter arms: `drafter.last_stats`); acceptance per draft depth, drafting / verification seconds per round;
- `mismatches`: prompts whose output differs from the same-dtype `ar` output, each classified at its first
  diverging position (see `classify_divergence`).

Numerics. Speculative decoding is exact in float32: every arm must equal `ar` token for token, so every float32
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
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch

from .bench_journal import JOURNAL_NAME, BenchJournal, config_digest, journal_header, run_from_dict, weights_digest
from .bench_report import markdown_table, same_length_summary, write_results
from .cli_args import check_model_source, check_output_dir, positive_int
from .lookup import lookup_settings
from .stats import SpeculativeStats

DEFAULT_TIE_TOLERANCE = 0.5
DEFAULT_OUTPUT_DIR = "runs/bench"
DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BASE_ARMS = ("ar", "pld", "chain", "tree")
WARMUP_MAX_NEW_TOKENS = 32


# ------------------------------------------------------------------------------------------------- prompts

def default_prompts_path() -> Path:
    """The evaluation prompts shipped inside the package (a copy of the project's `eval.jsonl`)."""
    return Path(__file__).parent / "data" / "eval_prompts.jsonl"


def load_prompts(path: str | os.PathLike | None = None) -> list[dict]:
    """Rows `{id, domain, language, prompt}` of a JSONL file (default: the shipped evaluation prompts)."""
    from .data import parse_jsonl_line

    path = Path(path) if path is not None else default_prompts_path()
    if not path.is_file():
        raise ValueError(f"`--prompts` must be a JSONL file, got {str(path)!r}, which does not exist.")
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = parse_jsonl_line(line, path, n)
            missing = [k for k in ("id", "domain", "prompt") if k not in row]
            if missing:
                raise ValueError(f"{path}:{n}: every prompt row needs `id`, `domain` and `prompt`; missing {missing}.")
            rows.append(row)
    if not rows:
        raise ValueError(f"`--prompts` file {str(path)!r} holds no rows.")
    return rows


def stratified_selection(rows: list[dict], limit: int | None) -> list[dict]:
    """Up to `limit` rows taken round-robin over the domains (sorted; file order within a domain), so every domain
    appears once `limit >= number of domains`; all rows when `limit` is None."""
    if limit is None:
        return list(rows)
    if not isinstance(limit, int) or limit < 1:
        raise ValueError(f"`--limit` must be a positive integer, got {limit!r}.")
    by_domain: dict[str, list[dict]] = {}
    for row in rows:
        by_domain.setdefault(row["domain"], []).append(row)
    queues = [list(reversed(by_domain[d])) for d in sorted(by_domain)]
    picked: list[dict] = []
    while len(picked) < limit and any(queues):
        for q in queues:
            if q and len(picked) < limit:
                picked.append(q.pop())
    return picked


@dataclass
class BenchPrompt:
    """One tokenised prompt: `input_ids` `(1, L)`."""

    id: str
    domain: str
    input_ids: torch.LongTensor


def tokenize_prompts(tokenizer, rows: list[dict]) -> list[BenchPrompt]:
    """Rows -> `BenchPrompt`s through the tokenizer's chat template (`add_generation_prompt=True`)."""
    out = []
    for row in rows:
        enc = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)
        out.append(BenchPrompt(str(row["id"]), str(row["domain"]), enc["input_ids"]))
    return out


# ---------------------------------------------------------------------------------------------------- arms

@dataclass
class Arm:
    """One way of generating, in one dtype.

    `kind` is `"ar"`, `"pld"`, `"chain"`, `"tree"` or `"custom"`. Chain/tree arms name their `drafter` (a key of the
    `drafters` given to `run_bench`). A custom arm (tests, experiments) calls
    `fn(model, input_ids, generate_kwargs) -> output ids (1, L)`.
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
        return self.kind in ("chain", "tree")


def build_arms(dtypes: list[str], drafters: dict[str, object], *, pld_tokens: int = 10, chain: int | None = None,
               tree: tuple[int, int] | None = None, tree_budget: int | None = None,
               lookup: dict | None = None, default_drafter: str = "chainflow",
               only: list[str] | None = None) -> list[Arm]:
    """The arms of a run: `ar`, `pld`, and chain + tree arms for every drafter, in every dtype.

    `drafters` maps a drafter name to any drafter of that name (its `generation_config` gives the defaults: chain
    length `num_assistant_tokens`, tree shape `tree_width` x `tree_depth` and `tree_budget`; `chain`/`tree`/
    `tree_budget` override them). The
    default drafter's arms are `chain`/`tree`, another drafter's `NAME-chain`/`NAME-tree`. `lookup` (the
    `lookup_*` generation-config fields) adds the default drafter's `tree+lookup` arm. `only` keeps the arms of
    those names.
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
    if only is not None:
        known = [n[0] for n in names]
        unknown = [o for o in only if o not in known]
        if unknown:
            raise ValueError(f"`--arms` names unknown arms {unknown}; the arms of this run are {known}.")
        names = [n for n in names if n[0] in only]
    return [Arm(name, kind, dtype, dname, dict(settings)) for dtype in dtypes for name, kind, dname, settings in names]


def configure_drafter(drafter, arm: Arm) -> None:
    """Set the drafter's `generation_config` for a chain or tree arm."""
    g = drafter.generation_config
    g.draft_mode = arm.kind
    # Arms share a drafter: the lookup branch only where an arm asks for it.
    g.lookup_num_tokens = g.lookup_trust_ngram = g.lookup_max_tokens = None
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
    if arm.kind in ("ar", "pld"):
        counter = _ForwardCounter(model)
        if arm.kind == "pld":
            kwargs["prompt_lookup_num_tokens"] = arm.settings["prompt_lookup_num_tokens"]
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


# ------------------------------------------------------------------------------------------------ numerics

def first_divergence(reference: list[int], other: list[int]) -> int | None:
    """First position where two token lists differ (a length difference counts at the shorter length); None when
    they are equal."""
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


def classify_divergence(logits: torch.Tensor, expected: int | None, got: int | None, dtype: str,
                        tolerance: float = DEFAULT_TIE_TOLERANCE) -> dict:
    """Classify one difference from the reference logits `(V,)` of the common prefix.

    `expected` is ar's token, `got` the arm's (None where that output had already ended). The difference is a
    `near_tie` when `dtype` is not float32 and both tokens' logits lie within `tolerance` of each other and of the
    reference's top logit (`top_gap`: top minus the higher of the two; a third token may be the reference's argmax
    when several tie); otherwise `unexplained` (float32 is exact; a gap beyond the rounding of a low-precision
    forward, two tokens tied far below the top, or a length difference, is a bug).
    """
    top = int(logits.argmax())
    if expected is None or got is None:
        return {"kind": "unexplained", "gap": None, "top_gap": None, "reference_top": top,
                "reason": "output length differs"}
    gap = float(logits[expected].float() - logits[got].float())
    top_gap = float(logits[top].float() - torch.maximum(logits[expected], logits[got]).float())
    if dtype == "float32":
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
                     tolerance: float) -> dict | None:
    """None when `other == reference`; else the first diverging position, both tokens and their classification
    from the plain `model` (of that dtype) scoring prompt + common prefix in one forward."""
    pos = first_divergence(reference, other)
    if pos is None:
        return None
    prefix = torch.tensor([reference[:pos]], dtype=prompt_ids.dtype, device=prompt_ids.device)
    ids = torch.cat([prompt_ids, prefix], 1)
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, -1]
    expected = reference[pos] if pos < len(reference) else None
    got = other[pos] if pos < len(other) else None
    return {"position": pos, "ar_token": expected, "arm_token": got,
            **classify_divergence(logits, expected, got, dtype, tolerance)}


# -------------------------------------------------------------------------------------------------- the run

def _pooled_stats(runs: list[Run]) -> SpeculativeStats | None:
    stats = [r.stats for r in runs if r.stats is not None]
    if not stats:
        return None
    merged = SpeculativeStats(mode=stats[0].mode, loop=stats[0].loop)
    for s in stats:
        merged.accepted += s.accepted
        merged.drafted_depth += s.drafted_depth
        merged.draft_time += s.draft_time
        merged.verify_time += s.verify_time
        merged.prefill_time += s.prefill_time
    return merged


def _tau(arm: Arm, runs: list[Run]) -> float | None:
    if arm.kind == "ar":
        return 1.0
    if arm.kind == "pld":
        forwards = sum(r.forwards - 1 for r in runs)  # after the prefill
        tokens = sum(max(r.new_tokens - 1, 0) for r in runs)  # the prefill's token is not a round's
        return tokens / forwards if forwards else None
    stats = _pooled_stats(runs)
    return stats.tau if stats is not None and stats.rounds else None


def _speed(runs: list[Run]) -> float:
    seconds = sum(r.seconds for r in runs)
    return sum(r.new_tokens for r in runs) / seconds if seconds > 0 else 0.0


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


def bf16_hardware_note(bf16_support: dict[str, bool | None] | None = None,
                       capability: str | None = None) -> str | None:
    """The note printed before bfloat16 runs on a CPU known to lack native bfloat16 matrix instructions, else `None`
    (also when torch cannot tell). Defaults: `bf16_matrix_instructions()` and torch's CPU capability string.
    """
    bf16_support = bf16_matrix_instructions() if bf16_support is None else bf16_support
    if any(v is not False for v in bf16_support.values()):
        return None
    capability = torch.backends.cpu.get_cpu_capability() if capability is None else capability
    return (f"note: this CPU has no native bfloat16 matrix instructions (no AMX, no AVX-512 BF16; torch reports "
            f"{capability}). Here a bfloat16 forward over several tokens costs several single-token steps, so "
            "speculative decoding in bfloat16 is expected to be slower than plain generation; in float32 the outputs "
            "are exact and several tokens cost less in proportion (docs/results.md, \"A CPU without bfloat16 matrix "
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


def run_bench(models: dict[str, object], prompts: list[BenchPrompt], arms: list[Arm],
              drafters: dict[str, dict[str, object]] | None = None, *, max_new_tokens: int = 128,
              tie_tolerance: float = DEFAULT_TIE_TOLERANCE, warmup: BenchPrompt | None = None, eos_token_id=None,
              pad_token_id=None, decode: Callable[[list[int]], str] | None = None, progress: bool = True,
              settings: dict | None = None, journal: str | os.PathLike | None = None, resume: bool = False,
              partial: bool = False) -> dict:
    """Run every arm on every prompt (interleaved) and summarise.

    Args:
        models: dtype name -> the target in that dtype (one copy per dtype).
        prompts: tokenised prompts; `warmup`: one more prompt run by every arm first and not counted.
        arms: from `build_arms` (plus any custom arms); every dtype needs an `ar` arm (the baseline).
        drafters: drafter name -> dtype name -> a drafter bound to `models[dtype]`.
        decode: token ids -> text, for the printed differences.
        journal: a file (`bench_journal.JOURNAL_NAME`) to which each finished prompt is appended; with `resume`,
            the prompts already in it are read back instead of run again (their settings must match).
        partial: with `resume`, run nothing: summarise only the prompts the journal already holds. The results get
            `"partial": {"prompts_done", "prompts_total"}`; pooled figures then cover those prompts' domains only.
    Returns the results dict written by `write_results`.
    """
    from tqdm.auto import tqdm

    drafters = drafters or {}
    if not prompts:
        raise ValueError("`prompts` is empty: give at least one prompt to benchmark.")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"`--max-new-tokens` must be a positive integer, got {max_new_tokens!r}.")
    if not tie_tolerance >= 0:
        raise ValueError(f"`--tie-tolerance` must be >= 0 (logits), got {tie_tolerance!r}.")
    for arm in arms:
        if arm.dtype not in models:
            raise ValueError(f"Arm {arm.key} needs a target in {arm.dtype}; `models` has {sorted(models)}.")
        if not any(a.kind == "ar" and a.dtype == arm.dtype for a in arms):
            raise ValueError(f"Arm {arm.key} has no `ar@{arm.dtype}` baseline: keep the `ar` arm in every dtype.")
        if arm.speculative and arm.dtype not in drafters.get(arm.drafter, {}):
            raise ValueError(f"Arm {arm.key} needs drafter {arm.drafter!r} bound to the {arm.dtype} target.")
    keys = [a.key for a in arms]
    if len(set(keys)) != len(keys):
        raise ValueError(f"Arm keys must be unique, got {keys}.")

    if resume and journal is None:
        raise ValueError("`resume=True` needs a `journal` file to resume from.")
    if partial and not resume:
        raise ValueError("`partial=True` (`--partial-report`) summarises a journaled run so far: it needs "
                         "`resume=True` (`--resume`) and the run's journal.")
    warmup_tokens = min(max_new_tokens, WARMUP_MAX_NEW_TOKENS)
    run_settings = {
        "max_new_tokens": max_new_tokens, "tie_tolerance": tie_tolerance, "num_prompts": len(prompts),
        "warmup": warmup.id if warmup is not None else None,
        "warmup_max_new_tokens": warmup_tokens if warmup is not None else None, "greedy": True, "batch_size": 1,
        "arms": {a.key: {"kind": a.kind, "dtype": a.dtype, "drafter": a.drafter, **a.settings} for a in arms},
        **(settings or {})}
    log = BenchJournal(journal, journal_header(run_settings, prompts), resume=resume) if journal is not None else None
    done = log.done if log is not None else {}
    total = len(prompts)
    if partial:
        prompts = [p for p in prompts if p.id in done]
        if not prompts:
            raise ValueError(f"`--partial-report`: the journal at {str(journal)!r} holds no finished prompt yet; "
                             "run the bench (with `--resume`) until at least one prompt has finished.")

    info = machine_info()
    started = time.perf_counter()

    def go(arm: Arm, prompt: BenchPrompt, n: int) -> Run:
        drafter = drafters[arm.drafter][arm.dtype] if arm.speculative else None
        return run_arm(arm, models[arm.dtype], prompt.input_ids, n, drafter, eos_token_id, pad_token_id)

    # 1. this part of the run: journal it and warm up, unless the journal already holds every prompt
    part = None
    if any(p.id not in done for p in prompts):
        part = log.start_part(info) if log is not None else None
        if warmup is not None:
            for arm in arms:
                go(arm, warmup, warmup_tokens)

    runs: dict[str, list[Run]] = {k: [] for k in keys}
    details: dict[str, list[dict]] = {k: [] for k in keys}
    per_prompt = []
    earlier_wall = 0.0
    finished = sum(p.id in done for p in prompts)  # the bar's rate and time left count this part's prompts only
    bar = tqdm(total=len(prompts), initial=finished, desc="bench", unit="prompt", disable=not progress or partial)
    for prompt in prompts:
        # 2. a prompt finished by an earlier part: read it back
        if prompt.id in done:
            line = done[prompt.id]
            for key in keys:
                runs[key].append(run_from_dict(line["runs"][key]))
                if line["details"].get(key) is not None:
                    details[key].append(line["details"][key])
            per_prompt.append(line["record"])
            earlier_wall += line["wall"]
            continue
        # 3. run every arm on it, then classify any difference outside the timed calls
        prompt_started = time.perf_counter()
        record = {"id": prompt.id, "domain": prompt.domain, "prompt_tokens": int(prompt.input_ids.shape[1]), "arms": {}}
        for arm in arms:
            run = go(arm, prompt, max_new_tokens)
            runs[arm.key].append(run)
            record["arms"][arm.key] = {"new_tokens": run.new_tokens, "seconds": run.seconds,
                                       "tau": _tau(arm, [run])}
        found: dict[str, dict | None] = {k: None for k in keys}
        for arm in arms:  # outside the timed calls
            if arm.kind == "ar":
                continue
            ref = runs[f"ar@{arm.dtype}"][-1].tokens
            d = explain_mismatch(models[arm.dtype], prompt.input_ids, ref, runs[arm.key][-1].tokens, arm.dtype,
                                 tie_tolerance)
            if d is None:
                continue
            d = {"id": prompt.id, "domain": prompt.domain, **d}
            details[arm.key].append(d)
            found[arm.key] = record["arms"][arm.key]["mismatch"] = d
            bar.write(_describe(arm.key, d, decode))
        per_prompt.append(record)
        # 4. journal the finished prompt
        if log is not None:
            log.add(part, prompt.id, time.perf_counter() - prompt_started, record,
                    {k: runs[k][-1] for k in keys}, found)
        bar.update(1)
    bar.close()

    if log is not None:
        run_settings = {**run_settings, "parts": log.parts}
    results = summarise(arms, runs, details, per_prompt, prompts, settings=run_settings, machine=info,
                        wall_time=earlier_wall + time.perf_counter() - started)
    if partial:
        results["partial"] = {"prompts_done": len(prompts), "prompts_total": total}
    return results


def _describe(key: str, d: dict, decode) -> str:
    def tok(t):
        if t is None:
            return "<end>"
        return f"{decode([t])!r}({t})" if decode is not None else str(t)

    gap = "n/a" if d["gap"] is None else f"{d['gap']:+.3f}"
    return (f"[{d['kind']}] {key} differs from ar on {d['id']} ({d['domain']}) at new token {d['position']}: "
            f"ar {tok(d['ar_token'])} vs arm {tok(d['arm_token'])}, reference logit gap {gap} ({d['reason']})")


def _numbers(arm: Arm, mine: list[Run], base: list[Run], fastest: float, mismatches: list[dict]) -> dict:
    """Pooled numbers of one arm over some prompts: `base` are the same prompts' same-dtype `ar` runs, `fastest`
    the tokens/s of the fastest `ar` arm over those prompts."""
    speed, base_speed = _speed(mine), _speed(base)
    stats = _pooled_stats(mine)
    rounds = stats.rounds if stats is not None else 0
    return {
        "prompts": len(mine), "new_tokens": sum(r.new_tokens for r in mine), "seconds": sum(r.seconds for r in mine),
        "tokens_per_second": speed,
        "speedup": speed / base_speed if base_speed else None,
        "speedup_vs_fastest_ar": speed / fastest if fastest else None,
        "tau": _tau(arm, mine),
        "rounds": rounds if stats is not None else None,
        "acceptance_per_depth": stats.acceptance_per_depth() if stats is not None else None,
        "draft_time_per_round": stats.draft_time / rounds if rounds else None,
        "verify_time_per_round": stats.verify_time / rounds if rounds else None,
        "mismatches": len(mismatches),
        "near_ties": sum(d["kind"] == "near_tie" for d in mismatches),
        "unexplained_mismatches": sum(d["kind"] == "unexplained" for d in mismatches),
    }


def summarise(arms: list[Arm], runs: dict[str, list[Run]], details: dict[str, list[dict]], per_prompt: list[dict],
              prompts: list[BenchPrompt], settings: dict, machine: dict, wall_time: float) -> dict:
    """Pool the per-prompt runs into per-arm and per-domain numbers."""
    domains = sorted({p.domain for p in prompts})
    ar_arms = [a for a in arms if a.kind == "ar"]

    def pick(key, idx):
        return [runs[key][i] for i in idx]

    def numbers(arm, idx, domain=None):
        fastest = max(_speed(pick(a.key, idx)) for a in ar_arms)
        mismatches = [d for d in details[arm.key] if domain is None or d["domain"] == domain]
        return _numbers(arm, pick(arm.key, idx), pick(f"ar@{arm.dtype}", idx), fastest, mismatches)

    everything = list(range(len(prompts)))
    by_domain = {dom: [i for i, p in enumerate(prompts) if p.domain == dom] for dom in domains}
    out = {}
    for arm in arms:
        out[arm.key] = {"name": arm.name, "kind": arm.kind, "dtype": arm.dtype, "drafter": arm.drafter,
                        "settings": arm.settings, **numbers(arm, everything), "mismatch_details": details[arm.key],
                        "per_domain": {dom: numbers(arm, idx, dom) for dom, idx in by_domain.items()}}
    if hasattr(os, "getloadavg"):
        machine = {**machine, "load_average_end": list(os.getloadavg())}
    results = {"arms": out, "domains": domains, "prompts": per_prompt, "settings": settings, "machine": machine,
               "wall_time": wall_time}
    results["same_length"] = same_length_summary(results)
    return results


# ------------------------------------------------------------------------------------------------------ CLI

def _parse_dtypes(text: str) -> list[str]:
    dtypes = [d.strip() for d in text.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPE_NAMES]
    if not dtypes or bad or len(set(dtypes)) != len(dtypes):
        raise ValueError(f"`--dtypes` must be distinct names from {sorted(DTYPE_NAMES)}, comma-separated, got {text!r}.")
    return dtypes


def _parse_tree(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"`--tree` must be WIDTHxDEPTH with positive integers (e.g. 8x4), got {text!r}.")
    return int(parts[0]), int(parts[1])


def _parse_extra_drafters(items: list[str] | None) -> dict[str, str]:
    out = {}
    for item in items or []:
        name, sep, path = item.partition("=")
        if not sep or not name or not path or not name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"`--drafter` must be NAME=PATH (NAME alphanumeric, '-' or '_'), got {item!r}.")
        if name in out or name == "chainflow":
            raise ValueError(f"`--drafter` names must be unique and not 'chainflow' (the default drafter), got {name!r}.")
        out[name] = path
    return out


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="Wall-clock speed and exactness of ar / prompt lookup / ChainFlow arms.",
                       description="\n\n".join(__doc__.split("\n\n")[1:5]),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct", help="known target name or local model directory")
    p.add_argument("--drafter-path", help="ChainFlow drafter directory (default: the drafter shipped in the package)")
    p.add_argument("--drafter", action="append", metavar="NAME=PATH",
                   help="an extra drafter, run as NAME-chain / NAME-tree arms (repeatable)")
    p.add_argument("--no-default-drafter", action="store_true", help="run no `chain`/`tree` arms of the default drafter")
    p.add_argument("--arms", help="comma-separated arm names to run (default: all, e.g. ar,pld,chain,tree)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated target dtypes")
    p.add_argument("--drafter-dtype", choices=sorted(DTYPE_NAMES), default="float32",
                   help="dtype of the drafters' weights (default float32)")
    p.add_argument("--pld-tokens", type=positive_int, default=10, help="prompt_lookup_num_tokens of the pld arm")
    p.add_argument("--chain", type=positive_int, help="chain length (default: the drafter's num_assistant_tokens)")
    p.add_argument("--tree", help="tree shape WIDTHxDEPTH (default: the drafter's tree_width x tree_depth)")
    p.add_argument("--tree-budget", type=positive_int,
                   help="keep this many nodes of each tree, highest path probability first (default: the drafter's "
                        "tree_budget; none = all WIDTHxDEPTH)")
    p.add_argument("--lookup-tokens", type=positive_int,
                   help="add a `tree+lookup` arm: the tree plus a prompt-lookup branch of this many tokens (default: "
                        "the drafter's `lookup_num_tokens`; the arm is added when either is set)")
    p.add_argument("--lookup-trust-ngram", type=positive_int,
                   help="in `tree+lookup`, a match this long is verified alone, without drafting (default: never)")
    p.add_argument("--lookup-max-tokens", type=positive_int,
                   help="in `tree+lookup`, let a branch verified alone and accepted whole grow up to this many tokens "
                        "(default: fixed length)")
    p.add_argument("--prompts", help="JSONL with id, domain, prompt (default: the shipped evaluation prompts)")
    p.add_argument("--limit", type=int, help="benchmark N prompts, stratified by domain")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt and arm (default 128)")
    p.add_argument("--tie-tolerance", type=float, default=DEFAULT_TIE_TOLERANCE,
                   help="logit gap below which a low-precision difference is a near-tie (default: measured, see docs)")
    p.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR,
                   help=f"where results go; each finished prompt is also appended to {JOURNAL_NAME} there")
    p.add_argument("--resume", action="store_true",
                   help=f"continue the run journaled in --output-dir/{JOURNAL_NAME}: its finished prompts are read "
                        "back, the rest run (repeat the same command, with --resume added)")
    p.add_argument("--partial-report", action="store_true",
                   help="with --resume: run no prompt; summarise the prompts the journal holds so far into "
                        "--output-dir/partial/ (results.json marked `partial`, the table, the plots)")
    p.add_argument("--threads", type=positive_int, help="torch.set_num_threads (default: all cores)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_bench_command)


def _load_target(name: str, dtype: torch.dtype):
    from .cli import load_model_and_tokenizer

    return load_model_and_tokenizer(name, dtype)


def run_bench_command(args: argparse.Namespace) -> int:
    """`hf-chainflow bench`: load targets and drafters, run, write, print the table."""
    from . import ChainFlowDrafter
    from .checkpoints import default_drafter_path

    if args.partial_report and not args.resume:
        raise ValueError("`--partial-report` summarises a journaled run so far: add `--resume` (and repeat the run's "
                         "other options) so that the journal in `--output-dir` is read.")
    lookup = None
    if args.lookup_tokens is not None:
        lookup = {"lookup_num_tokens": args.lookup_tokens, "lookup_trust_ngram": args.lookup_trust_ngram,
                  "lookup_max_tokens": args.lookup_max_tokens}
        lookup_settings(SimpleNamespace(**lookup))  # the generation-config rules, checked before any model loads
    else:
        for name in ("lookup_trust_ngram", "lookup_max_tokens"):
            if getattr(args, name) is not None:
                raise ValueError(f"`--{name.replace('_', '-')}` needs `--lookup-tokens` (it tunes the `tree+lookup` "
                                 "arm).")
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    dtypes = _parse_dtypes(args.dtypes)
    tree = _parse_tree(args.tree)
    note = bf16_hardware_note() if "bfloat16" in dtypes else None
    if note is not None:
        print(note)
    only = [a.strip() for a in args.arms.split(",") if a.strip()] if args.arms else None
    default_arms = {"chain", "tree", "tree+lookup"}
    wants_default = not args.no_default_drafter and (only is None or bool(default_arms & set(only)))
    paths = {"chainflow": args.drafter_path or str(default_drafter_path())} if wants_default else {}
    paths.update(_parse_extra_drafters(args.drafter))
    if args.no_default_drafter and only is not None and default_arms & set(only):
        raise ValueError(f"`--arms` asks for {sorted(default_arms & set(only))}, arms of the default drafter, but "
                         f"`--no-default-drafter` leaves it out; drop one of the two.")
    if only is not None:  # checked here, before loading: the drafters not asked for are not loaded at all
        possible = ["ar", "pld"] + ([] if args.no_default_drafter else sorted(default_arms)) + [
            f"{n}-{kind}" for n in paths if n != "chainflow" for kind in ("chain", "tree")]
        unknown = [a for a in only if a not in possible]
        if unknown:
            raise ValueError(f"`--arms` names unknown arms {unknown}; this command can run {possible}.")
    for name, path in paths.items():
        if name != "chainflow" or args.drafter_path:
            check_model_source("--drafter-path" if name == "chainflow" else f"--drafter {name}=PATH", path)
    check_output_dir("--output-dir", args.output_dir)

    all_rows = load_prompts(args.prompts)
    rows = stratified_selection(all_rows, args.limit)
    chosen = {r["id"] for r in rows}
    warm_row = next((r for r in all_rows if r["id"] not in chosen), rows[0])

    models, drafters, tokenizer = {}, {name: {} for name in paths}, None
    for dt in dtypes:
        models[dt], tokenizer = _load_target(args.target, DTYPE_NAMES[dt])
        for name, path in paths.items():
            drafters[name][dt] = ChainFlowDrafter.from_pretrained(path, target=models[dt],
                                                                  dtype=DTYPE_NAMES[args.drafter_dtype]).eval()
    if lookup is None and "chainflow" in drafters:  # the default drafter's own lookup setting, if it has one
        g = drafters["chainflow"][dtypes[0]].generation_config
        if getattr(g, "lookup_num_tokens", None) is not None:
            lookup = {"lookup_num_tokens": g.lookup_num_tokens,
                      "lookup_trust_ngram": getattr(g, "lookup_trust_ngram", None),
                      "lookup_max_tokens": getattr(g, "lookup_max_tokens", None)}
    arms = build_arms(dtypes, {n: d[dtypes[0]] for n, d in drafters.items()}, pld_tokens=args.pld_tokens,
                      chain=args.chain, tree=tree, tree_budget=args.tree_budget, lookup=lookup, only=only)
    prompts = tokenize_prompts(tokenizer, rows)
    warmup = tokenize_prompts(tokenizer, [warm_row])[0]
    gen = models[dtypes[0]].generation_config
    settings = {"target": args.target, "drafters": paths, "drafter_weights_sha256": {
                    name: weights_digest(d[dtypes[0]]) for name, d in drafters.items()},
                "drafter_config_sha256": {name: config_digest(d[dtypes[0]]) for name, d in drafters.items()},
                "drafter_dtype": args.drafter_dtype, "dtypes": dtypes,
                "prompts": str(args.prompts or default_prompts_path()), "limit": args.limit,
                "pld_tokens": args.pld_tokens, "threads": torch.get_num_threads()}
    results = run_bench(models, prompts, arms, drafters, max_new_tokens=args.max_new_tokens,
                        tie_tolerance=args.tie_tolerance, warmup=warmup, eos_token_id=gen.eos_token_id,
                        pad_token_id=gen.pad_token_id, decode=tokenizer.decode, progress=not args.no_progress,
                        settings=settings, journal=Path(args.output_dir) / JOURNAL_NAME, resume=args.resume,
                        partial=args.partial_report)
    written = write_results(results, Path(args.output_dir) / "partial" if args.partial_report else args.output_dir)
    print(markdown_table(results).split("\n## Settings")[0])
    print("wrote " + ", ".join(str(p) for p in written.values()))
    return 0


__all__ = ["Arm", "BenchPrompt", "DEFAULT_TIE_TOLERANCE", "bf16_hardware_note", "bf16_matrix_instructions",
           "build_arms", "classify_divergence", "cpu_identity", "explain_mismatch", "first_divergence", "load_prompts",
           "markdown_table", "run_arm", "run_bench", "stratified_selection", "tokenize_prompts", "write_results"]
