"""`ChainFlowProposer`: a ChainFlow drafter as a vLLM speculative proposer (the `custom_class` method).

vLLM (0.32, V1 model runner) builds it as `ChainFlowProposer(vllm_config)`, calls `load_model(target)` with the
target `nn.Module` once, then after every step that sampled tokens

    propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=...) -> list[list[int]]

with one row per request of the batch (vLLM's `input_batch` order): the tokens accepted + the bonus token of this
step, the committed length, and the committed token ids. vLLM verifies each returned chain in the next step.

The drafter needs the target's last hidden states of the committed tokens; vLLM hands them only to its own
EAGLE-family proposers. They are taken from the target's own forward, with no second pass:

    load_model   a forward hook on the target module: its output is the final (normed) hidden states `(N, D)`
                 vLLM passes to `compute_logits`; the attention metadata of the same forward
                 (`vllm.forward_context`) gives each request's rows (`query_start_loc`) and positions (`seq_lens`)
    propose      per request: rows of committed tokens (all but the bonus) -> context store -> last `C` states;
                 then one batched drafter pass for all requests with the same chain length and context length
                 (`predict_states` + the chain search of `drafting.draft(drafter, mode="chain")`) -> each chain's tokens

The context store keys a request's last `C` states by a digest of the committed tokens they follow from, so a
request is found again in the next step whatever vLLM did to the batch order (finished requests are condensed
away, rows swapped); a request not found (evicted, or a prefix-cache hit that skipped part of its prompt) drafts from
the states of this step alone and is counted in `stats["short_context"]`. Drafts never change what is emitted:
vLLM's verification decides.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict

import numpy as np
import torch

from hf_chainflow.generation.search import candidate_search, committed_tails
from hf_chainflow.generation.serving import serving_velocity
from hf_chainflow.generation.settings import SearchSettings

from hf_chainflow.vllm.settings import SETTINGS_KEY, check_settings


class _TargetView:
    """What `ChainFlowDrafter.bind_target` reads from a transformers model, taken from vLLM's target module:
    its config, its `lm_head` rows `(V, D)` and its input embeddings `(V, D)` (vLLM pads vocabularies; the rows past
    `vocab_size` are cut off)."""

    class _Rows:
        def __init__(self, weight: torch.Tensor):
            self.weight = weight

    def __init__(self, config, lm_head: torch.Tensor, embed: torch.Tensor):
        self.config = config
        V = config.get_text_config().vocab_size
        self._lm_head = self._Rows(lm_head[:V])
        self._embed = self._Rows(embed[:V])

    def get_output_embeddings(self):
        return self._lm_head

    def get_input_embeddings(self):
        return self._embed


def _target_weights(target: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The `lm_head` and input-embedding weights of a vLLM causal LM (`lm_head`, `model.embed_tokens`)."""
    lm_head = getattr(target, "lm_head", None)
    inner = getattr(target, "model", None)
    embed = getattr(inner, "embed_tokens", None) if inner is not None else None
    if not isinstance(getattr(lm_head, "weight", None), torch.Tensor) or not isinstance(
            getattr(embed, "weight", None), torch.Tensor):
        raise ValueError(
            f"The ChainFlow proposer needs the target's `lm_head.weight` and `model.embed_tokens.weight`; vLLM's "
            f"{type(target).__name__} does not have both. Only decoder-only causal LMs with these modules (Llama, "
            "Qwen, ... in vLLM) are supported.")
    return lm_head.weight, embed.weight


