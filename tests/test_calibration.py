"""Machine-sized drafting: the budget maths (`hf_chainflow.generation.budget`), the cost curve and its cache
(`hf_chainflow.generation.calibration`), `tree_budget="auto"` in the settings and through `generate` (lossless on
tiny Llama, Qwen3 and the Qwen3.5 hybrid, batch 1 and ragged), and the `calibrate` command's up-front checks."""

import itertools
import json
import math
import random

import pytest
import torch

from hf_chainflow.generation import calibration
from hf_chainflow.generation.budget import (
    acceptance_ratio,
    choose_batch_budgets,
    choose_budget,
    scaled_probabilities,
)
from hf_chainflow.generation.calibration import CostCurve
from hf_chainflow.generation.settings import SearchSettings, SpeculativeSettings
from hf_chainflow.testing import TINY_FAMILIES, OracleDrafter, tiny_target

from _speculative import random_drafter

SMALL = dict(rows=(1, 2, 4), context=16, repeats=1, warmup=0)  # a quick measurement where timing is not the point


@pytest.fixture(autouse=True)
def calibration_home(tmp_path, monkeypatch):
    """Every test caches curves in its own folder, never under the real HF_HOME."""
    monkeypatch.setenv(calibration.DIR_ENV, str(tmp_path / "calibration"))
    monkeypatch.delenv(calibration.CACHE_ENV, raising=False)
    return tmp_path / "calibration"


# ---------------------------------------------------------------------------------------------- the choice
def brute_force(probs, cost, extra=0, draft=0.0):
    """The best `k` by the definition, ties to the smaller."""
    ranked = sorted(probs, reverse=True)
    rates = [(1 + sum(ranked[:k])) / (cost(1 + k + extra) + draft) for k in range(len(ranked) + 1)]
    best = max(rates)
    return next(k for k, r in enumerate(rates) if r >= best * (1 - 1e-12))


def test_flat_costs_keep_every_node_of_positive_probability():
    probs = [0.9, 0.0, 0.5, 0.2, 0.0, 1e-3]
    assert choose_budget(probs, lambda n: 0.05) == 4
    assert choose_budget([0.0, 0.0], lambda n: 0.05) == 0
    assert choose_budget([], lambda n: 0.05) == 0


def test_steeper_costs_keep_fewer_nodes():
    probs = [0.95, 0.8, 0.6, 0.5, 0.3, 0.2, 0.1, 0.05]
    chosen = [choose_budget(probs, lambda n, s=s: 1.0 + s * n) for s in (0.0, 0.02, 0.1, 0.3, 1.0, 100.0)]
    assert chosen == sorted(chosen, reverse=True) and chosen[0] == len(probs) and chosen[-1] == 0, chosen
    assert len(set(chosen)) >= 4, chosen  # the steps in between are chosen too


def test_choice_matches_the_definition_on_random_rounds():
    gen = random.Random(0)
    for _ in range(300):
        probs = [gen.random() ** 3 for _ in range(gen.randint(0, 12))]
        slope, base, extra = gen.random() * 0.5, gen.random() * 2 + 0.1, gen.randint(0, 5)
        power = gen.choice([0.5, 1.0, 1.5])
        cost = lambda n: base + slope * n ** power  # noqa: E731
        draft = gen.choice([0.0, 0.3, 3.0])
        assert choose_budget(probs, cost, extra_rows=extra, draft_seconds=draft) == \
            brute_force(probs, cost, extra, draft)


def test_ties_go_to_the_smaller_budget_and_drafting_cost_favours_more_nodes():
    assert choose_budget([1.0], lambda n: float(n)) == 0  # 1 token per second either way
    assert choose_budget([1.0, 1.0], lambda n: float(n)) == 0
    probs, cost = [0.5] * 4, lambda n: 0.6 * n
    assert choose_budget(probs, cost) < choose_budget(probs, cost, draft_seconds=10.0) == 4


def test_batch_choice_shares_one_width():
    cost = lambda n: 1.0 + 0.05 * n ** 1.3  # noqa: E731
    probs = [[0.9, 0.7, 0.4, 0.1], [0.6, 0.2], []]
    ks = choose_batch_budgets(probs, cost, extra_rows=[0, 1, 3])
    width = 1 + max(k + e for k, e in zip(ks, [0, 1, 3]))
    assert ks[2] == 0 and all(k == min(len(p), width - 1 - e) for k, p, e in zip(ks, probs, [0, 1, 3]))
    best = max(range(4, 6), key=lambda n: sum(1 + sum(sorted(p, reverse=True)[:min(len(p), n - 1 - e)])
                                              for p, e in zip(probs, [0, 1, 3])) / cost(3 * n))
    assert width == best
    for p in probs:  # one row is the single-row choice
        assert choose_batch_budgets([p], cost) == [choose_budget(p, cost)]
    assert choose_batch_budgets([], cost) == []


