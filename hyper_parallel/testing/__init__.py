"""What the test suite and the benches share: code that drives the project's tools the way
a user does, on tiny models. Nothing else in the package imports it.

``tiny_families``: a tiny config per transformers decoder family (or remote-code fixture)
and its random checkpoint written by ``save_pretrained``. ``family_case``: one family x
layout in a throwaway project: a recipe, ``python -m hyper_parallel.codegen generate``
(with its verify stage) and optionally the gen backend's training under torchrun against
single-process HF, with the status (pass / refused / fail) and a one-line reason;
``bench/family_sweep.py`` runs every family, the suite's family subset
(``tests/families/test_family_subset.py``) reruns a few. ``light_boot``: a doit entry
point that fails when the run imported torch or transformers.

``tiny_families`` and ``family_case`` read the source checkout (``tests/data/remote_code``,
``dodo.py``): they serve a checkout of this repository, not an installed wheel.
"""
