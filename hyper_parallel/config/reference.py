"""The recipe reference (``docs/recipe-reference.md``), generated from the schema itself.

    python -m hyper_parallel.config.reference --write   # rewrite the page
    python -m hyper_parallel.config.reference --check   # exit 1 when the page is stale

One source of truth: every key, its type, default and meaning come from
``config/schema.py`` (a field's meaning is the comment on its line and the comment lines
right above it; ``one of NAME`` lists NAME's values), so a key added to the schema without a
comment is named by ``undocumented_keys`` (a test fails on it) and the page changes with the
schema (a test fails when the committed page differs). Torch-free.
"""

import ast
import dataclasses
import inspect
import io
import re
import sys
import tokenize
import types
import typing
from pathlib import Path

from hyper_parallel.config import schema

PAGE = Path(__file__).resolve().parents[2] / "docs" / "recipe-reference.md"
HEADER = """# Recipe reference

Every key a training recipe (YAML) may hold: its type, its default where the recipe leaves it
out, and what it does. Generated from `hyper_parallel/config/schema.py` by
`python -m hyper_parallel.config.reference --write` (a test fails when this page is stale or a
key has no meaning). A key the schema does not have is refused at load, naming the key and
the keys allowed there; any key can also be set for one run with `--set KEY=VALUE`
(`trainer launch`, the trainer, `dry-run`), typed and checked the same way.
"""


@dataclasses.dataclass(frozen=True)
class Key:
    """One recipe key: dotted name, type and default as written in the schema, and meaning."""

    name: str
    type: str
    default: str
    meaning: str
    section: type | None  # the dataclass of a key that holds keys of its own


def recipe_keys(cls: type = schema.TrainerConfig, prefix: str = "") -> list[Key]:
    """Every key under ``cls``, depth first in the schema's order."""
    notes = _field_notes(cls)
    hints = typing.get_type_hints(cls)
    keys = []
    for field in dataclasses.fields(cls):
        if field.name.startswith("_"):
            continue
        yaml_name = getattr(cls, "YAML_NAMES", {}).get(field.name, field.name)
        annotation, meaning = notes.get(field.name, ("", ""))
        section = _section_of(hints[field.name])
        key = Key(f"{prefix}{yaml_name}", annotation, _default(field, section), _expand(meaning), section)
        keys.append(key)
        if section is not None:
            keys += recipe_keys(section, f"{key.name}.")
    return keys


def undocumented_keys() -> list[str]:
    """Keys whose schema field carries no comment: what the page cannot explain."""
    return [key.name for key in recipe_keys() if not key.meaning]


def render() -> str:
    """The page: one table per section, the top-level keys first."""
    keys = recipe_keys()
    sections = [("", "The top level", schema.TrainerConfig)] + [
        (f"{key.name}.", f"`{key.name}`", key.section) for key in keys if key.section is not None]
    out = [HEADER]
    for prefix, title, cls in sections:
        rows = [key for key in keys if key.name.startswith(prefix) and "." not in key.name[len(prefix):]]
        out.append(f"\n## {title}\n")
        doc = inspect.getdoc(cls) if cls is not schema.TrainerConfig else None
        if doc and not doc.startswith(cls.__name__ + "("):
            out.append(" ".join(doc.split()) + "\n")
        out.append("| key | type | default | meaning |\n|---|---|---|---|")
        out += [f"| `{key.name}` | `{_cell(key.type)}` | {key.default} | {key.meaning} |" for key in rows]
    return "\n".join(out) + "\n"


def _cell(text: str) -> str:
    """Text inside a table cell: a ``|`` (``str | None``) would end the cell."""
    return text.replace("|", "\\|")


def _section_of(hint) -> type | None:
    """The schema dataclass a field holds (``X``, ``X | None``, ``X | str``), else None."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
        else (hint,)
    found = [option for option in options if dataclasses.is_dataclass(option)
             and option.__module__ == schema.__name__ and option.__name__ != "PlanOverride"]
    return found[0] if found else None


def _default(field: dataclasses.Field, section: type | None) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        if section is not None:
            return "its keys' defaults"
        value = field.default_factory()
    else:
        return "required"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if value == () or value == []:
        return "`[]`"
    if value == {}:
        return "`{}`"
    return f"`{value}`"


def _field_notes(cls: type) -> dict[str, tuple[str, str]]:
    """field name -> (its annotation as written, its comments: the lines above, then its own)."""
    source, start = inspect.getsourcelines(cls)
    text = "".join(source)
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    lines = text.splitlines()
    notes = {}
    for node in ast.parse(text).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            above, line = [], node.lineno - 1
            while line >= 1 and lines[line - 1].strip().startswith("#"):
                above.insert(0, comments[line])
                line -= 1
            own = comments.get(node.lineno, "")
            notes[node.target.id] = (ast.get_source_segment(text, node.annotation),
                                     " ".join(part for part in (*above, own) if part))
    return notes


def _expand(meaning: str) -> str:
    """``one of NAME`` -> ``one of `a`, `b``` from the schema's constant NAME."""
    def values(match: re.Match) -> str:
        found = getattr(schema, match.group(1), None)
        return "one of " + ", ".join(f"`{v}`" for v in found) if isinstance(found, tuple) else match.group(0)

    return _cell(re.sub(r"one of ([A-Z][A-Z_]+)", values, meaning))


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m hyper_parallel.config.reference", description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", action="store_true", help=f"rewrite {PAGE.name}")
    group.add_argument("--check", action="store_true", help=f"exit 1 when {PAGE.name} differs from the schema's")
    args = parser.parse_args(argv)
    missing = undocumented_keys()
    if missing:
        print(f"error: schema keys without a comment saying what they do: {', '.join(missing)} "
              f"(hyper_parallel/config/schema.py)", file=sys.stderr)
        return 1
    page = render()
    if args.write:
        PAGE.write_text(page)
        print(f"wrote {PAGE}")
        return 0
    if not PAGE.is_file() or PAGE.read_text() != page:
        print(f"error: {PAGE} is stale; fix: python -m hyper_parallel.config.reference --write", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