@pytest.mark.parametrize("call, needle", [
    (lambda: choose_budget([1.5], lambda n: 1.0), r"`path_probs\[0\]` must hold path probabilities in \[0, 1\]"),
    (lambda: choose_budget([0.5], lambda n: -1.0), r"`cost\(1\)` must be a finite number of seconds >= 0"),
    (lambda: choose_budget([0.5], lambda n: 1.0, draft_seconds=math.nan), r"`draft_seconds` must be a finite"),
    (lambda: choose_batch_budgets([[0.5]], lambda n: 1.0, extra_rows=[1, 2]), r"`extra_rows` must hold one count"),
])
def test_choice_refuses_bad_inputs(call, needle):
    with pytest.raises(ValueError, match=needle):
        call()


def test_acceptance_correction():
    assert acceptance_ratio(0, 0) == 1.0  # nothing counted yet: the drafter's own probabilities
    assert acceptance_ratio(2, 10, prior=8) == pytest.approx(10 / 18)
    assert acceptance_ratio(0, 1000) == 0.25 and acceptance_ratio(1000, 0) == 4.0  # clamped
    assert scaled_probabilities([0.9, 0.5, 0.1], 2.0) == [1.0, 1.0, 0.2]
    with pytest.raises(ValueError, match="must be >= 0"):
        acceptance_ratio(-1, 0)


def test_auto_budget_cuts_each_tree_and_counts_the_correction():
    from hf_chainflow.generation.budget import AutoBudget
    from hf_chainflow.generation.tree import DraftTree

    drafter = OracleDrafter(tiny_target("llama", num_layers=1))
    curve = fake_curve(lambda n: 0.01 + 0.004 * n)
    calibration.set_cost_curve(drafter, curve)
    probs = torch.tensor([0.9, 0.1, 0.8, 0.5])  # path probabilities 0.9, 0.1, 0.72, 0.36
    tree = DraftTree(tokens=torch.tensor([5, 6, 7, 8]), parents=torch.tensor([-1, -1, 0, 2]),
                     depths=torch.tensor([1, 1, 2, 3]), logprobs=probs.log())
    auto = AutoBudget(drafter, SpeculativeSettings(mode="tree", tree_budget="auto"))
    assert drafter._runtime["last_auto_budget"] is auto
    cut, alone = auto.cut([tree, None], [0, 2])
    (k, zero) = choose_batch_budgets([[0.9, 0.1, 0.72, 0.36], []], curve, extra_rows=[0, 2])
    assert alone is None and zero == 0 and auto.budgets == [[k]] and 0 < k < 4
    assert cut.tokens.tolist() == tree.top_nodes(k).tokens.tolist()
    auto.accepted([2, 5], [True, True])  # the row without a drafted tree is not counted
    predicted = sum(sorted([0.9, 0.1, 0.72, 0.36], reverse=True)[:k])
    assert auto.accepted_nodes == 2 and auto.predicted_nodes == pytest.approx(predicted)
    assert auto.ratio == pytest.approx(acceptance_ratio(2, predicted))
    auto.cut([tree], [3])
    auto.accepted([1], [False])  # a round with a lookup branch merged: not counted
    assert auto.accepted_nodes == 2


# ---------------------------------------------------------------------------------------------- the curve
def fake_curve(seconds_of, rows=(1, 2, 4, 8, 16, 32, 64), draft_seconds=0.0, **fields) -> CostCurve:
    return CostCurve(rows=rows, seconds=tuple(seconds_of(n) for n in rows), draft_seconds=draft_seconds, **fields)


def test_curve_interpolates_and_round_trips():
    curve = CostCurve(rows=(1, 4, 8), seconds=(0.01, 0.02, 0.04), draft_seconds=0.003,
                      target={"model_type": "llama"}, dtype="bfloat16", machine="m", torch="t", threads=2)
    assert curve(1) == 0.01 and curve(8) == 0.04 and curve(0) == 0.01
    assert curve(2) == pytest.approx(0.01 + 0.01 / 3) and curve(6) == pytest.approx(0.03)
    assert curve(12) == pytest.approx(0.06)  # the last segment extended
    assert curve.steps(8) == pytest.approx(4.0)
    again = CostCurve.from_dict(json.loads(json.dumps(curve.to_dict())))
    assert again == curve and again.key() == curve.key()
    assert CostCurve(rows=(1, 2), seconds=(0.02, 0.01))(9) == 0.01  # a falling last segment is not extended down


