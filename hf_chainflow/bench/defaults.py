"""The bench's defaults, importable without torch (the `hf-chainflow bench` parser reads them for `--help`)."""

DEFAULT_TIE_TOLERANCE = 0.5  # logits; how it was measured: `hf_chainflow.bench.numerics`
# logits; float32 rows of a left-padded batch against batch 1 (padding changes the products' shapes). Measured on
# SmolLM2-135M-Instruct (docs/research/scripts/padding_float32_drift.py, 32 evaluation prompts in batches of 8, 6,347
# positions): left padding moved a logit by at most 3.9e-4 and the top-2 gap by at most 5.9e-5.
PADDED_FLOAT32_TIE_TOLERANCE = 1e-3
DEFAULT_OUTPUT_DIR = "runs/bench"
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # target and drafter dtypes a run can use
BASE_ARMS = ("ar", "pld", "lookup", "chain", "tree", "dflash")
# the plain arms (kind "ar"): eager greedy `generate` (the same-dtype baseline of every arm) and the same with a static
# cache and the target's forward compiled (transformers' own compile path; run only when `--arms` names it)
PLAIN_ARMS = ("ar", "ar-compiled")
# arms run only when `--arms` names them (compiling costs a warm-up): the compiled plain arm, prompt lookup in
# hf_chainflow's loop with compiled verification, the default drafter's tree + lookup with compiled verification, and
# the same with the tree budget sized by the machine's cost curve (`tree_budget="auto"`)
OPT_IN_ARMS = ("ar-compiled", "pld-compiled", "tree+lookup-compiled", "tree+lookup-auto")
WARMUP_MAX_NEW_TOKENS = 32
JOURNAL_NAME = "runs.jsonl"  # the run's journal in the output directory (`hf_chainflow.bench.journal`)

__all__ = ["BASE_ARMS", "DEFAULT_OUTPUT_DIR", "DEFAULT_TIE_TOLERANCE", "DTYPE_NAMES", "JOURNAL_NAME", "OPT_IN_ARMS",
           "PADDED_FLOAT32_TIE_TOLERANCE", "PLAIN_ARMS", "WARMUP_MAX_NEW_TOKENS"]
