"""The held-out windows of `examples/check_compiled_round.py`, in its order (shared by `setups.py` and `partings.py`)."""
import torch

from hf_chainflow.training.corpus import ResponseCorpus


def held_out_windows(target, context_size: int, limit: int):
    """Yield `(index, states (1, C, D), committed (1, L))` for the first `limit` windows of the corpus's held-out
    responses, each run once through the target."""
    C, done = context_size, 0
    for row in ResponseCorpus("corpus/smollm2-135m-instruct").responses("heldout").values():
        ids = torch.tensor([list(row["prompt_ids"]) + list(row["response_ids"])])
        h = target(input_ids=ids, output_hidden_states=True).hidden_states[-1]  # (1, L, D)
        for t in range(C - 1, ids.shape[1] - 1):
            if done >= limit:
                return
            yield done, h[:, t - C + 1: t + 1].clone(), ids[:, : t + 2]
            done += 1