class _ContextStore:
    """The last `C` committed states of each live request, keyed by a digest of the tokens before them; LRU."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    @staticmethod
    def key(tokens: np.ndarray) -> bytes:
        return hashlib.blake2b(np.ascontiguousarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()

    def get(self, tokens: np.ndarray) -> torch.Tensor | None:
        k = self.key(tokens)
        states = self._entries.get(k)
        if states is not None:
            self._entries.move_to_end(k)
        return states

    def put(self, tokens: np.ndarray, states: torch.Tensor) -> None:
        k = self.key(tokens)
        self._entries[k] = states
        self._entries.move_to_end(k)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


class _Capture:
    """One target forward: its final states `(N, D)` and, per request of the batch, its first row and the
    position after its last row."""

    def __init__(self, hidden: torch.Tensor, query_start_loc: np.ndarray, seq_lens: np.ndarray):
        self.hidden = hidden
        self.query_start_loc = query_start_loc
        self.seq_lens = seq_lens


def _batch_layout(attn_metadata) -> tuple[np.ndarray, np.ndarray]:
    """`query_start_loc` `(R+1,)` and `seq_lens` `(R,)` of the forward being run (any attention layer's metadata:
    one KV-cache group shares them)."""
    if isinstance(attn_metadata, list):
        raise ValueError("The ChainFlow proposer does not support micro-batched forwards (dual-batch overlap / "
                         "ubatching): turn them off (`enable_dbo=False`).")
    if not isinstance(attn_metadata, dict) or not attn_metadata:
        raise ValueError(f"The ChainFlow proposer found no attention metadata in the target's forward context "
                         f"(got {type(attn_metadata).__name__}); it needs vLLM's V1 model runner.")
    for meta in attn_metadata.values():
        qsl, seq = getattr(meta, "query_start_loc", None), getattr(meta, "seq_lens", None)
        if isinstance(qsl, torch.Tensor) and isinstance(seq, torch.Tensor):
            return qsl.cpu().numpy().astype(np.int64), seq.cpu().numpy().astype(np.int64)
    kinds = sorted({type(m).__name__ for m in attn_metadata.values()})
    raise ValueError(f"The ChainFlow proposer needs `query_start_loc` and `seq_lens` in the attention metadata; "
                     f"{kinds} has neither.")


class ChainFlowProposer:
    """A ChainFlow drafter proposing one chain per request in vLLM (see the module docstring).

    Settings come from `vllm_config.speculative_config.draft_load_config.model_loader_extra_config["chainflow"]`
    (`hf_chainflow.vllm.speculative_config` writes them); the chain length is `num_speculative_tokens`.
    """

    def __init__(self, vllm_config):
        from hf_chainflow import ChainFlowDrafter

        spec = vllm_config.speculative_config
        load = spec.draft_load_config
        extra = getattr(load, "model_loader_extra_config", None) if load is not None else None
        if not isinstance(extra, dict) or SETTINGS_KEY not in extra:
            raise ValueError(
                "The ChainFlow proposer reads its drafter from speculative_config['draft_load_config']"
                f"['model_loader_extra_config'][{SETTINGS_KEY!r}], which is missing. Build the speculative config "
                "with `hf_chainflow.vllm.speculative_config(...)` (or `python -m hf_chainflow.vllm config` for "
                "`vllm serve --speculative-config`).")
        self.settings = check_settings(dict(extra[SETTINGS_KEY]))
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
            raise ValueError(
                f"The ChainFlow proposer runs on one worker: tensor_parallel_size and pipeline_parallel_size must be "
                f"1, got {parallel.tensor_parallel_size} and {parallel.pipeline_parallel_size} (it reads the whole "
                "lm_head and the final hidden states of one process).")
        if getattr(spec, "num_speculative_tokens_per_batch_size", None):
            raise ValueError("`num_speculative_tokens_per_batch_size` is not supported with the ChainFlow proposer: "
                             "vLLM does not tell a custom proposer the per-step draft length. Leave it unset.")
        self.num_tokens = spec.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.hf_config = vllm_config.model_config.hf_config
        self.device = torch.device(vllm_config.device_config.device)
        dtype = getattr(torch, self.settings.dtype)
        self.drafter = ChainFlowDrafter.from_pretrained(self.settings.drafter_path, dtype=dtype).to(self.device).eval()
        if self.drafter.state_layers:
            raise ValueError(
                f"The drafter at {self.settings.drafter_path} fuses target layers (`target_layer_ids="
                f"{list(self.drafter.state_layers)}`), but the ChainFlow proposer captures the target's final hidden "
                "states only. Serve it with transformers' `generate(assistant_model=drafter)`, or use a drafter "
                "without `target_layer_ids`.")
        K = self.drafter.config.num_draft_positions
        if not 1 <= self.num_tokens <= K:
            raise ValueError(f"`num_speculative_tokens` must be in [1, {K}] for the drafter at "
                             f"{self.settings.drafter_path} (it predicts K={K} positions per pass), got "
                             f"{self.num_tokens}.")
        self.num_flow_steps = self.settings.num_flow_steps or self.drafter.generation_config.num_flow_steps
        self.context_size = self.drafter.config.context_size
        capacity = 8 * vllm_config.scheduler_config.max_num_seqs + 16
        self.store = _ContextStore(capacity)
        self._capture: _Capture | None = None
        self._hook = None
        self.stats = {"steps": 0, "drafts": 0, "draft_tokens": 0, "short_context": 0, "lookup_drafts": 0,
                      "seconds": 0.0}
        # Set to a list to record `(committed tokens before the states, context states (<=C, D), chain)` of every
        # draft (tests compare the states with the target's own; `llm.collective_rpc` reaches the proposer).
        self.trace: list | None = None

    # ---------------------------------------------------------------------------------------------- vLLM's hooks
    def load_model(self, target: torch.nn.Module, *args, **kwargs) -> None:
        """Bind the drafter to the target's `lm_head` / embeddings and hook the target's forward."""
        lm_head, embed = _target_weights(target)
        self.drafter.bind_target(_TargetView(self.hf_config, lm_head, embed))
        self._hook = target.register_forward_hook(self._on_target_forward)

    def _on_target_forward(self, module, args, output) -> None:
        hidden = output[0] if isinstance(output, tuple) else output  # (N, D); a tuple carries EAGLE-3 aux states
        if not isinstance(hidden, torch.Tensor):
            self._capture = None
            return
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if not is_forward_context_available():
            self._capture = None
            return
        attn = get_forward_context().attn_metadata
        if attn is None:  # vLLM's profiling / warm-up runs have no batch
            self._capture = None
            return
        qsl, seq = _batch_layout(attn)
        self._capture = _Capture(hidden, qsl, seq)

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray,
                slot_mappings=None, **kwargs) -> list[list[int]]:
        """One chain per request (`[]` for a request that sampled nothing this step: a prompt chunk)."""
        capture, self._capture = self._capture, None
        num_reqs = len(sampled_token_ids)
        if capture is None or capture.query_start_loc.shape[0] < num_reqs + 1 or capture.seq_lens.shape[0] < num_reqs:
            raise RuntimeError(
                "The ChainFlow proposer saw no target forward for this step's batch of "
                f"{num_reqs} request(s) (its forward hook on the target did not fire, or fired without attention "
                "metadata). It needs vLLM's V1 model runner calling the target module it was given in "
                "`load_model`.")
        start = time.perf_counter()
        drafts: list[list[int] | None] = []
        pending: dict[tuple[int, int], list[tuple[int, torch.Tensor, torch.Tensor]]] = {}  # (room, T) -> requests
        for i, sampled in enumerate(sampled_token_ids):
            chain, wanted = self._prepare_one(capture, i, sampled, int(num_tokens_no_spec[i]), token_ids_cpu[i])
            drafts.append(chain)
            if wanted is not None:
                states, tokens, room = wanted
                pending.setdefault((room, states.shape[0]), []).append((i, states, tokens))
        for (room, _), group in pending.items():  # one drafter pass per chain length and context length
            for (i, states, tokens), chain in zip(group, self._draft_batch(group, room)):
                drafts[i] = chain
                self._record(token_ids_cpu[i][:tokens.shape[0] - 1], states, chain)
        self.stats["steps"] += 1
        self.stats["seconds"] += time.perf_counter() - start
        return drafts

    # ---------------------------------------------------------------------------------------------- one request
    def _prepare_one(self, capture: _Capture, i: int, sampled: list[int], committed: int, token_row: np.ndarray
                     ) -> tuple[list[int] | None, tuple[torch.Tensor, torch.Tensor, int] | None]:
        """Store request `i`'s new committed states; return its draft when it needs no drafter pass (`[]`, or a
        prompt-lookup match) or `(None, (context states (T<=C, D), committed tokens (L,), room))`."""
        q0, q1 = int(capture.query_start_loc[i]), int(capture.query_start_loc[i + 1])
        rows = q1 - q0
        start = int(capture.seq_lens[i]) - rows  # position of this step's first row
        if not sampled:  # a prompt chunk: every row is a prompt token; keep them for the next chunk
            valid = min(rows, committed - start)
        else:  # every row but the bonus token's is committed: the rows of positions start .. committed - 2
            valid = committed - 1 - start
        if not 0 <= valid <= rows or (sampled and valid < 1):
            raise RuntimeError(
                f"The ChainFlow proposer could not align request row {i}: the forward had {rows} row(s) from "
                f"position {start}, but the request has {committed} committed token(s) after sampling "
                f"{len(sampled)} (expected 1..{rows} committed rows). vLLM's runner changed how it schedules "
                "speculative steps; this proposer was written for vLLM 0.32's V1 runner.")
        end = start + valid  # states of positions < end are known after this step
        new = capture.hidden[q0:q0 + valid].detach()
        previous = self.store.get(token_row[:start]) if start > 0 else None
        states = new if previous is None else torch.cat([previous, new.to(previous.dtype)], 0)
        states = states[-self.context_size:].clone()  # (<=C, D), detached from vLLM's buffers
        if valid:
            self.store.put(token_row[:end], states)
        if not sampled:
            return [], None
        if states.shape[0] < min(self.context_size, end):
            self.stats["short_context"] += 1
        room = min(self.num_tokens, self.max_model_len - committed)
        if room < 1:
            return [], None
        tokens = torch.from_numpy(np.ascontiguousarray(token_row[:committed], dtype=np.int64)).to(self.device)
        if self.settings.lookup_trust_ngram is not None:
            chain = self._lookup(tokens, room)
            if chain is not None:
                self.stats["lookup_drafts"] += 1
                self._count(chain)
                self._record(token_row[:end], states, chain)
                return chain, None
        return None, (states, tokens, room)

    @torch.no_grad()
    def _draft_batch(self, group: list[tuple[int, torch.Tensor, torch.Tensor]], room: int) -> list[list[int]]:
        """One drafter pass for requests with the same chain length and context length: their context states
        `(B, T, D)` -> predicted states `(B, K, D)` -> one chain of `room` tokens each (`drafting.draft`'s steps,
        batched)."""
        states = torch.stack([g[1] for g in group]).to(self.device)  # (B, T, D)
        p = self.drafter.config.path_order
        tails = torch.stack([committed_tails(g[2][None], p, self.drafter.config.pad_token_id or 0)[0]
                             for g in group])  # (B, p): all the chain search reads of the committed tokens
        settings = SearchSettings(mode="chain", num_tokens=room, max_depth=self.drafter.max_draft_depth)
        # (B, K, D); the bonus token (the tails' last) is read by a drafter with `bonus_embedding`
        predicted = self.drafter.predict_states(states, num_flow_steps=self.num_flow_steps, bonus_tokens=tails[:, -1],
                                                velocity=serving_velocity(self.drafter))  # the experts stacked
        batch = candidate_search(self.drafter, predicted, tails, settings)
        chains = [batch.tree(j).tokens.tolist() for j in range(len(group))]
        for chain in chains:
            self._count(chain)
        return chains

    def _count(self, chain: list[int]) -> None:
        self.stats["drafts"] += 1
        self.stats["draft_tokens"] += len(chain)

    def _record(self, before: np.ndarray, states: torch.Tensor, chain: list[int]) -> None:
        """Trace one draft: the committed tokens the states follow (all but the bonus), the states, the chain."""
        if self.trace is not None:
            self.trace.append((before.copy(), states.float().cpu().numpy(), list(chain)))

    def _lookup(self, tokens: torch.Tensor, room: int) -> list[int] | None:
        """The continuation of the last `lookup_trust_ngram..lookup_ngram` tokens at their latest earlier
        occurrence (prompt lookup, as the shipped generation config's trusted branch), or None."""
        from hf_chainflow.generation.prompt_lookup import prompt_lookup

        found, _ = prompt_lookup(tokens, room, self.settings.lookup_ngram, self.settings.lookup_trust_ngram)
        if found is None or found.numel() == 0:
            return None
        return found.tolist()
