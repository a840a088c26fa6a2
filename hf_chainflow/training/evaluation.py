"""Offline acceptance length `tau` of a drafter on cached windows (no target forward needed).

A window anchored at `t` (see `hf_chainflow.training.prepared_data`) holds exactly what the serving loop hands the drafter: the last
`C` target states `h_{..t}` (`context_states`, `context_mask`) and the committed tokens up to the bonus token
`x_{t+1}` (the first `p` entries of `prev_tokens`), plus the target's own next tokens `x*_{t+2..t+K+1}`
(`target_tokens`, `target_mask`).  The drafter drafts `k` tokens; with greedy verification the target accepts the
longest prefix equal to its own tokens and adds one token of its own, so

    tau = 1 + (number of leading draft tokens equal to the target's tokens).

A draft position past the end of the response (`target_mask` false) is never accepted.  Conditional acceptance
`acc@i = P(position i accepted | positions < i accepted)` is counted over the windows whose positions `< i` were
accepted and whose position `i` exists.  Trees (`tree=(W, D)`): the longest root-to-node path matching the true
tokens is accepted.

`tau` above is the mean over *all* anchors.  A serving loop does not visit all anchors: after a round that accepts
`a` tokens the next round starts `a + 1` positions later, so easy stretches are crossed in few rounds and hard ones
in many, and served `tau` (tokens / rounds) is lower than the anchor mean.  The *serving walk* replays that on the
cached responses: start at a response's first anchor, draft, accept, jump `a + 1` anchors, repeat; its
`tau = tokens / rounds` is what the serving loop would measure on these responses (`walk_rounds`,
`evaluate_walk`).

Two paths give the same drafts: the serving call per window (`drafting.draft`, `reference_chain`), and the default
batched path (`draft_batch`, `draft_chains`), which predicts the states of a batch of windows in one drafter pass and
runs the serving search (`hf_chainflow.generation.search.candidate_search`) on all of them at once, for chains and trees.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch.utils.data import DataLoader, Subset
from tqdm.auto import tqdm
from transformers import default_data_collator

from hf_chainflow.checks import check_positive_int
from hf_chainflow.fileio import atomic_path, atomic_write_text
from hf_chainflow.training.windows import check_windows_fit
from hf_chainflow.generation import drafting
from hf_chainflow.generation.search import DraftBatch, candidate_search
from hf_chainflow.generation.serving import serving_velocity
from hf_chainflow.generation.settings import SearchSettings, check_num_flow_steps
from hf_chainflow.training.trainer import unwrap_drafter


@contextmanager
def _eval_mode(module: torch.nn.Module):
    """`module.eval()` for the block; its training flag comes back afterwards, also when the block raises."""
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)


# ----------------------------------------------------------------------------------------------------------------
# Drafting
# ----------------------------------------------------------------------------------------------------------------
def _committed(prev_tokens: torch.Tensor, p: int) -> torch.Tensor:
    """Committed tokens `x_{t+2-p..t+1}` (the last is the bonus token) from a window's `prev_tokens`."""
    return prev_tokens[..., :p]


@torch.no_grad()
def reference_chain(drafter, window: dict, num_tokens: int, num_flow_steps: int | None = None) -> torch.Tensor:
    """The serving call on one window: `drafting.draft(drafter, states, committed, mode="chain")` -> draft tokens
    `(k,)`."""
    return _serving_draft(drafter, window, dict(mode="chain", num_tokens=num_tokens), num_flow_steps).tokens


def _serving_draft(drafter, window: dict, search: dict, num_flow_steps: int | None):
    """`drafting.draft(drafter, **search)` on one window's existing context states and committed tokens -> its
    `DraftTree`."""
    states = window["context_states"][window["context_mask"].bool()][None]  # (1, T<=C, D): only existing states
    committed = _committed(window["prev_tokens"], drafter.config.path_order)[None]  # (1, p)
    return drafting.draft(drafter, states.to(drafter.device), committed.to(drafter.device),
                          num_flow_steps=num_flow_steps, **search)


