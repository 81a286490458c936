"""Work in a background thread whose results the consumer's thread takes in order: the one hand-off
that the prefetch path, the next iteration's head start and the threaded scorer use."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator

_END = object()


class Beside(Iterator):
    """Run ``produce(put, fail, stop)`` in a daemon thread started now; iterate over what it ``put``\\ s, in order.

    ``produce`` returns when it is done; ``fail(error)`` (from any thread) re-raises ``error`` in the
    consumer, and so does an exception ``produce`` lets out. ``close()`` (the consumer failed or stopped, or
    a ``yield from`` over this was closed) sets ``stop``, which ``produce`` checks between items. A thread
    blocked inside the pool ends when the pool is closed (its receive raises).
    """

    def __init__(self, produce: Callable[[Callable, Callable, threading.Event], None], name: str) -> None:
        self._handoff: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._name = name
        self._finished = False

        def run() -> None:
            try:
                produce(self._put, self._fail, self._stop)
                self._put(_END)
            except BaseException as error:  # noqa: BLE001 - re-raised in the consumer's thread
                self._fail(error)

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    def _put(self, item) -> None:
        self._handoff.put((item, None))

    def _fail(self, error: BaseException) -> None:
        self._handoff.put((None, error))

    def __next__(self):
        if self._finished:
            raise StopIteration
        while True:
            try:
                item, error = self._handoff.get(timeout=1.0)
            except queue.Empty:
                if not self._thread.is_alive() and self._handoff.empty():
                    self._finish()
                    raise RuntimeError(f"the thread {self._name} ended without a word") from None
                continue
            if error is not None:
                self._finish()
                raise error
            if item is _END:
                self._finish()
                raise StopIteration
            return item

    def _finish(self) -> None:
        self._finished = True
        self._stop.set()

    def close(self) -> None:
        """Stop the work at its next item; what it already handed over is dropped."""
        self._finish()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end (after ``close``, or once its work is done); whether it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()


def prefetched(items: Iterable, name: str) -> Iterator:
    """Run the generator ``items`` in a daemon thread, ahead of the consumer; re-raise its errors here."""
    return HeadStart(iter(items), name, to_the_end=True)


class HeadStart(Iterator):
    """A generator started in a thread now, before its consumer asks for anything.

    ``to_the_end=True``: the thread runs it to its end, ahead of the consumer (prefetch). ``False``: the
    thread runs it to its first item only, and the consumer's thread carries it on from there. The next
    iteration starts so, while the trainer finishes the last one: its requests go out and its first
    micro-batch is collated in the thread, and the rest is received between training steps as before.
    The generator runs in one thread at a time: the consumer takes it over only once the thread is done
    with it.

    Example::

        >>> import threading
        >>> def numbers():
        ...     for i in range(3):
        ...         yield i, threading.current_thread().name
        >>> started = HeadStart(numbers(), "head-start", to_the_end=False)
        >>> [(i, name == "head-start") for i, name in started]
        [(0, True), (1, False), (2, False)]
    """

    def __init__(self, items: Iterator, name: str, to_the_end: bool) -> None:
        self._items = items

        def produce(put, fail, stop: threading.Event) -> None:
            for item in items:
                if stop.is_set():
                    return
                put(item)
                if not to_the_end:
                    return  # the consumer's thread carries the generator on

        self._thread = Beside(produce, name)
        self._inline = not to_the_end
        self._in_thread = True

    def __next__(self):
        if self._in_thread:
            try:
                return next(self._thread)
            except StopIteration:
                self._in_thread = False
                if not self._inline:
                    raise
        return next(self._items)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end; whether it has."""
        return self._thread.join(timeout)

    def close(self) -> None:
        """Stop: the thread at its next item; the generator itself once no thread runs it."""
        self._thread.close()
        if not self._in_thread or self._thread.join(timeout=0):
            self._items.close()  # runs its clean-up (e.g. a scorer's threads) in this thread
