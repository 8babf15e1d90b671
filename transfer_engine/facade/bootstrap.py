"""The prefill instance's bootstrap registry, served on a thread of its own for threaded callers.

A serving system starts one :class:`BootstrapServer` beside its HTTP server (SGLang's
``KVBootstrapServer``); prefill ranks register their control endpoints with it and decode ranks ask
it for the instance's topology (:mod:`transfer_engine.actors.bootstrap` holds the registry itself).
"""

from __future__ import annotations

import concurrent.futures
from types import TracebackType

from anyio.abc import TaskStatus

from transfer_engine.actors.bootstrap import Bootstrap
from transfer_engine.errors import LocalProtocolError
from transfer_engine.facade.bridge import LoopThread
from transfer_engine.transport.security import Curve

__all__ = ["BootstrapServer"]


class _Bound(TaskStatus[None]):
    """Tells :meth:`BootstrapServer.start` (waiting on another thread) that the registry is bound."""

    def __init__(self, bound: concurrent.futures.Future[None]) -> None:
        self._bound = bound

    def started(self, value: None = None) -> None:
        self._bound.set_result(value)


class BootstrapServer:
    """The registry at ``tcp://host:port`` on a :class:`LoopThread`; ``port=0`` picks a free port.

    ``start()`` returns once the ROUTER is bound (``port`` is then the bound port) or raises why it
    could not bind (:class:`~transfer_engine.errors.PeerUnreachableError`). ``stop()`` closes the
    socket and joins the thread; it is idempotent. With ``curve`` only holders of an allowed key can
    register or ask (:meth:`transfer_engine.Curve.from_config`).
    """

    def __init__(self, host: str, port: int = 0, *, curve: Curve | None = None) -> None:
        self.host = host
        self._registry = Bootstrap(host, port, curve=curve)
        self._thread = LoopThread(f"te-bootstrap-{port}")
        self._started = False

    @property
    def port(self) -> int:
        """The port it listens on (the bound one once started)."""
        return self._registry.port

    def start(self) -> None:
        """Bind and serve; returns once bound. Once only."""
        if self._started:
            raise LocalProtocolError("this BootstrapServer was already started")
        self._started = True
        self._thread.start()
        bound: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread.spawn(self._serve, bound)
        try:
            bound.result()
        except concurrent.futures.CancelledError:
            self._thread.close()
            raise LocalProtocolError("the bootstrap server stopped before it was bound") from None
        except BaseException:
            self._thread.close()
            raise

    async def _serve(self, bound: concurrent.futures.Future[None]) -> None:
        try:
            await self._registry.run(task_status=_Bound(bound))
        except Exception as exc:
            if bound.done():
                raise
            bound.set_exception(exc)
        except BaseException:
            bound.cancel()
            raise

    def stop(self) -> None:
        """Close the socket and join the thread; idempotent."""
        self._thread.close()

    def __enter__(self) -> BootstrapServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
