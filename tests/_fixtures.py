"""The committed test data under `tests/fixtures/` (where it comes from: `tests/fixtures/README.md`)."""

from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures"
PROMPTS = FIXTURES / "prompts.jsonl"  # the first 48 training prompt rows (rows 25 and 40 are multi-turn)
RESPONSES = FIXTURES / "responses.jsonl"  # SmolLM2-135M-Instruct's first 50 greedy responses
RESPONSE_PROMPTS = FIXTURES / "response_prompts.jsonl"  # the 50 prompt rows those responses answer