@torch.no_grad()
def draft_batch(drafter, context_states: torch.Tensor, context_mask: torch.Tensor, committed: torch.Tensor,
                settings: SearchSettings, num_flow_steps: int | None = None) -> DraftBatch:
    """The drafts of a batch of windows: one drafter pass over their context, then the serving search.

    context_states `(B, C, (1 + n) D)` (`n = len(target_layer_ids)`), context_mask `(B, C)`, committed `(B, p)`
    (last = bonus) -> `DraftBatch` `(B, N)`.
    Each window gets the serving call's draft (`drafting.draft`), up to the rounding of batched products: a near-tie
    between two candidates can fall the other way.
    """
    states = drafter.predict_states(context_states, context_mask, num_flow_steps, bonus_tokens=committed[:, -1],
                                    velocity=serving_velocity(drafter))  # (B, K, D), as served
    return candidate_search(drafter, states, committed, settings)


@torch.no_grad()
def draft_chains(drafter, context_states: torch.Tensor, context_mask: torch.Tensor, committed: torch.Tensor,
                 num_tokens: int, num_flow_steps: int | None = None) -> torch.Tensor:
    """Greedy chains of `num_tokens` for a batch of windows (`draft_batch`) -> tokens `(B, k)`."""
    settings = SearchSettings(mode="chain", num_tokens=num_tokens, max_depth=drafter.max_draft_depth)
    return draft_batch(drafter, context_states, context_mask, committed, settings, num_flow_steps).tokens


# ----------------------------------------------------------------------------------------------------------------
# Acceptance accounting
# ----------------------------------------------------------------------------------------------------------------
def accepted_lengths(drafts: torch.Tensor, target_tokens: torch.Tensor, target_mask: torch.Tensor) -> torch.Tensor:
    """Leading draft tokens equal to the target's: drafts `(B, k)`, target tokens/mask `(B, >=k)` -> `(B,)`."""
    k = drafts.shape[1]
    match = (drafts == target_tokens[:, :k]) & target_mask[:, :k].bool()  # (B, k)
    return match.long().cumprod(1).sum(1)


def tree_matching_path(tree, target_tokens: torch.Tensor, target_mask: torch.Tensor) -> list[int]:
    """Node indices, root side first, of the longest root-to-node path of `tree` (a `DraftTree`) whose tokens
    equal the target's."""
    node, path = -1, []
    for d in range(tree.max_depth):
        if d >= target_tokens.shape[0] or not bool(target_mask[d]):
            break
        hit = ((tree.parents == node) & (tree.tokens == target_tokens[d])).nonzero()
        if hit.numel() == 0:
            break
        node = int(hit[0, 0])
        path.append(node)
    return path


def tree_accepted_length(tree, target_tokens: torch.Tensor, target_mask: torch.Tensor) -> int:
    """Depth of the longest root-to-node path of `tree` (a `DraftTree`) whose tokens equal the target's."""
    return len(tree_matching_path(tree, target_tokens, target_mask))


def tree_accepted_lengths(drafts: DraftBatch, target_tokens: torch.Tensor, target_mask: torch.Tensor) -> torch.Tensor:
    """`tree_accepted_length` for a batch: drafts `(B, N)` (chains or trees), target tokens/mask `(B, T)` -> `(B,)`."""
    B = drafts.tokens.shape[0]
    node = torch.full((B,), -1, dtype=torch.long, device=drafts.tokens.device)  # (B,) last matched node, -1 = root
    alive = torch.ones(B, dtype=torch.bool, device=node.device)
    accepted = torch.zeros(B, dtype=torch.long, device=node.device)
    for d in range(min(int(drafts.depths.max()) if drafts.depths.numel() else 0, target_tokens.shape[1])):
        hit = (drafts.parents == node[:, None]) & (drafts.tokens == target_tokens[:, d, None])  # (B, N)
        alive = alive & target_mask[:, d].bool() & hit.any(1)
        node = torch.where(alive, hit.long().argmax(1), node)  # the first matching child, as `tree_matching_path`
        accepted += alive.long()
    return accepted