@pytest.mark.parametrize("fields, needle", [
    (dict(rows=(2, 1), seconds=(1.0, 1.0)), "must be increasing positive integers"),
    (dict(rows=(1,), seconds=(0.0,)), "must be positive finite numbers"),
    (dict(rows=(1, 2), seconds=(1.0,)), "non-empty and of one length"),
    (dict(rows=(1,), seconds=(1.0,), draft_seconds=-1), "`CostCurve.draft_seconds` must be a finite number"),
])
def test_curve_refuses_bad_fields(fields, needle):
    with pytest.raises(ValueError, match=needle):
        CostCurve(**fields)


def test_measuring_runs_the_verify_path_and_puts_the_cache_back():
    for family in ("llama", "qwen3_5"):  # a dense cache cut back, a hybrid one copied back
        target = tiny_target(family, num_layers=2)
        curve = calibration.measure_cost_curve(target, rows=(1, 3, 9), context=20, repeats=2, warmup=1)
        assert curve.rows == (1, 3, 9) and all(s > 0 for s in curve.seconds) and curve.draft_seconds == 0.0
        assert curve.target["model_type"] == target.config.model_type and curve.dtype == "float32"
        assert curve.variant == "eager" and curve.threads == torch.get_num_threads() and curve.drafter is None
    target = tiny_target("llama", num_layers=2)
    drafter = random_drafter(target)
    drafter.generation_config.draft_mode = "tree"
    assert calibration.call_target(drafter) is target  # the binding's weak reference
    with_draft = calibration.measure_cost_curve(target, drafter=drafter, **SMALL)
    assert with_draft.draft_seconds > 0 and with_draft.drafter["round"]["tree_budget"] is None


# ---------------------------------------------------------------------------------------------- the cache
def test_cache_round_trip_and_key_separation(calibration_home):
    target = tiny_target("llama", num_layers=1)
    first = calibration.load_or_measure(target, **SMALL)
    assert first.measured and first.path.parent == calibration_home and first.path.is_file()
    assert first.path.stem == first.curve.key() == calibration.expected_key(target, context=16)
    again = calibration.load_or_measure(target, **SMALL)
    assert not again.measured and again.path == first.path and again.curve == first.curve
    bf16 = calibration.load_or_measure(tiny_target("llama", num_layers=1).to(torch.bfloat16), **SMALL)
    compiled = calibration.load_or_measure(target, variant="compiled", **SMALL)
    qwen = calibration.load_or_measure(tiny_target("qwen3", num_layers=1), **SMALL)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        more_threads = calibration.load_or_measure(target, **SMALL)
    finally:
        torch.set_num_threads(threads)
    paths = {r.path for r in (first, bf16, compiled, qwen, more_threads)}
    assert len(paths) == 5 and all(r.measured for r in (bf16, compiled, qwen, more_threads))
    assert sorted(p.name for p in calibration_home.iterdir()) == sorted(p.name for p in paths)  # no temp files left
    assert calibration.load_or_measure(target, refresh=True, **SMALL).measured


def test_cache_off_measures_every_time_and_writes_nothing(calibration_home, monkeypatch):
    target = tiny_target("llama", num_layers=1)
    monkeypatch.setenv(calibration.CACHE_ENV, "0")
    assert not calibration.cache_enabled()
    for _ in range(2):
        result = calibration.load_or_measure(target, **SMALL)
        assert result.measured and result.path is None
    assert not calibration_home.exists()
    monkeypatch.setenv(calibration.CACHE_ENV, "1")
    assert calibration.load_or_measure(target, cache=False, **SMALL).path is None and not calibration_home.exists()
    monkeypatch.setenv(calibration.CACHE_ENV, "maybe")
    with pytest.raises(ValueError, match="`HF_CHAINFLOW_CALIBRATION_CACHE` must be 1 .* or 0 .*, got 'maybe'"):
        calibration.load_or_measure(target, **SMALL)


