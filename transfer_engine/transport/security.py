"""Control-plane authentication and encryption with ZMQ CURVE (an option; off by default).

Scheme
------
A deployment shares ONE CURVE certificate, made with ``zmq.auth.create_certificates`` (a
``NAME.key`` public file and a ``NAME.key_secret`` file holding both keys). Every rank loads that
keypair from ``EngineConfig.curve_secret_key_file``. Then:

- every ROUTER (a rank's control socket, the bootstrap registry, the introspection endpoint) is a
  CURVE *server* with that keypair, and accepts only clients whose public key is one of the
  certificates in ``EngineConfig.curve_public_keys_dir`` (checked by a ZAP authenticator);
- every DEALER is a CURVE *client* with that keypair, and expects the server to hold the shared
  public key (``curve_serverkey``): a server with another key is never talked to.

A process without the secret key can neither read the control traffic nor be answered by any
socket; a process with another certificate fails the CURVE handshake, so its requests go
unanswered (``PeerUnreachableError`` after ``connect_timeout``). Only the control plane is covered:
KV bytes travel over NIXL, whose transport security is the fabric's.

Authenticator lifecycle
-----------------------
ZAP (ZMQ's authentication protocol) is per context: libzmq asks whoever is bound at
``inproc://zeromq.zap.01`` in the socket's context. :meth:`Curve.server` starts that handler for
the socket's context the first time it configures a server socket of it: a small thread blocked in
``recv`` (so handshakes are authenticated even while the event loop is busy). It lives exactly as
long as the context: terminating the context (``ctx.term()``, which every socket owner does on
close) makes its ``recv`` fail with ETERM, and the thread closes its socket and ends, so ``term()``
never hangs on it. Owners therefore need no extra start or stop calls, and ``curve.server`` can be
handed as-is to anything that takes a ``secure(socket)`` callable.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import zmq
import zmq.auth
from zmq.utils import z85

from transfer_engine.errors import ConfigError, TransportError

if TYPE_CHECKING:
    from transfer_engine.config import EngineConfig

__all__ = ["ZAP_DOMAIN", "Curve"]

log = logging.getLogger(__name__)

ZAP_DOMAIN = "transfer_engine"
"""The ZAP domain of every server socket (shows in the authenticator's requests and logs)."""

_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_ZAP_VERSION = b"1.0"
_START_TIMEOUT_S = 5.0


class Curve:
    """One rank's CURVE keys and client allow-list; configures sockets as servers or clients.

    Built once per engine by :meth:`from_config` and shared by its socket owners (Control,
    Bootstrap, Introspect). ``stats`` counts the authenticator's decisions (``allowed``,
    ``denied``, ``malformed``) over every context it serves.
    """

    def __init__(
        self,
        public_key: bytes,
        secret_key: bytes,
        allowed: frozenset[bytes],
        *,
        server_key: bytes | None = None,
    ) -> None:
        """``public_key``/``secret_key``: this rank's keypair (z85, 40 bytes each).

        ``allowed``: z85 public keys of the clients servers accept. ``server_key``: the public key
        clients expect of every server; the shared certificate's (``public_key``) by default.
        """
        for what, key in (("public", public_key), ("secret", secret_key)):
            if len(key) != 40:
                raise ConfigError(f"CURVE {what} key must be 40 z85 characters, got {len(key)}")
        self.public_key = public_key
        self.secret_key = secret_key
        self.server_key = public_key if server_key is None else server_key
        self.allowed = allowed
        self.stats: Counter[str] = Counter()
        self._handlers: weakref.WeakKeyDictionary[zmq.Context, _ZapHandler] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    @classmethod
    def load(cls, secret_key_file: str | Path, public_keys_dir: str | Path) -> Curve:
        """Read the keypair from a ``zmq.auth`` secret certificate and the allowed keys from a directory.

        Raises ConfigError naming the file or directory that is missing, unreadable, not a
        certificate, or holds no public key.
        """
        secret_path, keys_dir = Path(secret_key_file), Path(public_keys_dir)
        try:
            public, secret = zmq.auth.load_certificate(secret_path)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"curve_secret_key_file={str(secret_path)!r} is not readable: {exc}") from exc
        if not secret:
            raise ConfigError(
                f"curve_secret_key_file={str(secret_path)!r} holds no secret key "
                "(give the NAME.key_secret file, not NAME.key)"
            )
        if not keys_dir.is_dir():
            raise ConfigError(f"curve_public_keys_dir={str(keys_dir)!r} is not a directory")
        try:
            allowed = frozenset(zmq.auth.load_certificates(keys_dir))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"curve_public_keys_dir={str(keys_dir)!r} is not readable: {exc}") from exc
        if not allowed:
            raise ConfigError(
                f"curve_public_keys_dir={str(keys_dir)!r} holds no *.key certificate: every client "
                "would be refused"
            )
        return cls(public, secret, allowed)

    @classmethod
    def from_config(cls, config: EngineConfig) -> Curve | None:
        """The config's CURVE setup, or None when ``curve_secret_key_file`` is not set."""
        if not config.curve_secret_key_file:
            return None
        return cls.load(config.curve_secret_key_file, config.curve_public_keys_dir)

    def server(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (a ROUTER, before it binds) a CURVE server that accepts only allowed clients.

        Starts the ZAP authenticator of the socket's context if it is not running yet. Raises
        TransportError when the context already has another ZAP handler.
        """
        self._authenticate(sock.context)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public_key)
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())

    def client(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (a DEALER, before it connects) a CURVE client of servers holding ``server_key``."""
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public_key)
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_key)

    def _authenticate(self, ctx: zmq.Context) -> None:
        with self._lock:
            handler = self._handlers.get(ctx)
            if handler is not None and handler.is_alive():
                return
            handler = _ZapHandler(ctx, self)
            handler.start()
            if not handler.ready.wait(_START_TIMEOUT_S) or handler.error is not None:
                raise TransportError(f"cannot start the CURVE authenticator: {handler.error or 'timed out'}")
            self._handlers[ctx] = handler

    def decide(self, request: list[bytes]) -> tuple[bytes, bytes, bytes]:
        """The ZAP answer ``(status code, status text, user id)`` to one request (pure but for ``stats``).

        Accepts a CURVE client whose public key is allowed; refuses everything else (NULL and PLAIN
        clients, unknown keys, malformed requests). Called from the authenticator threads.
        """
        verdict, code, text, user = self._verdict(request)
        with self._lock:
            self.stats[verdict] += 1
        return code, text, user

    def _verdict(self, request: list[bytes]) -> tuple[str, bytes, bytes, bytes]:
        if len(request) < 6 or request[0] != _ZAP_VERSION:
            return "malformed", b"400", b"malformed ZAP request", b""
        address = request[3].decode(errors="replace")
        mechanism, credentials = request[5], request[6:]
        if mechanism != b"CURVE" or len(credentials) != 1 or len(credentials[0]) != 32:
            log.warning("CURVE: refused a %s client from %s", mechanism.decode(errors="replace"), address)
            return "denied", b"400", b"CURVE required", b""
        key = z85.encode(credentials[0])
        if key not in self.allowed:
            log.warning("CURVE: refused client key %s from %s", key.decode(), address)
            return "denied", b"400", b"unknown key", b""
        return "allowed", b"200", b"OK", key


class _ZapHandler(threading.Thread):
    """The ZAP REP socket of one context, answered by :meth:`Curve.decide`; ends when the context does."""

    def __init__(self, ctx: zmq.Context, curve: Curve) -> None:
        super().__init__(name="curve-zap", daemon=True)
        self._ctx = ctx
        self._curve = curve
        self.ready = threading.Event()
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            sock = self._ctx.socket(zmq.REP, socket_class=zmq.Socket)
        except zmq.ZMQError as exc:
            self.error = exc
            self.ready.set()
            return
        try:
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.bind(_ZAP_ENDPOINT)
            except zmq.ZMQError as exc:
                self.error = exc
                return
            finally:
                self.ready.set()
            while True:
                request = sock.recv_multipart()
                code, text, user = self._curve.decide(request)
                request_id = request[1] if len(request) > 1 else b""
                sock.send_multipart([_ZAP_VERSION, request_id, code, text, user, b""])
        except zmq.ContextTerminated:
            pass
        except zmq.ZMQError as exc:  # pragma: no cover - only on a libzmq failure
            log.warning("CURVE authenticator stopped: %s", exc)
        finally:
            sock.close(linger=0)