def summarize(accepted: np.ndarray, valid: np.ndarray, num_tokens: int) -> dict:
    """`tau` and conditional acceptance from accepted lengths `(n,)` and position validity `(n, k)`."""
    n = len(accepted)
    reached = [int(((accepted >= i - 1) & valid[:, i - 1]).sum()) for i in range(1, num_tokens + 1)]
    passed = [int((accepted >= i).sum()) for i in range(1, num_tokens + 1)]
    return {
        "num_windows": n,
        "tau": float(1 + accepted.mean()) if n else float("nan"),
        "acceptance": [p / r if r else float("nan") for p, r in zip(passed, reached)],  # acc@1..k
        "accepted_counts": passed,
        "reached_counts": reached,
    }


# ----------------------------------------------------------------------------------------------------------------
# The evaluation
# ----------------------------------------------------------------------------------------------------------------
def _subset(dataset, max_windows: int | None, seed: int):
    if max_windows is None or max_windows >= len(dataset):
        return dataset
    check_positive_int("max_windows", max_windows, optional=True)
    keep = np.sort(np.random.default_rng(seed).choice(len(dataset), size=max_windows, replace=False))
    return Subset(dataset, keep.tolist())


def _domain_names(dataset) -> list[str] | None:
    base = dataset.dataset if isinstance(dataset, Subset) else dataset
    return getattr(base, "domains", None)


@torch.no_grad()
def evaluate_offline(drafter, dataset, *, num_tokens: int = 3, batch_size: int = 64, max_windows: int | None = None,
                     tree: tuple[int, int] | None = None, tree_budget: int | None = None,
                     max_tree_windows: int | None = 512, num_flow_steps: int | None = None, batched: bool = True,
                     walk_sequences: int | None = None, output_dir: str | os.PathLike | None = None,
                     seed: int = 0, progress: bool = True) -> dict:
    """Offline `tau` of `drafter` (bound to its target) on the windows of `dataset`.

    Args:
        drafter: a bound `ChainFlowDrafter` (or a peft model around one).
        dataset: window dicts (`hf_chainflow.training.windows.ChainFlowWindowDataset` or any sequence of them); an optional
            `domain` index names a domain of `dataset.domains`.
        num_tokens: chain length `k` (the serving `num_assistant_tokens`).
        max_windows: evaluate a seeded random subset of this many windows.
        tree: `(width, depth)` to also measure tree drafting (on at most `max_tree_windows` of the windows).
        tree_budget: keep that many nodes of each tree (highest path probability; `None`: all).
        batched: draft batches of windows (`draft_batch`, fast) rather than one `drafting.draft` call per window (the
            serving call).
        walk_sequences: also replay the serving walk (`evaluate_walk`) on this many responses of `dataset` (seeded;
            all of them if it has fewer): the `tau` a serving loop would measure on them. Needs every anchor of
            those responses, so `dataset` must record `seq_of` and `anchor` (a `ChainFlowWindowDataset`).
        output_dir: where to write `offline_eval.json` and `acceptance.png`.

    Returns a dict: `tau`, `acceptance` (acc@1..k), counts, `per_domain` (the same per domain name), `tree` (if
    asked), `walk` (if asked), `settings`.
    """
    model = drafter
    drafter = unwrap_drafter(model)
    drafter._require_bound()
    check_windows_fit(drafter.config, dataset)
    searches = _search_settings(drafter, num_tokens, tree, tree_budget)
    check_num_flow_steps(num_flow_steps)
    check_positive_int("batch_size", batch_size)
    if output_dir is not None and Path(output_dir).exists() and not Path(output_dir).is_dir():
        raise ValueError(f"`output_dir` {str(output_dir)!r} is a file; give a folder for offline_eval.json.")
    if walk_sequences is not None:  # fail now, before any drafting, on a count or a dataset the walk cannot use
        _check_max_sequences(walk_sequences, "walk_sequences")
        sequence_walks(dataset)
    data = _subset(dataset, max_windows, seed)
    names = _domain_names(dataset)
    if len(data) == 0:
        raise ValueError("`dataset` holds no windows to evaluate.")

    def label(d: int) -> str:
        return "all" if d < 0 else names[d] if names is not None and d < len(names) else str(d)

    steps = drafter.config.num_flow_steps if num_flow_steps is None else num_flow_steps
    result = {"settings": {"num_tokens": num_tokens, "num_flow_steps": steps,
                           "max_windows": max_windows, "batched": batched, "walk_sequences": walk_sequences,
                           "seed": seed}}
    run = dict(batched=batched, batch_size=batch_size, num_flow_steps=num_flow_steps, label=label, progress=progress)
    with _eval_mode(model):
        result.update(_evaluate_mode(drafter, data, searches["chain"], desc="offline tau", **run))
        if tree is not None:
            result["tree"] = {"shape": list(tree), "budget": tree_budget, **_evaluate_mode(
                drafter, _subset(data, max_tree_windows, seed), searches["tree"],
                desc=f"offline tau (tree {tree[0]}x{tree[1]})", **run)}
        if walk_sequences is not None:
            result["walk"] = _walk(drafter, dataset, searches, max_sequences=walk_sequences,
                                   num_flow_steps=num_flow_steps, seed=seed, label=label, progress=progress)
    if output_dir is not None:
        write_report(result, output_dir)
    return result


