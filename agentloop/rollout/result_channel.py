"""The result channel: a worker's padded rows to the driver over one TCP connection per worker
(``rollout.agent.result_channel: tcp``), instead of as the items of Ray's streaming generator.

Why: a group's rows handed over by an async actor's streaming generator cost ~2.7 ms on a 2-core
host for a 128-row single-turn chunk (the item goes through a thread-pool hop, Ray's serializer,
two RPC hops and the driver's loading), ~1.6 ms of it Ray's floor for any item; the same rows
pickled by the worker and written to a TCP connection are in the driver's hands in ~1.3-1.9 ms
(``scripts/bench_after_last.py --floor``).  When the last group of a batch is the one that finished
last, that is time after the last sample (issue 33; docs/benchmarks.md).

What stays Ray's: the call that starts a worker's stream, its cancellation, a dead or hung worker
(the stream's error, the pings), and rows a worker could not send on its connection (it yields them
on the stream as before).  Nothing is lost when the channel breaks: a group counts as returned only
once its rows are in the driver's hands.

Security: the driver's listener accepts a connection only after it proves it holds the channel's
random key (an HMAC of a fresh nonce); only then are its frames (pickles) read.

Driver: :class:`ResultChannel` (a listener and one reader thread that drains every connection into
per-dispatch inboxes, so a worker never waits on the driver).  Worker: :class:`ResultSender` (the
event loop's own non-blocking socket calls; no thread hop).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import pickle
import secrets
import selectors
import socket
import struct
import threading
from collections import defaultdict
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["ResultChannel", "ResultSender"]

NONCE_BYTES = 32
HEADER = struct.Struct("!QQ")
"""A frame: (token, payload length), then the payload (a pickle)."""
HELLO_TOKEN = 0
"""The token of a connection's first frame: the worker's id (utf-8)."""
MAX_FRAME = 1 << 34
"""Frames larger than this (16 GiB) close the connection: no rows are that large."""


def _digest(authkey: bytes, nonce: bytes) -> bytes:
    return hmac.new(authkey, nonce, hashlib.sha256).digest()


class _Peer:
    """One worker's connection as the reader thread sees it."""

    def __init__(self, sock: socket.socket, nonce: bytes) -> None:
        self.sock, self.nonce = sock, nonce
        self.buf = bytearray()
        self.authed = False
        self.worker_id: str | None = None


class ResultChannel:
    """The driver's end: a TCP listener on ``host`` (default: this node's IP, as Ray knows it) and
    a reader thread.

    A :class:`DispatchRun <agentloop.rollout.dispatcher.DispatchRun>` calls :meth:`expect` with the
    token of each dispatch it sends, :meth:`take` to wait for rows, and :meth:`forget` when the
    dispatch is done (frames for tokens nobody expects are dropped).
    """

    def __init__(self, host: str | None = None) -> None:
        if host is None:
            import ray.util  # noqa: PLC0415 - only the driver's end needs it

            host = ray.util.get_node_ip_address()
        self.authkey = secrets.token_bytes(32)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, 0), family=family)
        self._listener.setblocking(False)
        self.address: tuple[str, int] = (host, self._listener.getsockname()[1])
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._cond = threading.Condition()
        self._inbox: dict[int, list[bytes]] = defaultdict(list)
        self._expected: set[int] = set()
        self._workers: set[str] = set()
        self.pokes = 0
        """Connections closed so far (each wakes :meth:`take`: a worker may have died)."""
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="agentloop-results", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> tuple[str, int, bytes]:
        """What a worker needs to connect: host, port and key."""
        return (*self.address, self.authkey)

    @property
    def closed(self) -> bool:
        """Closed, or its reader thread stopped: no more rows come this way."""
        return self._closed

    def connected(self, worker_id: str) -> bool:
        """Whether the worker ``worker_id`` has an open, authenticated connection."""
        with self._cond:
            return worker_id in self._workers

    def wait_connected(self, worker_ids: list[str], timeout: float) -> bool:
        """Wait until every worker in ``worker_ids`` has said hello (True), at most ``timeout``
        seconds (the reader thread notifies on each hello)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._workers.issuperset(worker_ids), timeout)

    def expect(self, token: int) -> None:
        with self._cond:
            self._expected.add(token)

    def forget(self, token: int) -> None:
        with self._cond:
            self._expected.discard(token)
            self._inbox.pop(token, None)

    def take(self, tokens: set[int], timeout: float | None) -> list[tuple[int, bytes]]:
        """Frames (token, payload) for any of ``tokens``, waiting up to ``timeout`` seconds for one
        (None: until one comes or a connection closes; a closed channel waits out ``timeout``)."""
        with self._cond:
            pokes = self.pokes

            def ready() -> bool:
                return self.pokes != pokes or any(t in self._inbox for t in tokens)

            if timeout != 0 and not ready():
                self._cond.wait_for(ready, timeout)
            return [(t, p) for t in tokens if t in self._inbox for p in self._inbox.pop(t)]

    def close(self) -> None:
        """Stop the reader thread and close every connection."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(timeout=5)

    # ---- the reader thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._closed:
                for key, _ in self._selector.select(timeout=1.0):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        return
                    else:
                        self._read(key.data)
        except Exception:  # noqa: BLE001 - the stream's rows then come through Ray
            logger.exception("the result channel's reader stopped")
        finally:
            for key in list(self._selector.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]
            self._selector.close()
            self._wake_w.close()
            with self._cond:
                self._closed = True
                self._workers.clear()
                self._cond.notify_all()

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except BlockingIOError:
            return
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce = secrets.token_bytes(NONCE_BYTES)
            sock.sendall(nonce)  # 32 bytes on a fresh connection: never blocks
            sock.setblocking(False)
        except OSError:
            sock.close()
            return
        self._selector.register(sock, selectors.EVENT_READ, _Peer(sock, nonce))

    def _drop(self, peer: _Peer) -> None:
        self._selector.unregister(peer.sock)
        peer.sock.close()
        with self._cond:
            self._workers.discard(peer.worker_id or "")
            self.pokes += 1
            self._cond.notify_all()

    def _read(self, peer: _Peer) -> None:
        try:
            data = peer.sock.recv(1 << 20)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop(peer)
            return
        peer.buf += data
        if not peer.authed:
            if len(peer.buf) < NONCE_BYTES:
                return
            if not hmac.compare_digest(bytes(peer.buf[:NONCE_BYTES]),
                                       _digest(self.authkey, peer.nonce)):
                logger.warning("result channel: a connection without the key was closed")
                self._drop(peer)
                return
            peer.authed = True
            del peer.buf[:NONCE_BYTES]
        frames: list[tuple[int, bytes]] = []
        while len(peer.buf) >= HEADER.size:
            token, size = HEADER.unpack_from(peer.buf)
            if size > MAX_FRAME:
                self._drop(peer)
                return
            if len(peer.buf) < HEADER.size + size:
                break
            frames.append((token, bytes(peer.buf[HEADER.size:HEADER.size + size])))
            del peer.buf[:HEADER.size + size]
        if not frames:
            return
        with self._cond:
            for token, payload in frames:
                if token == HELLO_TOKEN and peer.worker_id is None:
                    peer.worker_id = payload.decode()
                    self._workers.add(peer.worker_id)
                elif token in self._expected:
                    self._inbox[token].append(payload)
            self._cond.notify_all()


