"""Elastic membership of an SGLang pool: servers that join and leave between iterations.

The servers change only at a weight push, so every request of an iteration goes to a server that holds its
weights: a joining server answers ``/health``, receives θ_k in that push and must report version k (the
push's confirmation) before its first request; a leaving server is drained (no request of the iteration
after the push goes to it), and a server the pool launched is stopped when it leaves. A server that failed
during an iteration (its unfinished samples were already sent again, with the same seeds, to the others) is
dropped at the next push; listed again and healthy, it joins again.

Two ways to ask for a change, both read at the next push:

- from Python, on any thread: ``SGLangRolloutPool.add_server(url, capacity)`` and ``remove_server(url)``;
- from outside the training process: a membership file (``ServerSettings.membership_file``), one server per
  line, ``URL [capacity]``, ``#`` starts a comment. When the file exists, the attached servers become
  exactly those it lists (servers the pool launched stay until ``remove_server``); a missing file changes
  nothing, and one with a bad line changes nothing either (with a warning naming the line). Write it whole and
  rename it into place, so that a push never reads half of it.

Requests are spread by capacity: the next sample goes to the live server with the fewest requests in flight
per unit of capacity (``ServerFleet.pick``). Two set-ups keep their servers fixed, and a change asked of them is
refused with a warning: the ``distributed`` sync (its NCCL group is formed once, at the first push) and the
router (it balances its own worker list).

>>> import tempfile, os
>>> folder = tempfile.TemporaryDirectory()
>>> path = os.path.join(folder.name, "servers.txt")
>>> _ = open(path, "w").write("http://infer1:30000 2  # two GPUs' worth\\n\\nhttp://infer2:30000\\n")
>>> read_membership_file(path)
{'http://infer1:30000': 2.0, 'http://infer2:30000': 1.0}
>>> folder.cleanup()
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lit_parl.rollout.sglang.servers import Server, ServerFleet


@dataclass(frozen=True)
class MembershipChange:
    """What one push changed: servers that joined, left when asked, or were dropped after failing."""

    joined: tuple[str, ...] = ()
    left: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()

    def describe(self, servers: list[Server]) -> str:
        """The membership after the change, for the log: each server with its capacity, then what changed."""
        listing = ", ".join(f"{server.url} x{server.capacity:g}" for server in servers)
        changed = f"joined {list(self.joined)}, left {list(self.left)}, dropped after failing {list(self.dropped)}"
        return f"{len(servers)} server(s) [{listing}]; {changed}"


def why_fixed(router: bool, distributed: bool, adapters: bool = False) -> str | None:
    """Why a pool's servers cannot change (``None``: they can): a router in front, a ``distributed`` sync, or an
    adapter-only one (a joiner would lack the base, which is pushed once per fit)."""
    if router:
        return "the router balances its own workers (add them to it, or run without the router)"
    if distributed:
        return "the distributed sync's NCCL group is formed once (use sync.method=tensor or disk)"
    if adapters:
        return "with sync.lora=adapter the base is pushed once per fit, and a joiner would lack it (use merged)"
    return None


def read_membership_file(path: str | Path) -> dict[str, float]:
    """``{url: capacity}`` of a membership file; a bad line raises naming the file, the line and the fix."""
    servers: dict[str, float] = {}
    for number, raw in enumerate(Path(path).read_bytes().splitlines(), start=1):
        where = f"{path}:{number}"
        try:  # line by line, so that text that is not UTF-8 is named by its line
            line = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(
                f"{where}: not UTF-8 text ({error.reason} at byte {error.start}): write it as UTF-8"
            ) from None
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        url = fields[0].rstrip("/")
        if not url.startswith(("http://", "https://")) or len(fields) > 2:
            raise ValueError(f"{where}: {line.strip()!r} is not 'URL [capacity]' (e.g. 'http://infer1:30000 2')")
        servers[url] = capacity_of(fields[1], where) if len(fields) == 2 else 1.0
    return servers


def capacity_of(value, where: str) -> float:
    """A server's capacity: a positive number (its share of the requests is proportional to it)."""
    try:
        capacity = float(value)
    except (TypeError, ValueError):
        capacity = float("nan")
    if not capacity > 0:
        raise ValueError(f"{where}: capacity {value!r} must be a positive number (e.g. the server's GPUs)")
    return capacity