def _search_settings(drafter, num_tokens: int, tree, tree_budget) -> dict[str, SearchSettings]:
    """The chain (and, with `tree`, tree) search of an evaluation, checked once."""
    K = drafter.max_draft_depth
    out = {"chain": SearchSettings(mode="chain", num_tokens=num_tokens, max_depth=K)}
    if tree is not None:
        width, depth = _check_tree(tree)
        out["tree"] = SearchSettings(mode="tree", tree_width=width, tree_depth=depth, tree_budget=tree_budget,
                                     max_depth=K)
    return out


def _window_length(drafter, w: dict, settings: SearchSettings, num_flow_steps: int | None) -> tuple[int, int]:
    """The serving call (`drafting.draft`) on one window -> (accepted length, the draft's depth)."""
    if settings.mode == "chain":
        drafts = reference_chain(drafter, w, settings.num_tokens, num_flow_steps).cpu()[None]  # (1, k)
        return int(accepted_lengths(drafts, w["target_tokens"][None], w["target_mask"][None])[0]), drafts.shape[1]
    tree = _serving_draft(drafter, w, settings.draft_kwargs(), num_flow_steps)
    return tree_accepted_length(tree, w["target_tokens"].to(tree.tokens.device), w["target_mask"]), tree.max_depth


def _evaluate_mode(drafter, data, settings: SearchSettings, *, batched: bool, batch_size: int,
                   num_flow_steps: int | None, label, progress: bool, desc: str) -> dict:
    """Accepted lengths of `settings`' drafts on every window of `data` (`draft_batch` per batch, or the serving
    call per window), summarised overall and per domain."""
    p, device, depth = drafter.config.path_order, drafter.device, settings.depth
    accepted, valid, domains = [], [], []
    loader = DataLoader(data, batch_size=batch_size if batched else 1, collate_fn=default_data_collator)
    for batch in tqdm(loader, desc=desc, disable=not progress, unit="batch"):
        if batched:
            drafts = draft_batch(drafter, batch["context_states"].to(device), batch["context_mask"].to(device),
                                 _committed(batch["prev_tokens"], p).to(device), settings, num_flow_steps)
            lengths = tree_accepted_lengths(drafts, batch["target_tokens"].to(device),
                                            batch["target_mask"].to(device)).cpu()
        else:
            lengths = torch.tensor([_window_length(drafter, {k: v[0] for k, v in batch.items()}, settings,
                                                   num_flow_steps)[0]])
        accepted.append(lengths)
        valid.append(batch["target_mask"][:, :depth].bool())
        domains.append(batch["domain"] if "domain" in batch else torch.full((lengths.shape[0],), -1))
    accepted, valid, domains = torch.cat(accepted).numpy(), torch.cat(valid).numpy(), torch.cat(domains).numpy()
    return {**summarize(accepted, valid, depth),
            "per_domain": {label(d): summarize(accepted[domains == d], valid[domains == d], depth)
                           for d in sorted(set(domains.tolist()))}}


