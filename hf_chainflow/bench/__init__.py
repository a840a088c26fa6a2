"""The bench library behind `hf-chainflow bench` (and the demo's classification of differences):

    prompts.py   the evaluation prompts, a selection stratified by domain, their tokenisation
    arms.py      the arms (ar, ar-compiled, pld, a drafter's chain or tree, custom), one timed run on a prompt
    numerics.py  where an arm's output first differs from `ar`, and whether that is a near-tie or a bug
    machine.py   what the numbers were measured on (CPU, bfloat16 instructions, versions, load)
    journal.py   one JSON line per finished prompt, so that a run can stop and resume
    report.py    results.json, results.md and the plots
    run.py       the run (`run_bench`) and loading a target and drafters by name or path (`benchmark`)
    batched.py   the batched bench (`--batch-sizes`): plain batched generate vs the drafter arms per batch size
    defaults.py  the defaults, importable without torch

The public names import from here too (`from hf_chainflow.bench import run_bench`), each on first use.
"""

from hf_chainflow._lazy import lazy_exports

# public name -> the module of this package that defines it
_EXPORTS = {
    **dict.fromkeys(["BASE_ARMS", "DEFAULT_OUTPUT_DIR", "DEFAULT_TIE_TOLERANCE", "DTYPE_NAMES", "JOURNAL_NAME",
                     "PLAIN_ARMS"], "defaults"),
    **dict.fromkeys(["BenchPrompt", "choose_prompts", "default_prompts_path", "load_prompts",
                     "stratified_selection", "tokenize_prompts"], "prompts"),
    **dict.fromkeys(["Arm", "Run", "build_arms", "configure_drafter", "plain_compile_config", "run_arm",
                     "select_arms", "warm_up_compiled_plain"], "arms"),
    **dict.fromkeys(["classify_divergence", "explain_mismatch", "first_divergence"], "numerics"),
    **dict.fromkeys(["bf16_hardware_note", "bf16_matrix_instructions", "cpu_identity", "demo_dtype",
                     "lacks_bf16_matrix_instructions", "machine_info"], "machine"),
    **dict.fromkeys(["BenchJournal", "check_journal", "config_digest", "earlier_config_digests", "finished_prompts",
                     "journal_header", "read_journal", "run_from_dict", "run_to_dict", "weights_digest"], "journal"),
    **dict.fromkeys(["markdown_table", "same_length_summary", "write_report", "write_results"], "report"),
    **dict.fromkeys(["benchmark", "run_bench", "summarise", "warm_up_arms"], "run"),
    **dict.fromkeys(["batched_table", "left_padded", "run_batched_bench", "write_batched_results"], "batched"),
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
