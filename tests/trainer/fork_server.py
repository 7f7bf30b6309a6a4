"""A fork server for tests that start many short torchrun runs (test_checkpoint_kill.py).

    python tests/trainer/fork_server.py MOD[,MOD...]

Imports the modules once (transformers and the trainer: most of what a tiny run's start
costs), then reads one JSON request per line from stdin and answers one JSON line:

- ``{"op": "run", "cwd": DIR, "log": FILE, "argv": [...]}``: forks a child that runs
  ``forked_torchrun.main(argv)`` in DIR, its stdout and stderr in FILE; answers ``{"pid": N}``.
  The child is a whole torchrun (agent, rendezvous, ranks forked from it) like the one
  ``python -m hyper_parallel.launch.forked_torchrun`` starts, only without
  importing the modules again; SIGKILL of it and its ranks is a lost host as before.
- ``{"op": "wait", "pid": N}``: reaps the child, answers ``{"code": C}`` (``-9`` when killed).
"""

import importlib
import json
import os
import sys
import traceback


def _child(request: dict) -> int:
    os.chdir(request["cwd"])
    fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    from hyper_parallel.launch.forked_torchrun import main

    try:
        return main(request["argv"]) or 0
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # torchrun's ChildFailedError among them: the log says why
        traceback.print_exc()
        return 1


def serve(preload: list[str]) -> None:
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception:  # the run imports it again and reports the error itself
            pass
    importlib.import_module("hyper_parallel.launch.forked_torchrun")  # what every child runs

    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "run":
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    code = _child(request)
                finally:
                    try:
                        sys.stdout.flush()
                        sys.stderr.flush()
                    finally:
                        os._exit(code)
            answer = {"pid": pid}
        elif request["op"] == "wait":
            _, status = os.waitpid(request["pid"], 0)
            answer = {"code": os.waitstatus_to_exitcode(status)}
        else:
            answer = {"error": f"unknown op {request['op']!r}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve([name for name in sys.argv[1].split(",") if name] if len(sys.argv) > 1 else [])
