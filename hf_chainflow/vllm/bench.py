"""`python -m hf_chainflow.vllm.bench`: vLLM plain vs vLLM `ngram` vs vLLM + ChainFlow, speed and exactness.

Arms (`--arms`), each one vLLM engine on the target:

    plain              no speculation (the reference of speed and of output)
    ngram              vLLM's own prompt lookup (`--ngram-tokens`, `--ngram-min`..`--ngram-max`)
    chainflow-K        the ChainFlow drafter proposing chains of K tokens (`hf_chainflow.vllm.speculative_config`)
    chainflow-K+lookup the same, but a request whose last 2..3 tokens occurred earlier gets the tokens that followed
                       that occurrence instead of a ChainFlow draft (`lookup_trust_ngram=2`)

For every dtype and concurrency `c` (`--concurrency 1 8`), each arm generates greedily for the same evaluation
prompts (the shipped ones, chat template, `--limit` taken round-robin over the domains), `c` requests submitted
together, the next `c` when those have finished. Per arm: tokens/s over the timed generate calls (engine start and
a warm-up excluded), speedup against `plain` of the same dtype and concurrency in the same run, and vLLM's own
spec-decode counters (drafts, draft tokens, accepted tokens, per position): mean acceptance length
`1 + accepted / drafts` (tokens per target forward of a speculating request); for ChainFlow arms also the
share of the timed seconds the proposer spent drafting (read from the engine's worker).

Exactness: every arm's output is compared with `plain`'s of the same dtype and concurrency. At the first
difference the plain engine scores prompt + common prefix in one forward (`logprobs=20`) and
`hf_chainflow.bench.classify_divergence` classifies it: in float32 every difference is `unexplained`; in bfloat16 a
difference whose two tokens lie within `--tie-tolerance` logits of each other and of the top is a `near_tie`.

Engines run one at a time (vLLM's metrics are per process), `plain` last so that it can classify; arms are not
interleaved, so run this on an otherwise idle machine. Writes `results.json` and `results.md` to `--out`.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hf_chainflow.cli_args import positive_int

DEFAULT_OUTPUT_DIR = "runs/vllm-bench"
LOGPROBS = 20  # top logprobs asked of the plain engine at a divergence
WARMUP_TOKENS = 16


# ------------------------------------------------------------------------------------------------------ arms

@dataclass(frozen=True)
class VllmArm:
    """One engine configuration: `kind` is `"plain"`, `"ngram"` or `"chainflow"`."""

    name: str
    kind: str
    num_tokens: int = 0
    lookup: bool = False


def parse_arm(name: str) -> VllmArm:
    """`plain`, `ngram`, `chainflow-K` or `chainflow-K+lookup` -> a `VllmArm` (`ValueError` otherwise)."""
    if name in ("plain", "ngram"):
        return VllmArm(name, name)
    base, plus, extra = name.partition("+")
    head, _, k = base.partition("-")
    if head == "chainflow" and k.isdigit() and int(k) >= 1 and (not plus or extra == "lookup"):
        return VllmArm(name, "chainflow", int(k), lookup=bool(plus))
    raise ValueError(f"`--arms` takes plain, ngram, chainflow-K or chainflow-K+lookup (K a positive integer), got "
                     f"{name!r}.")


def speculative_for(arm: VllmArm, *, drafter_path: str | None, ngram_tokens: int, ngram_min: int,
                    ngram_max: int) -> dict | None:
    """The `speculative_config` of an arm (None for plain)."""
    if arm.kind == "plain":
        return None
    if arm.kind == "ngram":
        return {"method": "ngram", "num_speculative_tokens": ngram_tokens, "prompt_lookup_min": ngram_min,
                "prompt_lookup_max": ngram_max}
    from hf_chainflow.vllm import speculative_config

    lookup = {"lookup_trust_ngram": 2, "lookup_ngram": 3} if arm.lookup else {}
    return speculative_config(drafter_path, num_speculative_tokens=arm.num_tokens, **lookup)


# ------------------------------------------------------------------------------------------------- engines

def prepare_environment() -> None:
    """vLLM's CPU settings for the engine processes: 1 GiB of KV cache unless `VLLM_CPU_KVCACHE_SPACE` says
    otherwise, the bundled `libiomp5.so` preloaded (the engine's worker warns of a large slowdown without it),
    offline Hub, pickled `collective_rpc` calls allowed (local processes only). The engine's processes are spawned, so they see these even when set here."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # `llm.collective_rpc(function)` (reading the proposer's counters in the engine's worker) pickles the function
    # between this process and the engine processes it spawned; vLLM refuses that unless told.
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    if "LD_PRELOAD" not in os.environ and iomp.is_file():
        os.environ["LD_PRELOAD"] = str(iomp)


def start_engine(target: str, dtype: str, speculative: dict | None, *, max_model_len: int, max_num_seqs: int,
                 enforce_eager: bool = True, **engine_kwargs):
    """A `vllm.LLM` on `target` with its stats on (for the spec-decode counters); `engine_kwargs` go to `LLM`."""
    from vllm import LLM

    return LLM(model=target, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
               enforce_eager=enforce_eager, speculative_config=speculative, disable_log_stats=False, seed=0,
               **engine_kwargs)


def stop_engine(llm) -> None:
    """Shut the engine's processes down now (not at garbage collection), so the next engine has the CPU."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del llm
    gc.collect()


def spec_counters(llm) -> dict:
    """vLLM's spec-decode counters of this engine: drafts, draft tokens, accepted tokens, accepted per position."""
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []}
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    for metric in llm.get_metrics():
        if metric.name in names:
            out[names[metric.name]] += int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["accepted_per_pos"] = [int(v) for v in metric.values]
    return out