def test_default_folder_is_under_the_hugging_face_home(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.delenv(calibration.DIR_ENV)
    assert calibration.calibration_dir() == calibration.Path(constants.HF_HOME) / "hf_chainflow" / "calibration"


@pytest.mark.parametrize("text", ["{not json", json.dumps({"format": 1, "rows": [1]}), json.dumps([1, 2]),
                                  json.dumps({"format": 1, "rows": [1], "seconds": [-1.0]})])
def test_a_damaged_cache_file_is_named_with_the_fix(calibration_home, text):
    target = tiny_target("llama", num_layers=1)
    path = calibration_home / f"{calibration.expected_key(target, context=16)}.json"
    path.parent.mkdir(parents=True)
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"The cached cost curve {path} is damaged .* Delete it") as error:
        calibration.load_or_measure(target, **SMALL)
    assert "Traceback" not in str(error.value)


# ---------------------------------------------------------------------------------------------- the settings
def test_auto_budget_settings():
    settings = SpeculativeSettings(mode="tree", tree_budget="auto", max_depth=8)
    assert settings.auto_budget and settings.draft_kwargs(10)["tree_budget"] is None  # drafted whole, cut later
    assert not SpeculativeSettings(mode="chain", tree_budget="auto").auto_budget  # chains are never cut
    assert SpeculativeSettings(mode="chain", tree_budget="auto").draft_kwargs(10)["tree_budget"] is None
    assert not SpeculativeSettings(mode="tree", tree_budget=12).auto_budget
    for bad in ("Auto", "12", 0, -1, 2.5, True):
        with pytest.raises(ValueError, match=r"`drafter.generation_config.tree_budget` must be None \(keep every "
                                             r"node\) or a positive integer or 'auto'"):
            SpeculativeSettings(mode="tree", tree_budget=bad)
    with pytest.raises(ValueError, match=r"`tree_budget='auto'` is chosen round by round .* one drafting pass "
                                         r"takes None"):
        SearchSettings(mode="tree", tree_budget="auto")


def test_auto_budget_from_a_drafter_config():
    drafter = OracleDrafter(tiny_target("llama", num_layers=1))
    g = drafter.generation_config
    g.draft_mode, g.tree_budget = "tree", "auto"
    assert SpeculativeSettings.from_drafter(drafter).auto_budget
    g.tree_budget = "automatic"
    with pytest.raises(ValueError, match="or 'auto'"):
        SpeculativeSettings.from_drafter(drafter)


# ---------------------------------------------------------------------------------------------- generate
MAX_NEW, PAD = 16, 0


def _setup(family):
    target = tiny_target(family)
    gen = torch.Generator().manual_seed(3)
    span = torch.randint(3, 256, (6,), generator=gen)
    prompts = [torch.randint(3, 256, (n,), generator=gen) for n in (9, 3, 17)]
    prompts.append(torch.cat([span, torch.randint(3, 256, (3,), generator=gen), span]))  # prompt lookup finds it
    refs = [target.generate(p[None], max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                            pad_token_id=PAD)[0, p.shape[0]:] for p in prompts]
    return target, prompts, refs


def _generate(target, drafter, prompts):
    width = max(p.shape[0] for p in prompts)
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - p.shape[0]:], mask[b, width - p.shape[0]:] = p, 1
    out = target.generate(ids, attention_mask=mask if len(prompts) > 1 else None, max_new_tokens=MAX_NEW,
                          do_sample=False, eos_token_id=None, pad_token_id=PAD, assistant_model=drafter)
    return [out[b, width:] for b in range(len(prompts))]


STEEP = fake_curve(lambda n: 1e-3 * n * n)  # each input costs more than the last: few nodes pay
FLAT = fake_curve(lambda n: 0.01)  # inputs are free: every node of positive probability is kept


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_auto_budget_generates_exactly_plain_greedy(family):
    target, prompts, refs = _setup(family)
    makers = {"oracle": lambda: OracleDrafter(target, error_rate=0.3, seed=5),
              "chainflow": lambda: random_drafter(target)}
    for (kind, make), curve, lookup in itertools.product(makers.items(), (STEEP, FLAT), (None, 3)):
        drafter = make()
        g = drafter.generation_config
        g.draft_mode, g.tree_width, g.tree_depth, g.tree_budget, g.lookup_num_tokens = "tree", 4, 3, "auto", lookup
        calibration.set_cost_curve(drafter, curve)
        chosen = []
        for rows in ([0], [3], [0, 1, 2, 3]):  # batch 1, and a ragged left-padded batch
            got = _generate(target, drafter, [prompts[i] for i in rows])
            for b, i in enumerate(rows):
                assert torch.equal(got[b], refs[i]), (family, kind, curve is FLAT, lookup, rows, b)
            auto = drafter._runtime["last_auto_budget"]
            assert auto.budgets and auto.curve is curve
            chosen += [k for ks in auto.budgets for k in ks]
        nodes = 4 * 3
        if kind == "oracle" and curve is FLAT:  # path probability 1 everywhere: the whole tree (cut to its room)
            assert nodes in chosen and set(chosen) <= {4, 8, nodes}, chosen
        if curve is STEEP:
            assert max(chosen) < nodes, chosen
        if kind == "chainflow" and curve is FLAT:
            assert max(chosen) > min(chosen) or min(chosen) == nodes, chosen


