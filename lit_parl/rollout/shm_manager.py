"""A ``torch_shm_manager`` of the pool's own, for the CPU tensors that servers map by file name.

A CPU tensor pickled by torch's ``file_system`` strategy names a shared-memory file and the socket of the
manager that keeps its books (``rebuild_storage_filename(cls, manager, handle, size)``). The reader connects
to that manager and keeps the connection as long as it lives (libshm caches it), and a manager exits only
2 s after its last client has gone. Left to torch, the manager named is the one libtorch started for the
trainer's process (its own session, the trainer's stderr inherited): an attached server then keeps it,
and the caller's output pipe with it, alive after the fit, for as long as the server runs.

So the pool names its own manager in the pickles (``weight_transfer.serialize_named_tensors``): spawned
here, its output and error to ``/dev/null``, killed with the trainer by the kernel (``PR_SET_PDEATHSIG``,
from a thread that lives exactly as long as it), and stopped when the pool closes. The trainer is never
its client through libtorch, so libtorch's own manager keeps only the trainer as client and exits 2 s
after it, and the trainer's later shares (a second pool in the process) still reach that one. A server
keeps a dead socket in libshm's cache once this manager has gone; the next pool's pickles name a new one,
to which it connects afresh. What a server must not do is free a tensor of this manager's after it has
gone (libshm's free then throws in a destructor): servers drop an update's tensors before answering it.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import subprocess
import threading
import weakref
from pathlib import Path

import torch

from lit_parl.rollout.processes import dying_with_parent

START_TIMEOUT_S = 30.0


def manager_executable() -> Path:
    """The ``torch_shm_manager`` that ships with this torch (libtorch starts the same one)."""
    return Path(torch.__file__).resolve().parent / "bin" / "torch_shm_manager"


class ShmManager:
    """A ``torch_shm_manager`` process, started on the first ``handle()`` and gone after ``stop()``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state: dict = {}  # process, keepalive socket, socket path: what stop needs, also from a finalizer
        self._handle: bytes | None = None
        self._finalizer = weakref.finalize(self, _stop, self._state)  # a pool never closed, or interpreter exit

    @property
    def pid(self) -> int | None:
        process = self._state.get("process")
        return process.pid if process is not None else None

    def handle(self) -> bytes:
        """The manager's socket path as pickles name it, starting the manager on the first call."""
        with self._lock:
            if self._handle is None or self._state["process"].poll() is not None:
                _stop(self._state)
                self._handle = _start(self._state)
            return self._handle

    def stop(self) -> None:
        """Kill the manager and remove its socket's directory; idempotent. Servers that connected keep a
        dead socket, which they use only to free a tensor of this manager's (they freed them all already)."""
        with self._lock:
            _stop(self._state)
            self._handle = None


def _start(state: dict) -> bytes:
    ready = threading.Event()

    def spawn_and_wait() -> None:
        # the kernel's parent-death signal fires when the thread that forked exits: this one lives until the
        # manager has exited, so only the trainer's own death (or stop) ends the manager
        try:
            state["process"] = subprocess.Popen(
                dying_with_parent([str(manager_executable())]),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,  # never the caller's: it would hold the caller's pipe open
            )
        except BaseException as error:  # noqa: BLE001 - raised on the caller's thread
            state["error"] = error
            return
        finally:
            ready.set()
        state["process"].wait()

    state.pop("error", None)
    threading.Thread(target=spawn_and_wait, name="lit_parl-shm-manager", daemon=True).start()
    ready.wait()
    if "error" in state:
        raise RuntimeError(f"could not start {manager_executable()}: {state['error']}") from state["error"]
    process = state["process"]
    line = _first_line(process)
    if not line.startswith(b"/"):  # "ERROR: ..." or nothing: the manager could not open its socket
        _stop(state)
        raise RuntimeError(f"torch_shm_manager did not start: {line.decode(errors='replace') or 'no output'}")
    state["path"] = line.decode()
    # a client of our own from the start: a manager without clients exits after 2 s, before any server came
    keepalive = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    state["keepalive"] = keepalive
    try:
        keepalive.connect(state["path"])
    except OSError as error:
        _stop(state)
        raise RuntimeError(f"torch_shm_manager at {line.decode()} refused its first client: {error}") from error
    return line


def _first_line(process: subprocess.Popen) -> bytes:
    """The line the manager prints once its socket listens (then its output pipe is closed)."""
    line = b""
    with process.stdout:
        while not line.endswith(b"\n"):
            readable, _, _ = select.select([process.stdout], [], [], START_TIMEOUT_S)
            chunk = os.read(process.stdout.fileno(), 4096) if readable else b""
            if not chunk:
                break
            line += chunk
    return line.strip()


def _stop(state: dict) -> None:
    keepalive = state.pop("keepalive", None)
    if keepalive is not None:
        keepalive.close()
    process = state.pop("process", None)
    if process is not None and process.poll() is None:
        try:
            process.send_signal(signal.SIGKILL)  # its clients (the servers) stay connected: it would never exit
        except ProcessLookupError:
            pass
        process.wait()
    path = state.pop("path", None)
    if path is not None and Path(path).parent.name.startswith("torch-shm-dir-"):
        shutil.rmtree(Path(path).parent, ignore_errors=True)  # a killed manager leaves its socket's directory
