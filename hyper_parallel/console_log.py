"""Console output for the entry points (the CLI, doit's actions, the trainer).

Library modules log through ``logging.getLogger(__name__)`` and print nothing; an entry
point calls ``configure_console_logging`` once to show those records as plain lines on
stdout, the text the user reads. Import-light: dodo.py imports it through doit_tasks.
"""

import logging
import sys

PACKAGE_LOGGER = "hyper_parallel"


class _StdoutHandler(logging.StreamHandler):
    """Writes to ``sys.stdout`` as it is when a record comes, not as it was when the
    handler was made: doit and pytest swap stdout to capture an action's output."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:
        pass  # always the current sys.stdout


def configure_console_logging(level: int = logging.INFO, *, indent: str = "",
                              logger: str = PACKAGE_LOGGER) -> None:
    """Show ``logger``'s records at ``level`` and above on stdout, one line each, after
    ``indent``. Calling it again replaces the handler (doit runs one action after another
    in one process; tests call the CLI's main many times)."""
    target = logging.getLogger(logger)
    for handler in [h for h in target.handlers if isinstance(h, _StdoutHandler)]:
        target.removeHandler(handler)
    handler = _StdoutHandler()
    handler.setFormatter(logging.Formatter(indent + "%(message)s"))
    target.addHandler(handler)
    target.setLevel(level)
