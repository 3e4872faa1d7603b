"""Handshakes with peer engines, done once per peer and cached.

Both halves use it: the decode worker before a load, and the prefill scheduler to learn the
decode's layout before it stages (without blocking the engine: `poll` never waits).
"""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter

from vllm_qaic_connector.logs import get_logger
from vllm_qaic_connector.protocol import side_channel, wire
from vllm_qaic_connector.protocol.names import KV_DTYPES, LAYOUT_KINDS, address_problem
from vllm_qaic_connector.protocol.side_channel import SideChannelTimeout
from vllm_qaic_connector.protocol.ticket import RemotePrefill
from vllm_qaic_connector.protocol.wire import RankMetadata

logger = get_logger(__name__)  # inside vLLM's logger tree, so it is printed
RETRY_AFTER_S = 2.0
HANDSHAKE_ATTEMPTS = 3
_POSITIVE = ("block_size", "num_blocks", "head_size", "num_kv_heads", "num_layers", "tp_size")
# Engine-wide facts: every rank of one engine must state the same.
_AGREED = (
    "engine_id", "tp_size", "layout_kind", "block_size", "num_layers", "num_kv_heads",
    "head_size", "dtype", "model", "weights", "compat_hash",
)  # fmt: skip
_KNOWN = {"layout_kind": LAYOUT_KINDS, "dtype": KV_DTYPES, "endpoint.kind": ("shm", "nixl")}
# Both go into segment and agent names: no "/", no NUL, bounded; vLLM's default is a uuid4.
ENGINE_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
INCARNATION = re.compile(r"[0-9a-f]{16}")  # region_headers.new_incarnation()


def _name_problem(i: int, r: RankMetadata) -> str | None:
    """A peer may only point us at its own segment (or agent): the one its handshake's
    engine_id, tp_rank and incarnation name, never another engine's or a path."""
    if not ENGINE_ID.fullmatch(r.engine_id):
        return f"rank {i} engine_id {r.engine_id!r} is not a safe name ({ENGINE_ID.pattern})"
    if not INCARNATION.fullmatch(r.incarnation):
        return f"rank {i} incarnation {r.incarnation!r} is not 16 lowercase hex digits"
    want = wire.staging_name(r.engine_id, r.tp_rank, r.incarnation)
    if (r.endpoint.address, r.endpoint.size) == ("", 0):
        return None  # an engine that only loads has no staging
    if r.endpoint.owner is None:
        return f"rank {i} endpoint.address {r.endpoint.address!r} is not name[@0xbase]"
    if r.endpoint.owner != want:
        return (
            f"rank {i} endpoint.address {r.endpoint.address!r} is not the name its "
            f"handshake implies ({want!r})"
        )
    return None


def check_ranks(ranks: list[RankMetadata]) -> str | None:
    """Names the first thing wrong with a peer's handshake ranks, or None. Consumers index
    ranks by position, so rank i must be tp_rank i."""
    if not ranks:
        return "no ranks"
    for i, r in enumerate(ranks):
        for field in _POSITIVE:
            if getattr(r, field) <= 0:
                return f"rank {i} {field} must be > 0, got {getattr(r, field)}"
        if r.tp_size != len(ranks):
            return f"rank {i} tp_size is {r.tp_size} but the reply has {len(ranks)} ranks"
        if r.tp_rank != i:
            return f"rank {i} has tp_rank {r.tp_rank}: tp_rank must run 0..{len(ranks) - 1}"
        for field, known in _KNOWN.items():
            if (value := attrgetter(field)(r)) not in known:
                return f"rank {i} {field} {value!r} is unknown"
        if r.endpoint.size < 0:
            return f"rank {i} endpoint.size must be >= 0, got {r.endpoint.size}"
        if problem := _name_problem(i, r):
            return problem
        for field in _AGREED:
            if (value := getattr(r, field)) != (want := getattr(ranks[0], field)):
                return f"rank {i} {field} {value!r} differs from rank 0's {want!r}"
    return None


