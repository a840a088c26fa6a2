"""The documentation's cross-references resolve and its pages keep their size.

- Relative links name files that exist, `#anchors` name headings, and a reference by title
  (`[results.md](results.md), "Reading"`, `docs/results.md, "Reading"`, `docs/research/training-rounds.md, "A twelfth
  round"` or `section "Reading"` for the same page) names a heading or a bold paragraph lead of that page. The docs
  refer to each other by section title in prose; this keeps those references from going stale when a section moves
  or is renamed.
- The README stays at most 150 lines and each reference page in `docs/` at most 300; the research folder
  (`docs/research/`, the lab notebook) is exempt, but its index links every result folder, script and recipe in it.
"""

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES, REFERENCE_MAX_LINES = 150, 300
PAGES = sorted(
    [ROOT / "README.md", ROOT / "examples" / "README.md", *ROOT.glob("docs/**/*.md"),
     *ROOT.glob("hf_chainflow/checkpoints/*/README.md")]
)


def github_slug(heading):
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(text):
    return [line.lstrip("#").strip() for line in text.split("\n") if re.match(r"#{1,6} ", line)]


def titles(text):
    """Headings and bold paragraph leads (`**Title.**` at the start of a line or bullet), whitespace collapsed."""
    leads = re.findall(r"(?m)^\s*(?:- )?\*\*(.+?)\*\*", text)
    return [re.sub(r"\s+", " ", t) for t in headings(text) + leads]


def without_code(text):
    return re.sub(r"```.*?```", "", text, flags=re.S)


# `[x.md](x.md), "Title"` or `docs/x.md, "Title"` (optionally `, section "Title"`), in text with newlines collapsed
DOC_TITLE = re.compile(
    r'(?:\]\((?P<link>[\w./-]+\.md)\)|(?<![\w/\[.-])(?P<bare>(?:[\w-]+/)*[\w-]+\.md)),? (?:section )?"(?P<title>[^"]+)"'
)
SAME_PAGE_TITLE = re.compile(r'(?<!\.md\), )(?<!\.md, )section "(?P<title>[^"]+)"')


def resolve_page(page, name, linked):
    if linked:
        return (page.parent / name).resolve()
    if name.startswith(("docs/", "examples/", "hf_chainflow/")):
        return (ROOT / name).resolve()
    for candidate in (page.parent / name, ROOT / "docs" / name, ROOT / name):
        if candidate.exists():
            return candidate.resolve()
    return (page.parent / name).resolve()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(page):
    text = without_code(page.read_text())
    problems = []
    for match in re.finditer(r"\]\(([^)\s]+)\)", text):
        target = match.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            problems.append(f"link to a missing file: {target}")
            continue
        if anchor and file.suffix == ".md":
            if anchor not in {github_slug(h) for h in headings(file.read_text())}:
                problems.append(f"link to a missing heading: {target}")
    assert not problems, f"{page.relative_to(ROOT)}:\n" + "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_references_by_title_name_a_section(page):
    text = re.sub(r"\s*\n\s*", " ", without_code(page.read_text()))
    problems = []
    for match in DOC_TITLE.finditer(text):
        name = match.group("link") or match.group("bare")
        target = resolve_page(page, name, linked=bool(match.group("link")))
        if not target.exists():
            problems.append(f"reference to a missing page: {name}")
        elif not any(t.startswith(match.group("title")) for t in titles(target.read_text())):
            problems.append(f'{name} has no section "{match.group("title")}"')
    own = titles(page.read_text())
    for match in SAME_PAGE_TITLE.finditer(text):
        if not any(t.startswith(match.group("title")) for t in own):
            problems.append(f'this page has no section "{match.group("title")}"')
    assert not problems, f"{page.relative_to(ROOT)}:\n" + "\n".join(problems)


CODE = sorted(
    [*ROOT.glob("examples/*.py"), *ROOT.glob("examples/*.sh"), *ROOT.glob("docs/research/scripts/*"),
     *ROOT.glob("docs/research/recipes/*"), *ROOT.glob("hf_chainflow/**/*.py")]
)


