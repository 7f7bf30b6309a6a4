"""Launching rank processes under torchrun and hearing from each rank.

- ``ranks.py``: ``RankLaunch`` (a launch in a process group of its own, in its own
  scratch folder), ``RankFiles`` (per-rank phase, error and result files) and
  ``wait_for_ranks``, which names a rank that failed or went silent;
- ``forked_torchrun.py``: torchrun whose ranks are forks of a launcher that imported
  torch, transformers and the model's code once;
- ``forked_module.py``: a launch's ``python -m`` command as a fork of the build tool,
  which imported torch and transformers already;
- ``guard.py``: the watcher that ends a launch's processes and removes its scratch
  folder when the run dies;
- ``processes.py``: whether a process is alive.

Used by the build tool's verify and preflight stages, the family sweep (bench/families)
and the tests' multi-rank runs. Torch-free: the launcher side stays light.
"""