# ----------------------------------------------------------------------------------------------------------------
# The serving walk
# ----------------------------------------------------------------------------------------------------------------
def walk_rounds(accepted_at: Callable[[int], int], num_anchors: int) -> list[int]:
    """Accepted lengths of the rounds a serving loop runs over one response of `num_anchors` consecutive anchors.

    The first round drafts at anchor 0; a round at anchor `i` that accepts `a` draft tokens commits `a + 1` tokens
    (the bonus included), so the next round drafts at anchor `i + a + 1`.  `accepted_at(i)` is called only for the
    anchors visited.
    """
    out, i = [], 0
    while i < num_anchors:
        a = int(accepted_at(i))
        if a < 0:
            raise ValueError(f"`accepted_at({i})` returned {a}; an accepted length is at least 0.")
        out.append(a)
        i += a + 1
    return out


def sequence_walks(dataset) -> list[np.ndarray]:
    """Per response of `dataset`, the indices of its windows in anchor order (every anchor must be present)."""
    seq_of, anchor = getattr(dataset, "seq_of", None), getattr(dataset, "anchor", None)
    if seq_of is None or anchor is None:
        raise ValueError("The serving walk needs a dataset that records each window's response and anchor (`seq_of`, "
                         f"`anchor`, as `ChainFlowWindowDataset` does); got a {type(dataset).__name__}.")
    seq_of, anchor = np.asarray(seq_of), np.asarray(anchor)
    order = np.lexsort((anchor, seq_of))  # by response, then anchor
    walks = np.split(order, np.flatnonzero(np.diff(seq_of[order])) + 1) if len(order) else []
    sequences = getattr(dataset, "sequences", None)  # `ChainFlowWindowDataset`: each response's full anchor span
    for idx in walks:
        first, last = int(anchor[idx[0]]), int(anchor[idx[-1]])
        span = (first, last)
        if sequences is not None:  # anchors run from the last prompt position to the third-to-last token
            seq = sequences[int(seq_of[idx[0]])]
            span = (seq["response_start"] - 1, seq["length"] - 3)
        if np.any(np.diff(anchor[idx]) != 1) or (first, last) != span:
            raise ValueError(f"Response {int(seq_of[idx[0]])} of the dataset lacks some anchors (it has {len(idx)} "
                             f"between {first} and {last}, of {span[0]}..{span[1]}); the serving walk needs every "
                             "anchor: build the dataset without `max_windows`.")
    return walks


def _walk_summary(rounds: list[int], drafted: list[int], domains: list[str], depth: int,
                  per_sequence: dict | None = None) -> dict:
    """tokens / rounds; per depth `d`, the share of rounds drafting deeper than `d - 1` that accepted at least `d`
    tokens (the bench's `acceptance_per_depth`, `hf_chainflow.generation.stats`); `per_sequence` (response ids, their rounds
    and tokens) is stored as given, for paired comparisons (`paired_walk_difference`)."""
    a, n = np.asarray(rounds), np.asarray(drafted)
    out = {"tau": float((a + 1).sum() / len(a)), "rounds": len(a), "tokens": int((a + 1).sum()),
           "acceptance_per_depth": [float((a[n >= d] >= d).mean()) if (n >= d).any() else 0.0
                                    for d in range(1, depth + 1)]}
    names = np.asarray(domains)
    out["per_domain"] = {name: {"tau": float((a[names == name] + 1).mean()), "rounds": int((names == name).sum())}
                         for name in sorted(set(domains))}
    if per_sequence is not None:
        out["per_sequence"] = per_sequence
    return out


def _check_tree(tree) -> tuple[int, int]:
    """`tree` as a `(width, depth)` pair (their values are checked with the drafting arguments), or a `ValueError`."""
    if not isinstance(tree, (tuple, list)) or len(tree) != 2:
        raise ValueError(f"`tree` must be (width, depth), two positive integers such as (8, 4), got {tree!r}.")
    return tree[0], tree[1]


def _check_max_sequences(value, name: str) -> None:
    check_positive_int(name, value, optional=True, meaning="a number of responses")


