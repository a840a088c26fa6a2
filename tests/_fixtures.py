"""The committed test data under `tests/fixtures/` (where it comes from: `tests/fixtures/README.md`)."""

from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures"
PROMPTS = FIXTURES / "prompts.jsonl"  # the first 48 training prompt rows (rows 25 and 40 are multi-turn)
RESPONSES = FIXTURES / "responses.jsonl"  # SmolLM2-135M-Instruct's first 50 greedy responses
RESPONSE_PROMPTS = FIXTURES / "response_prompts.jsonl"  # the 50 prompt rows those responses answer


def save_with_tokenizer(model, tokenizer, folder):
    """Save a tiny target with `tokenizer` (its EOS and pad ids in the generation config) as a model folder that the
    commands load like a real one; returns the folder."""
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
