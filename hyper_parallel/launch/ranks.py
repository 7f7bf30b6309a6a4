"""Starting rank processes for verify and preflight, and ending them.

A launch runs in a scratch folder of its own (``scratch_dir``) and in a process group of
its own; each rank reports its phase and its own error in per-rank files (no closing
collective that a silent rank could block), so ``wait_for_ranks`` can name a rank that
went silent. A watcher process (``launch/guard.py``) removes the scratch folder and ends every
process the run started if the run dies — SIGKILL included, where no ``finally`` runs;
each launch also asks the kernel to kill it with its parent. No torch import here: the
launcher side stays light.
"""

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hyper_parallel.launch.forked_module import ForkedModule, fork_refusal
from hyper_parallel.launch.processes import pid_alive
from hyper_parallel.launch.guard import OWNER_ENV
from hyper_parallel.distributed.rank_exit import FORKED_ENV
from hyper_parallel.errors import HyperParallelError

GUARD = "hyper_parallel.launch.guard"
SCRATCH_PREFIX = "hp-"  # scratch folders are named hp-<kind>-<pid of their owner>-<random>
# A launch from inside a rank (the trainer's rank 0 generating) starts ranks of its own:
# none of the outer launch's rendezvous, nor its "forked" mark, may reach them.
LAUNCH_ENV_DROPPED = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", FORKED_ENV)


class LaunchError(RuntimeError, HyperParallelError):
    """The ranks failed, went silent or ran out of time; the message names the ranks."""


@contextlib.contextmanager
def scratch_dir(kind: str) -> Iterator[Path]:
    """A temp folder named after this process, removed on the way out — and, by a watcher
    process, also when this process dies without a way out (SIGKILL), together with every
    process it started meanwhile. Folders of dead owners are removed first."""
    remove_orphaned_scratch()
    path = Path(tempfile.gettempdir()) / f"{SCRATCH_PREFIX}{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    watcher = subprocess.Popen([sys.executable, "-m", GUARD, "watch", "--parent", str(os.getpid()),
                                "--scratch", str(path)],
                               stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        path.mkdir(mode=0o700)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        _release(watcher)


def _release(watcher: subprocess.Popen) -> None:
    """Tell the watcher this run cleaned up itself; it leaves without acting."""
    try:
        watcher.stdin.write(b"done\n")
        watcher.stdin.close()
    except OSError:
        pass
    try:
        watcher.wait(timeout=10)
    except subprocess.TimeoutExpired:
        watcher.kill()


def remove_orphaned_scratch() -> list[Path]:
    """Remove this user's scratch folders whose owning process is gone."""
    removed = []
    for entry in Path(tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}*-*-*"):
        parts = entry.name.split("-")
        if len(parts) < 4 or not parts[2].isdigit() or entry.is_symlink() or not entry.is_dir():
            continue
        try:
            if entry.stat().st_uid != os.getuid() or pid_alive(int(parts[2])):
                continue
        except OSError:
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


@dataclass(frozen=True)
class RankFiles:
    """Where each rank writes how far it got (``<prefix>.progress.rank<N>``) and its own
    error (``<prefix>.error.rank<N>``). Workers write them; the launcher reads them."""

    prefix: str

    def progress(self, rank: int) -> Path:
        return Path(f"{self.prefix}.progress.rank{rank}")

    def error(self, rank: int) -> Path:
        return Path(f"{self.prefix}.error.rank{rank}")

    def result(self, rank: int) -> Path:
        return Path(f"{self.prefix}.result.rank{rank}.json")

    def stack(self, rank: int) -> Path:
        return Path(f"{self.prefix}.stack.rank{rank}")

    def report_progress(self, rank: int, phase: str) -> None:
        self.progress(rank).write_text(phase)

    def report_error(self, rank: int, error: str) -> None:
        self.error(rank).write_text(error)

    def read(self, kind: str, world: int) -> dict[int, str]:
        found = {}
        for rank in range(world):
            path = getattr(self, kind)(rank)
            if path.is_file():
                found[rank] = path.read_text().strip()
        return found


