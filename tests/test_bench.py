"""`hf-chainflow bench` / `demo` on tiny random targets: results fields, exactness in float32, the mismatch
classifier (hand-made logits and a deliberately wrong arm), plots, and both commands through the CLI."""

import copy
import json
import shutil

import pytest
import torch

from hf_chainflow import ChainFlowConfig, ChainFlowDrafter
from hf_chainflow.bench import (
    Arm,
    BenchPrompt,
    build_arms,
    classify_divergence,
    first_divergence,
    markdown_table,
    run_bench,
    select_arms,
    stratified_selection,
    warm_up_arms,
    write_results,
)
from hf_chainflow.bench.defaults import PADDED_FLOAT32_TIE_TOLERANCE
from hf_chainflow.commands.bench import _parse_extra_drafters, _parse_tree
from hf_chainflow.generation import drafting
from hf_chainflow.testing import OracleDrafter, tiny_target

from _fixtures import save_with_tokenizer
from _windows import one_thread

DRAFTER = {"num_blocks": 1, "num_heads": 2, "ffn_multiplier": 2, "vae_num_layers": 1, "vae_num_heads": 2,
           "path_hidden_size": 16, "markov_rank": 8}


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    with one_thread():
        yield


# ------------------------------------------------------------------------------------------ pure helpers

def test_classify_divergence_hand_made_logits():
    logits = torch.zeros(10)
    logits[3], logits[7], logits[5] = 12.0, 11.875, 4.0
    tie = classify_divergence(logits, 3, 7, "bfloat16", tolerance=0.25)
    assert tie["kind"] == "near_tie" and tie["gap"] == pytest.approx(0.125) and tie["reference_top"] == 3
    # The reference may itself rank the arm's token first: still a tie when the gap is small.
    assert classify_divergence(logits, 7, 3, "bfloat16", tolerance=0.25)["kind"] == "near_tie"
    wrong = classify_divergence(logits, 3, 5, "bfloat16", tolerance=0.25)
    assert wrong["kind"] == "unexplained" and wrong["gap"] == pytest.approx(8.0)
    assert tie["top_gap"] == 0.0
    # Tied with each other but far below the reference's top: not a near-tie of the decision that was made.
    logits[6] = 4.0
    low = classify_divergence(logits, 5, 6, "bfloat16", tolerance=0.25)
    assert low["kind"] == "unexplained" and low["top_gap"] == pytest.approx(8.0) and "below" in low["reason"]
    logits[4] = 12.0  # a third token tied at the top: ar's and the arm's both within tolerance of it
    assert classify_divergence(logits, 7, 3, "bfloat16", tolerance=0.25)["kind"] == "near_tie"
    # float32 is exact: even a tiny gap is a bug.
    assert classify_divergence(logits, 3, 7, "float32", tolerance=0.25)["kind"] == "unexplained"
    # A row of a left-padded batch in float32: a near-tie only within PADDED_FLOAT32_TIE_TOLERANCE, whatever
    # `tolerance` says (logits 3 and 7 are 0.125 apart, far beyond float32 rounding).
    assert classify_divergence(logits, 3, 7, "float32", tolerance=0.25, padded=True)["kind"] == "unexplained"
    close = logits.clone()
    close[7] = close[3] - PADDED_FLOAT32_TIE_TOLERANCE / 2
    assert classify_divergence(close, 3, 7, "float32", padded=True)["kind"] == "near_tie"
    assert classify_divergence(close, 3, 7, "float32")["kind"] == "unexplained"
    # One output ended where the other went on.
    assert classify_divergence(logits, 3, None, "bfloat16")["kind"] == "unexplained"


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2


def test_stratified_selection_covers_every_domain():
    rows = [{"id": f"a{i}", "domain": "a"} for i in range(5)] + [{"id": f"b{i}", "domain": "b"} for i in range(2)]
    rows += [{"id": "c0", "domain": "c"}]
    picked = stratified_selection(rows, 4)
    assert [r["id"] for r in picked] == ["a0", "b0", "c0", "a1"]
    assert len(stratified_selection(rows, 100)) == len(rows)
    with pytest.raises(ValueError, match="--limit"):
        stratified_selection(rows, 0)


def test_argument_parsers():
    assert _parse_tree("8x4") == (8, 4)
    with pytest.raises(ValueError, match="WIDTHxDEPTH"):
        _parse_tree("8x")
    assert _parse_extra_drafters(["flashmap=/x/y"]) == {"flashmap": "/x/y"}
    with pytest.raises(ValueError, match="NAME=PATH"):
        _parse_extra_drafters(["flashmap"])


@pytest.mark.parametrize("flags,message", [
    (["--lookup-trust-ngram", "2"], r"`--lookup-trust-ngram` needs `--lookup-tokens`"),
    (["--lookup-tokens", "10", "--lookup-max-tokens", "32"], r"lookup_max_tokens` \(32\) needs `lookup_trust_ngram`"),
    (["--lookup-tokens", "10", "--lookup-trust-ngram", "2", "--lookup-max-tokens", "4"],
     r"lookup_max_tokens` \(4\) cannot be smaller than `lookup_num_tokens` \(10\)"),
])
def test_bench_refuses_bad_lookup_flags_before_loading_anything(flags, message):
    from hf_chainflow.commands import main

    with pytest.raises(SystemExit, match=message):  # a missing target path would fail later, so nothing loaded
        main(["bench", "--target", "/nonexistent/target", *flags])


# ------------------------------------------------------------------------------------- bench on tiny targets

def _wrong_arm(dtype: str, position: int = 3) -> Arm:
    """Plain greedy, except that new token `position` is replaced by the least likely token (a bug on purpose)."""

    def fn(model, input_ids, kwargs):
        out = model.generate(input_ids, **kwargs)
        p = input_ids.shape[1] + position
        logits = model(input_ids=out[:, :p]).logits[0, -1]
        out = out.clone()
        out[0, p] = int(logits.argmin())
        return out[:, : p + 1]

    return Arm("wrong", "custom", dtype, fn=fn)


def _prompts(vocab: int) -> list[BenchPrompt]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(4):
        ids = torch.randint(3, vocab, (1, 10), generator=g)
        if i % 2:  # repetitive prompts give prompt lookup something to find
            ids = ids[:, :5].repeat(1, 3)
        out.append(BenchPrompt(f"p{i}", "code" if i < 2 else "math", ids))
    return out


