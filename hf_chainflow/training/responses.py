"""The target's own greedy responses: generated in padded batches (`generate_responses`, for `prepare` too), and
answered into a response corpus with how they were made (`generate_into_corpus`, behind `hf-chainflow
generate-responses`; the corpus folder and its rows' `GenerationSettings`: `hf_chainflow.training.corpus`).
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from hf_chainflow.checks import is_int
from hf_chainflow.training.corpus import GenerationSettings, ResponseCorpus, check_writable
from hf_chainflow.training.prompts import chat_prompt_ids

__all__ = ["batches_by_length", "cut_response", "generate_into_corpus", "generate_responses",
           "target_eos_ids", "target_pad_id"]


# ----------------------------------------------------------------------------------------------------------------
# Generating
# ----------------------------------------------------------------------------------------------------------------

def target_eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The EOS token id(s) the target's greedy responses end at: its generation config's, else the tokenizer's."""
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    if not eos:
        raise ValueError("Neither the model's generation_config nor the tokenizer names an EOS token id; set "
                         "`model.generation_config.eos_token_id`.")
    return eos


def target_pad_id(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, eos: list[int]) -> int:
    """The padding id of batched passes: the tokenizer's, the generation config's or the config's, else an EOS id."""
    for pad in (tokenizer.pad_token_id, model.generation_config.pad_token_id, model.config.pad_token_id):
        if pad is not None:
            return int(pad)
    return eos[0]