JOINING = "joining the process group"
_MAIN_THREAD = "main thread: "  # the stack file's first line: which of the dumped threads is the rank's own


def join_process_group(files: RankFiles, rank: int, init, timeout_s: float) -> bool:
    """A rank's ``init()`` (its ``init_process_group``), reported like the rest of its work:
    the phase first; a failure as this rank's own error (False: the rank then leaves);
    and, if the rank is still inside after most of ``timeout_s``, its Python stacks
    (every thread's, by ``faulthandler``) in ``files.stack(rank)``. A rank that never
    joins leaves the others only a store timeout naming a key; its stacks say where it
    hung, and ``rank_reports`` shows them."""
    import faulthandler
    import threading

    files.report_progress(rank, JOINING)
    with files.stack(rank).open("w") as out:
        out.write(f"{_MAIN_THREAD}0x{threading.main_thread().ident:016x}\n")
        out.flush()
        faulthandler.dump_traceback_later(max(1.0, 0.8 * timeout_s), file=out)
        try:
            init()
        except Exception as exc:  # noqa: BLE001 - the rank's own report, then it leaves
            files.report_error(rank, f"rank {rank}: {JOINING}: {type(exc).__name__}: {exc}")
            return False
        finally:
            faulthandler.cancel_dump_traceback_later()
    files.stack(rank).write_text("")  # joined: a dump made while it was slow is no hang of a later phase
    return True


