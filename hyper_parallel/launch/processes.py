"""Whether a process is alive: what a launch's watcher and the bundle folder's stale
staging clean-up (a folder is stale when the process that made it is gone) both ask."""

import os


def pid_alive(pid: int) -> bool:
    """True while a process with this pid exists (ours or another user's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
