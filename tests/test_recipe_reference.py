"""docs/recipe-reference.md is the schema's own (issue 56): every key with its type, default
and meaning, generated from config/schema.py; stale or undocumented keys fail here."""

from dataclasses import dataclass

from hyper_parallel.config.reference import PAGE, recipe_keys, render, undocumented_keys


def test_every_schema_key_says_what_it_does():
    assert undocumented_keys() == [], "add a comment on the field's line in hyper_parallel/config/schema.py"


def test_the_committed_page_is_the_schemas():
    assert PAGE.read_text() == render(), "fix: python -m hyper_parallel.config.reference --write"


@dataclass
class _Probe:
    # What the first key does, above it.
    first: int = 1
    second: str | None = None  # one of MODEL_INITS, said on its line
    third: bool = False


def test_a_key_without_a_comment_is_found_and_constants_are_listed():
    keys = {key.name: key for key in recipe_keys(_Probe)}
    assert keys["first"].meaning == "What the first key does, above it."
    assert keys["second"].meaning == "one of `pretrained`, `random`, said on its line"
    assert keys["second"].type == "str | None" and keys["second"].default == "`null`"
    assert keys["third"].meaning == ""  # what undocumented_keys reports for a schema field
    assert "| `accelerator.tp_size` | `int` | `1` |" in render()
