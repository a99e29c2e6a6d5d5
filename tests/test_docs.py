"""The product's text describes the project as it is: no diary ("session N", "issue N"), no
pointer to a design file that is not in the repository, links that resolve, and a results
page and README table that are what `armkv report` makes of the committed summaries."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DIARY = re.compile(r"\b(sessions?|issues?)\s+#?\d+", re.IGNORECASE)


def _product_files():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "pyproject.toml"]
    files += sorted((ROOT / "src").rglob("*.py")) + sorted((ROOT / "src").rglob("*.cpp"))
    files += sorted((ROOT / "src" / "armkv" / "adapters").rglob("*.json"))
    return [f for f in files if f.is_file()]


def test_no_diary_and_no_missing_design_file_in_the_product():
    found = []
    for path in _product_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for match in DIARY.finditer(text):
            found.append(f"{path.relative_to(ROOT)}: {match.group(0)!r}")
        if "DESIGN.md" in text:
            found.append(f"{path.relative_to(ROOT)}: DESIGN.md")
    assert not found, found


def test_the_diary_pattern_catches_what_it_should():
    assert DIARY.search("as measured in session 16") and DIARY.search("Issue 7's bar") and DIARY.search("issue #3")
    assert not DIARY.search("a session of the decode benchmark") and not DIARY.search("the issue is the pool")


def test_help_texts_have_no_diary(capsys):
    from armkv.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    texts = [parser.format_help()]
    for p in sub.choices.values():
        texts.append(p.format_help())
        texts += [
            q.format_help()
            for a in p._actions
            if a.__class__.__name__ == "_SubParsersAction"
            for q in a.choices.values()
        ]
    bad = [m.group(0) for t in texts for m in DIARY.finditer(t)] + [t for t in texts if "DESIGN.md" in t]
    assert not bad, bad


def test_relative_links_in_the_docs_resolve():
    broken = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)", path.read_text()):
            if "://" not in target and not (path.parent / target).exists():
                broken.append(f"{path.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_results_page_and_readme_table_are_what_report_makes_of_the_summaries():
    from armkv.tools.report import END, START, load, render

    results = ROOT / "docs" / "results"
    plots = sorted(p.name for p in results.glob("*.png"))
    page, table = render(load(results), plots)
    assert (ROOT / "docs" / "results.md").read_text() == page, "docs/results.md is stale: run `armkv report`"
    readme = (ROOT / "README.md").read_text()
    assert readme.split(START)[1].split(END)[0].strip() == table.strip(), "README's table is stale: run `armkv report`"
    # the folder holds the JSON summaries and the plots the page links, nothing else
    assert all(p.suffix == ".json" or f"results/{p.name})" in page for p in results.iterdir())


@pytest.mark.parametrize("name", ["design.md", "results.md", "decisions.md", "evaluation.md", "training.md"])
def test_readme_links_every_doc(name):
    assert f"docs/{name}" in (ROOT / "README.md").read_text()


def _paragraphs(text: str) -> list[str]:
    """Prose paragraphs: blank-line separated blocks that are not tables, code or markers."""
    blocks = re.split(r"\n\s*\n", re.sub(r"```.*?```", "", text, flags=re.S))
    return [b for b in blocks if b.strip() and not b.lstrip().startswith(("|", "<!--", "    "))]


@pytest.mark.parametrize("name,lines,words", [("README.md", 120, 120), ("docs/design.md", 400, 150)])
def test_readme_and_design_stay_short(name, lines, words):
    text = (ROOT / name).read_text()
    assert len(text.splitlines()) <= lines, f"{name}: {len(text.splitlines())} lines, at most {lines}"
    longest = max(_paragraphs(text), key=lambda p: len(p.split()))
    assert len(longest.split()) <= words, f"{name}: a paragraph of {len(longest.split())} words: {longest[:80]!r}"


def test_no_commit_hash_in_the_docs_prose():
    """Commits are provenance: they live in docs/results/*.json and results.md's last section."""
    sha = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        if path.name == "results.md":
            text = text.split("## Provenance")[0]
        found += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in sha.finditer(text)]
    assert not found, found
