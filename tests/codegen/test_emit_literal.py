"""The literal renderer: what it prints must evaluate back to the data it was given."""

import pytest

from hyper_parallel.codegen.emit.literal import WIDTH, render_literal

ENTRY = " | ".join(["packed_experts", *(f"param{i}: tp=shard({i}) ep=shard(0)" for i in range(8)), "local_map"])


@pytest.mark.parametrize("value", [
    {"modules": {"short": "colwise | local_map", "a.long.key": ENTRY, "x" * 90: "rowwise | in: tp=shard(1)"}},
    {"no_separator": "y" * 150, "nested": [{"k": ENTRY}], "n": None, "t": (1,), "f": 1.5, "b": True},
])
def test_rendered_literal_evaluates_to_the_value_and_keeps_the_width(value):
    text = render_literal(value)
    assert eval(text) == value  # noqa: S307 - our own output
    for line in text.splitlines():
        assert len(line) <= WIDTH or " | " not in line.strip().strip('",'), line


def test_a_long_entry_hangs_under_its_key_cut_before_separators():
    text = render_literal({"modules": {"a.long.key": ENTRY}})
    lines = text.splitlines()
    assert lines[2] == '        "a.long.key":'
    assert lines[3].startswith('            "packed_experts | param0:')
    assert all(line.startswith('            " | ') for line in lines[4:-2])  # up to the closing braces
    assert lines[-3].endswith('local_map",')
    assert "(" not in lines[2]  # inside the dict's braces no parentheses are needed
