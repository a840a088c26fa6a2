"""Targets and test doubles for tests, examples and benchmarks.

- `tiny_target(family)`: tiny random Llama / Qwen3 / Qwen3.5-hybrid causal LMs built in-process (no download).
- `OracleDrafter(target, error_rate)`: a drafter that drafts the target's own greedy continuation, corrupted at a
  given rate (high acceptance: long accepted paths get exercised).

Importing this module changes nothing else: `tiny_target` is a plain transformers model. The `generate` hook
(`hf_chainflow.generation.hook.install`) is installed when an `OracleDrafter` is made, the first thing that needs it
(as a `ChainFlowDrafter` installs it when its module is imported).
"""

from __future__ import annotations

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
)

TINY_FAMILIES = ("llama", "qwen3", "qwen3_5")


def tiny_target(family: str = "llama", *, vocab_size: int = 256, hidden_size: int = 64, num_layers: int = 4,
                seed: int = 0, attn_implementation: str = "sdpa") -> PreTrainedModel:
    """A tiny random causal LM of the given family, in float32 eval mode.

    `family` is one of `"llama"`, `"qwen3"`, `"qwen3_5"` (a hybrid stack whose `layer_types` mix
    `linear_attention` (Gated DeltaNet) and `full_attention`).
    """
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    if family == "llama":
        config = LlamaConfig(**common)
        cls = LlamaForCausalLM
    elif family == "qwen3":
        config = Qwen3Config(**common)
        cls = Qwen3ForCausalLM
    elif family == "qwen3_5":
        layer_types = ["linear_attention" if (i % 2 == 0) else "full_attention" for i in range(num_layers)]
        config = Qwen3_5TextConfig(
            **common,
            layer_types=layer_types,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
        )
        cls = Qwen3_5ForCausalLM
    else:
        raise ValueError(f"`family` must be one of {TINY_FAMILIES}, got {family!r}.")
    config._attn_implementation = attn_implementation
    model = cls(config)
    # Random init gives near-uniform logits; scale the head up so greedy decoding has clear winners and
    # realistic (peaked) distributions, as a trained model would.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.eval()