def _read_proposer_stats(worker) -> dict | None:
    stats = getattr(getattr(worker.model_runner, "drafter", None), "stats", None)
    return dict(stats) if isinstance(stats, dict) else None


def proposer_stats(llm) -> dict | None:
    """The ChainFlow proposer's own counters in the engine's worker (`seconds` spent proposing, `drafts`,
    `lookup_drafts`, `short_context`), or None for another method."""
    return llm.collective_rpc(_read_proposer_stats)[0]


def counter_delta(after: dict, before: dict) -> dict:
    per_pos = [a - (before["accepted_per_pos"][i] if i < len(before["accepted_per_pos"]) else 0)
               for i, a in enumerate(after["accepted_per_pos"])]
    return {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")} | {"accepted_per_pos": per_pos}


# -------------------------------------------------------------------------------------------------- prompts

@dataclass
class Prompt:
    id: str
    domain: str
    token_ids: list[int]


def load_eval_prompts(target: str, limit: int | None, path: str | None = None) -> list[Prompt]:
    """The evaluation prompts through the target's chat template, as `hf-chainflow bench` tokenises them."""
    from transformers import AutoTokenizer

    from hf_chainflow.bench import load_prompts, stratified_selection, tokenize_prompts

    tokenizer = AutoTokenizer.from_pretrained(target)
    rows = stratified_selection(load_prompts(path), limit)
    return [Prompt(p.id, p.domain, p.input_ids[0].tolist()) for p in tokenize_prompts(tokenizer, rows)]


def generate(llm, prompts: list[Prompt], max_new_tokens: int, concurrency: int) -> tuple[list[list[int]], float]:
    """Greedy outputs of `prompts`, `concurrency` requests at a time, and the seconds the generate calls took."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    outputs, seconds = [], 0.0
    for start in range(0, len(prompts), concurrency):
        group = [TokensPrompt(prompt_token_ids=p.token_ids) for p in prompts[start:start + concurrency]]
        t0 = time.perf_counter()
        results = llm.generate(group, params, use_tqdm=False)
        seconds += time.perf_counter() - t0
        outputs += [list(r.outputs[0].token_ids) for r in results]
    return outputs, seconds


def classify(llm, prompt: Prompt, reference: list[int], other: list[int], dtype: str, tolerance: float) -> dict | None:
    """None when `other == reference`; else the first difference classified from the plain engine's logprobs of
    prompt + common prefix (tokens outside its top `LOGPROBS` count as -inf)."""
    import torch
    from vllm import SamplingParams, TokensPrompt

    from hf_chainflow.bench import classify_divergence, first_divergence

    pos = first_divergence(reference, other)
    if pos is None:
        return None
    expected = reference[pos] if pos < len(reference) else None
    got = other[pos] if pos < len(other) else None
    result = llm.generate([TokensPrompt(prompt_token_ids=prompt.token_ids + reference[:pos])],
                          SamplingParams(temperature=0.0, max_tokens=1, logprobs=LOGPROBS), use_tqdm=False)[0]
    top = result.outputs[0].logprobs[0]  # {token id: Logprob}
    ids = [t for t in (expected, got) if t is not None]
    vocab = max([*top, *ids]) + 1
    logits = torch.full((vocab,), float("-inf"))
    for token, lp in top.items():
        logits[token] = lp.logprob
    verdict = classify_divergence(logits, expected, got, dtype, tolerance)
    return {"prompt": prompt.id, "domain": prompt.domain, "position": pos, "plain_token": expected,
            "arm_token": got, **verdict}


# ------------------------------------------------------------------------------------------------------ run

@dataclass
class Cell:
    """One arm at one dtype and concurrency."""

    arm: str
    dtype: str
    concurrency: int
    prompts: int
    new_tokens: int
    seconds: float
    counters: dict
    outputs: list[list[int]] = field(repr=False)
    speedup: float | None = None
    differences: list[dict] = field(default_factory=list)
    proposer: dict | None = None  # the ChainFlow proposer's counters over this cell (its drafting time)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def mean_acceptance_length(self) -> float | None:
        d = self.counters["drafts"]
        return 1 + self.counters["accepted"] / d if d else None

    def summary(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "outputs"}
        out["tokens_per_s"] = self.tokens_per_s
        out["mean_acceptance_length"] = self.mean_acceptance_length
        out["exact"] = self.prompts - len(self.differences)
        out["near_tie"] = sum(d["kind"] == "near_tie" for d in self.differences)
        out["unexplained"] = sum(d["kind"] == "unexplained" for d in self.differences)
        out["proposer_share"] = self.proposer["seconds"] / self.seconds if self.proposer and self.seconds else None
        return out


def run_bench(target: str, prompts: list[Prompt], arms: list[VllmArm], dtypes: list[str], concurrency: list[int], *,
              max_new_tokens: int = 128, max_model_len: int = 2048, drafter_path: str | None = None,
              ngram_tokens: int = 4, ngram_min: int = 2, ngram_max: int = 4, tie_tolerance: float = 0.5,
              enforce_eager: bool = True, log=print) -> list[Cell]:
    """Every arm at every dtype and concurrency (see the module docstring); `plain` is always run, last."""
    longest = max(len(p.token_ids) for p in prompts)
    if longest + max_new_tokens > max_model_len:
        raise ValueError(f"`--max-model-len` ({max_model_len}) must hold the longest prompt ({longest} tokens) plus "
                         f"`--max-new-tokens` ({max_new_tokens}); raise it or lower `--limit`.")
    order = [a for a in arms if a.kind != "plain"] + [VllmArm("plain", "plain")]
    cells: list[Cell] = []
    for dtype in dtypes:
        mine: dict[tuple[str, int], Cell] = {}
        for arm in order:
            spec = speculative_for(arm, drafter_path=drafter_path, ngram_tokens=ngram_tokens, ngram_min=ngram_min,
                                   ngram_max=ngram_max)
            t0 = time.perf_counter()
            llm = start_engine(target, dtype, spec, max_model_len=max_model_len, max_num_seqs=max(concurrency),
                               enforce_eager=enforce_eager)
            log(f"[{dtype}] {arm.name}: engine started in {time.perf_counter() - t0:.0f} s")
            generate(llm, prompts[:1], WARMUP_TOKENS, 1)
            for c in concurrency:
                llm.reset_prefix_cache()  # every pass starts cold, as new requests do
                before, proposer_before = spec_counters(llm), proposer_stats(llm) if arm.kind == "chainflow" else None
                outputs, seconds = generate(llm, prompts, max_new_tokens, c)
                cell = Cell(arm.name, dtype, c, len(prompts), sum(map(len, outputs)), seconds,
                            counter_delta(spec_counters(llm), before), outputs)
                if proposer_before is not None:
                    after = proposer_stats(llm)
                    cell.proposer = {k: after[k] - proposer_before[k] for k in after}
                mine[arm.name, c] = cell
                log(f"[{dtype}] {arm.name} @ {c}: {cell.tokens_per_s:.1f} tokens/s, mean acceptance length "
                    f"{cell.mean_acceptance_length or 1:.2f}")
            if arm.kind == "plain":  # the reference: speedups and the classification of every difference
                llm.reset_prefix_cache()  # a divergence is scored in one forward
                for (name, c), cell in mine.items():
                    ref = mine["plain", c]
                    cell.speedup = cell.tokens_per_s / ref.tokens_per_s if ref.tokens_per_s else None
                    if name == "plain":
                        continue
                    for p, a, b in zip(prompts, ref.outputs, cell.outputs):
                        verdict = classify(llm, p, a, b, dtype, tie_tolerance)
                        if verdict is not None:
                            cell.differences.append(verdict)
                    log(f"[{dtype}] {name} @ {c}: {len(prompts) - len(cell.differences)} of {len(prompts)} outputs "
                        f"equal plain; {sum(d['kind'] == 'unexplained' for d in cell.differences)} unexplained")
            stop_engine(llm)
        shown = ["plain"] + [a.name for a in order if a.kind != "plain"]
        cells += [mine[name, c] for c in concurrency for name in shown]
    return cells


def markdown(cells: list[Cell]) -> str:
    lines = ["| dtype | concurrency | arm | tokens/s | speedup | mean acceptance length | drafts | drafting time | "
             "equal to plain | near-ties | unexplained |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        s = c.summary()
        mal = f"{s['mean_acceptance_length']:.2f}" if s["mean_acceptance_length"] is not None else "–"
        speed = f"{s['speedup']:.2f}×" if s["speedup"] is not None else "–"
        share = f"{100 * s['proposer_share']:.0f}%" if s["proposer_share"] is not None else "–"
        lines.append(f"| {c.dtype} | {c.concurrency} | {c.arm} | {s['tokens_per_s']:.1f} | {speed} | {mal} | "
                     f"{c.counters['drafts']} | {share} | {s['exact']}/{c.prompts} | {s['near_tie']} | "
                     f"{s['unexplained']} |")
    return "\n".join(lines) + "\n"


def batch_effect(cells: list[Cell]) -> list[str]:
    """Per dtype, how many of plain's outputs at each concurrency equal plain's at the first concurrency (vLLM's
    kernels round differently for different batch shapes; a speculative arm verifies several tokens per request)."""
    lines = []
    plain = {(c.dtype, c.concurrency): c for c in cells if c.arm == "plain"}
    for dtype in dict.fromkeys(c.dtype for c in cells):
        levels = [k[1] for k in plain if k[0] == dtype]
        first = plain[dtype, levels[0]]
        for c in levels[1:]:
            same = sum(a == b for a, b in zip(first.outputs, plain[dtype, c].outputs))
            lines.append(f"plain @ {c} equals plain @ {levels[0]} on {same}/{first.prompts} prompts ({dtype})")
    return lines


def write_serving_report(out: Path, cells: list[Cell], meta: dict) -> dict[str, Path]:
    """`results.json` and `results.md` of a serving run, written as the bench writes its own
    (`hf_chainflow.bench.report.write_report`: atomically)."""
    from hf_chainflow.bench.report import write_report

    results = {"meta": meta, "cells": [c.summary() for c in cells],
               "outputs": {f"{c.arm}@{c.dtype}@{c.concurrency}": c.outputs for c in cells}}
    notes = "".join(f"- {line}\n" for line in batch_effect(cells))
    text = (f"# vLLM serving bench\n\n`{meta['command']}`\n\n{meta['machine']}\n\n" + markdown(cells)
            + ("\n" + notes if notes else ""))
    return write_report(out, results, text)


# ---------------------------------------------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hf_chainflow.vllm.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="the target's transformers folder (default: the converted SmolLM2-135M-Instruct "
                                    "of hf_chainflow.targets, converted on first use)")
    p.add_argument("--drafter-path", help="a saved ChainFlow drafter (default: the shipped one)")
    p.add_argument("--arms", nargs="+", default=["plain", "ngram", "chainflow-2", "chainflow-3", "chainflow-4"],
                   help="plain, ngram, chainflow-K, chainflow-K+lookup (plain always runs: it is the reference)")
    p.add_argument("--dtype", nargs="+", choices=["float32", "bfloat16"], default=["bfloat16"])
    p.add_argument("--concurrency", nargs="+", type=positive_int, default=[1, 8])
    p.add_argument("--limit", type=positive_int, default=40, help="prompts, round-robin over the domains")
    p.add_argument("--prompts", help="a JSONL file of {id, domain, prompt} (default: the shipped evaluation prompts)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--max-model-len", type=positive_int, default=2048)
    p.add_argument("--ngram-tokens", type=positive_int, default=4, help="num_speculative_tokens of the ngram arm")
    p.add_argument("--ngram-min", type=positive_int, default=2)
    p.add_argument("--ngram-max", type=positive_int, default=4)
    p.add_argument("--tie-tolerance", type=float, default=0.5)
    p.add_argument("--compile", action="store_true", help="let vLLM compile the target (default: enforce_eager)")
    p.add_argument("--out", default=DEFAULT_OUTPUT_DIR)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    arms = [parse_arm(a) for a in args.arms]
    if args.ngram_min > args.ngram_max:
        raise ValueError(f"`--ngram-min` ({args.ngram_min}) cannot exceed `--ngram-max` ({args.ngram_max}).")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"`--out` must name a directory, got {str(out)!r}, which is a file.")
    prepare_environment()
    if args.target is None:
        from hf_chainflow.targets import convert_target

        args.target = str(convert_target())
    prompts = load_eval_prompts(args.target, args.limit, args.prompts)
    cells = run_bench(args.target, prompts, arms, args.dtype, args.concurrency, max_new_tokens=args.max_new_tokens,
                      max_model_len=args.max_model_len, drafter_path=args.drafter_path,
                      ngram_tokens=args.ngram_tokens, ngram_min=args.ngram_min, ngram_max=args.ngram_max,
                      tie_tolerance=args.tie_tolerance, enforce_eager=not args.compile)
    import torch
    import vllm

    meta = {"command": "python -m hf_chainflow.vllm.bench " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, vllm {vllm.__version__}, "
                       f"torch {torch.__version__}, AVX-512 BF16: {torch.cpu._is_avx512_bf16_supported()}",
            "prompts": [p.id for p in prompts], "max_new_tokens": args.max_new_tokens}
    meta["batch_effect"] = batch_effect(cells)
    write_serving_report(out, cells, meta)
    print(markdown(cells) + "".join(f"- {line}\n" for line in meta["batch_effect"]))
    return 0 if all(c.summary()["unexplained"] == 0 for c in cells) else 1


if __name__ == "__main__":
    raise SystemExit(main())
