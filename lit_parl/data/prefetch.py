"""Run a generator in a background thread, ahead of its consumer (the optional prefetch path)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

_END = object()


def prefetched(items: Iterator, name: str) -> Iterator:
    """Run the generator ``items`` in a daemon thread, ahead of the consumer; re-raise its errors here.

    Closing this generator (the consumer failed or stopped) tells the thread to stop at its next item.
    A thread blocked inside the pool ends when the pool is closed (its receive raises).
    """
    handoff: queue.SimpleQueue = queue.SimpleQueue()
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in items:
                if stop.is_set():
                    return
                handoff.put((item, None))
            handoff.put((_END, None))
        except BaseException as error:  # noqa: BLE001 - re-raised in the consumer's thread
            handoff.put((None, error))

    thread = threading.Thread(target=produce, name=name, daemon=True)
    thread.start()
    try:
        while True:
            try:
                item, error = handoff.get(timeout=1.0)
            except queue.Empty:
                if not thread.is_alive() and handoff.empty():
                    raise RuntimeError(f"the prefetch thread {name} ended without a word") from None
                continue
            if error is not None:
                raise error
            if item is _END:
                return
            yield item
    finally:
        stop.set()
