"""The test suite runs on a clone placed anywhere: no test names a path on the machine it was written on, and the
committed fixtures it reads instead (`tests/fixtures/`, described in its README) are what the tests expect."""

import json
import re
from pathlib import Path

from _fixtures import FIXTURES, PROMPTS, RESPONSE_PROMPTS, RESPONSES

TESTS = Path(__file__).resolve().parent
WORK = "/" + "work"  # spelled in two parts, so that this file does not name the path it looks for
# an absolute path starting at that directory: not a relative `x/work` or a word like `homework`
ABSOLUTE_WORK = re.compile(r"(?<![\w./~-])" + re.escape(WORK) + r"(?![\w.-])")


def test_the_pattern_finds_absolute_work_paths_only():
    for text in (f'Path("{WORK}/shared/data/prompts/train.jsonl")', f"'{WORK}'", f"cd {WORK}/main && make",
                 f"PROMPTS={WORK}/shared"):
        assert ABSOLUTE_WORK.search(text), text
    for text in (f"runs{WORK}/x", f"homework/{WORK[1:]}s", f"~{WORK}", f"{WORK}er/x", f"{WORK}.py", "network"):
        assert not ABSOLUTE_WORK.search(text), text


def test_no_test_file_names_an_absolute_work_path():
    files = [p for p in sorted(TESTS.rglob("*")) if p.is_file() and "__pycache__" not in p.parts]
    assert TESTS / "conftest.py" in files and RESPONSES in files  # the walk sees the tests and the fixtures
    found = []
    for path in files:
        try:
            text = path.read_text()
        except UnicodeDecodeError:  # a binary file names no path a test reads
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if ABSOLUTE_WORK.search(line):
                found.append(f"{path.relative_to(TESTS.parent)}:{n}: {line.strip()}")
    assert not found, ("tests must read committed files (tests/fixtures/, see its README), not paths on one "
                       "machine:\n" + "\n".join(found))


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_fixtures_hold_what_the_tests_and_their_readme_say():
    prompts, responses, answered = _rows(PROMPTS), _rows(RESPONSES), _rows(RESPONSE_PROMPTS)
    assert (len(prompts), len(responses), len(answered)) == (48, 50, 50)
    for row in prompts + answered:
        assert {"id", "domain", "language", "source", "prompt"} <= set(row) and row["prompt"], row["id"]
    assert [n for n, row in enumerate(prompts) if "turns" in row] == [25, 40]  # test_data.py takes row 25
    for row in responses:
        assert set(row) == {"id", "domain", "language", "source", "prompt_ids", "response_ids", "finish"}
        assert row["finish"] in ("eos", "length") and 0 < len(row["response_ids"]) <= 256
        assert (row["response_ids"][-1] == 2) == (row["finish"] == "eos")  # SmolLM2's EOS id ends an "eos" row
    assert {r["id"] for r in answered} == {r["id"] for r in responses}  # each response's prompt row is there
    assert not {r["id"] for r in answered} & {r["id"] for r in prompts}
    readme = (FIXTURES / "README.md").read_text()
    for path in (PROMPTS, RESPONSES, RESPONSE_PROMPTS):
        assert f"`{path.name}`" in readme
    for source in {r["source"] for r in prompts + answered}:  # every copied source has its licence recorded
        assert f"| `{source}` |" in readme, source
    assert sum(p.stat().st_size for p in FIXTURES.iterdir()) < 300_000  # small fixtures, not a corpus
