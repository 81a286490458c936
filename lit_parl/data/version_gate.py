"""VersionGate: the one owner of "which policy version may generate now".

The weight-sync callback opens the gate with a version once the pool confirmed it; the iteration's
stream waits on the gate before it sends a single request, and closes it when the iteration is done.
Lightning's hook order and prefetching are not trusted for this ordering: the gate is.

Example::

    >>> gate = VersionGate(timeout_s=1.0)
    >>> gate.open(0, confirmed=0); gate.wait()
    0
    >>> gate.close(); gate.last_version
    0
    >>> gate.open(0, confirmed=0)
    Traceback (most recent call last):
    ...
    lit_parl.errors.OffPolicyError: policy version 0 is not newer than the last iteration's (0)
"""

from __future__ import annotations

import threading

from lit_parl.errors import OffPolicyError


class VersionGate:
    """Opened once per iteration with a newer version; waited on before any request is sent.

    Args:
        timeout_s: how long ``wait`` waits for ``open`` before it fails (nothing synced the weights).
    """

    def __init__(self, timeout_s: float = 300.0) -> None:
        self.timeout_s = timeout_s
        self.last_version: int | None = None  # the last iteration's version (checkpointed)
        self._event = threading.Event()
        self._version: int | None = None

    def open(self, version: int, confirmed: int | None) -> None:
        """Let an iteration of ``version`` start; ``confirmed`` is the version the pool reports holding."""
        if self.last_version is not None and version <= self.last_version:
            raise OffPolicyError(
                f"policy version {version} is not newer than the last iteration's ({self.last_version})"
            )
        if confirmed != version:
            raise OffPolicyError(
                f"the gate was asked to open version {version} but the pool confirmed version {confirmed}"
            )
        self._version = version
        self._event.set()

    def wait(self) -> int:
        """The open version; raises ``TimeoutError`` if nothing opens the gate within ``timeout_s``."""
        if not self._event.wait(self.timeout_s):
            raise TimeoutError(
                f"waited {self.timeout_s:.0f} s for the iteration's weights: nothing opened the version gate. "
                "Add lit_parl.callbacks.WeightSync() to the Trainer's callbacks."
            )
        return self._version

    def close(self) -> None:
        """The iteration is complete: its version becomes the last one and the gate waits for a newer."""
        self.last_version = self._version
        self._event.clear()

    def withdraw(self) -> None:
        """An opened iteration will not run (the fit ended first): the gate closes without booking its version."""
        self._version = None
        self._event.clear()

    def state_dict(self) -> dict:
        return {"last_version": self.last_version}

    def load_state_dict(self, state_dict: dict) -> None:
        self.last_version = state_dict["last_version"]