@pytest.mark.parametrize("source", CODE, ids=lambda p: str(p.relative_to(ROOT)))
def test_code_and_example_references_name_a_section(source):
    """Comments, docstrings and messages that cite `docs/x.md, "Title"` name a section of that page (pages outside
    the repository, such as the shared SPEC.md, are not checked)."""
    text = source.read_text().replace('\\"', '"')
    text = re.sub(r"\s*\n\s*(?:#\s*)?", " ", text)  # join wrapped comment lines
    problems = []
    for match in re.finditer(r'(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.md),? (?:section )?"([^"]+)"', text):
        name = match.group(1)
        page = ROOT / name if "/" in name else ROOT / "docs" / name
        if not page.exists():
            if "/" in name:  # a bare name outside docs/ (such as the shared SPEC.md) is not checked
                problems.append(f"reference to a missing page: {name}")
            continue
        if not any(t.startswith(match.group(2).strip()) for t in titles(page.read_text())):
            problems.append(f'{match.group(1)} has no section "{match.group(2)}"')
    assert not problems, f"{source.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_page_lengths():
    """The README and each reference page of `docs/` stay short; `docs/research/` is exempt."""
    too_long = [f"README.md: {n} lines (at most {README_MAX_LINES})"
                for n in [len((ROOT / "README.md").read_text().splitlines())] if n > README_MAX_LINES]
    for page in sorted(ROOT.glob("docs/*.md")):
        n = len(page.read_text().splitlines())
        if n > REFERENCE_MAX_LINES:
            too_long.append(f"{page.relative_to(ROOT)}: {n} lines (at most {REFERENCE_MAX_LINES}; history belongs "
                            f"in docs/research/)")
    assert not too_long, "\n".join(too_long)


def test_research_index_links_every_experiment():
    """Every result folder or file, script and recipe of `docs/research/` is linked from its index, so that no figure
    is lost from view when pages change."""
    research = ROOT / "docs" / "research"
    index = research / "README.md"
    linked = {(index.parent / m.group(1).partition("#")[0]).resolve()
              for m in re.finditer(r"\]\(([^)\s]+)\)", without_code(index.read_text()))}
    entries = [*(research / "results").iterdir(), *(research / "scripts").iterdir(), *(research / "recipes").iterdir()]
    missing = []
    for entry in sorted(entries):
        if entry.name.startswith(".") or entry.name == "__pycache__":
            continue
        inside = {entry.resolve(), *(p.resolve() for p in entry.rglob("*"))} if entry.is_dir() else {entry.resolve()}
        if not inside & linked:
            missing.append(str(entry.relative_to(ROOT)))
    assert not missing, "docs/research/README.md links none of:\n" + "\n".join(missing)


def test_the_checks_catch_a_stale_reference(tmp_path, monkeypatch):
    """The checks above fail on a broken link, a missing anchor and a title that names no section."""
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "a.md"
    (tmp_path / "docs" / "b.md").write_text("# B\n\n## Present\n\n- **A bold lead.** text\n")
    page.write_text(
        "See [b](b.md#absent), [c](c.md), [b.md](b.md), \"Gone\", [b.md](b.md), \"Present\", "
        "[b.md](b.md), \"A bold lead\" and section \"Nowhere\" (docs/b.md, \"Also gone\"; "
        "docs/research/absent.md, \"Anything\").\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(AssertionError) as links:
        test_relative_links_and_anchors_resolve(page)
    assert "b.md#absent" in str(links.value) and "c.md" in str(links.value)
    with pytest.raises(AssertionError) as refs:
        test_references_by_title_name_a_section(page)
    message = str(refs.value)
    assert '"Gone"' in message and '"Nowhere"' in message and '"Also gone"' in message
    assert "missing page: docs/research/absent.md" in message
    assert '"Present"' not in message and "bold lead" not in message


def test_the_size_and_index_checks_catch_a_long_page_and_an_unlisted_experiment(tmp_path, monkeypatch):
    research = tmp_path / "docs" / "research"
    for folder in ("results/run-a", "scripts", "recipes"):
        (research / folder).mkdir(parents=True)
    (research / "scripts" / "probe.py").write_text("")
    (research / "README.md").write_text("[run a](results/run-a/)\n")  # lists the run, not the script
    (research / "log.md").write_text("line\n" * 1000)  # the research folder is exempt from the size limit
    (tmp_path / "README.md").write_text("line\n" * (README_MAX_LINES + 1))
    (tmp_path / "docs" / "long.md").write_text("line\n" * (REFERENCE_MAX_LINES + 1))
    (tmp_path / "docs" / "short.md").write_text("line\n" * REFERENCE_MAX_LINES)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(AssertionError) as sizes:
        test_page_lengths()
    message = str(sizes.value)
    assert "README.md: 151 lines" in message and "docs/long.md: 301 lines" in message
    assert "short.md" not in message and "log.md" not in message
    with pytest.raises(AssertionError) as index:
        test_research_index_links_every_experiment()
    assert "docs/research/scripts/probe.py" in str(index.value) and "run-a" not in str(index.value)
