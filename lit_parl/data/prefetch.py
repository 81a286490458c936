"""Work in a background thread whose results the consumer's thread takes in order: the one hand-off
that the prefetch path and the threaded scorer both use."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator

_END = object()


def beside(produce: Callable[[Callable, Callable, threading.Event], None], name: str) -> Iterator:
    """Run ``produce(put, fail, stop)`` in a daemon thread; yield what it ``put``\\ s, in order.

    ``produce`` returns when it is done; ``fail(error)`` (from any thread) re-raises ``error`` in the
    consumer, and so does an exception ``produce`` lets out. Closing this generator (the consumer failed
    or stopped) sets ``stop``, which ``produce`` checks between items. A thread blocked inside the pool
    ends when the pool is closed (its receive raises).
    """
    handoff: queue.SimpleQueue = queue.SimpleQueue()
    stop = threading.Event()

    def put(item) -> None:
        handoff.put((item, None))

    def fail(error: BaseException) -> None:
        handoff.put((None, error))

    def run() -> None:
        try:
            produce(put, fail, stop)
            put(_END)
        except BaseException as error:  # noqa: BLE001 - re-raised in the consumer's thread
            fail(error)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    try:
        while True:
            try:
                item, error = handoff.get(timeout=1.0)
            except queue.Empty:
                if not thread.is_alive() and handoff.empty():
                    raise RuntimeError(f"the thread {name} ended without a word") from None
                continue
            if error is not None:
                raise error
            if item is _END:
                return
            yield item
    finally:
        stop.set()


def prefetched(items: Iterable, name: str) -> Iterator:
    """Run the generator ``items`` in a daemon thread, ahead of the consumer; re-raise its errors here."""

    def produce(put, fail, stop: threading.Event) -> None:
        for item in items:
            if stop.is_set():
                return
            put(item)

    return beside(produce, name)
