"""The bench's defaults, importable without torch (the `hf-chainflow bench` parser reads them for `--help`)."""

DEFAULT_TIE_TOLERANCE = 0.5  # logits; how it was measured: `hf_chainflow.bench.numerics`
DEFAULT_OUTPUT_DIR = "runs/bench"
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # target and drafter dtypes a run can use
BASE_ARMS = ("ar", "pld", "chain", "tree", "dflash")
WARMUP_MAX_NEW_TOKENS = 32
JOURNAL_NAME = "runs.jsonl"  # the run's journal in the output directory (`hf_chainflow.bench.journal`)

__all__ = ["BASE_ARMS", "DEFAULT_OUTPUT_DIR", "DEFAULT_TIE_TOLERANCE", "DTYPE_NAMES", "JOURNAL_NAME",
           "WARMUP_MAX_NEW_TOKENS"]
