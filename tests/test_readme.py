"""README carries no benchmark history (issue 56): no commit hash, and no measured figure in its
prose without the date it was measured on (dated figures live in docs/benchmarks.md). The
quickstart's expected output is sample output and says when and where it was printed."""

import re

from tests.project_fixtures import REPO

COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
FIGURE = re.compile(r"\b\d+(?:\.\d+)?\s?(?:s|ms|GiB|MiB|GB|MB|x|×|%|tok/s|tokens/s)(?![\w/])")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def _prose_paragraphs(text: str) -> list[str]:
    """README's paragraphs outside fenced code blocks."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return [paragraph for paragraph in re.split(r"\n\s*\n", prose) if paragraph.strip()]


def test_readme_names_no_commit():
    hashes = [(number, line) for number, line in enumerate((REPO / "README.md").read_text().splitlines(), start=1)
              if COMMIT.search(line)]
    assert hashes == [], hashes


def test_readme_prose_has_no_undated_figure():
    undated = [paragraph[:120] for paragraph in _prose_paragraphs((REPO / "README.md").read_text())
               if FIGURE.search(paragraph) and not DATE.search(paragraph)]
    assert undated == [], undated


def test_the_patterns_find_what_they_are_named_after():
    assert COMMIT.search("measured at e9561fd") and not COMMIT.search("the deadbeef-free text 1234567")
    assert FIGURE.search("took 0.91 s") and FIGURE.search("1.33x") and not FIGURE.search("2 layers")