class RankLaunch:
    """The rank processes, in their own process group, killed by the kernel if this process
    dies (``guard exec``) and ended with everything they started when the caller
    leaves early (an exception, a signal turned into one). A ``python -m`` command runs as
    a fork of this process where that is the same thing (``forked_module``): it finds
    torch and transformers imported."""

    def __init__(self, cmd: list[str], *, log: Path, env: dict[str, str] | None = None):
        env = {**(os.environ if env is None else env), "OMP_NUM_THREADS": "1", OWNER_ENV: str(os.getpid())}
        for key in LAUNCH_ENV_DROPPED:
            env.pop(key, None)
        self.cmd = cmd
        self.log = log
        if fork_refusal(cmd) is None:
            self.proc = ForkedModule(cmd[2], cmd[3:], env=env, log=log)
            return
        guarded = [sys.executable, "-m", GUARD, "exec", "--parent", str(os.getpid()), "--", *cmd]
        # Output into a file, not a pipe: a pipe nobody drains while we poll would block the ranks.
        with log.open("w") as out:
            self.proc = subprocess.Popen(guarded, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def __enter__(self) -> "RankLaunch":
        return self

    def __exit__(self, *exc_info) -> bool:
        if self.proc.poll() is None:
            kill_tree(self.proc)
        return False

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.is_file() else ""


def kill_tree(proc: subprocess.Popen) -> None:
    """End the launch and every process it started: torchrun puts its ranks in sessions of
    their own, so the process group alone would leave them (a stopped one for good)."""
    import psutil

    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    if proc.poll() is None:  # a fork killed before its own setsid() is in no group of its own yet
        proc.kill()
    for child in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    proc.wait()


def wait_for_ranks(launch: RankLaunch, files: RankFiles, world: int, *, what: str, timeout_s: float,
                   collective_timeout_s: float, result: Path | None = None) -> None:
    """Wait for the launch to end. Once some rank failed and every other one failed or
    finished except a few that went silent, end them all (a stopped process would keep
    torchrun waiting for good) and raise, naming the silent ranks with their last phase."""
    deadline = time.monotonic() + timeout_s
    while launch.proc.poll() is None:
        if time.monotonic() > deadline:
            kill_tree(launch.proc)
            silent = silent_ranks(files, world)
            named = f"; ranks that never finished: {_phases(files, silent)}" if silent else ""
            stacks = "".join(f"\n{stack}" for stack in _stacks(files, silent))
            raise LaunchError(f"{what} did not finish within {timeout_s:.0f}s{named}; run it by hand: "
                              f"{' '.join(launch.cmd)}{stacks}")
        if _only_silent_ranks_left(files, world, collective_timeout_s):
            time.sleep(2)  # a last report on its way
            kill_tree(launch.proc)
            break
        time.sleep(0.2)
    if launch.proc.returncode == 0 and (result is None or result.is_file()):
        return
    reason = rank_reports(files, world, collective_timeout_s) or last_error_line(launch.output())
    raise LaunchError(f"{what} failed:\n{reason}")


def silent_ranks(files: RankFiles, world: int) -> list[int]:
    errors = files.read("error", world)
    phases = files.read("progress", world)
    return [rank for rank in range(world) if rank not in errors and phases.get(rank) != "done"]


def _phases(files: RankFiles, ranks: list[int]) -> str:
    phases = files.read("progress", max(ranks) + 1 if ranks else 0)
    return ", ".join(f"rank {rank}: {phases.get(rank, 'never started')!r}" for rank in ranks)


def _only_silent_ranks_left(files: RankFiles, world: int, collective_timeout_s: float) -> bool:
    """Some ranks are silent and every other one failed or finished. After a failure the
    failing ranks' collectives already gave up on the silent ones (a short grace); when
    the others all finished, a silent rank gets the collective timeout to catch up."""
    silent = silent_ranks(files, world)
    if not silent or len(silent) == world:
        return False
    grace = 5.0 if files.read("error", world) else collective_timeout_s + 5.0
    return _quiet(files, silent, grace)


def _quiet(files: RankFiles, ranks: list[int], quiet_s: float = 5.0) -> bool:
    """Every rank that has neither failed nor finished has been quiet for a while: the
    failing ranks' collectives already gave up on it."""
    now = time.time()
    for rank in ranks:
        path = files.progress(rank)
        if path.is_file() and now - path.stat().st_mtime < quiet_s:
            return False
    return True


def rank_reports(files: RankFiles, world: int, collective_timeout_s: float) -> str:
    """The ranks' own errors (one line per distinct error) and the ranks that went silent."""
    errors = files.read("error", world)
    silent = silent_ranks(files, world)
    lines = [merge_rank_errors([errors.get(rank) for rank in range(world)])] if errors else []
    if silent and len(silent) < world:
        ranks = ", ".join(map(str, silent))
        if errors and not _waited_out(files, silent, errors, collective_timeout_s):
            lines.append(f"rank(s) {ranks} were ended while waiting for the failed rank(s) (last phase reported: "
                         f"{_phases(files, silent)})")
        else:
            lines.insert(0, f"rank(s) {ranks} went silent (last phase reported: {_phases(files, silent)}); the "
                            f"other ranks gave up waiting for them after {collective_timeout_s:g}s "
                            f"(accelerator.check_timeout_s)")
    lines.extend(_stacks(files, silent if len(silent) < world else []))
    return "\n".join(lines)


def _stacks(files: RankFiles, ranks: list[int], frames: int = 12) -> list[str]:
    """The Python stacks a silent rank dumped while it hung (``join_process_group``): the
    innermost ``frames`` lines of each thread's, its main thread first."""
    out = []
    for rank in ranks:
        path = files.stack(rank)
        lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
        if len(lines) < 2 or not lines[0].startswith(_MAIN_THREAD):
            continue  # armed, never fired: the rank got past the join
        main = lines[0][len(_MAIN_THREAD):]
        threads = [block.splitlines() for block in re.split(r"\n(?=(?:Current thread|Thread) 0x)", "\n".join(lines[1:]))
                   if re.match(r"(?:Current thread|Thread) 0x", block)]
        shown = []
        for block in sorted(threads, key=lambda block: main not in block[0]):
            shown.extend([block[0] + (" (the rank's main thread)" if main in block[0] else ""), *block[1:frames + 1]])
        out.append(f"rank {rank}'s stacks while it hung (innermost first):\n    " + "\n    ".join(shown))
    return out


def _waited_out(files: RankFiles, silent: list[int], errors: dict[int, str], collective_timeout_s: float) -> bool:
    """Whether the first error came about a collective timeout after the silent ranks last
    reported (they went quiet and the others gave up), rather than sooner (a rank failed
    on its own and the others were left waiting for it)."""
    first_error = min(files.error(rank).stat().st_mtime for rank in errors)
    last_heard = max((files.progress(rank).stat().st_mtime for rank in silent if files.progress(rank).is_file()),
                     default=0.0)
    return first_error - last_heard >= 0.8 * collective_timeout_s


def merge_rank_errors(errors: list[str | None]) -> str:
    """One line per distinct error (``rank N: text``), naming every rank that raised it."""
    by_text: dict[str, list[int]] = {}
    for rank, error in enumerate(errors):
        if error:
            text = error.split(": ", 1)[1] if error.startswith("rank ") and ": " in error else error
            by_text.setdefault(text, []).append(rank)
    return "\n".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {text}"
                     for text, r in by_text.items())


