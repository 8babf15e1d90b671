"""The ``transfer-engine`` command.

    transfer-engine dump --endpoint tcp://127.0.0.1:PORT            # a table of the rank's state
    transfer-engine dump --endpoint ... --json                      # the Snapshot as JSON
    transfer-engine dump --endpoint ... --watch [--interval 2]      # refresh until Ctrl-C
    transfer-engine dump --endpoint ... --room 42                   # one room's progress and history
    transfer-engine dump --endpoint ... --room cmpl-8e1f...         # the same, by request id

``--endpoint`` is a rank's introspection endpoint (``engine.introspect_endpoint``; the examples print
it at start). ``--room`` takes a room number, or a serving system's request id, which names the
room the integrations give it (:func:`transfer_engine.room_id` of it: vLLM's ``transfer_id``, the
prefill's request id unless a router set one); ``--request-id`` hashes even an id of digits only.
An endpoint that is a prefill instance's bootstrap server, not an introspection endpoint, is named
as such (exit status 2). ``--json`` prints :class:`transfer_engine.observe.Snapshot` as JSON, one document
per line with ``--watch``; read it back with ``msgspec.json.decode(line, type=Snapshot)``. An endpoint
that does not answer within ``--timeout`` seconds is reported on stderr with exit status 1 (2 for a
usage error). With CURVE on the control plane, pass the deployment's certificate files.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TextIO

import msgspec
import zmq

from transfer_engine.errors import PeerUnreachableError, RemoteProtocolError, TransferError
from transfer_engine.observe import Snapshot, decode_snapshot, has_room, render_table
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.room_ids import room_id

__all__ = ["CurveKeys", "NotIntrospectionError", "fetch_snapshot", "main", "parse_room"]

PROG = "transfer-engine"

EXIT_OK = 0
EXIT_FAILED = 1
"""The endpoint did not answer, answered something that is not a snapshot, or lacks ``--room``."""
EXIT_USAGE = 2
"""A usage error: bad flags, or an endpoint that is not an introspection endpoint."""


class NotIntrospectionError(RemoteProtocolError):
    """Raised by :func:`fetch_snapshot` when the endpoint is a bootstrap server, not an introspection endpoint."""

    def __init__(self, endpoint: str, topology: m.Topology) -> None:
        self.endpoint = endpoint
        self.topology = topology
        ranks = ", ".join(f"rank {r.rank} {r.endpoint}" for r in topology.ranks) or "none registered yet"
        super().__init__(
            f"{endpoint} is the bootstrap server of a prefill instance (TP {topology.tp_size}; control "
            f"sockets: {ranks}), not an introspection endpoint: each engine logs its own at start "
            f"('transfer-engine dump --endpoint tcp://...'), and engine.introspect_endpoint names it"
        )


def parse_room(text: str, *, request_id: bool = False) -> int:
    """The room ``--room`` names: digits are a room number, anything else a request id (hashed by
    :func:`~transfer_engine.room_id`, as the integrations do); ``request_id`` hashes digits too."""
    text = text.strip()
    if not request_id and text.isdigit():
        return int(text)
    return room_id(text)


class CurveKeys(msgspec.Struct, frozen=True):
    """CURVE client keys for the DEALER: our keypair and the server's public key (z85 bytes)."""

    public: bytes
    secret: bytes
    server: bytes

    @classmethod
    def load(cls, secret_key_file: str, server_key_file: str) -> CurveKeys:
        """Read ``zmq.auth`` certificate files; TransferError naming a file that is missing or keyless."""
        import zmq.auth

        try:
            public, secret = zmq.auth.load_certificate(secret_key_file)
            server, _ = zmq.auth.load_certificate(server_key_file)
        except (OSError, ValueError) as exc:
            raise TransferError(f"cannot load CURVE certificate: {exc}") from exc
        if not secret:
            raise TransferError(f"{secret_key_file} holds no secret key (pass the .key_secret file)")
        return cls(public=public, secret=secret, server=server)


