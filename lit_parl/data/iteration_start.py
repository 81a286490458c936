"""IterationStart: the iteration the version gate opened, started in a thread before its stream takes it.

``WeightSync`` opens the gate once the pool holds θ_k, often at the previous epoch's end: the iteration
starts right then (``open``), so its requests leave and its first micro-batch is collated while Lightning
finishes the epoch. The iteration's stream then ``take``\\ s it, after the gate, or starts one of its own when
the gate was opened past ``open``. An opened iteration the fit never runs (it stopped first) is discarded
unbooked (``discard``): its thread is joined and the gate withdrawn, so nothing of it counts.

Example (a "batcher" that yields its version three times)::

    >>> from lit_parl.data.version_gate import VersionGate
    >>> gate = VersionGate(timeout_s=1.0)
    >>> start = IterationStart(gate, lambda version: Started(version, None,
    ...     HeadStart(iter([version] * 3), "it", False)))
    >>> start.open(0, confirmed=0)
    >>> list(start.take().batches)
    [0, 0, 0]
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import NamedTuple

from lit_parl.data.head_start import HeadStart
from lit_parl.data.iteration_stats import IterationStats
from lit_parl.data.version_gate import VersionGate


class Started(NamedTuple):
    """An iteration started when its gate opened: its version, its stats so far, its micro-batches."""

    version: int
    stats: IterationStats | None
    batches: HeadStart


class IterationStart:
    """Owns the started iteration between the gate's opening and its stream.

    Args:
        gate: the version gate the stream waits at.
        start: ``version -> Started``: the iteration of ``version``, its batcher started in a thread.
    """

    def __init__(self, gate: VersionGate, start: Callable[[int], Started]) -> None:
        self.gate = gate
        self.start = start
        self._started: Started | None = None
        self._lock = threading.Lock()  # a stream already waiting at the gate takes this start, not one of its own

    @property
    def pending(self) -> Started | None:
        """The opened iteration no stream has taken yet."""
        return self._started

    def open(self, version: int, confirmed: int | None) -> None:
        """The pool confirmed ``version``: its iteration starts now, whether or not its epoch has begun."""
        with self._lock:
            self.gate.open(version, confirmed)
            self._close_pending()  # an earlier opening whose iteration never ran (none in a fit that runs on)
            self._started = self.start(version)

    def take(self) -> Started:
        """After the gate (waiting for it): the started iteration, or one started now."""
        version = self.gate.wait()
        with self._lock:
            started, self._started = self._started, None
        if started is None or started.version != version:  # the gate was opened past ``open``
            if started is not None:
                started.batches.close()
            started = self.start(version)
        return started

    def discard(self, join_s: float = 10.0) -> None:
        """An opened iteration will not run (the fit ended first): end its thread, withdraw the gate."""
        if self._started is None:
            return
        thread = self._started.batches
        self._close_pending()
        thread.join(timeout=join_s)  # it ends at its next exchange with the closed pool
        self.gate.withdraw()

    def _close_pending(self) -> None:
        if self._started is not None:
            self._started.batches.close()
            self._started = None
