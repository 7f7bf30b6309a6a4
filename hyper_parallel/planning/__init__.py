"""Build-time planning: from a model's structure to its sharding plan, before any run.

The sharding planner, the dataflow trace of a tiny model copy and its dry runs, the roles
and the sequence and expert layouts, the plan's lints and the recipe's overrides, and the
offline mesh they reason over. Codegen's derive and verify use this package; training never
imports it (it applies a frozen plan with ``distributed/``, the layer below), which
``tests/test_import_graph.py`` holds it to.
"""
