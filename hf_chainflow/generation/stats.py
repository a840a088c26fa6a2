"""Per-call speculative decoding statistics (`drafter.last_stats`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class SpeculativeStats:
    """What one speculative `generate` call did.

    Attributes:
        mode: `"chain"` or `"tree"`; loop: `"transformers"` (assisted decoding) or `"chainflow"` (own loop).
        accepted: accepted draft tokens per verification round (the bonus token not included).
        drafted_depth: draft depth per round (chain length or tree depth).
        draft_time / verify_time: seconds spent drafting / in target verification (+ acceptance, commit).
        prefill_time: seconds of the prompt forward.
        lookup_rounds / lookup_only_rounds: rounds with a prompt-lookup branch / verified on that branch alone.
        longest_lookup: the longest looked-up branch verified (it grows with `lookup_max_tokens`).
        corpus_lookup_rounds: rounds with a corpus-lookup branch (`hf_chainflow.generation.corpus_lookup`).
        batch_size: rows in the call. rows: per-row statistics of a batched call (one `SpeculativeStats` per row,
            in input order; empty for a single unpadded prompt); this object then pools them: `accepted` and
            `drafted_depth` hold every row's rounds, so `tau` is the tokens a row commits per round.
        forwards: target verify forwards of a batched call (one per round for the whole batch).
        speculative: False when the call decoded without drafting (`reason` says why, e.g. a batch above
            `drafter.generation_config.max_speculative_batch_size`).
        compiled_rounds / eager_rounds: verify forwards of hf_chainflow's loop run compiled / eagerly
            (`compile_verification`; `compile_reasons` says why any ran eagerly), and `compile_time` the seconds of
            this call's first forwards at new shapes (compilation).
        auto_budgets: with `tree_budget="auto"`, the budget chosen for each drafted tree (rows of every round).
    """

    mode: str = "chain"
    loop: str = "transformers"
    accepted: list[int] = field(default_factory=list)
    drafted_depth: list[int] = field(default_factory=list)
    draft_time: float = 0.0
    verify_time: float = 0.0
    prefill_time: float = 0.0
    new_tokens: int = 0
    lookup_rounds: int = 0
    lookup_only_rounds: int = 0
    longest_lookup: int = 0
    corpus_lookup_rounds: int = 0
    batch_size: int = 1
    rows: list["SpeculativeStats"] = field(default_factory=list)
    forwards: int = 0
    speculative: bool = True
    reason: str | None = None
    compiled_rounds: int = 0
    eager_rounds: int = 0
    compile_reasons: list[str] = field(default_factory=list)
    compile_time: float = 0.0
    auto_budgets: list[int] = field(default_factory=list)

    @classmethod
    def pooled(cls, rows: list["SpeculativeStats"], forwards: int, **fields) -> "SpeculativeStats":
        """The statistics of a batched call from its rows' (times and `fields` as given)."""
        out = cls(batch_size=len(rows), rows=list(rows), forwards=forwards, **fields)
        for r in rows:
            out.accepted += r.accepted
            out.drafted_depth += r.drafted_depth
            out.new_tokens += r.new_tokens
            out.lookup_rounds += r.lookup_rounds
            out.lookup_only_rounds += r.lookup_only_rounds
            out.longest_lookup = max(out.longest_lookup, r.longest_lookup)
            out.corpus_lookup_rounds += r.corpus_lookup_rounds
            out.auto_budgets += r.auto_budgets
        return out

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    @property
    def tau(self) -> float:
        """Tokens committed per target forward after prefill, bonus included."""
        return (sum(self.accepted) + self.rounds) / self.rounds if self.rounds else 0.0

    def acceptance_per_depth(self) -> list[float]:
        """`acc[d]`: fraction of rounds drafting depth > d whose draft was accepted to depth > d."""
        depth = max(self.drafted_depth, default=0)
        out = []
        for d in range(depth):
            tried = [a for a, n in zip(self.accepted, self.drafted_depth) if n > d]
            out.append(sum(a > d for a in tried) / len(tried) if tried else 0.0)
        return out

    def record_branches(self, branches) -> None:
        """Count a round's looked-up branches (`hf_chainflow.generation.prompt_lookup.RoundBranches`)."""
        if branches.lookup is not None:
            self.lookup_rounds += 1
            self.lookup_only_rounds += int(branches.trusted)
            self.longest_lookup = max(self.longest_lookup, int(branches.lookup.shape[0]))
        self.corpus_lookup_rounds += int(branches.recalled is not None)

    def record_round(self, accepted: int, depth: int) -> None:
        if not 0 <= int(accepted) <= int(depth):
            raise ValueError(f"A round accepts between 0 and its drafted depth; got accepted={accepted}, "
                             f"depth={depth}.")
        self.accepted.append(int(accepted))
        self.drafted_depth.append(int(depth))

    def to_dict(self) -> dict:
        return {
            "mode": self.mode, "loop": self.loop, "rounds": self.rounds, "tau": self.tau,
            "accepted": list(self.accepted), "acceptance_per_depth": self.acceptance_per_depth(),
            "draft_time": self.draft_time, "verify_time": self.verify_time, "prefill_time": self.prefill_time,
            "new_tokens": self.new_tokens, "lookup_rounds": self.lookup_rounds,
            "lookup_only_rounds": self.lookup_only_rounds, "longest_lookup": self.longest_lookup,
            "corpus_lookup_rounds": self.corpus_lookup_rounds,
            "batch_size": self.batch_size, "forwards": self.forwards, "speculative": self.speculative,
            "reason": self.reason, "compiled_rounds": self.compiled_rounds, "eager_rounds": self.eager_rounds,
            "compile_reasons": list(self.compile_reasons), "compile_time": self.compile_time,
            "auto_budgets": list(self.auto_budgets),
            "rows": [r.to_dict() for r in self.rows],
        }


class Timer:
    """`with Timer() as t: ...; t.elapsed`"""

    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.elapsed = time.perf_counter() - self.start
        return False
