"""emit: write the generated modeling file (``modeling.py``) and its review diff
(``diff.py``). Nothing is imported here: a stage's implementation hash follows what it
imports, so the diff stage importing ``emit.diff`` does not take in the emitter too."""