def fetch_snapshot(
    endpoint: str, *, room: int | None = None, timeout: float = 2.0, curve: CurveKeys | None = None
) -> Snapshot:
    """Ask ``endpoint`` for a snapshot (of one room with ``room``). Blocking; for tools and tests.

    Raises PeerUnreachableError when no answer comes within ``timeout`` seconds (or the endpoint is
    not a valid ZMQ address), NotIntrospectionError when a bootstrap server answered,
    RemoteProtocolError when the answer is not a snapshot.
    """
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            if curve is not None:
                sock.curve_secretkey = curve.secret
                sock.curve_publickey = curve.public
                sock.curve_serverkey = curve.server
            try:
                sock.connect(endpoint)
            except zmq.ZMQError as exc:
                raise PeerUnreachableError(endpoint, f"not a usable ZMQ endpoint: {exc}") from exc
            sock.send(m.encode(m.DumpRequest(room=room)))
            if not sock.poll(int(timeout * 1000), zmq.POLLIN):
                raise PeerUnreachableError(
                    endpoint, f"no answer within {timeout:g} s (is an engine's introspection endpoint there?)"
                )
            reply = m.decode(sock.recv())
        finally:
            sock.close(linger=0)
    finally:
        ctx.term()
    if isinstance(reply, m.Topology):
        raise NotIntrospectionError(endpoint, reply)
    if not isinstance(reply, m.DumpReply):
        raise RemoteProtocolError(f"{endpoint} answered {type(reply).__name__}, not DumpReply")
    return decode_snapshot(reply.snapshot)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Inspect running transfer engines.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    dump = commands.add_parser(
        "dump",
        help="show one rank's rooms, workers, ring, peers and counters",
        description="Show one rank's state: rooms by state (oldest first) with what each waits for, "
        "workers, staging ring, peers, NIXL and counters.",
    )
    dump.add_argument("--endpoint", required=True, help="the rank's introspection endpoint, tcp://HOST:PORT")
    dump.add_argument("--json", action="store_true", help="print the snapshot as JSON (one line per refresh)")
    which = dump.add_mutually_exclusive_group()
    which.add_argument(
        "--room",
        default=None,
        metavar="ROOM",
        help="show one room's progress and history: a room number, or a serving system's request id",
    )
    which.add_argument(
        "--request-id", default=None, metavar="ID", help="as --room, for a request id of digits only"
    )
    dump.add_argument("--watch", action="store_true", help="refresh until interrupted")
    dump.add_argument("--interval", type=float, default=2.0, metavar="S", help="seconds between refreshes")
    dump.add_argument("--count", type=int, default=None, metavar="K", help="with --watch: stop after K")
    dump.add_argument("--timeout", type=float, default=2.0, metavar="S", help="seconds to wait for an answer")
    dump.add_argument(
        "--curve-secret-key-file",
        default=None,
        metavar="FILE",
        help="CURVE: our certificate, the .key_secret file of zmq.auth.create_certificates",
    )
    dump.add_argument(
        "--curve-server-key-file",
        default=None,
        metavar="FILE",
        help="CURVE: the server's public certificate (.key or .key_secret file)",
    )
    return parser


def main(argv: list[str] | None = None, *, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """Run the command with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    out = stdout or sys.stdout
    err = stderr or sys.stderr
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse printed the usage error (to sys.stderr)
        return int(exc.code) if isinstance(exc.code, int) else EXIT_USAGE
    problem = _check(args)
    args.named = args.room if args.request_id is None else args.request_id  # None: no room asked
    if not problem and args.named is not None:
        try:
            args.room = parse_room(args.named, request_id=args.request_id is not None)
        except TransferError as exc:
            problem = f"--room: {exc}"
    if problem:
        err.write(f"{PROG} dump: {problem}\n")
        return EXIT_USAGE
    try:
        curve = (
            CurveKeys.load(args.curve_secret_key_file, args.curve_server_key_file)
            if args.curve_secret_key_file
            else None
        )
    except TransferError as exc:
        err.write(f"{PROG} dump: {exc}\n")
        return EXIT_USAGE
    try:
        return _dump(args, curve, out, err)
    except KeyboardInterrupt:
        return EXIT_OK if args.watch else EXIT_FAILED


def _check(args: argparse.Namespace) -> str:
    if args.timeout <= 0:
        return f"--timeout={args.timeout} must be > 0"
    if args.interval <= 0:
        return f"--interval={args.interval} must be > 0"
    if args.count is not None and args.count < 1:
        return f"--count={args.count} must be >= 1"
    if bool(args.curve_secret_key_file) != bool(args.curve_server_key_file):
        return "--curve-secret-key-file and --curve-server-key-file go together"
    return ""


def _dump(args: argparse.Namespace, curve: CurveKeys | None, out: TextIO, err: TextIO) -> int:
    """One dump, or with ``--watch`` one per ``--interval``; the status is the last dump's."""
    shown = 0
    while True:
        status = _dump_once(args, curve, out, err)
        shown += 1
        if not args.watch or (args.count is not None and shown >= args.count):
            return status
        time.sleep(args.interval)


def _dump_once(args: argparse.Namespace, curve: CurveKeys | None, out: TextIO, err: TextIO) -> int:
    try:
        snapshot = fetch_snapshot(args.endpoint, room=args.room, timeout=args.timeout, curve=curve)
    except NotIntrospectionError as exc:
        err.write(f"{PROG} dump: {exc}\n")
        err.flush()
        return EXIT_USAGE
    except (PeerUnreachableError, RemoteProtocolError) as exc:
        err.write(f"{PROG} dump: {exc}\n")
        err.flush()
        return EXIT_FAILED
    if args.json:
        out.write(msgspec.json.encode(snapshot).decode() + "\n")
    else:
        if args.watch and out.isatty():
            out.write("\x1b[H\x1b[2J")  # home and clear: redraw in place
        if args.named is not None and str(args.room) != args.named.strip():
            out.write(f"request id {args.named.strip()!r} is room {args.room}\n")
        out.write(render_table(snapshot, room=args.room))
        if args.watch:
            out.write(f"\n(every {args.interval:g} s; Ctrl-C to stop)\n")
    out.flush()
    if args.room is not None and not has_room(snapshot, args.room):
        return EXIT_FAILED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
