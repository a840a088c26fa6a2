"""Shared helpers of the verification and hybrid tests: a fixed branching draft tree, a prefilled cache, a plain
causal forward."""

import torch
from transformers import DynamicCache

from hf_chainflow.generation.tree import DraftTree

PREFIX_LEN = 9
# 12 nodes, depth 5; several branchings (root has 2 children, node 0 has 2, node 2 has 2, node 5 has 2)
TREE_PARENTS = [-1, -1, 0, 0, 1, 2, 2, 3, 5, 5, 8, 4]


def make_tree(parents=TREE_PARENTS, seed=1, vocab=256) -> DraftTree:
    depths = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, vocab, (len(parents),), generator=gen)
    return DraftTree(tokens=tokens, parents=torch.tensor(parents), depths=torch.tensor(depths),
                     logprobs=torch.zeros(len(parents)))


def prefilled(model, length=PREFIX_LEN, seed=0) -> DynamicCache:
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, model.config.vocab_size, (1, length), generator=gen)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=prefix, cache=cache, use_cache=True)
    return cache


@torch.no_grad()
def plain(model, cache, tokens):
    """Plain causal forward of `tokens` on `cache` (mutated); logits `(T, V)`."""
    return model(input_ids=torch.tensor([tokens]), cache=cache, use_cache=True).logits[0]
