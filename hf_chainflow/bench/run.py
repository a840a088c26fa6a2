"""The bench run: every arm on every prompt, interleaved prompt by prompt (every arm runs on a prompt before the next
prompt starts, so machine noise hits all arms alike), each finished prompt journaled (`hf_chainflow.bench.journal`),
then pooled into per-arm and per-domain numbers (`summarise`; what each number means: `hf-chainflow bench --help`
and docs/bench.md). `benchmark` loads a target and drafters by name or path and runs them: the `hf-chainflow bench`
command.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path
from typing import Callable

import torch

from hf_chainflow.checks import check_positive_int
from hf_chainflow.fileio import FolderLock
from hf_chainflow.generation.stats import SpeculativeStats
from hf_chainflow.bench.arms import Arm, Run, build_arms, configure_drafter, run_arm, warm_up_compiled_plain
from hf_chainflow.bench.defaults import DEFAULT_OUTPUT_DIR, DEFAULT_TIE_TOLERANCE, JOURNAL_NAME, WARMUP_MAX_NEW_TOKENS
from hf_chainflow.bench.journal import (BenchJournal, check_journal, config_digest, earlier_config_digests, journal_header,
                      run_from_dict, weights_digest)
from hf_chainflow.bench.machine import machine_info
from hf_chainflow.bench.numerics import explain_mismatch
from hf_chainflow.bench.prompts import BenchPrompt, choose_prompts, default_prompts_path, tokenize_prompts
from hf_chainflow.bench.report import same_length_summary, write_results


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
        merged.compiled_rounds += s.compiled_rounds
        merged.eager_rounds += s.eager_rounds
        merged.auto_budgets += s.auto_budgets
    return merged


def _tau(arm: Arm, runs: list[Run]) -> float | None:
    if arm.kind == "ar":
        return 1.0
    if arm.kind in ("pld", "dflash"):  # one target forward per round
        forwards = sum(r.forwards - 1 for r in runs)  # after the prefill
        tokens = sum(max(r.new_tokens - 1, 0) for r in runs)  # the prefill's token is not a round's
        return tokens / forwards if forwards else None
    stats = _pooled_stats(runs)
    return stats.tau if stats is not None and stats.rounds else None


def _speed(runs: list[Run]) -> float:
    seconds = sum(r.seconds for r in runs)
    return sum(r.new_tokens for r in runs) / seconds if seconds > 0 else 0.0


def run_bench(models: dict[str, object], prompts: list[BenchPrompt], arms: list[Arm],
              drafters: dict[str, dict[str, object]] | None = None, *, max_new_tokens: int = 128,
              tie_tolerance: float = DEFAULT_TIE_TOLERANCE, warmup: BenchPrompt | None = None, eos_token_id=None,
              pad_token_id=None, decode: Callable[[list[int]], str] | None = None, progress: bool = True,
              settings: dict | None = None, journal: str | os.PathLike | None = None, resume: bool = False,
              partial: bool = False, overwrite: bool = False) -> dict:
    """Run every arm on every prompt (interleaved) and summarise.

    Args:
        models: dtype name -> the target in that dtype (one copy per dtype).
        prompts: tokenised prompts; `warmup`: one more prompt run by every arm first and not counted.
        arms: from `build_arms` (plus any custom arms); every dtype needs an `ar` arm (the baseline). An
            `ar-compiled` arm is compiled first by one warm-up `generate` (on `warmup`, else the first prompt; its
            seconds and whether it compiled are reported: `results["plain_compile"]`, `warm_up_compiled_plain`);
            arms with compiled verification get every bucket's verify forward compiled first
            (`compiled_verification.warm_up`, reported per dtype: `results["verify_compile"]`).
        drafters: drafter name -> dtype name -> a drafter bound to `models[dtype]`.
        decode: token ids -> text, for the printed differences.
        journal: a file (`defaults.JOURNAL_NAME`) to which each finished prompt is appended; with `resume`,
            the prompts already in it are read back instead of run again (their settings must match). Without
            `resume`, a journal there holding finished prompts is refused unless `overwrite` (start a fresh one).
        partial: with `resume`, run nothing: summarise only the prompts the journal already holds. The results get
            `"partial": {"prompts_done", "prompts_total"}`; pooled figures then cover those prompts' domains only.
    Returns the results dict written by `write_results`.
    """
    from tqdm.auto import tqdm

    drafters = drafters or {}
    if not prompts:
        raise ValueError("`prompts` is empty: give at least one prompt to benchmark.")
    repeated = sorted(i for i, n in Counter(p.id for p in prompts).items() if n > 1)
    if repeated:
        raise ValueError(f"Prompt ids must be unique (each prompt is journaled and reported by its id), got "
                         f"{repeated} more than once; give each prompt its own id.")
    check_positive_int("--max-new-tokens", max_new_tokens)
    if not tie_tolerance >= 0:
        raise ValueError(f"`--tie-tolerance` must be >= 0 (logits), got {tie_tolerance!r}.")
    for arm in arms:
        if arm.dtype not in models:
            raise ValueError(f"Arm {arm.key} needs a target in {arm.dtype}; `models` has {sorted(models)}.")
        if not any(a.key == f"ar@{arm.dtype}" for a in arms):
            raise ValueError(f"Arm {arm.key} has no `ar@{arm.dtype}` baseline: keep the `ar` arm in every dtype.")
        if arm.uses_drafter and arm.dtype not in drafters.get(arm.drafter, {}):
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
    # a journal written before the config-digest rule of 2026-12-07 holds the drafters' digests under the earlier one
    digested = run_settings.get("drafter_config_sha256", {})
    accepted = {("settings", "drafter_config_sha256", name): earlier_config_digests(next(iter(by_dtype.values())))
                for name, by_dtype in drafters.items() if name in digested and by_dtype}
    log = (BenchJournal(journal, journal_header(run_settings, prompts), resume=resume, accepted=accepted,
                        overwrite=overwrite) if journal is not None else None)
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
        drafter = drafters[arm.drafter][arm.dtype] if arm.uses_drafter else None
        return run_arm(arm, models[arm.dtype], prompt.input_ids, n, drafter, eos_token_id, pad_token_id)

    # 1. this part of the run: journal it and warm up, unless the journal already holds every prompt
    part, verify_compile = None, {}
    if any(p.id not in done for p in prompts):
        part = log.start_part(info) if log is not None else None
        lengths = [int(p.input_ids.shape[1]) + max_new_tokens for p in prompts]
        if warmup is not None:
            lengths.append(int(warmup.input_ids.shape[1]) + warmup_tokens)
        verify_compile = _warm_up_verification(arms, models, drafters, max(lengths))
        compiled = [arm for arm in arms if arm.compiled_plain]
        if compiled:  # one static-cache length for every call: one compiled graph serves all prompts
            first = warmup if warmup is not None else prompts[0]
            for arm in compiled:
                warm_up_compiled_plain(arm, models[arm.dtype], first.input_ids, warmup_tokens,
                                       max_cache_len=max(lengths), eos_token_id=eos_token_id,
                                       pad_token_id=pad_token_id)
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
            if arm.key == f"ar@{arm.dtype}":  # the baseline
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
        mixed = log.mixed_cpu_kinds()
        run_settings = {**run_settings, "parts": log.parts, **({"part_cpu_kinds": mixed} if mixed else {})}
    results = summarise(arms, runs, details, per_prompt, prompts, settings=run_settings, machine=info,
                        wall_time=earlier_wall + time.perf_counter() - started)
    results["verify_compile"] = verify_compile  # {} when no prompt ran in this part
    if partial:
        results["partial"] = {"prompts_done": len(prompts), "prompts_total": total}
    return results


def _warm_up_verification(arms: list[Arm], models: dict, drafters: dict, max_length: int) -> dict:
    """Compile the verify forwards of every arm with compiled verification, per dtype (and per drafter state
    layers), for calls up to `max_length` tokens, outside any timed region. Returns, per dtype, what
    `compiled_verification.warm_up` found (seconds summed)."""
    from hf_chainflow.generation.compiled_verification import warm_up

    out = {}
    for arm in arms:
        if not arm.compiled_verification:
            continue
        drafter = drafters[arm.drafter][arm.dtype] if arm.uses_drafter else None
        layers = tuple(getattr(drafter, "state_layers", ()) or ())
        key = (arm.dtype, layers)
        if key in out:
            continue
        with torch.inference_mode():
            out[key] = warm_up(models[arm.dtype], max_length, state_layers=layers)
    by_dtype = {}
    for (dtype, _), record in out.items():
        if dtype in by_dtype:
            by_dtype[dtype]["seconds"] += record["seconds"]
            by_dtype[dtype]["compiled"] &= record["compiled"]
            by_dtype[dtype]["reasons"] += record["reasons"]
        else:
            by_dtype[dtype] = dict(record)
    return by_dtype


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
    the tokens/s of the fastest plain arm (`ar`, `ar-compiled`, any dtype) over those prompts. `draft_ratio`:
    drafting seconds per round over the same-dtype `ar` arm's seconds per new token (one plain step)."""
    speed, base_speed = _speed(mine), _speed(base)
    stats = _pooled_stats(mine)
    rounds = stats.rounds if stats is not None else 0
    draft_per_round = stats.draft_time / rounds if rounds else None
    return {
        "prompts": len(mine), "new_tokens": sum(r.new_tokens for r in mine), "seconds": sum(r.seconds for r in mine),
        "tokens_per_second": speed,
        "speedup": speed / base_speed if base_speed else None,
        "speedup_vs_fastest_ar": speed / fastest if fastest else None,
        "tau": _tau(arm, mine),
        "rounds": rounds if stats is not None else None,
        "acceptance_per_depth": stats.acceptance_per_depth() if stats is not None else None,
        "draft_time_per_round": draft_per_round,
        "draft_ratio": draft_per_round * base_speed if draft_per_round is not None and base_speed else None,
        "verify_time_per_round": stats.verify_time / rounds if rounds else None,
        "compiled_rounds": stats.compiled_rounds if stats is not None else None,
        "eager_rounds": stats.eager_rounds if stats is not None else None,
        "auto_budgets": _budget_summary(stats.auto_budgets) if stats is not None and stats.auto_budgets else None,
        "mismatches": len(mismatches),
        "near_ties": sum(d["kind"] == "near_tie" for d in mismatches),
        "unexplained_mismatches": sum(d["kind"] == "unexplained" for d in mismatches),
    }


