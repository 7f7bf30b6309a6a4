"""How a rank process leaves once its work is done, under plain or forked torchrun.

Exiting through the interpreter's teardown now and then kills a rank after everything
passed: a gloo worker thread releases a finished collective's work (and the tensors in
it) after the caller's ``wait()`` returned; when that release comes while the interpreter
is finalizing, the thread's GIL acquire ends it with ``pthread_exit``, whose unwinding
through the work's destructor calls ``std::terminate`` — SIGABRT, "terminate called
without an active exception", and torchrun fails the launch (about 1 launch in 30 on CPU).

- A rank torchrun started as a process of its own leaves with ``os._exit``.
- A rank torchrun forked from its launcher (``codegen.check.forked_torchrun`` sets
  ``FORKED_ENV``) leaves with ``sys.exit``: torchrun's fork wrapper hands the rank's
  result back through its queue and then ends the process itself without teardown; an
  ``os._exit`` there would leave torchrun waiting for a result that never comes.
"""

import os
import sys

FORKED_ENV = "HYPER_PARALLEL_FORKED_RANK"  # set in the launcher; the forked ranks inherit it


def exit_rank(code: int) -> None:
    """End this rank with ``code`` without the interpreter's teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    if os.environ.get(FORKED_ENV):
        sys.exit(code)
    os._exit(code)