class Membership:
    """The changes asked of a pool's servers, kept until the next push applies them.

    Args:
        file: the membership file read at each push (``None``: only ``add``/``remove`` change the servers).
    """

    def __init__(self, file: str | Path | None = None) -> None:
        self.file = Path(file) if file is not None else None
        self._lock = threading.Lock()  # add/remove come from any thread, the push from the trainer's
        self._adds: dict[str, float] = {}
        self._removes: set[str] = set()

    def add(self, url: str, capacity: float = 1.0) -> None:
        url = url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"add_server({url!r}): give the server's URL, http://host:port")
        capacity = capacity_of(capacity, f"add_server({url!r})")
        with self._lock:
            self._removes.discard(url)
            self._adds[url] = capacity

    def remove(self, url: str) -> None:
        url = url.rstrip("/")
        with self._lock:
            self._adds.pop(url, None)
            self._removes.add(url)

    def asked(self, attached: dict[str, float]) -> tuple[dict[str, float], set[str]]:
        """``(joins, leaves)`` against the ``attached`` servers (``{url: capacity}``, launched ones apart): the
        file's list when it exists, then what ``add``/``remove`` asked since the last push (taken here)."""
        joins: dict[str, float] = {}
        leaves: set[str] = set()
        listed = self._read_file()
        if listed is not None:
            joins = {url: c for url, c in listed.items() if attached.get(url) != c}  # new, or a new capacity
            leaves = {url for url in attached if url not in listed}
        with self._lock:
            joins.update(self._adds)
            leaves = (leaves - set(self._adds)) | self._removes
            self._adds, self._removes = {}, set()
        return joins, leaves

    def _read_file(self) -> dict[str, float] | None:
        """The file's servers; ``None`` when there is no file, or it cannot be read (a running fit is not stopped
        for a typo: it says why, and the servers stay as they are until the file is fixed)."""
        if self.file is None or not self.file.exists():
            return None
        try:
            return read_membership_file(self.file)
        except (OSError, ValueError) as error:
            warnings.warn(f"{error}; the SGLang servers stay as they are", RuntimeWarning, stacklevel=4)
            return None

    def apply(
        self, fleet: ServerFleet, healthy: Callable[[str], bool], fixed: str | None, drop_failed: bool = True
    ) -> MembershipChange:
        """At a push: drop the servers that failed (``drop_failed``), then let the asked ones join and leave.
        ``healthy(url)`` probes a joining server; ``fixed`` says why this pool's servers cannot change (``None``:
        they can)."""
        dropped = [server for server in fleet.servers if not server.alive] if drop_failed else []
        for server in dropped:
            fleet.drop(server)
        joins, leaves = self.asked({s.url: s.capacity for s in fleet.servers if s.process is None})
        by_url = {server.url: server for server in fleet.servers}
        leaves &= set(by_url)
        joins = {url: c for url, c in joins.items() if url not in by_url or by_url[url].capacity != c}
        if fixed is not None and (joins or leaves):
            warnings.warn(
                f"SGLang servers {sorted(joins)} were not added and {sorted(leaves)} not removed: {fixed}",
                RuntimeWarning,
                stacklevel=3,
            )
            return MembershipChange(dropped=tuple(s.url for s in dropped))
        for url in sorted(leaves):
            fleet.drop(by_url[url])
        joined = []
        for url, capacity in joins.items():
            if url in by_url:
                by_url[url].capacity = capacity
            elif healthy(url):
                fleet.attach([url], [capacity])
                joined.append(url)
            else:
                warnings.warn(
                    f"SGLang server {url} does not answer /health, so it was not added: ask again (a membership file "
                    "asks at every push)",
                    RuntimeWarning,
                    stacklevel=3,
                )
        return MembershipChange(tuple(joined), tuple(sorted(leaves)), tuple(s.url for s in dropped))