class ResultSender:
    """A worker's end: one connection to the driver's :class:`ResultChannel`, used from the
    worker's event loop.  :meth:`send` returns False once the connection is broken (the caller then
    yields the rows on its Ray stream)."""

    def __init__(self, host: str, port: int, authkey: bytes, worker_id: str) -> None:
        self.address, self.authkey, self.worker_id = (host, port), authkey, worker_id
        self._sock: socket.socket | None = None
        self._lock: asyncio.Lock | None = None
        self.frames_sent = 0
        """Frames written so far (rows the driver got this way, not through Ray)."""

    @property
    def up(self) -> bool:
        return self._sock is not None

    async def connect(self, timeout: float = 5.0) -> None:
        """Connect, prove the key, say who this worker is.

        Raises:
            OSError, TimeoutError: the driver cannot be reached (or refused the key).
        """
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET6 if ":" in self.address[0] else socket.AF_INET)
        sock.setblocking(False)
        try:
            async with asyncio.timeout(timeout):
                await loop.sock_connect(sock, self.address)
                nonce = b""
                while len(nonce) < NONCE_BYTES:
                    chunk = await loop.sock_recv(sock, NONCE_BYTES - len(nonce))
                    if not chunk:
                        raise ConnectionError("the driver closed the result channel")
                    nonce += chunk
                hello = self.worker_id.encode()
                await loop.sock_sendall(sock, _digest(self.authkey, nonce)
                                        + HEADER.pack(HELLO_TOKEN, len(hello)) + hello)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except BaseException:
            sock.close()
            raise
        self._sock, self._lock = sock, asyncio.Lock()

    async def send(self, token: int, item: Any) -> bool:
        """Pickle ``item`` and write it as one frame for ``token``; False (nothing sent) when the
        connection is down or breaks, or ``item`` does not pickle (the caller yields it to Ray)."""
        if self._sock is None or self._lock is None:
            return False
        try:
            data = pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001 - e.g. a lambda in a column: Ray's cloudpickle may take it
            return False
        loop = asyncio.get_running_loop()
        async with self._lock:  # one frame at a time: streams of one worker share the connection
            sock = self._sock
            if sock is None:
                return False
            try:
                await loop.sock_sendall(sock, HEADER.pack(token, len(data)) + data)
            except (OSError, asyncio.CancelledError) as e:
                # a frame cut part-way would corrupt the next one: the connection is closed
                self.close()
                if isinstance(e, asyncio.CancelledError):
                    raise
                logger.warning("result channel to %s:%d broke (%s); rows go through Ray now",
                               *self.address, e)
                return False
            self.frames_sent += 1
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
