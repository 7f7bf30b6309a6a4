"""Where the project's workspace is: the folder of build outputs and caches (codegen's
per-recipe stage outputs and doit's state, the trainer's token cache), git-ignored.
Torch-free: dodo.py and every up-to-date check read it."""

import os
from pathlib import Path

# A folder of this name under the folder the command runs in, unless $HYPER_PARALLEL_WORKSPACE moves it.
WORKSPACE_DIR = "generated"
WORKSPACE_ENV = "HYPER_PARALLEL_WORKSPACE"


def default_workspace_root() -> Path:
    """``$HYPER_PARALLEL_WORKSPACE``, else ``./generated`` (doit runs in the project root)."""
    env = os.environ.get(WORKSPACE_ENV)
    return Path(env).resolve() if env else Path.cwd().resolve() / WORKSPACE_DIR