def batches_by_length(lengths: Sequence[int], max_batch: int, max_tokens: int | None = None) -> list[list[int]]:
    """Indices sorted by length, cut into batches of at most `max_batch` rows and `max_tokens` padded tokens."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, cur = [], []
    for i in order:  # ascending, so row i is the longest of the batch it joins
        if cur and (len(cur) >= max_batch or (max_tokens is not None and lengths[i] * (len(cur) + 1) > max_tokens)):
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def cut_response(new_tokens: Sequence[int], eos_ids: Sequence[int]) -> tuple[list[int], str]:
    """Cut generated ids after the first EOS (kept); `finish` is "eos" or "length"."""
    for k, tok in enumerate(new_tokens):
        if tok in eos_ids:
            return list(new_tokens[: k + 1]), "eos"
    return list(new_tokens), "length"


@torch.no_grad()
def generate_responses(model: PreTrainedModel, prompts: Sequence[Sequence[int]], *, eos_token_ids: Sequence[int],
                       pad_token_id: int, batch_size: int = 32, max_new_tokens: int = 256,
                       progress: tqdm | None = None) -> list[tuple[list[int], str]]:
    """Greedy responses `(response_ids, finish)` to tokenised prompts, in padded static batches bucketed by prompt
    length (left padding). The model runs in whatever dtype it has."""
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=list(eos_token_ids),
                                  pad_token_id=pad_token_id)
    results: list[Any] = [None] * len(prompts)
    for batch in batches_by_length([len(p) for p in prompts], batch_size):
        width = max(len(prompts[i]) for i in batch)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)  # (B, P)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, i in enumerate(batch):
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]):] = 1
        out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                             generation_config=gen_config)  # (B, P + new)
        for r, i in enumerate(batch):
            results[i] = cut_response(out[r, width:].tolist(), eos_token_ids)
        if progress is not None:
            progress.update(len(batch))
    return results


# ----------------------------------------------------------------------------------------------------------------
# Into a response corpus
# ----------------------------------------------------------------------------------------------------------------

def generate_into_corpus(model, tokenizer, prompts: Sequence[dict], corpus: ResponseCorpus,
                         settings: GenerationSettings, *, batch_size: int = 32, shard_size: int = 512,
                         chunk_size: int = 1024, rank: int = 0, world_size: int = 1, max_prompts: int | None = None,
                         progress: bool = True) -> dict:
    """Answer `prompts` (rows with `id, domain, language, source` and `prompt` text or `prompt_ids`, in the order to
    answer them) with `model` and add the responses to `corpus`'s train split. Prompt text goes through the
    tokenizer's chat template (`hf_chainflow.training.prompts.chat_prompt_ids`).

    Prompts already in the corpus or pending are skipped; process `rank` of `world_size` answers every
    `world_size`-th of the rest. Inside a chunk of `chunk_size` prompts, batches of `batch_size` prompts of similar
    length are generated (left padding) and appended to the pending file after each batch; a shard is written
    whenever `shard_size` rows are pending, and the last pending rows when every prompt is answered. `max_prompts`
    stops after that many new responses (their rows stay pending unless they complete a shard). Returns counts.

    The whole run holds the corpus's writer lock (`writer_lock`): another job writing to the corpus is refused with a
    `FolderBusyError` naming it; the processes of one `torchrun` job share it. A corpus folder that is not writable is
    refused before the first batch.
    """
    check_writable(corpus.path)
    with corpus.writing():
        return _generate_locked(model, tokenizer, prompts, corpus, settings, batch_size=batch_size,
                                shard_size=shard_size, chunk_size=chunk_size, rank=rank, world_size=world_size,
                                max_prompts=max_prompts, progress=progress)


def _generate_locked(model, tokenizer, prompts, corpus, settings, *, batch_size, shard_size, chunk_size, rank,
                     world_size, max_prompts, progress) -> dict:
    corpus.check_tokenizer(tokenizer)
    for n, r in enumerate(prompts):
        bad = [i for i in r.get("prompt_ids", ()) if not is_int(i) or not 0 <= i < corpus.vocab_size]
        if bad:
            raise ValueError(f"Prompt row {n} (id {r.get('id')!r}): `prompt_ids` holds {bad[:5]}, not ids of the "
                             f"tokenizer's vocabulary of {corpus.vocab_size}.")
    answered = corpus.ids() | {r["id"] for r in corpus.pending()}
    mine = [r for i, r in enumerate(prompts) if i % world_size == rank]
    todo = [r for r in mine if r["id"] not in answered][:max_prompts]
    eos = target_eos_ids(model, tokenizer)
    pad = target_pad_id(model, tokenizer, eos)
    fixed = {k: v for k, v in asdict(settings).items()}
    written, generated, tokens = [], 0, 0
    start = time.perf_counter()
    shard = corpus.flush_pending(rank=rank, min_rows=shard_size)  # a killed run's full shard
    if shard is not None:
        written.append(shard)
    bar = tqdm(total=len(mine), initial=len(mine) - len(todo), desc=f"responses (process {rank})", unit="resp",
               disable=not progress, dynamic_ncols=True)
    for c in range(0, len(todo), chunk_size):
        chunk = [r if "prompt_ids" in r else {**r, "prompt_ids": chat_prompt_ids(tokenizer, r["prompt"])}
                 for r in todo[c:c + chunk_size]]
        order = sorted(range(len(chunk)), key=lambda i: len(chunk[i]["prompt_ids"]))
        for b in range(0, len(order), batch_size):
            batch = [chunk[i] for i in order[b:b + batch_size]]
            outs = generate_responses(model, [r["prompt_ids"] for r in batch], eos_token_ids=eos, pad_token_id=pad,
                                      batch_size=batch_size, max_new_tokens=settings.max_new_tokens)
            rows = [{"id": r["id"], "domain": r["domain"], "language": r["language"], "source": r.get("source", ""),
                     "prompt_ids": list(r["prompt_ids"]), "response_ids": resp, "finish": finish, **fixed}
                    for r, (resp, finish) in zip(batch, outs)]
            corpus.append_pending(rows, rank)
            generated += len(rows)
            tokens += sum(len(r["response_ids"]) for r in rows)
            bar.update(len(rows))
            bar.set_postfix_str(f"{tokens / (time.perf_counter() - start):.0f} tok/s")
            shard = corpus.flush_pending(rank=rank, min_rows=shard_size)
            if shard is not None:
                written.append(shard)
                corpus.write_card()
                bar.write(f"shard {shard.name}: {shard.stat().st_size / 1e6:.2f} MB")
    if len(todo) == len([r for r in mine if r["id"] not in answered]):  # every prompt of this process answered
        shard = corpus.flush_pending(rank=rank)
        if shard is not None:
            written.append(shard)
            corpus.write_card()
    bar.close()
    return {"generated": generated, "response_tokens": tokens, "seconds": time.perf_counter() - start,
            "shards": [str(p) for p in written], "pending": len(corpus.pending(rank))}
