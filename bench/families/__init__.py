"""A decoder family through the project's tools, as ``bench/family_sweep.py`` runs it and
the test suite's family subset (``tests/families/test_family_subset.py``) reruns it. Not
part of the package: ``python bench/family_sweep.py`` imports it as ``families``, the tests
as ``bench.families`` (its modules import each other relatively).

``tiny``: a tiny config per transformers family (or remote-code fixture) and its random
checkpoint written by ``save_pretrained``. ``case``: one family x layout in a throwaway
project: a recipe, ``python -m hyper_parallel.codegen generate`` (with its verify stage)
and optionally the gen backend's training under torchrun against single-process HF, with
the status (pass / refused / fail) and a one-line reason.

Both read the source checkout (``tests/data/remote_code``, ``dodo.py``).
"""