def last_error_line(output: str) -> str:
    """The failing rank's own error (``[rankN]: SomeError: ...``) rather than torchrun's
    ChildFailedError summary, which says only that a child failed; for a rank killed by a
    signal (no Python error), which rank, how, and the last lines it wrote."""
    lines = [ln for ln in output.splitlines() if ln.strip() and not ln.startswith(("W1", "I1", "*"))]
    errors = [ln for ln in lines if "Error" in ln or "Exception" in ln]
    from_ranks = [ln for ln in errors if ln.startswith("[rank") and "ChildFailedError" not in ln]
    own = [ln for ln in errors if "ChildFailedError" not in ln and "elastic" not in ln]
    if from_ranks or own:
        return (from_ranks or own)[-1]
    exits = rank_exits(output)
    if exits:
        rank, code = exits[0]
        written = [ln for ln in rank_stderr_lines(output) if not RANK_PREFIX.match(ln)][-3:]
        return f"rank {rank} {exit_text(code)}" + (f"; it wrote last: {' | '.join(written)}" if written else "")
    return (errors or lines or ["(no output)"])[-1]


# torchrun's own log lines (``W1201 02:40:35.362000 4953 .../api.py:1028] ...``) and its
# failure report (``Root Cause`` ... ``exitcode  : -6 (pid: 5002)``) around the ranks' output.
TORCHRUN_LOG = re.compile(r"^[WEIF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+\] ")
RANK_EXIT = re.compile(r"^\s*rank\s*: (\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*: (-?\d+)", re.M)
RANK_PREFIX = re.compile(r"^\[rank\d+\]:")


def exit_text(code: int) -> str:
    """``exit 1``, or ``killed by SIGABRT (exit -6)`` for a negative (signal) code."""
    if code < 0:
        try:
            oom = "; the out-of-memory killer sends it" if -code == signal.SIGKILL else ""
            return f"killed by {signal.Signals(-code).name} (exit {code}{oom})"
        except ValueError:
            return f"killed by signal {-code} (exit {code})"
    return f"exit {code}"


def rank_exits(stderr: str) -> list[tuple[int, int]]:
    """(rank, exit code) from torchrun's failure report, the root cause first (torchrun
    lists the other failures first, then ``Root Cause (first observed failure)``)."""
    cause = stderr.rfind("Root Cause")
    found = [(int(rank), int(code)) for rank, code in RANK_EXIT.findall(stderr[cause:] if cause >= 0 else "")]
    for rank, code in RANK_EXIT.findall(stderr[:cause] if cause >= 0 else stderr):
        if (int(rank), int(code)) not in found:
            found.append((int(rank), int(code)))
    return found


def rank_stderr_lines(stderr: str) -> list[str]:
    """The ranks' own stderr lines: torchrun's log lines and its closing traceback and
    failure report (from the launcher's ``Traceback`` that ends in ChildFailedError) left out."""
    lines = stderr.splitlines()
    failed = next((i for i, line in enumerate(lines) if "ChildFailedError" in line), None)
    if failed is not None:
        start = next((i for i in range(failed, -1, -1) if lines[i].startswith("Traceback (most recent call last)")),
                     failed)
        lines = lines[:start]
    return [line.strip() for line in lines if line.strip() and not TORCHRUN_LOG.match(line)]