def test_run_bench_tiny_target(tmp_path):
    target = tiny_target("llama", num_layers=2)
    models = {"float32": target, "bfloat16": copy.deepcopy(target).to(torch.bfloat16)}
    drafters = {"oracle": {dt: OracleDrafter(m, error_rate=0.3) for dt, m in models.items()}}
    arms = build_arms(list(models), {"oracle": drafters["oracle"]["float32"]}, pld_tokens=4, tree=(3, 3),
                      default_drafter="oracle")
    arms += [_wrong_arm("float32"), _wrong_arm("bfloat16")]
    prompts = _prompts(target.config.vocab_size)
    results = run_bench(models, prompts, arms, drafters, max_new_tokens=12, warmup=prompts[0], eos_token_id=None,
                        pad_token_id=0, progress=False)
    paths = write_results(results, tmp_path)

    loaded = json.loads(paths["json"].read_text())
    assert set(loaded) >= {"arms", "settings", "machine", "same_length"}
    assert set(loaded["same_length"]) == {"float32", "bfloat16"}
    keys = {"ar@float32", "pld@float32", "chain@float32", "tree@float32", "ar@bfloat16", "pld@bfloat16",
            "chain@bfloat16", "tree@bfloat16", "wrong@float32", "wrong@bfloat16"}
    assert set(loaded["arms"]) == keys
    for key, a in loaded["arms"].items():
        for field in ("dtype", "tokens_per_second", "speedup", "speedup_vs_fastest_ar", "tau", "mismatches",
                      "unexplained_mismatches", "per_domain"):
            assert field in a, (key, field)
        assert a["dtype"] == key.split("@")[1]
        assert set(a["per_domain"]) == {"code", "math"}
        assert {"speedup", "tau"} <= set(a["per_domain"]["code"])
    arms_out = loaded["arms"]
    for dt in models:  # the baseline
        assert arms_out[f"ar@{dt}"]["speedup"] == pytest.approx(1.0) and arms_out[f"ar@{dt}"]["tau"] == 1.0
    # float32 is exact for every real arm; the drafter arms' tau and acceptance come from last_stats.
    for name in ("pld", "chain", "tree"):
        assert arms_out[f"{name}@float32"]["mismatches"] == 0
        assert arms_out[f"{name}@float32"]["unexplained_mismatches"] == 0
        assert arms_out[f"{name}@float32"]["tau"] >= 1.0
    assert len(arms_out["tree@float32"]["acceptance_per_depth"]) == 3
    assert len(arms_out["tree@float32"]["per_domain"]["math"]["acceptance_per_depth"]) == 3
    assert len(arms_out["chain@float32"]["acceptance_per_depth"]) == 3  # the oracle's num_assistant_tokens
    assert arms_out["chain@float32"]["draft_time_per_round"] > 0
    # drafting per round against one plain step: seconds per round x the same-dtype ar arm's tokens per second
    chain, ar = arms_out["chain@float32"], arms_out["ar@float32"]
    assert chain["draft_ratio"] == pytest.approx(chain["draft_time_per_round"] * ar["tokens_per_second"])
    assert ar["draft_ratio"] is None
    assert loaded["settings"]["arms"]["tree@float32"]["tree_width"] == 3
    # bfloat16 differences are classified; none of the real arms may be unexplained.
    for name in ("pld", "chain", "tree"):
        a = arms_out[f"{name}@bfloat16"]
        assert a["near_ties"] + a["unexplained_mismatches"] == a["mismatches"]
        assert a["unexplained_mismatches"] == 0, a["mismatch_details"]
    # The deliberately wrong arm is flagged in both dtypes, at the position it was broken.
    for dt in models:
        wrong = arms_out[f"wrong@{dt}"]
        assert wrong["unexplained_mismatches"] == len(prompts)
        assert all(d["position"] == 3 for d in wrong["mismatch_details"])
    assert paths["speedup_png"].stat().st_size > 0 and paths["acceptance_png"].stat().st_size > 0
    assert "| tree | float32 |" in paths["md"].read_text()


def test_run_bench_rejects_a_missing_baseline():
    target = tiny_target("llama", num_layers=2)
    arms = [Arm("pld", "pld", "float32", settings={"prompt_lookup_num_tokens": 2})]
    with pytest.raises(ValueError, match="baseline"):
        run_bench({"float32": target}, _prompts(target.config.vocab_size), arms, progress=False)


def test_journal_drops_a_cut_last_line_and_refuses_a_broken_middle_line(tmp_path, caplog):
    from hf_chainflow.bench.journal import BenchJournal

    path = tmp_path / "runs.jsonl"
    header = {"settings": {"a": 1}, "prompt_ids": ["x", "y"], "prompt_tokens_sha256": "0"}
    journal = BenchJournal(path, header)
    journal.add(journal.start_part({"m": 1}), "x", 1.0, {}, {}, {})
    complete = path.read_bytes()
    with open(path, "a") as f:
        f.write('{"type": "prompt", "part": 0, "id": "y", "wall": 1.0, "rec')  # killed mid-append
    cut = path.read_bytes()
    with pytest.raises(ValueError, match=r"differ from the journal .* \['settings.a'\]"):
        BenchJournal(path, {**header, "settings": {"a": 2}}, resume=True)
    assert path.read_bytes() == cut  # a refused resume changes nothing
    with caplog.at_level("WARNING", logger="hf_chainflow.bench.journal"):
        resumed = BenchJournal(path, header, resume=True)
    assert "cut short" in caplog.text
    assert set(resumed.done) == {"x"} and path.read_bytes() == complete
    resumed.add(resumed.start_part({"m": 2}), "y", 1.0, {}, {}, {})  # appends start on a line of their own
    assert set(BenchJournal(path, header, resume=True).done) == {"x", "y"}
    # A broken line before the last one is not an interrupted append: refused, naming the file and the line.
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + lines[1] + '{"type": "pro\n' + "".join(lines[2:]))
    before = path.read_bytes()
    with pytest.raises(ValueError, match=r"runs.jsonl' line 3 is not valid JSON"):
        BenchJournal(path, header, resume=True)
    assert path.read_bytes() == before


def test_journal_keeps_finished_prompts_unless_told_to_overwrite(tmp_path, caplog):
    """A new journal over one holding finished prompts is refused (nothing written) unless `overwrite`, which
    replaces it whole when the run starts its prompts; a journal with none is replaced; both flags are refused."""
    from hf_chainflow.bench.journal import BenchJournal

    path = tmp_path / "runs.jsonl"
    header = {"settings": {"a": 1}, "prompt_ids": ["x", "y"], "prompt_tokens_sha256": "0"}
    BenchJournal(path, header).start_part({"m": 1})
    BenchJournal(path, header).start_part({"m": 2})  # no finished prompt: replaced
    assert [json.loads(x)["type"] for x in path.read_text().splitlines()] == ["header", "part"]
    journal = BenchJournal(path, header, resume=True)
    journal.add(journal.start_part({"m": 3}), "x", 1.0, {}, {}, {})
    before = path.read_bytes()
    with pytest.raises(ValueError, match=r"already holds a bench journal \(runs.jsonl\) with 1 finished prompt of 2; "
                                         r"a new run would discard it"):
        BenchJournal(path, header)
    with pytest.raises(ValueError, match="contradict each other"):
        BenchJournal(path, header, resume=True, overwrite=True)
    fresh = BenchJournal(path, header, overwrite=True)
    assert path.read_bytes() == before  # nothing replaced until the run starts its prompts
    with caplog.at_level("WARNING", logger="hf_chainflow.bench.journal"):
        fresh.start_part({"m": 4})
    assert "discarding its 1 finished prompt." in caplog.text
    assert [json.loads(x)["type"] for x in path.read_text().splitlines()] == ["header", "part"]
    target = tiny_target("llama", num_layers=2)
    twice = _prompts(target.config.vocab_size)[:2] * 2
    with pytest.raises(ValueError, match=r"Prompt ids must be unique .* got \['p0', 'p1'\] more than once"):
        run_bench({"float32": target}, twice, [Arm("ar", "ar", "float32")], progress=False)