def _budget_summary(budgets: list[int]) -> dict:
    """The tree budgets `tree_budget="auto"` chose: mean, quartiles and how often each value was chosen."""
    ordered = sorted(budgets)
    counts = Counter(ordered)
    return {"trees": len(ordered), "mean": sum(ordered) / len(ordered),
            "quartiles": [ordered[len(ordered) * q // 4] for q in (1, 2, 3)],
            "counts": {str(k): counts[k] for k in sorted(counts)}}


def summarise(arms: list[Arm], runs: dict[str, list[Run]], details: dict[str, list[dict]], per_prompt: list[dict],
              prompts: list[BenchPrompt], settings: dict, machine: dict, wall_time: float) -> dict:
    """Pool the per-prompt runs into per-arm and per-domain numbers. `speedup_vs_fastest_ar` is against the fastest
    plain arm (`ar` or `ar-compiled`, any dtype) over the same prompts; `fastest_ar` names it over all prompts. A
    compiled plain arm also reports whether it compiled and its warm-up's seconds (`plain_compile`)."""
    domains = sorted({p.domain for p in prompts})
    ar_arms = [a for a in arms if a.kind == "ar"]  # every plain arm

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
        if arm.compiled_plain:  # None: not warmed up in this part (a resumed run whose prompts were all done)
            out[arm.key]["compiled"] = arm.compile_state.get("compiled")
            out[arm.key]["compile_warmup_seconds"] = arm.compile_state.get("warmup_seconds")
    if hasattr(os, "getloadavg"):
        machine = {**machine, "load_average_end": list(os.getloadavg())}
    fastest_ar = max(ar_arms, key=lambda a: _speed(runs[a.key])).key if ar_arms else None
    results = {"arms": out, "domains": domains, "prompts": per_prompt, "settings": settings, "machine": machine,
               "wall_time": wall_time, "fastest_ar": fastest_ar,
               "plain_compile": {a.key: dict(a.compile_state) for a in arms if a.compiled_plain}}
    results["same_length"] = same_length_summary(results)
    return results



def warm_up_arms(arms: list[Arm], drafters: dict[str, dict[str, object]], compile_drafting: bool | None) -> dict:
    """Set `compile_drafting` on every drafter (`None`: keep its own) and compile the drafting rounds of every
    speculative arm (`hf_chainflow.generation.drafting.warm_up_drafting`), outside any timed region; an arm with
    `tree_budget="auto"` gets its cost curve read from the calibration cache or measured here. Returns, per drafter
    name, `{"compile_drafting", "dtype", "serving_head_dtype", "compile_seconds"}` and, for auto arms,
    `"cost_curves"` (arm key -> the curve's cache key: in the journal's header, so a resumed run uses the same
    curve's machine and settings) (the record of the run)."""
    from hf_chainflow.generation.calibration import cost_curve_for_call
    from hf_chainflow.generation.drafting import warm_up_drafting
    from hf_chainflow.generation.settings import SpeculativeSettings

    if compile_drafting is not None and not isinstance(compile_drafting, bool):
        raise ValueError(f"`compile_drafting` must be True, False or None (keep each drafter's own setting), got "
                         f"{compile_drafting!r}.")
    record = {}
    for name, by_dtype in drafters.items():
        for drafter in by_dtype.values():
            if compile_drafting is not None:
                drafter.generation_config.compile_drafting = compile_drafting
        first = next(iter(by_dtype.values()))
        record[name] = {"compile_drafting": bool(getattr(first.generation_config, "compile_drafting", False)),
                        "dtype": str(first.dtype).removeprefix("torch."),
                        "serving_head_dtype": first.config.serving_head_dtype, "compile_seconds": 0.0}
    for arm in arms:
        if not arm.speculative:
            continue
        drafter = drafters[arm.drafter][arm.dtype]
        configure_drafter(drafter, arm)
        with torch.inference_mode():
            settings = SpeculativeSettings.from_drafter(drafter)
            record[arm.drafter]["compile_seconds"] += warm_up_drafting(drafter, settings)
            if settings.auto_budget:  # the machine's cost curve, read or measured now rather than in a timed call
                curve = cost_curve_for_call(drafter, settings)
                record[arm.drafter].setdefault("cost_curves", {})[arm.key] = curve.key()
    return record


def benchmark(target: str, drafter_paths: dict[str, str], *, dtypes: list[str], drafter_dtype: str = "float32",
              pld_tokens: int = 10, chain: int | None = None, tree: tuple[int, int] | None = None,
              tree_budget: int | None = None, lookup: dict | None = None, only: list[str] | None = None,
              prompts: str | os.PathLike | None = None, limit: int | None = None, max_new_tokens: int = 128,
              tie_tolerance: float = DEFAULT_TIE_TOLERANCE, output_dir: str | os.PathLike = DEFAULT_OUTPUT_DIR,
              resume: bool = False, partial: bool = False, overwrite: bool = False, progress: bool = True,
              compile_drafting: bool | None = None, compile_verification: bool | None = None,
              batch_sizes: list[int] | None = None,
              dflash: str | os.PathLike | None = None) -> tuple[dict, dict[str, Path]]:
    """Load the target (a known name or a model directory, see `hf_chainflow.targets.load_model_and_tokenizer`) in
    every dtype of `dtypes` and each drafter of `drafter_paths` (name -> directory; `"chainflow"` is the default
    drafter, whose arms are `chain`/`tree`/`tree+lookup`) bound to each copy, run every arm on the prompts
    (`prompts`: a JSONL file, default the shipped evaluation prompts; `limit`: that many, stratified by domain),
    journal each finished prompt in `output_dir`, and write the results there (`output_dir/partial/` with
    `partial`). Returns the results and the written files (`write_results`). The prompts file and the journal
    (`resume`; without it a journal holding finished prompts is refused unless `overwrite`) are checked before any
    model loads (`check_journal`).

    `lookup` (the `lookup_*` generation-config fields) adds the `tree+lookup` arm; without it the default drafter's
    own `lookup_num_tokens` does, when set (with its `corpus_lookup_num_tokens`, when set). `chain`, `tree`,
    `tree_budget` override the drafters' generation configs; `only` keeps the arms of those names (`build_arms`). `compile_drafting` sets every drafter's
    `generation_config.compile_drafting` (`None`: keep each drafter's own); compiled rounds are warmed up for every
    arm before anything is timed, and the seconds that took are recorded (`settings["drafting"]`).
    `compile_verification` sets every chain/tree arm's verification compiled or eager (`None`: each drafter's own
    `generation_config.compile_verification`; the opt-in compiled arms are compiled either way). With
    `batch_sizes`, runs the batched bench instead (`hf_chainflow.bench.batched`: plain batched `generate` against
    each drafter arm at every batch size) and writes `batched_results.json` / `.md` to `output_dir`.

    `dflash`: a DFlash drafter folder (`hf-chainflow train --drafter-type dflash`), loaded in each target dtype
    (`hf_chainflow.training.dflash.load_dflash_drafter`: stock transformers feeds it the target's tensors as they are) and run
    as the `dflash` arm by stock transformers (`speculation_type="dflash"`); its τ is counted like prompt lookup's.
    Stock DFlash decoding is batch 1, so it has no place in the batched bench.
    """
    from hf_chainflow.models.chainflow.modeling_chainflow import ChainFlowDrafter
    from hf_chainflow.targets import load_model_and_tokenizer

    if dflash is not None and batch_sizes is not None:
        raise ValueError("`--dflash` with `--batch-sizes`: stock transformers' DFlash decoding runs one prompt at a "
                         "time (assisted decoding is batch 1); run the DFlash arm in the ordinary bench.")
    rows, warm_row = choose_prompts(prompts, limit)
    # one bench at a time per output folder: a second one would interleave its lines into the same journal
    with FolderLock(output_dir, what="bench output folder"):
        if batch_sizes is None:
            check_journal(Path(output_dir) / JOURNAL_NAME, resume=resume, overwrite=overwrite)

        models, drafters, tokenizer = {}, {name: {} for name in drafter_paths}, None
        for dt in dtypes:
            models[dt], tokenizer = load_model_and_tokenizer(target, getattr(torch, dt))
            for name, path in drafter_paths.items():
                drafters[name][dt] = ChainFlowDrafter.from_pretrained(path, target=models[dt],
                                                                      dtype=getattr(torch, drafter_dtype)).eval()
        dflash_drafters = {}
        if dflash is not None:
            from hf_chainflow.training.dflash import load_dflash_drafter

            dflash_drafters = {dt: load_dflash_drafter(dflash, models[dt]) for dt in dtypes}
        if lookup is None and "chainflow" in drafters:  # the default drafter's own lookup setting, if it has one
            g = drafters["chainflow"][dtypes[0]].generation_config
            if getattr(g, "lookup_num_tokens", None) is not None:
                lookup = {"lookup_num_tokens": g.lookup_num_tokens,
                          "lookup_trust_ngram": getattr(g, "lookup_trust_ngram", None),
                          "lookup_max_tokens": getattr(g, "lookup_max_tokens", None)}
                if getattr(g, "corpus_lookup_num_tokens", None) is not None:  # a drafter with a corpus-lookup table
                    lookup["corpus_lookup_num_tokens"] = g.corpus_lookup_num_tokens
        arms = build_arms(dtypes, {n: d[dtypes[0]] for n, d in drafters.items()}, pld_tokens=pld_tokens,
                          chain=chain, tree=tree, tree_budget=tree_budget, lookup=lookup, only=only,
                          dflash=dflash is not None, compile_verification=compile_verification)
        drafting = warm_up_arms(arms, drafters, compile_drafting)
        if dflash is not None:
            drafters["dflash"] = dflash_drafters
        bench_prompts = tokenize_prompts(tokenizer, rows)
        warmup = tokenize_prompts(tokenizer, [warm_row])[0]
        gen = models[dtypes[0]].generation_config
        if batch_sizes is not None:
            from hf_chainflow.bench.batched import run_batched_bench, write_batched_results

            results = run_batched_bench(models, bench_prompts, arms, drafters, batch_sizes,
                                        max_new_tokens=max_new_tokens,
                                        tie_tolerance=tie_tolerance, eos_token_id=gen.eos_token_id,
                                        pad_token_id=gen.pad_token_id, progress=progress)
            results["settings"] = {"target": target, "drafters": drafter_paths, "dtypes": dtypes, "limit": limit,
                                   "prompts": str(prompts or default_prompts_path()),
                                   "threads": torch.get_num_threads(),
                                   "machine": machine_info(), "drafting": drafting}
            return results, write_batched_results(results, output_dir)
        settings = {"target": target, "drafters": drafter_paths, "drafter_weights_sha256": {
                        name: weights_digest(d[dtypes[0]]) for name, d in drafters.items()},
                    "drafter_config_sha256": {name: config_digest(d[dtypes[0]]) for name, d in drafters.items()},
                    "drafter_dtype": drafter_dtype, "dtypes": dtypes,
                    "prompts": str(prompts or default_prompts_path()), "limit": limit,
                    "pld_tokens": pld_tokens, "threads": torch.get_num_threads(), "drafting": drafting}
        if dflash is not None:  # (absent otherwise: the journals of runs without it resume as before)
            settings["dflash"] = str(dflash)
        results = run_bench(models, bench_prompts, arms, drafters, max_new_tokens=max_new_tokens,
                            tie_tolerance=tie_tolerance, warmup=warmup, eos_token_id=gen.eos_token_id,
                            pad_token_id=gen.pad_token_id, decode=tokenizer.decode, progress=progress,
                            settings=settings, journal=Path(output_dir) / JOURNAL_NAME, resume=resume, partial=partial,
                            overwrite=overwrite)
        written = write_results(results, Path(output_dir) / "partial" if partial else output_dir)
        return results, written


__all__ = ["benchmark", "run_bench", "summarise", "warm_up_arms"]