@torch.no_grad()
def evaluate_walk(drafter, dataset, *, num_tokens: int = 3, tree: tuple[int, int] | None = None,
                  tree_budget: int | None = None, max_sequences: int | None = None, num_flow_steps: int | None = None,
                  seed: int = 0, label: Callable[[int], str] | None = None, progress: bool = True) -> dict:
    """Served `tau` replayed on cached responses: chain (and tree) drafting along each response's serving walk.

    Every round is the serving call (`drafting.draft`) on the window at the walk's anchor.  `max_sequences` walks a
    seeded random subset of the responses; `label` names a window's `domain` index (default: the dataset's
    `domains`).  Returns `num_sequences` and, per mode (`chain`, `tree`), `tau` (tokens / rounds), `rounds`,
    `tokens`, `acceptance_per_depth` (as the bench counts it), `per_domain` and `per_sequence` (`seq`: the
    responses' indices in `dataset.sequences`, `rounds`, `tokens`: one entry each, in walk order).
    """
    drafter = unwrap_drafter(drafter)
    drafter._require_bound()
    check_windows_fit(drafter.config, dataset)
    searches = _search_settings(drafter, num_tokens, tree, tree_budget)
    check_num_flow_steps(num_flow_steps)
    _check_max_sequences(max_sequences, "max_sequences")
    if label is None:
        names = _domain_names(dataset)
        label = (lambda d: names[d]) if names is not None else str
    with _eval_mode(drafter):
        return _walk(drafter, dataset, searches, max_sequences=max_sequences, num_flow_steps=num_flow_steps,
                     seed=seed, label=label, progress=progress)


def _walk(drafter, dataset, searches: dict[str, SearchSettings], *, max_sequences, num_flow_steps, seed, label,
          progress) -> dict:
    """`evaluate_walk` with its settings checked: the serving walk of every search in `searches` (by mode)."""
    walks, seq_of = sequence_walks(dataset), np.asarray(dataset.seq_of)
    if max_sequences is not None and max_sequences < len(walks):
        walks = [walks[i] for i in walk_subset(len(walks), max_sequences, seed)]
    result = {"num_sequences": len(walks)}
    for mode, settings in searches.items():
        rounds, drafted, domains = [], [], []
        per_sequence = {"seq": [], "rounds": [], "tokens": []}
        for idx in tqdm(walks, desc=f"serving walk ({mode})", disable=not progress, unit="response"):
            def accepted_at(i: int, idx=idx, settings=settings) -> int:
                a, d = _window_length(drafter, dataset[int(idx[i])], settings, num_flow_steps)
                drafted.append(d)
                return a

            visited = walk_rounds(accepted_at, len(idx))
            first = dataset[int(idx[0])]
            rounds += visited
            domains += [label(int(first["domain"])) if "domain" in first else "all"] * len(visited)
            per_sequence["seq"].append(int(seq_of[idx[0]]))
            per_sequence["rounds"].append(len(visited))
            per_sequence["tokens"].append(sum(visited) + len(visited))
        result[mode] = _walk_summary(rounds, drafted, domains, settings.depth, per_sequence)
    return result


def walk_subset(num_sequences: int, size: int, seed: int) -> np.ndarray:
    """The responses (sorted indices) a walk over `size` of `num_sequences` responses visits, for `seed`."""
    return np.sort(np.random.default_rng(seed).choice(num_sequences, size=size, replace=False))


def resampled_walk_taus(walks: list[dict], *, num_resamples: int = 10000, size: int | None = None,
                        seed: int = 0) -> np.ndarray:
    """`tau` (tokens / rounds, pooled) of each walk over `num_resamples` draws of `size` responses (default: as many
    as were walked) with replacement, the same draw for every walk: `(R, len(walks))`.

    `walks` are one mode of `evaluate_walk` results (e.g. `result["walk"]["tree"]`) over the same responses.
    """
    for name, walk in enumerate(walks):
        if not isinstance(walk, dict) or "per_sequence" not in walk:
            raise ValueError(f"walk {name} must be one mode of an `evaluate_walk` result with its `per_sequence` "
                             "record (written since this function exists: re-run `eval-offline --walk-sequences`); "
                             f"got {type(walk).__name__} with keys {sorted(walk) if isinstance(walk, dict) else None}.")
    seqs = [walk["per_sequence"]["seq"] for walk in walks]
    if any(seq != seqs[0] for seq in seqs):
        raise ValueError(f"The walks covered different responses ({', '.join(str(len(s)) for s in seqs)}, not the "
                         "same ids in the same order); a paired comparison needs the same held-out data, shards and "
                         "`walk_sequences` for all.")
    check_positive_int("num_resamples", num_resamples)
    check_positive_int("size", size, optional=True, meaning="responses per draw")
    n = len(seqs[0])
    draws = np.random.default_rng(seed).integers(0, n, size=(num_resamples, size or n))  # (R, S)
    taus = []
    for walk in walks:
        rounds, tokens = (np.asarray(walk["per_sequence"][k], dtype=np.float64) for k in ("rounds", "tokens"))  # (N,)
        taus.append(tokens[draws].sum(1) / rounds[draws].sum(1))  # (R,)
    return np.stack(taus, 1)  # (R, len(walks))