def test_a_journal_from_before_config_digests_resumes_with_a_warning(tmp_path, caplog):
    """The committed 320-prompt journal has no `drafter_config_sha256`: it still resumes (weights and every other
    setting checked), with a warning that the configs could not be; any other difference is still refused."""
    from hf_chainflow.bench.journal import BenchJournal

    path = tmp_path / "runs.jsonl"
    old = {"settings": {"a": 1, "drafter_weights_sha256": {"c": "w"}}, "prompt_ids": ["x"], "prompt_tokens_sha256": "0"}
    BenchJournal(path, old).add(BenchJournal(path, old).start_part({}), "x", 1.0, {}, {}, {})
    new = {**old, "settings": {**old["settings"], "drafter_config_sha256": {"c": "k"}}}
    with caplog.at_level("WARNING", logger="hf_chainflow.bench.journal"):
        assert set(BenchJournal(path, new, resume=True).done) == {"x"}
    assert "predates `drafter_config_sha256`" in caplog.text
    with pytest.raises(ValueError, match=r"\['settings.drafter_weights_sha256.c'\]"):
        BenchJournal(path, {**new, "settings": {**new["settings"], "drafter_weights_sha256": {"c": "v"}}}, resume=True)


def test_config_digest_follows_config_and_generation_config(tmp_path):
    from hf_chainflow.bench.journal import config_digest

    ChainFlowDrafter(ChainFlowConfig.for_target(tiny_target("llama").config, **DRAFTER)).save_pretrained(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    a, b = ChainFlowDrafter.from_pretrained(tmp_path / "a"), ChainFlowDrafter.from_pretrained(tmp_path / "b")
    assert config_digest(a) == config_digest(b)  # the path is not part of it
    b.generation_config.num_flow_steps = 4
    assert config_digest(a) != config_digest(b)
    b = ChainFlowDrafter.from_pretrained(tmp_path / "b")
    b.config.serving_head_dtype = "float32"
    assert config_digest(a) != config_digest(b)


def test_config_digest_counts_only_fields_off_their_defaults():
    """A field at its class default does not count, so a field added later with a default that drafts as before
    leaves the digest of every saved drafter (and every journal) as it was; a field moved off its default counts."""
    from hf_chainflow.bench.journal import config_digest

    drafter = ChainFlowDrafter(ChainFlowConfig.for_target(tiny_target("llama").config, **DRAFTER))
    digest = config_digest(drafter)
    del drafter.config.continuation_min_ngram  # as read from a config saved before the field existed
    assert config_digest(drafter) == digest
    drafter.config.continuation_min_ngram = 3
    assert config_digest(drafter) != digest


def test_a_journal_with_earlier_config_digests_resumes(tmp_path):
    """A journal written before the config-digest rule of 2026-12-07 (issue 40's 320-prompt run among them) holds its
    drafters' digests under the earlier rule: every field of the config class, without the fields added since. It
    resumes; a digest of neither rule is refused and leaves the journal as it was."""
    import hashlib

    from hf_chainflow.bench.journal import config_digest, earlier_config_digests

    target = tiny_target("llama", num_layers=2)
    drafter = ChainFlowDrafter(ChainFlowConfig.for_target(target.config, **DRAFTER)).bind_target(target).eval()
    models, prompts = {"float32": target}, _prompts(target.config.vocab_size)[:2]
    arms = build_arms(["float32"], {"cf": drafter}, pld_tokens=4, chain=2, default_drafter="cf", only=["ar", "chain"])
    kw = dict(max_new_tokens=4, pad_token_id=0, progress=False,
              settings={"drafter_config_sha256": {"cf": config_digest(drafter)}})
    journal = tmp_path / "runs.jsonl"
    run_bench(models, prompts, arms, {"cf": {"float32": drafter}}, journal=journal, **kw)
    lines = journal.read_text().splitlines()

    skip = ("_name_or_path", "transformers_version", "_from_model_config")  # the earlier rule, as it was written
    dicts = {name: {k: v for k, v in getattr(drafter, name).to_diff_dict().items() if k not in skip}
             for name in ("config", "generation_config")}
    for key in ("continuation_table_size", "continuation_min_ngram", "continuation_max_ngram"):
        del dicts["config"][key]  # added after that journal was written, as was the generation config's
    if dicts["generation_config"].get("corpus_lookup_num_tokens", 0) is None:
        del dicts["generation_config"]["corpus_lookup_num_tokens"]
    earlier = hashlib.sha256(json.dumps(dicts, sort_keys=True, default=str).encode()).hexdigest()[:16]
    assert earlier in earlier_config_digests(drafter) and earlier != config_digest(drafter)
    header = json.loads(lines[0])
    for held, accepted in ((earlier, True), ("0123456789abcdef", False)):
        header["settings"]["drafter_config_sha256"]["cf"] = held
        journal.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
        before = journal.read_bytes()
        if accepted:
            part = run_bench(models, prompts, arms, {"cf": {"float32": drafter}}, journal=journal, resume=True,
                             partial=True, **kw)
            assert part["arms"]["chain@float32"]["prompts"] == 2
        else:
            with pytest.raises(ValueError, match=r"\['settings.drafter_config_sha256.cf'\]"):
                run_bench(models, prompts, arms, {"cf": {"float32": drafter}}, journal=journal, resume=True, **kw)
        assert journal.read_bytes() == before


def test_a_resume_on_another_kind_of_cpu_is_warned_of_and_reported(tmp_path, monkeypatch, caplog):
    """A part on another kind of CPU than an earlier part's still runs (each prompt compares its arms side by side)
    but is warned of, and the results and their `results.md` list each part's kind; a part on the same kind, or an
    earlier part that recorded fewer fields (a journal from before them), changes nothing."""
    from hf_chainflow.bench import run as bench_run

    zen4 = {"cpu_vendor": "AuthenticAMD", "cpu_family": 25, "cpu_model": 17, "cpu_count": 2,
            "cpu_capability": "AVX512", "bf16_matrix_instructions": {"amx_tile": False, "avx512_bf16": True}}
    here = dict(zen4)
    monkeypatch.setattr(bench_run, "machine_info", lambda: dict(here))
    target = tiny_target("llama", num_layers=2)
    models, prompts = {"float32": target}, _prompts(target.config.vocab_size)[:3]
    arms = build_arms(["float32"], {}, pld_tokens=4, only=["ar", "pld"])
    kw = dict(max_new_tokens=4, pad_token_id=0, progress=False)
    journal = tmp_path / "runs.jsonl"
    run_bench(models, prompts, arms, journal=journal, **kw)
    lines = journal.read_text().splitlines()

    def resume_last_prompt(earlier_machine: dict) -> tuple[dict, str]:
        part = json.loads(lines[1])
        journal.write_text("\n".join([lines[0], json.dumps({**part, "machine": earlier_machine}), *lines[2:-1]]) + "\n")
        caplog.clear()
        with caplog.at_level("WARNING", logger="hf_chainflow.bench.journal"):
            results = run_bench(models, prompts, arms, journal=journal, resume=True, **kw)
        return results, caplog.text

    results, warned = resume_last_prompt(zen4)
    assert "part_cpu_kinds" not in results["settings"] and "another kind of CPU" not in warned
    here.update(cpu_model=1, cpu_capability="AVX2", bf16_matrix_instructions={"amx_tile": False, "avx512_bf16": False})
    results, warned = resume_last_prompt({k: zen4[k] for k in ("cpu_vendor", "cpu_family", "cpu_count")})
    assert "part_cpu_kinds" not in results["settings"] and "another kind of CPU" not in warned  # fields it lacks
    results, warned = resume_last_prompt(zen4)
    assert "another kind of CPU than part 0 (cpu_model 1 against 17, cpu_capability 'AVX2' against 'AVX512'" in warned
    assert results["settings"]["parts"] == 2 and results["arms"]["pld@float32"]["prompts"] == 3
    assert [(k["part"], k["cpu_model"]) for k in results["settings"]["part_cpu_kinds"]] == [(0, 17), (1, 1)]
    table = markdown_table(results)
    assert "more than one kind of CPU" in table and "| 1 | AuthenticAMD | 25 | 1 | 2 | AVX2 |" in table

    # Parts 1 and 2 differ though neither differs from a part 0 that recorded fewer fields: warned and reported.
    from hf_chainflow.bench.journal import BenchJournal

    log = BenchJournal(tmp_path / "three.jsonl", {"settings": {}})
    log.start_part({"cpu_vendor": "AuthenticAMD"})
    log.start_part(zen4)
    caplog.clear()
    with caplog.at_level("WARNING", logger="hf_chainflow.bench.journal"):
        log.start_part(here)
    assert "than part 1 (cpu_model 1 against 17" in caplog.text
    assert [k["cpu_model"] for k in log.mixed_cpu_kinds()] == [None, 17, 1]
    assert BenchJournal(tmp_path / "none.jsonl", {"settings": {}}).mixed_cpu_kinds() == []


def test_run_bench_journal_resumes_an_interrupted_run(tmp_path):
    """A run stopped after two prompts resumes from its journal and summarises like an uninterrupted run; a resume
    with other settings, or without a journal, is refused and leaves the journal as it was."""
    from hf_chainflow.bench.journal import BenchJournal

    target = tiny_target("llama", num_layers=2)
    models = {"float32": target}
    drafters = {"oracle": {"float32": OracleDrafter(target, error_rate=0.0)}}
    prompts = _prompts(target.config.vocab_size)
    stop = {"at": prompts[2].id}

    def maybe_stop(model, input_ids, kwargs):
        if stop["at"] is not None and torch.equal(input_ids, next(p.input_ids for p in prompts if p.id == stop["at"])):
            raise KeyboardInterrupt
        return model.generate(input_ids, **kwargs)

    arms = build_arms(["float32"], {"oracle": drafters["oracle"]["float32"]}, pld_tokens=4, tree=(3, 3),
                      default_drafter="oracle") + [_wrong_arm("float32"), Arm("stop", "custom", "float32", fn=maybe_stop)]
    kw = dict(max_new_tokens=8, warmup=prompts[0], pad_token_id=0, progress=False)
    journal = tmp_path / "runs.jsonl"

    with pytest.raises(KeyboardInterrupt):
        run_bench(models, prompts, arms, drafters, journal=journal, **kw)
    lines = [json.loads(x) for x in journal.read_text().splitlines()]
    assert [x["type"] for x in lines] == ["header", "part", "prompt", "prompt"]  # the stopped prompt left no line
    assert [x["id"] for x in lines[2:]] == [prompts[0].id, prompts[1].id]

    # A partial report of the stopped run summarises the two finished prompts, runs nothing, journals nothing.
    before = journal.read_bytes()
    part = run_bench(models, prompts, arms, drafters, journal=journal, resume=True, partial=True, **kw)
    assert journal.read_bytes() == before
    assert part["partial"] == {"prompts_done": 2, "prompts_total": len(prompts)}
    assert [r["id"] for r in part["prompts"]] == [prompts[0].id, prompts[1].id]
    assert part["arms"]["tree@float32"]["prompts"] == 2
    assert part["arms"]["wrong@float32"]["unexplained_mismatches"] == 2
    assert "Partial report: 2 of" in markdown_table(part)
    with pytest.raises(ValueError, match="needs `resume=True`"):
        run_bench(models, prompts, arms, drafters, journal=journal, partial=True, **kw)

    stop["at"] = None
    resumed = run_bench(models, prompts, arms, drafters, journal=journal, resume=True, **kw)
    reference = run_bench(models, prompts, arms, drafters, **kw)
    lines = [json.loads(x) for x in journal.read_text().splitlines()]
    assert [x["type"] for x in lines] == ["header", "part", "prompt", "prompt", "part", "prompt", "prompt"]
    assert resumed["settings"]["parts"] == 2
    assert [r["id"] for r in resumed["prompts"]] == [p.id for p in prompts]
    for key, a in reference["arms"].items():
        b = resumed["arms"][key]
        for field in ("tau", "mismatches", "unexplained_mismatches", "acceptance_per_depth"):
            assert b.get(field) == a.get(field), (key, field)
        assert [r["arms"][key]["new_tokens"] for r in resumed["prompts"]] == \
            [r["arms"][key]["new_tokens"] for r in reference["prompts"]]
    assert resumed["arms"]["wrong@float32"]["unexplained_mismatches"] == len(prompts)  # read back from the journal
    assert resumed["arms"]["tree@float32"]["tau"] > 1.0

    # Every prompt journaled: a further resume runs nothing and summarises the same, also from another path to the
    # same prompts file (paths are not part of the identity; the prompts' tokens are).
    again = run_bench(models, prompts, arms, drafters, journal=journal, resume=True,
                      settings={"prompts": "/elsewhere/eval_prompts.jsonl"}, **kw)
    assert again["arms"]["tree@float32"]["tau"] == resumed["arms"]["tree@float32"]["tau"]
    assert again["settings"]["parts"] == 2
    assert "in 2 parts" in markdown_table(again)

    before = journal.read_bytes()
    with pytest.raises(ValueError, match="max_new_tokens"):
        run_bench(models, prompts, arms, drafters, journal=journal, resume=True, **{**kw, "max_new_tokens": 9})
    with pytest.raises(ValueError, match="prompt_ids"):
        run_bench(models, prompts[:3], arms, drafters, journal=journal, resume=True, **kw)
    edited = [BenchPrompt(p.id, p.domain, p.input_ids.flip(1)) for p in prompts]  # same ids, other tokens
    with pytest.raises(ValueError, match="prompt_tokens_sha256"):
        run_bench(models, edited, arms, drafters, journal=journal, resume=True, **kw)
    with pytest.raises(ValueError, match="tree_width"):  # an arm setting
        other = build_arms(["float32"], {"oracle": drafters["oracle"]["float32"]}, pld_tokens=4, tree=(2, 3),
                           default_drafter="oracle") + arms[-2:]
        run_bench(models, prompts, other, drafters, journal=journal, resume=True, **kw)
    assert journal.read_bytes() == before
    with pytest.raises(ValueError, match="found no journal"):
        BenchJournal(tmp_path / "missing.jsonl", {"settings": {}}, resume=True)
    with pytest.raises(ValueError, match="needs a `journal`"):
        run_bench(models, prompts, arms, drafters, resume=True, **kw)
    fresh = tmp_path / "fresh.jsonl"
    fresh.write_text(journal.read_text().splitlines()[0] + "\n")  # this run's header, no finished prompt
    with pytest.raises(ValueError, match="holds no finished prompt"):
        run_bench(models, prompts, arms, drafters, journal=fresh, resume=True, partial=True, **kw)


# ------------------------------------------------------------------------------- both commands via the CLI

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer (chat template) and a random drafter, saved."""
    from hf_chainflow.targets import load_tokenizer

    try:
        tokenizer = load_tokenizer()
    except ValueError as err:  # the GGUF package is not installed
        pytest.skip(str(err))
    tmp = tmp_path_factory.mktemp("bench")
    target = tiny_target("llama", vocab_size=len(tokenizer), hidden_size=64, num_layers=2)
    save_with_tokenizer(target, tokenizer, tmp / "target")
    torch.manual_seed(0)
    drafter = ChainFlowDrafter(ChainFlowConfig.for_target(target.config, **DRAFTER))
    g = drafter.generation_config
    g.tree_width, g.tree_depth, g.tree_budget, g.lookup_num_tokens = 3, 2, 4, 3
    drafter.save_pretrained(tmp / "drafter")
    return tmp


def test_arms_are_kept_per_dtype_by_name_at_dtype():
    target = tiny_target("llama", num_layers=2)
    drafter = ChainFlowDrafter(ChainFlowConfig.for_target(target.config, **DRAFTER)).bind_target(target).eval()
    dtypes = ["float32", "bfloat16"]
    arms = build_arms(dtypes, {"chainflow": drafter}, tree=(2, 2), only=["ar", "tree@float32", "pld@bfloat16"])
    assert [a.key for a in arms] == ["ar@float32", "tree@float32", "ar@bfloat16", "pld@bfloat16"]
    assert [a.key for a in build_arms(dtypes, {}, only=["pld", "ar"])] == [
        "ar@float32", "pld@float32", "ar@bfloat16", "pld@bfloat16"]
    assert select_arms(None, ["ar", "pld"], ["float32"]) == {("ar", "float32"), ("pld", "float32")}
    for only, match in ((["ar", "tree@float16"], r"unknown arms \['tree@float16'\]"),
                        (["ar", "chain@"], r"unknown arms \['chain@'\]"),
                        (["ar@float32", "pld@float32"], r"runs nothing in \['bfloat16'\]")):
        with pytest.raises(ValueError, match=match):
            build_arms(dtypes, {"chainflow": drafter}, only=only)


def test_warm_up_arms_records_the_drafting_setup():
    target = tiny_target("llama", num_layers=2)
    drafter = ChainFlowDrafter(ChainFlowConfig.for_target(target.config, **DRAFTER)).bind_target(target).eval()
    drafter.generation_config.compile_drafting = True
    arms = build_arms(["float32"], {"chainflow": drafter}, tree=(2, 2))
    # False switches compiling off on every drafter: nothing is compiled, the record says so
    record = warm_up_arms(arms, {"chainflow": {"float32": drafter}}, False)
    assert record == {"chainflow": {"compile_drafting": False, "dtype": "float32",
                                    "serving_head_dtype": drafter.config.serving_head_dtype, "compile_seconds": 0.0}}
    assert drafter.generation_config.compile_drafting is False and drafting.compiled_round(drafter) is None
    with pytest.raises(ValueError, match="compile_drafting"):
        warm_up_arms(arms, {"chainflow": {"float32": drafter}}, "yes")


def test_bench_command(saved, capsys):
    from hf_chainflow.commands import main

    out = saved / "run"
    argv = ["bench", "--target", str(saved / "target"), "--drafter-path", str(saved / "drafter"),
            "--drafter", f"other={saved / 'drafter'}", "--arms", "ar,pld,tree,tree+lookup,other-chain", "--limit", "2",
            "--max-new-tokens", "6", "--threads", "1", "--output-dir", str(out), "--no-progress"]
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert len(results["settings"]["drafter_weights_sha256"]["chainflow"]) == 64
    # The journal of the run: resuming it runs nothing more and writes the same numbers.
    with pytest.raises(SystemExit, match="add `--resume`"):
        main(argv + ["--partial-report"])
    assert main(argv + ["--resume", "--partial-report"]) == 0
    assert json.loads((out / "partial" / "results.json").read_text())["partial"] == {"prompts_done": 2,
                                                                                      "prompts_total": 2}
    assert main(argv + ["--resume"]) == 0
    again = json.loads((out / "results.json").read_text())
    assert {k: (a["tau"], a["mismatches"]) for k, a in again["arms"].items()} == \
        {k: (a["tau"], a["mismatches"]) for k, a in results["arms"].items()}
    with pytest.raises(SystemExit, match="max_new_tokens"):
        main([("7" if a == "6" else a) for a in argv] + ["--resume"])
    # Same weights, another serving config (not an arm setting): refused too.
    shutil.copytree(saved / "drafter", saved / "drafter-budget")
    config = json.loads((saved / "drafter-budget" / "config.json").read_text())
    (saved / "drafter-budget" / "config.json").write_text(json.dumps({**config, "candidate_budget": 8}))
    with pytest.raises(SystemExit, match=r"drafter_config_sha256.chainflow"):
        main([str(saved / "drafter-budget") if a == str(saved / "drafter") else a for a in argv] + ["--resume"])
    assert set(results["arms"]) == {f"{a}@{dt}" for a in ("ar", "pld", "tree", "tree+lookup", "other-chain")
                                    for dt in ("float32", "bfloat16")}
    assert results["settings"]["num_prompts"] == 2 and len(results["domains"]) == 2  # stratified
    assert results["arms"]["tree@float32"]["settings"] == {"tree_width": 3, "tree_depth": 2, "tree_budget": 4}
    assert results["arms"]["tree+lookup@float32"]["settings"] == {  # the drafter's own lookup setting
        "tree_width": 3, "tree_depth": 2, "tree_budget": 4, "lookup_num_tokens": 3, "lookup_trust_ngram": None,
        "lookup_max_tokens": None}
    for key, a in results["arms"].items():
        if a["dtype"] == "float32":
            assert a["unexplained_mismatches"] == 0, a["mismatch_details"]
    assert (out / "results.md").is_file() and (out / "speedup_per_domain.png").is_file()
    assert "speedup" in capsys.readouterr().out


def test_demo_command(saved, capsys, monkeypatch):
    import hf_chainflow.bench.machine as machine
    from hf_chainflow.commands import main

    # As on a CPU without bfloat16 matrix instructions: the note is for bfloat16 runs only.
    monkeypatch.setattr(machine, "bf16_matrix_instructions", lambda: {"amx_tile": False, "avx512_bf16": False})
    assert main(["demo", "--target", str(saved / "target"), "--drafter-path", str(saved / "drafter"), "--dtype",
                 "float32", "--prompt", "Say hi.", "--max-new-tokens", "5", "--threads", "1"]) == 0
    text = capsys.readouterr().out
    assert "tau" in text and "speedup" in text and "identical to plain generation on 1/1 prompts" in text
    assert "drafting: chain of 3 + prompt-lookup branch of 3" in text  # the drafter's own settings by default
    assert "bfloat16 matrix instructions" not in text
    assert main(["demo", "--target", str(saved / "target"), "--drafter-path", str(saved / "drafter"), "--dtype",
                 "float32", "--prompt", "Say hi.", "--max-new-tokens", "5", "--threads", "1", "--mode", "tree",
                 "--no-lookup"]) == 0
    text = capsys.readouterr().out
    assert "drafting: tree 3x2 cut to 4 nodes\n" in text and "identical to plain generation on 1/1 prompts" in text
    assert main(["demo", "--target", str(saved / "target"), "--drafter-path", str(saved / "drafter"), "--dtype",
                 "bfloat16", "--prompt", "Say hi.", "--max-new-tokens", "3", "--threads", "1"]) == 0
    assert capsys.readouterr().out.startswith("note: this CPU has no native bfloat16 matrix instructions")
    # No dtype asked for on such a CPU: float32, said first, and no bfloat16 note.
    assert main(["demo", "--target", str(saved / "target"), "--drafter-path", str(saved / "drafter"),
                 "--prompt", "Say hi.", "--max-new-tokens", "3", "--threads", "1"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("dtype: float32 (this CPU has no native bfloat16 matrix instructions")
    assert ", float32: tau" in text and "note:" not in text


def test_describe_settings_names_every_drafting_knob():
    from types import SimpleNamespace

    from hf_chainflow.commands.demo_run import describe_settings

    g = SimpleNamespace(draft_mode="tree", tree_width=8, tree_depth=4, tree_budget=12, lookup_num_tokens=10,
                        lookup_trust_ngram=2, lookup_max_tokens=32)
    assert describe_settings(g) == ("tree 8x4 cut to 12 nodes + prompt-lookup branch of 10 (alone on 2-gram matches, "
                                    "growing to 32 while accepted whole)")
    g.lookup_max_tokens = None
    assert describe_settings(g).endswith("branch of 10 (alone on 2-gram matches)")
    g.draft_mode, g.num_assistant_tokens, g.lookup_num_tokens = "chain", 3, None
    assert describe_settings(g) == "chain of 3"
    g.corpus_lookup_num_tokens = 6
    assert describe_settings(g) == "chain of 3 + corpus-lookup branch of 6"


def _record(pid, domain, **arms):
    return {"id": pid, "domain": domain, "arms": {k.replace("_", "@"): {"new_tokens": n, "seconds": s}
                                                  for k, (n, s) in arms.items()}}


def test_same_length_summary_keeps_only_prompts_where_every_arm_matches_ar_length():
    from hf_chainflow.bench.report import same_length_summary

    arms = {k: {"dtype": k.split("@")[1]} for k in ("ar@bfloat16", "pld@bfloat16", "tree@bfloat16", "ar@float32")}
    prompts = [
        _record("p0", "code", ar_bfloat16=(10, 2.0), pld_bfloat16=(10, 1.0), tree_bfloat16=(10, 0.5), ar_float32=(10, 3)),
        _record("p1", "code", ar_bfloat16=(10, 2.0), pld_bfloat16=(4, 0.1), tree_bfloat16=(10, 0.5), ar_float32=(10, 3)),
        _record("p2", "math", ar_bfloat16=(8, 4.0), pld_bfloat16=(8, 1.0), tree_bfloat16=(8, 4.0), ar_float32=(8, 3)),
        _record("p3", "rag", ar_bfloat16=(8, 4.0), pld_bfloat16=(8, 1.0), tree_bfloat16=(9, 4.0), ar_float32=(8, 3)),
    ]
    out = same_length_summary({"arms": arms, "prompts": prompts, "domains": ["code", "math", "rag"]})
    bf16 = out["bfloat16"]
    assert bf16["prompts"] == 2 and bf16["per_domain_prompts"] == {"code": 1, "math": 1, "rag": 0}
    assert bf16["speedup"]["pld@bfloat16"] == {"all": 6.0 / 2.0, "code": 2.0, "math": 4.0, "rag": None}
    assert bf16["speedup"]["tree@bfloat16"]["all"] == 6.0 / 4.5
    assert bf16["speedup"]["ar@bfloat16"]["code"] == 1.0
    assert out["float32"]["prompts"] == 4  # a dtype's set depends only on that dtype's arms


def test_bench_report_main_rewrites_a_saved_run(tmp_path):
    from hf_chainflow.bench.report import main

    with pytest.raises(ValueError, match="holds no results.json"):
        main([str(tmp_path)])
    arms = {"ar@bfloat16": {"name": "ar", "kind": "ar", "dtype": "bfloat16", "drafter": None, "tokens_per_second": 5.0,
                            "speedup": 1.0, "speedup_vs_fastest_ar": 1.0, "tau": 1.0, "draft_time_per_round": None,
                            "verify_time_per_round": None, "mismatches": 0, "near_ties": 0, "unexplained_mismatches": 0,
                            "acceptance_per_depth": None, "mismatch_details": [],
                            "per_domain": {"code": {"speedup": 1.0, "tau": 1.0}}}}
    saved = {"arms": arms, "domains": ["code"], "prompts": [_record("p0", "code", ar_bfloat16=(10, 2.0))],
             "settings": {"num_prompts": 1, "max_new_tokens": 10}, "machine": {}, "wall_time": 2.0}
    (tmp_path / "results.json").write_text(json.dumps(saved))
    assert main([str(tmp_path)]) == 0
    assert json.loads((tmp_path / "results.json").read_text())["same_length"]["bfloat16"]["prompts"] == 1
    assert "## Same-length prompts" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "speedup_per_domain.png").is_file()


def test_demo_dtype_is_float32_only_where_bf16_instructions_are_known_missing():
    from hf_chainflow.bench import demo_dtype, lacks_bf16_matrix_instructions

    assert demo_dtype({"amx_tile": False, "avx512_bf16": False}) == "float32"
    assert demo_dtype({"amx_tile": True, "avx512_bf16": False}) == "bfloat16"
    assert demo_dtype({"amx_tile": False, "avx512_bf16": True}) == "bfloat16"
    assert demo_dtype({"amx_tile": False, "avx512_bf16": None}) == "bfloat16"  # unknown: no claim
    assert demo_dtype({}) == "bfloat16" and not lacks_bf16_matrix_instructions({})  # no probe at all: no claim
    assert (demo_dtype() == "float32") == lacks_bf16_matrix_instructions()


def test_bf16_hardware_note_only_without_native_instructions():
    from hf_chainflow.bench.machine import bf16_hardware_note, bf16_matrix_instructions

    note = bf16_hardware_note({"amx_tile": False, "avx512_bf16": False}, "AVX2")
    assert note is not None and "AVX2" in note and "float32" in note
    assert bf16_hardware_note({"amx_tile": True, "avx512_bf16": False}, "AVX512") is None
    assert bf16_hardware_note({"amx_tile": False, "avx512_bf16": True}, "AVX512") is None
    assert bf16_hardware_note({"amx_tile": False, "avx512_bf16": None}, "AVX2") is None  # unknown: no claim
    support = bf16_matrix_instructions()  # torch 2.13 has both probes
    assert set(support) == {"amx_tile", "avx512_bf16"} and all(isinstance(v, bool) for v in support.values())
    assert (bf16_hardware_note() is None) == any(support.values())


def test_cpu_identity_reads_the_first_processor_block():
    from hf_chainflow.bench.machine import cpu_identity, machine_info

    text = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
            "model name\t: AMD EPYC\nflags\t\t: fpu avx512_bf16\n\n"
            "processor\t: 1\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\n")
    assert cpu_identity(text) == {"name": "AMD EPYC", "vendor": "AuthenticAMD", "family": 25, "model": 17}
    assert cpu_identity("") == {"name": None, "vendor": None, "family": None, "model": None}
    info = machine_info()
    assert {"cpu", "cpu_vendor", "cpu_family", "cpu_model", "bf16_matrix_instructions"} <= set(info)


@pytest.mark.parametrize("support, noted", [(False, True), (True, False)])
def test_bench_notes_a_cpu_without_bf16_matrix_instructions(monkeypatch, tmp_path, capsys, support, noted):
    import hf_chainflow.bench.machine as machine
    from hf_chainflow.commands import main

    monkeypatch.setattr(machine, "bf16_matrix_instructions", lambda: {"amx_tile": support, "avx512_bf16": False})
    missing = tmp_path / "missing.jsonl"  # the run stops at the prompts, before any model loads
    with pytest.raises(SystemExit, match="--prompts"):
        main(["bench", "--dtypes", "bfloat16", "--prompts", str(missing), "--threads", "1"])
    assert ("no native bfloat16 matrix instructions" in capsys.readouterr().out) is noted
    with pytest.raises(SystemExit, match="--prompts"):
        main(["bench", "--dtypes", "float32", "--prompts", str(missing), "--threads", "1"])
    assert "bfloat16 matrix" not in capsys.readouterr().out


# ---------------------------------------------------------------------------- the compiled plain arm (ar-compiled)

def test_ar_compiled_is_run_when_named_and_accepted_by_the_command(tmp_path):
    from hf_chainflow.commands import main

    assert "ar-compiled" not in {a.name for a in build_arms(["float32"], {})}  # compiling costs a warm-up: asked for
    arms = build_arms(["float32", "bfloat16"], {}, only=["ar", "ar-compiled@bfloat16"])
    assert [a.key for a in arms] == ["ar@float32", "ar@bfloat16", "ar-compiled@bfloat16"]
    compiled = arms[-1]
    assert compiled.kind == "ar" and compiled.compiled_plain and not arms[0].compiled_plain
    assert compiled.settings == {"compile": True, "cache_implementation": "static"}
    # the command accepts the arm (checked before anything loads: the missing target fails later, not the arm)
    with pytest.raises(BaseException) as caught:
        main(["bench", "--target", str(tmp_path / "no-target"), "--arms", "ar,ar-compiled", "--dtypes", "float32",
              "--output-dir", str(tmp_path / "out"), "--no-progress"])
    assert "unknown arms" not in str(caught.value)
    with pytest.raises(SystemExit, match=r"unknown arms \['ar-compiled@float16'\]"):
        main(["bench", "--target", str(tmp_path / "no-target"), "--arms", "ar,ar-compiled@float16",
              "--dtypes", "float32"])


def test_ar_compiled_compiles_outside_the_timed_runs_and_equals_ar(tmp_path):
    """One real compile (inductor, CPU): the arm warms up once, reports the warm-up's seconds, equals `ar`."""
    from hf_chainflow.bench.arms import plain_compile_config

    target = tiny_target("llama", num_layers=2)
    arms = build_arms(["float32"], {}, only=["ar", "ar-compiled"])
    prompts = _prompts(target.config.vocab_size)
    results = run_bench({"float32": target}, prompts, arms, max_new_tokens=12, warmup=prompts[0], pad_token_id=0,
                        progress=False)
    state = results["plain_compile"]["ar-compiled@float32"]
    assert state["compiled"] is True and state["reason"] is None and state["warmup_seconds"] > 0
    assert state["max_cache_len"] == max(p.input_ids.shape[1] for p in prompts) + 12  # one graph for every prompt
    assert target._last_compile_config == plain_compile_config()  # transformers' own compile path ran
    out = results["arms"]["ar-compiled@float32"]
    assert out["compiled"] is True and out["compile_warmup_seconds"] == state["warmup_seconds"]
    assert out["mismatches"] == 0 and out["tau"] == 1.0  # plain greedy: the same tokens as `ar`
    assert [p["arms"]["ar-compiled@float32"]["new_tokens"] for p in results["prompts"]] == [12] * len(prompts)
    assert results["fastest_ar"] in ("ar@float32", "ar-compiled@float32")
    md = write_results(results, tmp_path)["md"].read_text()
    assert "## Compiled plain arm" in md and f"| ar-compiled@float32 | yes | {state['warmup_seconds']:.1f} |" in md
    assert f"against the fastest plain arm of the run, `{results['fastest_ar']}`" in md
    assert json.loads((tmp_path / "results.json").read_text())["plain_compile"] == results["plain_compile"]


def _failing_backend(gm, example_inputs):
    raise RuntimeError("Compiler: g++ not found")  # what inductor raises on a machine without a C++ compiler


@pytest.mark.parametrize("how", ["no_compiler", "declined"])
def test_ar_compiled_that_cannot_compile_warns_and_is_labelled(how, monkeypatch, caplog, tmp_path):
    """A platform that cannot compile: one warning line, the arm runs eager (static cache), reported as not
    compiled, and still equals `ar`."""
    from transformers import CompileConfig

    import hf_chainflow.bench.arms as arms_module

    def config():
        c = CompileConfig(backend=_failing_backend, mode=None)
        c._compile_all_devices = how == "no_compiler"  # "declined": transformers skips compiling on CPU
        return c

    monkeypatch.setattr(arms_module, "plain_compile_config", config)
    target = tiny_target("llama", num_layers=2)
    arms = build_arms(["float32"], {}, only=["ar", "ar-compiled"])
    prompts = _prompts(target.config.vocab_size)[:2]
    with caplog.at_level("WARNING", logger="hf_chainflow.bench.arms"):
        results = run_bench({"float32": target}, prompts, arms, max_new_tokens=8, pad_token_id=0, progress=False)
    warnings = [r.getMessage() for r in caplog.records if r.name == "hf_chainflow.bench.arms"]
    assert len(warnings) == 1 and "\n" not in warnings[0] and "cannot compile" in warnings[0]
    assert ("g++ not found" in warnings[0]) == (how == "no_compiler")
    state = results["plain_compile"]["ar-compiled@float32"]
    assert state["compiled"] is False and state["reason"] and state["warmup_seconds"] >= 0
    out = results["arms"]["ar-compiled@float32"]
    assert out["compiled"] is False and out["mismatches"] == 0
    md = write_results(results, tmp_path)["md"].read_text()
    assert "| ar-compiled (not compiled) | float32 |" in md and "| ar-compiled@float32 | **no** |" in md


def test_speedup_vs_fastest_ar_takes_the_fastest_plain_arm():
    from hf_chainflow.bench import Run, summarise

    arms = [Arm("ar", "ar", "float32"), Arm("ar", "ar", "bfloat16"),
            Arm("ar-compiled", "ar", "bfloat16", settings={"compile": True, "cache_implementation": "static"}),
            Arm("tree", "tree", "bfloat16", drafter="chainflow")]
    seconds = {"ar@float32": 4.0, "ar@bfloat16": 2.0, "ar-compiled@bfloat16": 1.0, "tree@bfloat16": 0.5}
    prompts = [BenchPrompt("p0", "code", torch.ones(1, 3, dtype=torch.long))]
    runs = {k: [Run([5] * 10, s)] for k, s in seconds.items()}
    per_prompt = [{"id": "p0", "domain": "code", "arms": {k: {"new_tokens": 10, "seconds": s}
                                                            for k, s in seconds.items()}}]
    arms[2].compile_state = {"compiled": True, "warmup_seconds": 12.5, "max_cache_len": 40, "reason": None}
    results = summarise(arms, runs, {k: [] for k in seconds}, per_prompt, prompts, settings={"num_prompts": 1,
                        "max_new_tokens": 10}, machine={}, wall_time=1.0)
    out = results["arms"]
    assert results["fastest_ar"] == "ar-compiled@bfloat16"
    assert out["tree@bfloat16"]["speedup"] == pytest.approx(4.0)  # against same-dtype eager `ar`, as before
    assert out["tree@bfloat16"]["speedup_vs_fastest_ar"] == pytest.approx(2.0)  # against the compiled arm
    assert out["ar@float32"]["speedup_vs_fastest_ar"] == pytest.approx(0.25)
    assert out["tree@bfloat16"]["per_domain"]["code"]["speedup_vs_fastest_ar"] == pytest.approx(2.0)
    assert out["ar-compiled@bfloat16"]["compile_warmup_seconds"] == 12.5
    assert "compiled" not in out["ar@bfloat16"]
    md = markdown_table(results)
    assert "against the fastest plain arm of the run, `ar-compiled@bfloat16`" in md
    assert "| ar-compiled@bfloat16 | yes | 12.5 | 40 |" in md


# ---------------------------------------------------------------------------- compiled verification arms
def test_compiled_verification_arms_are_opt_in_and_run_compiled(tmp_path, monkeypatch):
    """pld-compiled, tree+lookup-compiled and tree+lookup-auto: named to run, warmed up before timing, every round
    compiled (torch.compile's aot_eager backend here), the same tokens as `ar` in float32, the budgets reported."""
    from hf_chainflow.generation import compiled_verification

    monkeypatch.setattr(compiled_verification, "COMPILE_BACKEND", "aot_eager")
    monkeypatch.setenv("HF_CHAINFLOW_CALIBRATION_CACHE", "0")
    target = tiny_target("llama", num_layers=2)
    drafter = ChainFlowDrafter(ChainFlowConfig.for_target(target.config, **DRAFTER)).bind_target(target).eval()
    drafters = {"oracle": {"float32": drafter}}
    lookup = {"lookup_num_tokens": 4, "lookup_trust_ngram": None, "lookup_max_tokens": None}
    names = ["pld-compiled", "tree+lookup-compiled", "tree+lookup-auto"]
    plain = build_arms(["float32"], {"oracle": drafters["oracle"]["float32"]}, lookup=lookup,
                       default_drafter="oracle")
    assert not set(names) & {a.name for a in plain}  # compiling costs a warm-up: asked for by name
    arms = build_arms(["float32"], {"oracle": drafters["oracle"]["float32"]}, pld_tokens=4, tree=(3, 3),
                      tree_budget=4, lookup=lookup, default_drafter="oracle", only=["ar", "tree+lookup", *names])
    assert [a.name for a in arms] == ["ar", "pld-compiled", "tree+lookup", "tree+lookup-compiled",
                                      "tree+lookup-auto"]
    assert [a.compiled_verification for a in arms] == [False, True, False, True, True]
    assert arms[-1].settings["tree_budget"] == "auto"
    drafting_record = warm_up_arms(arms, drafters, None)
    assert set(drafting_record["oracle"]["cost_curves"]) == {"tree+lookup-auto@float32"}
    prompts = _prompts(target.config.vocab_size)
    results = run_bench({"float32": target}, prompts, arms, drafters, max_new_tokens=12, warmup=prompts[0],
                        pad_token_id=0, progress=False)
    assert results["verify_compile"]["float32"]["compiled"] is True
    out = results["arms"]
    for name in names:
        a = out[f"{name}@float32"]
        assert a["mismatches"] == 0 and a["compiled_rounds"] > 0 and a["eager_rounds"] == 0, (name, a)
    assert out["tree+lookup@float32"]["compiled_rounds"] == 0 and out["tree+lookup@float32"]["eager_rounds"] > 0
    assert out["tree+lookup-auto@float32"]["auto_budgets"]["trees"] > 0
    assert out["pld-compiled@float32"]["tau"] >= 1.0
    assert out["tree+lookup@float32"]["tau"] >= 1.0
