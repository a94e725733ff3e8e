"""BENCHMARKS.md is the one page of results a user reads: short, a headline table, no internal
references, and every file, script and link it names present in the repository."""

import glob
import itertools
import os
import re

from test_docs import CODE_SPAN, FENCE, LINK, anchors, forbidden_in  # tests/unit is on sys.path

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE = os.path.join(REPO, "BENCHMARKS.md")
NOTES = os.path.join(REPO, "benchmarks", "NOTES.md")
RESULTS = os.path.join(REPO, "benchmarks", "results")
HEADLINE = "| goal | measured | met | machine | date | command |"
INTERNAL = re.compile(r"\b(?:issues?|point|part) \d+", re.IGNORECASE)


def text() -> str:
    with open(PAGE, encoding="utf-8") as f:
        return f.read()


def expand(pattern: str) -> list:
    """``a.{json,png}`` -> ``a.json``, ``a.png`` (the shell's brace expansion, one level)."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return list(itertools.chain.from_iterable(
        expand(pattern[:m.start()] + alt + pattern[m.end():]) for alt in m.group(1).split(",")))


def named_files(page: str) -> list:
    """Files the page names in code spans: repository paths, and result files by their name."""
    names = []
    for span in re.findall(r"`([^`\n]+)`", page):
        for word in span.split():
            word = word.strip("(),;")
            if re.match(r"^(benchmarks|deploy|docs|tests)/\S+\.(py|json|png|yaml|md)", word):
                names += [os.path.join(REPO, w) for w in expand(word)]
            elif re.match(r"^[\w*.{},-]+\.(\{[\w,]+\}|json|png)$", word):
                names += [os.path.join(RESULTS, w) for w in expand(word)]
    return names


def test_one_page_with_a_headline_table():
    page = text()
    assert len(page.splitlines()) <= 300, "BENCHMARKS.md is one page: at most 300 lines"
    assert HEADLINE in page, "the headline table (goal, measured, met, machine, date, command)"
    rows = page.split(HEADLINE, 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    assert len(rows) >= 10
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        assert len(cells) == 6 and all(cells), f"a headline row with an empty cell: {row}"
        assert re.match(r"^\d{4}-\d{2}-\d{2}$", cells[4]), f"date of {cells[0]}: {cells[4]}"
        assert cells[5].startswith("`") and cells[5].endswith("`") or "`" in cells[5], row


def test_no_internal_references():
    page = text()
    assert not INTERNAL.findall(page), f"internal issue numbers: {INTERNAL.findall(page)}"
    assert not forbidden_in(page)


def test_every_file_it_names_exists():
    names = named_files(text())
    assert len(names) > 20
    missing = [os.path.relpath(n, REPO) for n in names if not glob.glob(n)]
    assert not missing, f"BENCHMARKS.md names files that do not exist: {missing}"


def test_every_link_resolves():
    broken = []
    for path in (PAGE, NOTES):
        with open(path, encoding="utf-8") as f:
            body = CODE_SPAN.sub("", FENCE.sub("", f.read()))
        for target in LINK.findall(body):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue
            file_part, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(path), file_part))
            if not os.path.exists(resolved):
                broken.append(f"{os.path.relpath(path, REPO)}: {target}")
            elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
                broken.append(f"{os.path.relpath(path, REPO)}: {target} (no heading)")
    assert not broken, f"broken links: {broken}"


def test_the_lab_notes_and_results_moved_together():
    assert os.path.isfile(NOTES)
    assert glob.glob(os.path.join(RESULTS, "*.json")) and glob.glob(os.path.join(RESULTS, "*.png"))
