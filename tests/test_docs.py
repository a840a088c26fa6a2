"""The documentation's cross-references resolve: relative links name files that exist, `#anchors` name headings,
and a reference by title (`[results.md](results.md), "Reading"`, `docs/results.md, "Reading"` or
`section "Reading"` for the same page) names a heading or a bold paragraph lead of that page.

The docs refer to each other by section title in prose; this keeps those references from going stale when a
section moves or is renamed."""

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    [ROOT / "README.md", ROOT / "examples" / "README.md", *ROOT.glob("docs/*.md"),
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
    r'(?:\]\((?P<link>[\w./-]+\.md)\)|(?<![\w/(\[-])(?P<bare>(?:docs/)?[\w-]+\.md)),? (?:section )?"(?P<title>[^"]+)"'
)
SAME_PAGE_TITLE = re.compile(r'(?<!\.md\), )(?<!\.md, )section "(?P<title>[^"]+)"')


def resolve_page(page, name, linked):
    if linked:
        return (page.parent / name).resolve()
    if name.startswith("docs/"):
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
    [*ROOT.glob("examples/*.py"), *ROOT.glob("examples/*.yaml"), *ROOT.glob("examples/*.sh"),
     *ROOT.glob("hf_chainflow/*.py")]
)


@pytest.mark.parametrize("source", CODE, ids=lambda p: str(p.relative_to(ROOT)))
def test_code_and_example_references_name_a_section(source):
    """Comments, docstrings and messages that cite `docs/x.md, "Title"` name a section of that page (pages outside
    the repository, such as the shared SPEC.md, are not checked)."""
    text = source.read_text().replace('\\"', '"')
    text = re.sub(r"\s*\n\s*(?:#\s*)?", " ", text)  # join wrapped comment lines
    problems = []
    for match in re.finditer(r'(?<![\w/-])((?:docs/)?[\w-]+\.md),? (?:section )?"([^"]+)"', text):
        page = ROOT / "docs" / Path(match.group(1)).name
        if page.exists() and not any(t.startswith(match.group(2).strip()) for t in titles(page.read_text())):
            problems.append(f'{match.group(1)} has no section "{match.group(2)}"')
    assert not problems, f"{source.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_the_checks_catch_a_stale_reference(tmp_path, monkeypatch):
    """The checks above fail on a broken link, a missing anchor and a title that names no section."""
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "a.md"
    (tmp_path / "docs" / "b.md").write_text("# B\n\n## Present\n\n- **A bold lead.** text\n")
    page.write_text(
        "See [b](b.md#absent), [c](c.md), [b.md](b.md), \"Gone\", [b.md](b.md), \"Present\", "
        "[b.md](b.md), \"A bold lead\" and section \"Nowhere\".\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(AssertionError) as links:
        test_relative_links_and_anchors_resolve(page)
    assert "b.md#absent" in str(links.value) and "c.md" in str(links.value)
    with pytest.raises(AssertionError) as refs:
        test_references_by_title_name_a_section(page)
    message = str(refs.value)
    assert '"Gone"' in message and '"Nowhere"' in message
    assert '"Present"' not in message and "bold lead" not in message