class OracleDrafter:
    """A test double usable wherever a ChainFlow drafter is: it proposes the target's own greedy continuation
    (computed by running the target ahead) with a fraction `error_rate` of tokens corrupted.

    - chain mode: the continuation, each token replaced by a random other token with probability `error_rate`;
      with `do_sample=True` each token is drawn from `q = (1 - error_rate) * onehot(greedy) + error_rate * uniform`
      and `q` is reported in `DraftTree.draft_probs` (so rejection sampling stays exact);
    - tree mode: the (corrupted) true path hidden among random siblings, nodes shuffled within each level.

    `draft` ignores the hidden states: it only needs the committed tokens. Running ahead `n` tokens from a prefix, it
    runs `2n + 1` and remembers the continuation for the prefix and for each prefix along it (the target's own greedy
    path, which a greedy call commits), up to `MEMO_SIZE` prefixes, forgotten when the target's weights change: the
    next rounds of a greedy call, and the thousands of calls of a sampling test over a few prompts, do not each run the
    target ahead again.
    """

    is_chainflow_drafter = True
    context_size = 1
    max_draft_depth = 64
    MEMO_SIZE = 4096

    def __init__(self, target: PreTrainedModel, error_rate: float = 0.0, seed: int = 0):
        if not 0.0 <= error_rate <= 1.0:
            raise ValueError(f"`error_rate` must lie in [0, 1], got {error_rate!r}.")
        from transformers import GenerationConfig

        from hf_chainflow.generation import hook

        hook.install()  # `target.generate(..., assistant_model=oracle)` routes to hf_chainflow (idempotent)

        self.target = target
        self.config = target.config
        self.error_rate = float(error_rate)
        self.vocab_size = target.config.get_text_config().vocab_size
        self.generator = torch.Generator().manual_seed(seed)
        self.generation_config = GenerationConfig(num_assistant_tokens=3, num_assistant_tokens_schedule="constant",
                                                  draft_mode="chain", tree_width=8, tree_depth=4,
                                                  tree_budget=None)
        self.last_stats = None
        self._memo: dict[tuple[int, ...], list[int]] = {}  # committed prefix -> its greedy continuation so far
        self._memo_weights = None

    def check_target(self, target) -> None:
        if target is not self.target:
            raise ValueError("This OracleDrafter runs ahead with another target than the one generating.")

    def _rand(self) -> float:
        return float(torch.rand((), generator=self.generator))

    def _other(self, token: int) -> int:
        other = int(torch.randint(0, self.vocab_size - 1, (), generator=self.generator))
        return other + (other >= token)

    def _weights(self) -> tuple:
        """Where the target's parameters live and their in-place version counters: changes when any is written."""
        return tuple((p.data_ptr(), p._version) for p in self.target.parameters())

    def _continuation(self, input_ids: torch.LongTensor, n: int) -> list[int]:
        weights = self._weights()
        if weights != self._memo_weights or len(self._memo) >= self.MEMO_SIZE:
            self._memo, self._memo_weights = {}, weights
        prefix = input_ids.reshape(-1).tolist()
        known = self._memo.get(tuple(prefix))
        if known is None or len(known) < n:  # greedy: a longer continuation starts with the shorter one
            ids = input_ids.to(self.target.device)
            m = 2 * n + 1
            with torch.no_grad():
                out = self.target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=m,
                                           min_new_tokens=m, do_sample=False, eos_token_id=None, pad_token_id=0,
                                           stop_strings=None)
            known = out[0, ids.shape[1]:].tolist()
            for k in range(len(known)):  # the prefix extended by k tokens of its own continuation: the rest
                key = tuple(prefix + known[:k])
                if len(self._memo.get(key, ())) < len(known) - k:
                    self._memo[key] = known[k:]
        return known[:n]

    def draft(self, hidden_states, input_ids, *, mode="chain", num_tokens=3, tree_width=8, tree_depth=4,
              tree_budget=None, num_flow_steps=None, do_sample=False, temperature=1.0):
        from hf_chainflow.generation.tree import DraftTree

        device = input_ids.device
        depth = num_tokens if mode == "chain" else tree_depth
        truth = self._continuation(input_ids, depth)
        if mode == "chain" and do_sample:
            q = torch.full((depth, self.vocab_size), self.error_rate / self.vocab_size)
            q[torch.arange(depth), torch.tensor(truth)] += 1.0 - self.error_rate
            tokens = torch.multinomial(q, 1, generator=self.generator)[:, 0]
            logp = q.gather(1, tokens[:, None])[:, 0].log()
            return DraftTree.chain(tokens.to(device), logp.to(device), q.to(device))
        path = [t if self._rand() >= self.error_rate else self._other(t) for t in truth]
        if mode == "chain":
            return DraftTree.chain(torch.tensor(path, device=device))
        tokens, parents, depths = [], [], []
        prev_level: list[int] = [-1]  # node indices of the previous level; the true one first
        for d, token in enumerate(path):
            width = tree_width
            level_tokens = [token] + [int(torch.randint(0, self.vocab_size, (), generator=self.generator))
                                      for _ in range(width - 1)]
            level_parents = [prev_level[0]] + [prev_level[int(torch.randint(0, len(prev_level), (),
                                                                             generator=self.generator))]
                                                for _ in range(width - 1)]
            order = torch.randperm(width, generator=self.generator).tolist()
            base = len(tokens)
            tokens += [level_tokens[i] for i in order]
            parents += [level_parents[i] for i in order]
            depths += [d + 1] * width
            true_index = base + order.index(0)
            prev_level = [true_index] + [base + j for j in range(width) if base + j != true_index]
        tree = DraftTree(tokens=torch.tensor(tokens, device=device), parents=torch.tensor(parents, device=device),
                         depths=torch.tensor(depths, device=device), logprobs=torch.zeros(len(tokens), device=device))
        return tree if tree_budget is None else tree.top_nodes(tree_budget)  # equal scores: breadth-first prefix

    def draft_batch(self, hidden_states, committed, context_mask=None, **kwargs):
        """`draft` for each row's committed tokens `(L_b,)` (the batched loop's drafting call); the states are not
        read."""
        return [self.draft(None, ids[None], **kwargs) for ids in committed]
