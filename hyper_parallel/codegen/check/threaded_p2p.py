"""Point-to-point sends for verify's simulated ranks: torch's threaded process group
(``multi_threaded_pg``, every rank a thread of one process) has collectives only, and
pipeline stages hand activations and gradients on with ``isend``/``irecv``.

``installed()`` gives ``ProcessLocalGroup`` a ``send`` and a ``recv`` for its lifetime:
a send copies the tensor into a mailbox keyed by (group, source, destination, tag), or
straight into a receive already waiting there; a receive takes the oldest message of its
key, or waits for it (its ``Work`` completes when the message arrives). Messages of one
key arrive in the order they were sent, as over a socket. When a rank fails
(``ProcessLocalGroup.exception_handle``), the receives still waiting fail too, so a rank
blocked on a message its failed peer will never send raises instead of waiting out the
timeout.
"""

import collections
import contextlib
import threading
from typing import Any


class Mailboxes:
    """The messages sent and not yet received, and the receives still waiting, by key."""

    def __init__(self):
        self.lock = threading.Lock()
        self.sent: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
        self.waiting: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
        self.failure: BaseException | None = None  # a peer failed: every receive from now on fails

    def send(self, key: tuple, tensor: Any) -> None:
        with self.lock:
            if self.waiting[key]:
                target, future = self.waiting[key].popleft()
                _write(target, tensor)
                future.set_result([target])
                return
            self.sent[key].append(tensor.detach().clone())

    def recv(self, key: tuple, target: Any) -> Any:
        """A future that holds ``target`` once the message of ``key`` is copied into it."""
        from torch.futures import Future

        future = Future()
        with self.lock:
            if self.failure is not None and not self.sent[key]:
                future.set_exception(RuntimeError(f"a peer rank failed before sending: {self.failure}"))
            elif self.sent[key]:
                _write(target, self.sent[key].popleft())
                future.set_result([target])
            else:
                self.waiting[key].append((target, future))
        return future

    def fail_waiting(self, exc: BaseException) -> None:
        """Every receive waiting, and every later one with nothing to take, fails with
        ``exc`` (a peer rank failed)."""
        with self.lock:
            self.failure = exc
            waiting = [future for queue in self.waiting.values() for _, future in queue]
            self.waiting.clear()
        for future in waiting:
            future.set_exception(RuntimeError(f"a peer rank failed before sending: {exc}"))


def _write(target: Any, message: Any) -> None:
    """Fill a receive buffer as a process group does: outside autograd (the stage's
    buffers are leaves that require grad once received into)."""
    import torch

    with torch.no_grad():
        target.copy_(message)


@contextlib.contextmanager
def installed():
    """``ProcessLocalGroup.send``/``recv`` over one set of mailboxes, removed on exit."""
    from torch._C._distributed_c10d import _create_work_from_future
    from torch.futures import Future
    from torch.testing._internal.distributed.multi_threaded_pg import ProcessLocalGroup

    boxes = Mailboxes()

    def send(self, tensors, dst_rank, tag=0):
        for tensor in tensors:
            boxes.send((self.pg_name, self._rank, dst_rank, tag), tensor)
        done = Future()
        done.set_result(tensors)
        return _create_work_from_future(done)

    def recv(self, tensors, src_rank, tag=0):
        (target,) = tensors
        return _create_work_from_future(boxes.recv((self.pg_name, src_rank, self._rank, tag), target))

    original_handle = ProcessLocalGroup.__dict__["exception_handle"]

    def exception_handle(cls, exc):
        original_handle.__func__(cls, exc)
        boxes.fail_waiting(exc)

    ProcessLocalGroup.send, ProcessLocalGroup.recv = send, recv
    ProcessLocalGroup.exception_handle = classmethod(exception_handle)
    try:
        yield boxes
    finally:
        del ProcessLocalGroup.send, ProcessLocalGroup.recv
        ProcessLocalGroup.exception_handle = original_handle
