"""MetricsServer actor: serves the engine's Prometheus metrics over HTTP, on the event loop.

A minimal HTTP/1.0 responder on ``{host}:{port}`` (port 0 picks a free one): ``GET /metrics`` (or
``/``) answers the exposition text, anything else 404; one request per connection. It runs on the
engine's event loop rather than in prometheus-client's server thread, so a scrape reads engine state
between two awaits, never while an actor is half-way through changing it.

:func:`load_metrics` imports the optional ``prometheus-client`` package, turning its absence into a
ConfigError that names it (there is no silent fallback when metrics were asked for).
"""

from __future__ import annotations

import errno
import logging
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import anyio
import anyio.abc
from anyio.abc import SocketAttribute, TaskStatus

from transfer_engine.errors import AddressInUseError, BindError, ConfigError
from transfer_engine.runtime.logbook import LogBook

if TYPE_CHECKING:
    from transfer_engine.observe import Snapshot
    from transfer_engine.observe.metrics import Metrics

log = logging.getLogger(__name__)

REQUEST_LIMIT = 8192
"""Largest request head read (bytes); longer requests are answered 431 and closed."""

REQUEST_TIMEOUT_S = 5.0
"""How long a client may take to send its request head."""


def load_metrics(port: int, snapshot: Callable[[], Snapshot]) -> Metrics:
    """The engine's :class:`~transfer_engine.observe.metrics.Metrics`; ConfigError without prometheus-client."""
    try:
        from transfer_engine.observe.metrics import Metrics
    except ImportError as exc:
        if exc.name is None or not exc.name.startswith("prometheus_client"):
            raise
        raise ConfigError(
            f"metrics_port={port} needs the package prometheus-client, which is not "
            "installed: pip install 'transfer-engine[metrics]' (or prometheus-client), or set metrics_port=None"
        ) from exc
    return Metrics(snapshot)


class MetricsServer:
    """See the module docstring. ``endpoint`` is ``http://host:port/metrics`` once started."""

    def __init__(self, host: str, port: int, metrics: Metrics) -> None:
        self.host = host
        self.port = port
        self.metrics = metrics
        self.endpoint = ""
        self.served = 0
        self.dropped: Counter[str] = Counter()
        """Requests not served, by kind: ``timeout`` (no request head within REQUEST_TIMEOUT_S),
        ``too_large`` (431), ``bad_method`` (405), ``not_found`` (404), ``disconnected``."""
        self._book = LogBook(log, f"metrics {host}:{port}")

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Listen, report ready, then serve scrapes until cancelled."""
        try:
            listener = await anyio.create_tcp_listener(local_host=self.host, local_port=self.port)
        except OSError as exc:
            address = f"http://{self.host}:{self.port}"
            if exc.errno == errno.EADDRINUSE:
                raise AddressInUseError(
                    address,
                    f"{exc.strerror}: another process listens there (set metrics_port to another port)",
                ) from exc
            raise BindError(address, str(exc)) from exc
        async with listener:
            self.port = int(listener.extra(SocketAttribute.local_port))
            host = f"[{self.host}]" if ":" in self.host else self.host
            self.endpoint = f"http://{host}:{self.port}/metrics"
            self._book.name = self.endpoint
            task_status.started()
            try:
                await listener.serve(self._serve_one)
            finally:
                self._book.close()

    def _drop(self, kind: str, client: str, detail: str) -> None:
        self.dropped[kind] += 1
        self._book.note(kind, "%s: dropped request from %s: %s", self.endpoint, client, detail)

    async def _serve_one(self, stream: anyio.abc.SocketStream) -> None:
        async with stream:
            client = _peer(stream)
            self._book.flush()
            try:
                with anyio.fail_after(REQUEST_TIMEOUT_S):
                    head = await _read_head(stream)
                if head is None:
                    self._drop("too_large", client, f"request head over {REQUEST_LIMIT} bytes")
                    await _respond(stream, 431, b"request head too large\n", "text/plain")
                    return
                method, _, rest = head.partition(b" ")
                path = rest.split(b" ", 1)[0].split(b"?", 1)[0]
                if method != b"GET":
                    self._drop("bad_method", client, f"method {method[:32]!r}")
                    await _respond(stream, 405, b"only GET\n", "text/plain")
                elif path not in (b"/metrics", b"/"):
                    self._drop("not_found", client, f"path {path[:64]!r}")
                    await _respond(stream, 404, b"see /metrics\n", "text/plain")
                else:
                    body, content_type = self.metrics.render()
                    await _respond(stream, 200, body, content_type)
                    self.served += 1
            except TimeoutError:
                self._drop("timeout", client, f"no request head within {REQUEST_TIMEOUT_S} s")
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
                self._drop("disconnected", client, type(exc).__name__)  # nothing to answer


def _peer(stream: anyio.abc.SocketStream) -> str:
    try:
        address = stream.extra(SocketAttribute.remote_address)
    except (anyio.TypedAttributeLookupError, OSError):
        return "?"
    return address if isinstance(address, str) else f"{address[0]}:{address[1]}"


async def _read_head(stream: anyio.abc.SocketStream) -> bytes | None:
    """The request line and headers up to the blank line; None when over REQUEST_LIMIT."""
    data = b""
    while b"\r\n\r\n" not in data and b"\n\n" not in data:
        if len(data) > REQUEST_LIMIT:
            return None
        data += await stream.receive(4096)
    return data


async def _respond(stream: anyio.abc.SocketStream, status: int, body: bytes, content_type: str) -> None:
    reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 431: "Request Header Fields Too Large"}
    head = (
        f"HTTP/1.0 {status} {reason[status]}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    await stream.send(head.encode("ascii") + body)
