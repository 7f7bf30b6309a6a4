"""``HyperParallelError``: the one base of every exception class this package defines.

A caller (the CLI choosing its exit code, the trainer, a training script) tells "the
project refused this and says what to fix" apart from a bug or another library's error
with one ``except HyperParallelError``, instead of listing every class or testing
``type(exc).__module__``. Each class keeps its builtin base as well (``ValueError``,
``OSError``, ``KeyError``, ...), so every existing ``except ValueError`` still catches it.

A leaf module: it imports nothing, so any module (torch-free ones, ``dodo.py``'s
imports, the generated files' runtime) can depend on it.
"""


class HyperParallelError(Exception):
    """Base of every exception class defined under ``hyper_parallel`` (a test walks the
    package and checks it); list it after the builtin base: ``class X(ValueError,
    HyperParallelError)``."""