def test_auto_budget_measures_once_through_the_cache(calibration_home, monkeypatch):
    measured = []
    real = calibration.measure_cost_curve

    def quick(target, **kwargs):
        measured.append(kwargs.get("variant"))
        return real(target, **{**kwargs, "rows": (1, 2, 4, 8, 16), "context": 16, "repeats": 1, "warmup": 0})

    monkeypatch.setattr(calibration, "measure_cost_curve", quick)
    target, prompts, refs = _setup("llama")
    drafter = random_drafter(target)  # a ChainFlowDrafter: found through its binding, its round timed too
    g = drafter.generation_config
    g.draft_mode, g.tree_width, g.tree_depth, g.tree_budget = "tree", 4, 3, "auto"
    for rows in ([0], [1, 2]):
        got = _generate(target, drafter, [prompts[i] for i in rows])
        assert all(torch.equal(got[b], refs[i]) for b, i in enumerate(rows))
    assert measured == ["eager"]  # once per process: then from the drafter's runtime
    (stored,) = calibration_home.iterdir()
    curve = calibration.load_curve(stored)
    assert curve.draft_seconds > 0 and curve.drafter is not None
    other = random_drafter(target)  # a new drafter object: read from the cache, not measured
    other.generation_config.draft_mode, other.generation_config.tree_width = "tree", 4
    other.generation_config.tree_depth, other.generation_config.tree_budget = 3, "auto"
    _generate(target, other, [prompts[0]])
    assert measured == ["eager"] and other._runtime["last_auto_budget"].curve == curve


def test_auto_budget_needs_a_target_or_a_pinned_curve():
    drafter = random_drafter(tiny_target("llama", num_layers=1))
    drafter.unbind_target()
    with pytest.raises(ValueError, match="not bound to a target"):
        calibration.call_target(drafter)
    with pytest.raises(ValueError, match="must be a `CostCurve` or None"):
        calibration.set_cost_curve(drafter, {"rows": [1]})


# ---------------------------------------------------------------------------------------------- the command
def test_calibrate_command_checks_arguments_before_loading(capsys, monkeypatch):
    from hf_chainflow.commands import main

    with pytest.raises(SystemExit, match="`--no-drafter` times no drafter, but `--drafter-path` names one"):
        main(["calibrate", "--no-drafter", "--drafter-path", "x"])
    with pytest.raises(SystemExit, match="`--refresh` overwrites the cached curve, but `--no-cache`"):
        main(["calibrate", "--no-cache", "--refresh"])
    with pytest.raises(SystemExit, match="`--drafter-path` must be"):
        main(["calibrate", "--drafter-path", "/no/such/folder"])
    monkeypatch.setenv(calibration.CACHE_ENV, "sometimes")
    with pytest.raises(SystemExit, match="HF_CHAINFLOW_CALIBRATION_CACHE"):
        main(["calibrate", "--target", "smollm2-135m-instruct", "--no-drafter"])
    with pytest.raises(SystemExit):
        main(["calibrate", "--threads", "0"])
    assert "expected a positive integer" in capsys.readouterr().err


def test_calibrate_table():
    from hf_chainflow.commands.calibrate import format_curve

    text = format_curve(fake_curve(lambda n: 0.01 + 0.001 * n, draft_seconds=0.002, target={"model_type": "llama"},
                                   drafter={"config": "x"}))
    lines = text.splitlines()
    assert lines[1].split() == ["inputs", "ms", "x", "1-input"]
    assert lines[2].split() == ["1", "11.00", "1.00"] and lines[-2].split() == ["64", "74.00", "6.73"]
    assert lines[-1] == "drafting round: 2.00 ms"