class PeerRefused(ConnectionError):
    """The peer answered, but we cannot use it (a bad or incompatible handshake)."""


@dataclass
class _Entry:
    done: threading.Event
    ranks: list[RankMetadata] | None = None
    error: str | None = None
    answered: bool = False  # the peer replied, even if we refused it
    finished: float = 0.0


class PeerDirectory:
    def __init__(self, engine_id: str, key: bytes | None, timeout_s: float) -> None:
        self.engine_id, self.key, self.timeout_s = engine_id, key, timeout_s
        self.ours: RankMetadata | None = None  # set once our workers registered
        self._entries: dict[tuple[str, int], _Entry] = {}
        self._lock = threading.Lock()
        self._completed = 0  # handshakes since the last take_handshakes()
        self._on_resolved: list[Callable[[], None]] = []

    def when_resolved(self, callback: Callable[[], None]) -> None:
        """``callback()`` runs (on the handshake's thread) each time a handshake resolves,
        so what waits on one goes on without waiting for anything else."""
        self._on_resolved.append(callback)

    def _probe(self, host: str, port: int) -> None:
        """A plain TCP connect: a refused port or an unknown host fails at once, by name,
        where ZMQ would silently retry until the timeout."""
        try:
            socket.create_connection((host.strip("[]"), port), timeout=self.timeout_s).close()
        except TimeoutError:
            raise SideChannelTimeout(f"{host}:{port} did not accept a connection") from None
        except ConnectionRefusedError:
            raise ConnectionError(f"connection refused by {host}:{port}") from None
        except socket.gaierror as exc:
            raise ConnectionError(f"peer host {host!r} does not resolve: {exc}") from None
        except OSError as exc:  # unreachable network or host
            raise ConnectionError(f"cannot connect to {host}:{port}: {exc}") from None

    def _handshake(self, host: str, port: int) -> list[RankMetadata]:
        if problem := address_problem(host, port):
            raise ConnectionError(f"bad peer address {host!r}:{port!r}: {problem}")
        request = wire.HandshakeRequest(wire.PROTOCOL_VERSION, self.engine_id)
        for attempt in range(1, HANDSHAKE_ATTEMPTS + 1):
            try:
                self._probe(host, port)
                reply = side_channel.call(host, port, request, self.key, self.timeout_s)
                break
            except SideChannelTimeout:
                # A busy peer on an oversubscribed host can miss one deadline; a dead one
                # misses them all.
                if attempt == HANDSHAKE_ATTEMPTS:
                    raise ConnectionError(
                        f"side channel {host}:{port} silent {attempt} times "
                        f"({self.timeout_s}s each)"
                    ) from None
        if not isinstance(reply, wire.HandshakeReply):
            raise PeerRefused(f"bad handshake reply from {host}:{port}: got {type(reply).__name__}")
        if problem := check_ranks(reply.ranks):
            raise PeerRefused(f"bad handshake reply from {host}:{port}: {problem}")
        if self.ours is not None and (problem := wire.incompatibility(self.ours, reply.ranks[0])):
            raise PeerRefused(f"incompatible peer at {host}:{port}: {problem}")
        with self._lock:
            self._completed += 1
        return reply.ranks

    def take_handshakes(self) -> int:
        """Handshakes completed since the last call (for the stats)."""
        with self._lock:
            done, self._completed = self._completed, 0
            return done

    def _run(self, host: str, port: int, entry: _Entry) -> None:
        try:
            ranks = self._handshake(host, port)
            r = ranks[0]
            facts = (r.engine_id, host, port, r.layout_kind, r.block_size, r.tp_size)
            logger.info(
                "QAICConnector: handshake with %s at %s:%d: %s layout, block %d, TP %d", *facts
            )
            entry.ranks, entry.answered = ranks, True  # last: a failure above leaves it None
        except ConnectionError as exc:
            entry.error, entry.answered = str(exc), isinstance(exc, PeerRefused)
            logger.warning("QAICConnector: %s", exc)
        except Exception as exc:  # a bug here must fail this peer, not hang its callers
            entry.error = f"handshake with {host}:{port} failed: {type(exc).__name__}: {exc}"
            logger.exception("QAICConnector: %s", entry.error)
        finally:
            entry.finished = time.monotonic()
            entry.done.set()
            for callback in self._on_resolved:
                callback()

    def _entry(self, host: str, port: int, retry: bool = True) -> _Entry:
        with self._lock:
            entry = self._entries.get((host, port))
            # A failed handshake is retried after a pause, not cached forever.
            age = time.monotonic() - entry.finished if entry is not None else 0.0
            if entry is None or (retry and entry.error is not None and age > RETRY_AFTER_S):
                entry = self._entries[(host, port)] = _Entry(threading.Event())
                thread = threading.Thread(
                    target=self._run, args=(host, port, entry), daemon=True, name="qaic-handshake"
                )
                try:
                    thread.start()
                except RuntimeError as exc:  # out of threads: fail this peer, not the step
                    entry.error = f"handshake with {host}:{port} not started: {exc}"
                    entry.finished = time.monotonic()
                    entry.done.set()
            return entry

    def answered(self, host: str, port: int) -> bool:
        """Whether the peer's last finished handshake got a reply (it is alive)."""
        with self._lock:
            entry = self._entries.get((host, port))
        return entry is not None and entry.done.is_set() and entry.answered

    def forget(self, host: str, port: int) -> None:
        """Drop what we know of a peer (it restarted): the next lookup handshakes afresh."""
        with self._lock:
            self._entries.pop((host, port), None)

    def staged_by(
        self,
        remote: RemotePrefill,
        restarted: Callable[[list[RankMetadata]], None] = lambda _: None,
        retry: bool = True,
    ) -> list[RankMetadata]:
        """The ranks of the engine start that staged ``remote``: a peer met before, that has
        restarted since, is handshaken afresh (``restarted`` hears of its old ranks). Raises
        ConnectionError where the address answers as another engine, or as a later start
        (the KV is gone with the earlier one)."""
        host, port = remote.remote_host, remote.remote_port
        ranks = self.get(host, port, retry)
        if ranks[0].incarnation != remote.incarnation:
            restarted(ranks)
            self.forget(host, port)
            ranks = self.get(host, port)
        if ranks[0].engine_id != remote.remote_engine_id:
            raise ConnectionError(
                f"{host}:{port} is engine {ranks[0].engine_id!r}, not {remote.remote_engine_id!r}"
            )
        if ranks[0].incarnation != remote.incarnation:
            raise ConnectionError(
                f"engine {remote.remote_engine_id} restarted since it staged the KV"
            )
        return ranks

    def poll(self, host: str, port: int, retry: bool = True) -> list[RankMetadata] | str | None:
        """Ranks if known, an error string if the handshake failed, None while pending.
        ``retry=False``: a failure stays the answer however old (for a caller waiting on
        that very handshake, which must not start it over)."""
        entry = self._entry(host, port, retry)
        if not entry.done.is_set():
            return None
        return entry.ranks if entry.ranks is not None else entry.error

    def get(self, host: str, port: int, retry: bool = True) -> list[RankMetadata]:
        """Blocking lookup, bounded by the handshake timeout. Raises ConnectionError."""
        entry = self._entry(host, port, retry)
        # Each attempt is a TCP probe and a round trip, each bounded by the timeout.
        if not entry.done.wait(HANDSHAKE_ATTEMPTS * 2 * self.timeout_s + 1.0):
            raise ConnectionError(f"handshake with {host}:{port} timed out")
        if entry.ranks is None:
            raise ConnectionError(entry.error or f"handshake with {host}:{port} failed")
        return entry.ranks
