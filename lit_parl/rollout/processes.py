"""Stopping what a rollout backend started: its processes, their descendants, nothing else.

Every backend launches processes (spawned workers, inference servers); none may outlive the trainer,
whether it closes the pool, fails, or is SIGKILLed. These helpers are the Linux side of that promise:
``die_with_parent`` (the kernel kills a child whose parent died; ``dying_with_parent`` wraps a command the trainer
starts so), the descendants of a process read from
``/proc`` (an engine may start processes of its own, which are re-parented once it has gone), and
``stop_workers``, which asks spawned workers to stop and kills what is left. And one check for when a
spawned worker dies at once: ``unguarded_main_script`` (spawned workers import the user's script again).

And the two ends of a worker's results pipe, one pipe per worker: ``Outbox`` in the worker (a thread
sends, so the worker never waits for a trainer that is busy training) and ``read_messages`` on a
thread of the trainer. A process killed in the middle of a message cuts short only its own pipe; the
reader drops the partial message and reports the end of the pipe, which is how the pool learns that
the worker is gone. A shared queue would be corrupted instead, or stay locked by the dead writer.
"""

from __future__ import annotations

import ctypes
import os
import queue
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from lit_parl.rollout.worker_messages import Exited, Stop, Unreadable, WorkerError


def pin_to_cores(cores: Sequence[int]) -> None:
    """Run every thread of this process, and every thread it starts later, on ``cores`` only (CPU affinity).

    Linux keeps an affinity mask per thread and a new thread inherits its creator's: setting only the calling
    thread's would leave threads started before (an OpenMP team, a pipe reader) wherever they were.
    """
    cores = set(cores)
    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cores)
        except ProcessLookupError:
            pass  # a thread that ended meanwhile


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies, however the parent dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass  # not Linux: a spawned worker still exits when it sees its parent gone


# Sets the parent-death signal, checks that the parent is still the one that started it (it may have died before
# the signal was set), then becomes the command: the signal survives exec.
_DIE_WITH_PARENT_THEN_EXEC = """\
import ctypes, os, signal, sys
try:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
except OSError:
    pass
if os.getppid() != int(sys.argv[1]):
    os._exit(1)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def dying_with_parent(command: Sequence[str]) -> list[str]:
    """``command``, started through a small interpreter that asks Linux to SIGKILL it when the thread that started
    it exits (the trainer's death, however it dies), then execs it.

    Not ``Popen(preexec_fn=die_with_parent)``: a ``preexec_fn`` runs Python in the forked child of a threaded trainer,
    and CPython first frees the other threads' states there; freeing what they held (a gloo process group cached by
    torch, once) can wait forever on a lock whose owner thread does not exist in the child. The child must go
    straight to exec, which ``Popen`` without ``preexec_fn`` does.
    """
    return [sys.executable, "-I", "-S", "-c", _DIE_WITH_PARENT_THEN_EXEC, str(os.getpid()), *command]


def process_table() -> dict[int, tuple[int, int]]:
    """``pid -> (parent pid, start time)`` of every process, read from /proc (empty where there is none)."""
    table = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return table
    for entry in entries:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # fields[0] is proc(5)'s field 3, the state
                table[int(entry)] = (int(fields[1]), int(fields[19]))
            except (OSError, IndexError, ValueError):
                continue
    return table


def descendants(pids: list[int]) -> dict[int, int]:
    """``pid -> start time`` of the live descendants of ``pids``."""
    table = process_table()
    found, frontier = {}, set(pids)
    while frontier:
        children = {pid: start for pid, (parent, start) in table.items() if parent in frontier}
        found.update(children)
        frontier = set(children)
    return found


def kill_if_same(processes: dict[int, int]) -> None:
    """SIGKILL each ``pid -> start time`` that is still that process (not a reused pid)."""
    table = process_table()
    for pid, start in processes.items():
        if table.get(pid, (None, None))[1] == start:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def stop_workers(processes: list, inboxes: list, grace_s: float = 5.0) -> None:
    """Ask spawned workers to stop, give them ``grace_s`` together, kill the ones left and their descendants."""
    # note the descendants first: they are re-parented (and lost from view) once their worker has gone
    leftovers = descendants([p.pid for p in processes if p.pid is not None])
    for inbox in inboxes:
        try:
            inbox.put(Stop())
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + grace_s
    for process in processes:
        if process.pid is not None:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join(timeout=5.0)
    kill_if_same(leftovers)


def unguarded_main_script() -> str | None:
    """The path of the ``__main__`` script if it has no ``if __name__ == "__main__":`` guard, else None."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    try:
        source = Path(path).read_text() if path else None
    except (OSError, UnicodeDecodeError):
        return None
    if source is None or re.search(r"""__name__\s*==\s*['"]__main__['"]|['"]__main__['"]\s*==\s*__name__""", source):
        return None
    return path


class Outbox:
    """A worker's end of its results pipe: ``put`` never blocks, a thread sends the messages in order.

    Args:
        connection: the write end of the worker's pipe (``multiprocessing.Pipe(duplex=False)[1]``).
    """

    def __init__(self, connection) -> None:
        self._connection = connection
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._send_all, name="lit_parl-outbox", daemon=True)
        self._thread.start()

    def put(self, message: object) -> None:
        self._queue.put(message)

    def close(self) -> None:
        """Send what is queued, then close the pipe: its reader sees the end once this process has exited."""
        self._queue.put(None)
        self._thread.join()
        self._connection.close()

    def _send_all(self) -> None:
        while (message := self._queue.get()) is not None:
            try:
                self._connection.send(message)
            except OSError:
                return  # the trainer is gone: nobody reads any more
            except Exception:  # noqa: BLE001 - not picklable (nothing was written): the trainer must hear why
                self._connection.send(WorkerError(traceback.format_exc()))


def read_messages(connection, tag, messages: queue.Queue) -> None:
    """Put each message of ``connection`` on ``messages`` as ``(tag, message)``, then ``(tag, Exited())``.

    Runs on a thread of its own until the pipe ends, which happens once every process holding its write
    end has exited; a message cut short by the writer's death ends it the same way and is dropped. A
    complete message that cannot be unpickled is passed on as ``(tag, Unreadable(traceback))``.
    """
    try:
        while True:
            try:
                message = connection.recv()
            except (EOFError, OSError):
                return
            except Exception:  # noqa: BLE001 - read whole but not unpickled: the pipe is still in step
                message = Unreadable(traceback.format_exc())
            messages.put((tag, message))
    finally:
        connection.close()
        messages.put((tag, Exited()))


def why_gone(hung: bool, exitcode: int | None, response_timeout_s: float) -> str:
    """How a worker process ended, for the message that reports it (``hung``: killed for its silence)."""
    if hung:
        return f"was silent for {response_timeout_s:g} s with work outstanding (hung), so it was killed"
    if exitcode is not None and exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name} (exit code {exitcode})"
        except ValueError:
            pass
    return f"exited (exit code {exitcode})"