def walk_tau(walk: dict) -> float:
    """Pooled `tau` of one walk mode from its `per_sequence` record."""
    return float(sum(walk["per_sequence"]["tokens"]) / sum(walk["per_sequence"]["rounds"]))


def paired_walk_difference(a: dict, b: dict, *, num_resamples: int = 10000, seed: int = 0) -> dict:
    """How far walk `b`'s `tau` is from walk `a`'s, with its sampling noise over the responses walked.

    `a` and `b` are one mode of two `evaluate_walk` results (e.g. `result["walk"]["tree"]`) over the same responses.
    `tau` is tokens / rounds pooled over the responses, so the responses are resampled with replacement (the same
    draw for both walks: a paired bootstrap) and each draw's difference `tau_b - tau_a` recomputed.  Returns `tau_a`,
    `tau_b`, `difference`, `ci95` (the 2.5 and 97.5 percentiles of the resampled differences), `p_not_above`
    (the share of draws where `b` is not above `a`), `num_sequences` and `num_resamples`.
    """
    taus = resampled_walk_taus([a, b], num_resamples=num_resamples, seed=seed)  # (R, 2)
    diffs = taus[:, 1] - taus[:, 0]  # (R,)
    tau_a, tau_b = walk_tau(a), walk_tau(b)
    return {"tau_a": tau_a, "tau_b": tau_b, "difference": tau_b - tau_a,
            "ci95": [float(np.percentile(diffs, 2.5)), float(np.percentile(diffs, 97.5))],
            "p_not_above": float((diffs <= 0).mean()), "num_sequences": len(a["per_sequence"]["seq"]),
            "num_resamples": num_resamples}


def strict_json(obj, **kwargs) -> str:
    """`json.dumps` for reports: a non-finite float (a position no window reached has no acceptance) is written as
    `null`, so the file is strict JSON (JavaScript, `json.loads(..., parse_constant=...)` refuse `NaN`)."""
    def clean(x):
        if isinstance(x, float) and not np.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    return json.dumps(clean(obj), allow_nan=False, **kwargs)


def write_report(result: dict, output_dir: str | os.PathLike) -> tuple[Path, Path]:
    """Write `offline_eval.json` and `acceptance.png` (conditional acceptance per position, per domain)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out / "offline_eval.json", out / "acceptance.png"
    atomic_write_text(json_path, strict_json(result, indent=1))  # a kill leaves the old file or the new
    k = len(result["acceptance"])
    fig, ax = plt.subplots(figsize=(6, 4))
    positions = np.arange(1, k + 1)
    for name, stats in result["per_domain"].items():
        ax.plot(positions, stats["acceptance"], marker="o", alpha=0.6, label=f"{name} (tau {stats['tau']:.2f})")
    ax.plot(positions, result["acceptance"], marker="s", color="black", linewidth=2.5,
            label=f"all (tau {result['tau']:.2f})")
    ax.set_xlabel("draft position i")
    ax.set_ylabel("acc@i = P(i accepted | < i accepted)")
    ax.set_xticks(positions)
    ax.set_ylim(0, 1)
    ax.set_title(f"Offline acceptance, chain k={k}, {result['num_windows']} windows")
    ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(png_path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
    return json_path, png_path


__all__ = ["accepted_lengths", "draft_batch", "draft_chains", "evaluate_offline", "evaluate_walk",
           "paired_walk_difference", "reference_chain", "resampled_walk_taus", "sequence_walks", "summarize",
           "tree_accepted_length", "tree_accepted_lengths", "tree_matching_path", "walk_rounds", "walk_subset",
           "walk_tau", "write_report"]
