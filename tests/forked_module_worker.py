"""What tests/codegen/test_forked_launch.py runs as ``python -m``: one action per call.

    exit N       leave with sys.exit(N)
    raise        raise an error (the launch reports it and exits 1)
    report PATH  write this process's pid, parent, session, environment, torch threads
                 and open descriptors to PATH as JSON
    sleep S      print the pid, then sleep S seconds
"""

import json
import os
import sys
import time


def _report(path: str) -> None:
    torch = sys.modules.get("torch")
    report = {"pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0), "env": dict(os.environ),
              "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
              "torch_imported": torch is not None, "torch_threads": torch.get_num_threads() if torch else None,
              "argv": sys.argv, "name": __name__}
    print("reported", flush=True)
    with open(path, "w") as out:
        json.dump(report, out)


def main(argv: list[str]) -> int:
    action, value = argv[0], (argv[1] if len(argv) > 1 else "")
    if action == "exit":
        return int(value)
    if action == "raise":
        raise RuntimeError("the worker failed on purpose")
    if action == "report":
        _report(value)
        return 0
    if action == "sleep":
        print(os.getpid(), flush=True)
        time.sleep(float(value))
        return 0
    raise SystemExit(f"unknown action {action!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
