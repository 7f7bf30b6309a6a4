"""The package's comments and docstrings point to files a reader of the repo has, not to
documents outside it (the design map, the seed specifications, issue numbers, milestone
names): a reference the reader cannot follow is noise."""

import re
from pathlib import Path

import hyper_parallel

OUTSIDE = re.compile(r"DESIGN\s*§|DESIGN\.md|seed\s+§|seed [\w-]+ §|\bM1\b|\(issue \d+|\bissue \d+\)")


def test_no_reference_to_documents_outside_the_repo():
    package = Path(hyper_parallel.__file__).parent
    found = [f"{path.relative_to(package)}:{number}: {line.strip()}"
             for path in sorted(package.rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), start=1) if OUTSIDE.search(line)]
    assert not found, "\n".join(found)


def test_the_pattern_finds_what_it_is_named_after():
    for text in ("(DESIGN §4)", "seed §10's", "(seed codegen-design §9)", "The M1 protocol layer", "(issue 28)"):
        assert OUTSIDE.search(text), text
    assert not OUTSIDE.search("see docs/guide/codegen.md, section 5")
