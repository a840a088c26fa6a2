"""The draft tree: what the drafter proposes in one round and the target verifies in one forward.

A chain is the tree whose every node has the previous one as parent.  Nodes are stored flattened in
breadth-first (hence topological) order; the *root* is the last committed token (the target's own "bonus"
token, not yet in the target's cache) and is not a node of the tree: a node whose parent is ``-1`` hangs
directly under the root.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_chainflow.checks import check_positive_int


@dataclass
class DraftTree:
    """One round's draft (batch size 1).

    Attributes:
        tokens (`torch.LongTensor` of shape `(N,)`): draft token id of each node.
        parents (`torch.LongTensor` of shape `(N,)`): index of each node's parent node, `-1` for the root.
            Always `parents[i] < i`.
        depths (`torch.LongTensor` of shape `(N,)`): depth of each node, `1` for children of the root.
        logprobs (`torch.FloatTensor` of shape `(N,)`): drafter log-probability of each node's token given
            its root-to-parent path.
        draft_probs (`torch.FloatTensor` of shape `(N, V)`, *optional*): the full draft distribution `q` each
            node's token was drawn from (chains in sampling mode; zero outside the candidate set).
    """

    tokens: torch.LongTensor
    parents: torch.LongTensor
    depths: torch.LongTensor
    logprobs: torch.FloatTensor
    draft_probs: torch.FloatTensor | None = None

    def __post_init__(self):
        fields = {"tokens": self.tokens, "parents": self.parents, "depths": self.depths, "logprobs": self.logprobs}
        shapes = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__ for k, v in fields.items()}
        n = shapes["tokens"][0] if isinstance(self.tokens, torch.Tensor) and self.tokens.dim() == 1 else None
        if n is None or any(s != (n,) for s in shapes.values()):
            raise ValueError(f"`DraftTree` fields must be 1-D tensors of one length N (one entry per node), got "
                             f"shapes {shapes}; for a batch of one pass `tokens[0]`.")
        for name in ("tokens", "parents", "depths"):
            if getattr(self, name).is_floating_point():
                raise ValueError(f"`DraftTree.{name}` must hold integers, got {getattr(self, name).dtype}.")
        if self.draft_probs is not None and (self.draft_probs.dim() != 2 or self.draft_probs.shape[0] != n):
            raise ValueError(f"`DraftTree.draft_probs` must have shape (N={n}, V), got {tuple(self.draft_probs.shape)}.")

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def max_depth(self) -> int:
        return int(self.depths.max()) if self.num_nodes else 0

    @property
    def is_chain(self) -> bool:
        expected = torch.arange(-1, self.num_nodes - 1, device=self.parents.device)
        return bool(torch.equal(self.parents, expected))

    @classmethod
    def empty(cls, device=None) -> "DraftTree":
        """A draft of no nodes (a round with no room left to draft)."""
        none = torch.zeros(0, dtype=torch.long, device=device)
        return cls(tokens=none, parents=none.clone(), depths=none.clone(), logprobs=torch.zeros(0, device=device))

    @classmethod
    def chain(cls, tokens: torch.LongTensor, logprobs: torch.FloatTensor | None = None,
              draft_probs: torch.FloatTensor | None = None) -> "DraftTree":
        n = int(tokens.shape[0])
        device = tokens.device
        if logprobs is None:
            logprobs = torch.zeros(n, device=device)
        return cls(
            tokens=tokens,
            parents=torch.arange(-1, n - 1, device=device),
            depths=torch.arange(1, n + 1, device=device),
            logprobs=logprobs,
            draft_probs=draft_probs,
        )

    def cumulative_logprobs(self) -> torch.FloatTensor:
        """`(N,)` drafter log-probability of each node's whole root-to-node path."""
        cum = self.logprobs.tolist()
        for i, parent in enumerate(self.parents.tolist()):  # breadth-first: a parent is final before its children
            if parent >= 0:
                cum[i] += cum[parent]
        return torch.tensor(cum, dtype=self.logprobs.dtype, device=self.logprobs.device)

    def take(self, index: torch.LongTensor) -> "DraftTree":
        """The nodes `index` `(m,)` (every kept node's parent kept, parents listed first), parents renumbered."""
        return DraftTree(tokens=self.tokens[index], parents=take_parents(self.parents[None], index[None])[0],
                         depths=self.depths[index], logprobs=self.logprobs[index],
                         draft_probs=None if self.draft_probs is None else self.draft_probs[index])

    def top_nodes(self, budget: int) -> "DraftTree":
        """The subtree of the `budget` nodes with the highest path log-probability (EAGLE-2-style reranking).

        Ranks by `cumulative_logprobs()`, ties by breadth-first index (`keep_most_probable`): a parent's path
        probability is at least its child's and its index is lower, so every kept node's ancestors are kept. Order
        stays breadth-first.
        """
        check_positive_int("budget", budget)
        if budget >= self.num_nodes:
            return self
        return self.take(keep_most_probable(self.cumulative_logprobs()[None], budget)[0])

    def with_chain(self, tokens: torch.LongTensor) -> "DraftTree":
        """This tree plus the root-to-leaf branch `tokens` `(k,)`: follows existing nodes while they match, then
        adds new ones (log-probability 0: the drafter did not score them). Greedy trees only; order stays
        breadth-first."""
        if self.draft_probs is not None:
            raise ValueError("`with_chain` adds unscored nodes; it is for greedy trees (no `draft_probs`).")
        toks, parents, depths = self.tokens.tolist(), self.parents.tolist(), self.depths.tolist()
        child = {(p, t): i for i, (p, t) in enumerate(zip(parents, toks))}
        node, added = -1, 0
        for d, t in enumerate(tokens.tolist()):
            if (node, t) not in child:
                child[(node, t)] = len(toks)
                toks.append(t), parents.append(node), depths.append(d + 1)
                added += 1
            node = child[(node, t)]
        if not added:
            return self
        device = self.tokens.device
        grown = DraftTree(tokens=torch.tensor(toks, device=device), parents=torch.tensor(parents, device=device),
                          depths=torch.tensor(depths, device=device),
                          logprobs=torch.cat([self.logprobs, self.logprobs.new_zeros(added)]))
        return grown.take(torch.sort(grown.depths, stable=True).indices)  # breadth-first again

    def ancestor_matrix(self) -> torch.BoolTensor:
        """`(N, N)` bool: `anc[i, j]` is True when node `j` is node `i` or one of its ancestors."""
        n = self.num_nodes
        anc = torch.eye(n, dtype=torch.bool, device=self.tokens.device)
        parents = self.parents.tolist()
        for i in range(n):
            p = parents[i]
            if p >= 0:
                anc[i] |= anc[p]
        return anc

    def path_to(self, node: int) -> list[int]:
        """Node indices from the first level down to `node` (inclusive)."""
        path = []
        parents = self.parents.tolist()
        while node >= 0:
            path.append(node)
            node = parents[node]
        return path[::-1]


def keep_most_probable(cumulative: torch.Tensor, budget: int) -> torch.LongTensor:
    """Per row of `cumulative` `(B, N)` (path log-probabilities, breadth-first), the indices `(B, budget)` of the
    `budget` highest, ties broken by the lower index, in breadth-first order."""
    order = torch.sort(cumulative, dim=-1, descending=True, stable=True).indices  # (B, N)
    return order[:, :budget].sort(dim=-1).values


def take_parents(parents: torch.LongTensor, index: torch.LongTensor) -> torch.LongTensor:
    """The parents `(B, m)` of the nodes `index` `(B, m)` of trees with parents `(B, N)`, renumbered into the kept
    nodes (every kept node's parent is kept; `-1`, the root, stays)."""
    B, m = index.shape
    remap = torch.full_like(parents, -1).scatter_(1, index, torch.arange(m, device=index.device).expand(B, m))
    kept = parents.gather(1, index)  # (B, m)
    return torch.where(kept >= 0, remap.gather(1, kept.clamp(min=0)), kept)
