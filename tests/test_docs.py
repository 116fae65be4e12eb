"""The README and docs/ pages: links resolve, quoted figures come from the committed results files.

Anchors follow GitHub's heading slugs (github/cmark-gfm's anchor rule as GitHub renders it: lower case,
every character that is not a letter, digit, `_`, `-` or space dropped, spaces turned into `-`, a
repeated slug suffixed `-1`, `-2`, ...); the hand-computed examples below check the rule itself.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RESULTS = REPO / "experiments" / "results"

_FENCE = re.compile(r"^(```|~~~)")
_LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _prose_lines(text: str) -> list[str]:
    """The lines of a Markdown text outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def _slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # a link in a heading: its text
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose_lines(path.read_text()):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_slug_rule_matches_githubs_hand_computed_anchors():
    # GitHub renders "## Where the trials' steps run: `trial.execute`" with id
    # "where-the-trials-steps-run-trialexecute": the quote, colon, backticks and dot dropped.
    assert _slug("Where the trials' steps run: `trial.execute`") == "where-the-trials-steps-run-trialexecute"
    assert _slug("Predict before running: `oomtune plan`") == "predict-before-running-oomtune-plan"
    assert _slug("Several machines: one study on PostgreSQL") == "several-machines-one-study-on-postgresql"


def _links(path: Path):
    for line in _prose_lines(path.read_text()):
        for target in _LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):      # http:, https:, mailto:
                continue
            yield target


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(page):
    targets = list(_links(page))
    bad = []
    for target in targets:
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            bad.append(f"{target}: no file {dest}")
            continue
        if anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(REPO)}")
    assert not bad, f"{page.relative_to(REPO)}: " + "; ".join(bad)


def test_readme_links_every_docs_page():
    readme_targets = {t.partition("#")[0] for t in _links(REPO / "README.md")}
    for page in sorted((REPO / "docs").glob("*.md")):
        assert f"docs/{page.name}" in readme_targets, f"README.md does not link docs/{page.name}"


def test_readme_is_a_front_door():
    assert len((REPO / "README.md").read_text().splitlines()) <= 220


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    nxt = text.find("\n## ", start + len(heading))
    return text[start:nxt if nxt >= 0 else len(text)]


def test_readme_output_excerpt_is_copied_from_the_committed_log():
    """Every line of the README's excerpt of the main command's output is a line of the run's log."""
    log = (RESULTS / "readme_main_command.log").read_text().splitlines()
    section = _section((REPO / "README.md").read_text(), "## What the main command prints")
    blocks = re.findall(r"^```\n(.*?)^```", section, flags=re.S | re.M)
    assert blocks, "no output excerpt in the README's 'What the main command prints'"
    excerpt = [line for line in blocks[0].splitlines() if line.strip()]
    assert len(excerpt) >= 5
    missing = [line for line in excerpt if line not in log]
    assert not missing, f"README excerpt lines not in readme_main_command.log: {missing}"


def test_readme_figures_of_the_main_command_are_in_the_log():
    """Every figure with a unit in the README's prose about the main command (seconds, MiB/GiB,
    ratios, batch sizes named as such) appears in the log it cites, as the log writes it (sizes may
    be written with two decimals, as oomtune formats them)."""
    log = (RESULTS / "readme_main_command.log").read_text()
    section = _section((REPO / "README.md").read_text(), "## What the main command prints")
    prose = "\n".join(_prose_lines(section))
    figures = re.findall(r"\b\d+(?:\.\d+)?(?: s\b| MiB\b| GiB\b|x\b)|\bbatch \d+", prose)
    assert len(figures) >= 5, figures
    missing = []
    for fig in figures:
        m = re.match(r"(\d+(?:\.\d+)?) (MiB|GiB)$", fig)
        forms = {fig}
        if m:
            forms.add(f"{float(m.group(1)):.2f} {m.group(2)}")
        if fig.startswith("batch "):
            forms = {f"bs={fig.split()[1]}", fig}
        if not any(f in log for f in forms):
            missing.append(fig)
    assert not missing, f"README figures not in readme_main_command.log: {missing}"


def test_results_page_cites_committed_results_files():
    """Every results file docs/results.md names exists under experiments/results/, and every table row
    with figures names the file it comes from."""
    text = (REPO / "docs" / "results.md").read_text()
    named = set(re.findall(r"`(?:experiments/results/)?([\w.-]+\.(?:txt|md|log))`", text))
    assert named
    for name in named:
        assert (RESULTS / name).exists(), f"docs/results.md cites {name}, not in experiments/results/"
    for line in _prose_lines(text):
        if line.startswith("|") and not set(line) <= set("|-: ") and re.search(r"\d", line):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if cells[0] in ("what", "tool"):
                continue
            header_context = text[:text.index(line)].rsplit("\n\n", 2)[-2]
            assert re.search(r"\.(txt|md|log)`", line) or re.search(r"\.(txt|md|log)`", header_context), \
                f"docs/results.md row without its results file: {line[:100]}"


def test_table_cells_are_short():
    for page in PAGES:
        for line in _prose_lines(page.read_text()):
            if line.startswith("|"):
                for cell in line.strip("|").split("|"):
                    assert len(cell) <= 450, f"{page.relative_to(REPO)}: a {len(cell)}-character cell: {cell[:80]}"


def test_commits_named_in_the_results_page_are_in_the_history():
    """docs/results.md names the commits earlier measurements ran at; each must be a commit of this
    repository's history (an id rebased away would point nowhere)."""
    import subprocess

    text = (REPO / "docs" / "results.md").read_text()
    ids = {c for c in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"[a-f]", c) and re.search(r"\d", c)}
    assert ids
    for c in sorted(ids):
        ok = subprocess.run(["git", "-C", str(REPO), "merge-base", "--is-ancestor", c, "HEAD"],
                            capture_output=True).returncode == 0
        assert ok, f"docs/results.md names commit {c}, not in this branch's history"
