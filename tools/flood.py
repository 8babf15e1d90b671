"""Flood: hostile traffic at every endpoint of a running P=1 -> D=1 cluster; peak RSS against idle.

    python tools/flood.py --seconds 60 --idle 10 [--json PATH] [--only junk,churn,...] [--max-bytes N]
                          [--settle S] [--trim-during]

Starts the cluster in a child process (``--serve``: one prefill engine hosting the bootstrap and
one decode engine, real NIXL and ZMQ, metrics on), measures its resident memory idle for
``--idle`` seconds, then floods it for ``--seconds`` seconds and samples its RSS every 0.2 s. Every
sender runs in its own thread of this process and stops at the deadline or at its count limit,
whichever comes first; all traffic goes to 127.0.0.1. The flood:

- **junk frames** (:func:`junk`) on one DEALER per ZMQ endpoint (bootstrap, both control sockets,
  both introspection sockets): random bytes up to 64 KiB, multipart frames, msgpack of the wrong
  shape, and well-formed messages the endpoint does not accept — each one dropped and counted;
- **connection churn** (:func:`churn`): TCP connections opened to each ZMQ port, sent garbage (not
  ZMTP) and closed, thousands of them;
- **slow readers** (:func:`slow_readers`): DEALERs that send DumpRequests to the introspection
  endpoints and never read the replies (the engine's send high-water mark must bound what it queues);
- **HTTP junk** (:func:`http_junk`) at both metrics endpoints: wrong methods, wrong paths, heads
  over the limit, clients that disconnect mid-request;
- **NIXL notifications** (:func:`notif_junk`): a NIXL agent that loaded the decode engine's
  metadata sends malformed notifications and well-formed ones for rooms that do not exist.

``--only`` runs some of these senders and ``--max-bytes`` sets the largest junk frame, to see what
each costs. The RSS is also listed every 5 s of the flood (a plateau or a slope), and after
``--settle`` idle seconds and a ``malloc_trim(0)`` in the child (``--trim-during``: every 5 s of the
flood too), which tells memory the flood holds from heap glibc kept after it was freed.

Afterwards the child runs rooms that must verify byte for byte and reports its drop counters and
log lines. Prints one JSON object: idle RSS, peak RSS during the flood, what was sent, what the
engines counted, the log lines they wrote, and the rooms verified. Exit status 1 when a room did
not verify or something leaked.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import zmq

from transfer_engine.protocol import messages as m

MAX_JUNK_BYTES = 64 * 1024
"""Largest random frame sent (the engine's frame cap is far above; 70 MiB frames are the fuzz
test's business, here the rate matters)."""

ROOT = Path(__file__).resolve().parents[1]
"""The repository (the serving child borrows the test harness's cluster)."""

NOTIF_LINGER_S = 2.0
"""How long the notification sender keeps its peer after its last send."""

JUNK_KINDS = 4
"""Frame ``i`` of :func:`junk` is of kind ``i % JUNK_KINDS``; each kind is one drop, counted."""


def junk(i: int, rng: random.Random, endpoint_kind: str, max_bytes: int = MAX_JUNK_BYTES) -> list[bytes]:
    """The ``i``-th hostile message for an endpoint of ``endpoint_kind`` (bootstrap, control, introspect).

    Every one is dropped and counted exactly once by the endpoint: kind 0 random bytes (malformed),
    1 three frames (bad_frames), 2 msgpack of the wrong shape (malformed), 3 a well-formed message
    the endpoint refuses (control: a request from an agent that never said PeerHello; bootstrap and
    introspection: a heartbeat).
    """
    kind = i % JUNK_KINDS
    if kind == 0:
        return [rng.randbytes(rng.randint(1, max_bytes))]
    if kind == 1:
        return [b"a", rng.randbytes(8), b"c"]
    if kind == 2:
        return [msgspec.msgpack.encode({"type": "TransferRequest", "room": i, "x": [1, 2, 3]})]
    if endpoint_kind == "control":
        request = m.TransferRequest(
            agent=f"flood-{i}", room=i, decode_rank=0, decode_tp=1, path="direct",
            dst_pages=[0], aux_slot=None, slices=[],
        )  # fmt: skip
        return [m.encode(request)]
    return [m.encode(m.Heartbeat(agent=f"flood-{i}", rank=0, side="decode", seq=i))]


def send_junk(
    endpoint: str,
    endpoint_kind: str,
    count: int,
    stop_at: float,
    seed: int = 0,
    max_bytes: int = MAX_JUNK_BYTES,
) -> int:
    """Send up to ``count`` junk messages on one DEALER to ``endpoint`` until ``stop_at``; returns how
    many were sent (blocking sends: each one is queued, none is dropped on this side)."""
    rng = random.Random(seed)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 5000)
    sock.setsockopt(zmq.SNDTIMEO, 1000)
    sock.connect(endpoint)
    sent = 0
    try:
        while sent < count and time.monotonic() < stop_at:
            try:
                sock.send_multipart(junk(sent, rng, endpoint_kind, max_bytes))
            except zmq.Again:
                continue
            sent += 1
    finally:
        sock.close()  # lingers until what was queued went out
    return sent


def churn(host: str, port: int, count: int, stop_at: float, seed: int = 0) -> int:
    """Open up to ``count`` TCP connections to ``host:port``, each sending garbage and closing at once."""
    rng = random.Random(seed)
    opened = 0
    while opened < count and time.monotonic() < stop_at:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1.0) as s:
            s.sendall(rng.randbytes(rng.randint(1, 512)))
            opened += 1
    return opened


def slow_readers(endpoint: str, sockets: int, per_socket: int, stop_at: float) -> int:
    """``sockets`` DEALERs that each send up to ``per_socket`` DumpRequests and never read a reply."""
    ctx = zmq.Context.instance()
    socks = []
    sent = 0
    try:
        for _ in range(sockets):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 1)
            sock.setsockopt(zmq.RCVBUF, 4096)
            sock.connect(endpoint)
            socks.append(sock)
        request = m.encode(m.DumpRequest(room=None))
        for _ in range(per_socket):
            for sock in socks:
                if time.monotonic() >= stop_at:
                    return sent
                with contextlib.suppress(zmq.Again):
                    sock.send(request, flags=zmq.NOBLOCK)
                    sent += 1
            time.sleep(0.01)
        while time.monotonic() < stop_at:  # stay connected, unread, until the flood ends
            time.sleep(0.05)
    finally:
        for sock in socks:
            sock.close()
    return sent


HTTP_JUNK = (
    b"POST /metrics HTTP/1.0\r\n\r\n",
    b"GET /secret HTTP/1.0\r\n\r\n",
    b"GET /metrics HTTP/1.0\r\nX: " + b"y" * 20_000 + b"\r\n\r\n",  # over REQUEST_LIMIT before its end
    b"GET /metr",  # then the client goes away
)


def http_junk(host: str, port: int, count: int, stop_at: float) -> int:
    """Up to ``count`` bad HTTP requests at a metrics endpoint (each kind of :data:`HTTP_JUNK` in turn)."""
    sent = 0
    while sent < count and time.monotonic() < stop_at:
        payload = HTTP_JUNK[sent % len(HTTP_JUNK)]
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=2.0) as s:
            s.sendall(payload)
            if payload.endswith(b"\r\n\r\n"):
                s.settimeout(2.0)
                with contextlib.suppress(OSError):
                    s.recv(4096)
            sent += 1
    return sent


def notif_agent(seed: int = 0) -> Any:
    """A NIXL agent of the flood's own (``.name``, ``get_agent_metadata()``). NIXL delivers its
    notifications only to agents that loaded its metadata, as a decode rank does a prefill's during
    the handshake: the flood plays a peer that completed the handshake and then misbehaves."""
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(f"flood-{os.getpid()}-{seed}", nixl_agent_config(backends=["UCX"], num_threads=0))


def notif_junk(agent: Any, metadata: bytes, count: int, stop_at: float, seed: int = 0) -> int:
    """``agent`` (:func:`notif_agent`) sends up to ``count`` notifications to the agent of ``metadata``:
    malformed ones and well-formed ChunkLanded of rooms that do not exist, alternately."""
    rng = random.Random(seed)
    peer = agent.add_remote_agent(metadata)
    sent = 0
    try:
        while sent < count and time.monotonic() < stop_at:
            if sent % 2:
                notif = rng.randbytes(rng.randint(1, 200))
            else:
                landed = m.ChunkLanded(
                    room=(1 << 62) + sent,
                    chunk_id=0,
                    last=True,
                    sender=0,
                    page_start=0,
                    num_pages=1,
                    region=-1,
                )
                notif = m.encode(landed)
            agent.send_notif(peer, notif)
            sent += 1
    finally:
        time.sleep(NOTIF_LINGER_S)  # sends still queued would be cancelled with the peer
        agent.remove_remote_agent(peer)
    return sent


@dataclass(frozen=True)
class Targets:
    """The endpoints of a P=1 -> D=1 cluster, as the serving child reports them."""

    bootstrap: str
    control: list[str]
    introspect: list[str]
    metrics: list[str]
    decode_metadata_hex: str


def _hostport(endpoint: str) -> tuple[str, int]:
    rest = endpoint.split("://", 1)[1].split("/", 1)[0]
    host, port = rest.rsplit(":", 1)
    return host, int(port)


SENDERS = ("junk", "churn", "slow", "http", "notif")
"""The kinds of sender :func:`flood` runs (``--only`` picks some, to see what each costs)."""


def flood(
    targets: Targets,
    seconds: float,
    *,
    frames: int,
    connections: int,
    notifier: Any = None,
    seed: int = 0,
    only: frozenset[str] = frozenset(SENDERS),
    max_bytes: int = MAX_JUNK_BYTES,
) -> dict[str, int]:
    """Run the senders named in ``only`` (:data:`SENDERS`) at ``targets`` in threads for at most
    ``seconds``; returns what each sent.

    ``frames``: junk messages per ZMQ endpoint, each at most ``max_bytes``; ``connections``: TCP
    connections per ZMQ port (and a tenth of it in HTTP requests per metrics endpoint and, from
    ``notifier``, in notifications).
    """
    stop_at = time.monotonic() + seconds
    sent: Counter[str] = Counter()
    lock = threading.Lock()
    jobs: list[tuple[str, Callable[[], int]]] = []
    zmq_targets = [(targets.bootstrap, "bootstrap")]
    zmq_targets += [(e, "control") for e in targets.control] + [(e, "introspect") for e in targets.introspect]
    for n, (endpoint, kind) in enumerate(zmq_targets):
        if "junk" in only:
            jobs.append(
                (
                    f"junk_frames.{kind}",
                    lambda e=endpoint, k=kind, n=n: send_junk(e, k, frames, stop_at, seed + n, max_bytes),
                )
            )
        host, port = _hostport(endpoint)
        if "churn" in only:
            jobs.append(
                ("connections", lambda h=host, p=port, n=n: churn(h, p, connections, stop_at, seed + n))
            )
    for endpoint in targets.introspect if "slow" in only else ():
        jobs.append(("dump_requests_unread", lambda e=endpoint: slow_readers(e, 20, 200, stop_at)))
    for endpoint in targets.metrics if "http" in only else ():
        host, port = _hostport(endpoint)
        jobs.append(
            ("http_requests", lambda h=host, p=port: http_junk(h, p, max(connections // 10, 4), stop_at))
        )
    if notifier is not None and "notif" in only:
        metadata = bytes.fromhex(targets.decode_metadata_hex)
        jobs.append(
            ("notifications", lambda: notif_junk(notifier, metadata, max(connections // 10, 2), stop_at))
        )

    def run(name: str, job: Callable[[], int]) -> None:
        n = job()
        with lock:
            sent[name] += n

    threads = [threading.Thread(target=run, args=job, daemon=True) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 30)
    return dict(sorted(sent.items()))


# --- the child: a cluster that serves until told to stop ---------------------------------------------


class _LineCounter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.lines += 1


async def _serve() -> None:
    """Child mode: start the cluster, print its targets as JSON, then obey commands read on stdin."""
    import anyio
    import numpy as np

    from transfer_engine.engine.snapshot import build_snapshot
    from transfer_engine.transport.nixl import RemotePeer

    sys.path.insert(0, str(ROOT))
    from tests.integration.harness import cluster, run_room, small_layout

    counter = _LineCounter()
    logging.getLogger("transfer_engine").addHandler(counter)
    async with cluster(small_layout(), 1, 1, metrics_port=0, heartbeat_interval=1.0) as c:
        p, d = c.prefill[0], c.decode[0]
        targets = Targets(
            bootstrap=c.bootstrap,
            control=[p.endpoint, d.endpoint],
            introspect=[p.introspect_endpoint, d.introspect_endpoint],
            metrics=[e for e in (p.metrics_endpoint, d.metrics_endpoint) if e],
            decode_metadata_hex=d.poller.metadata().hex(),
        )
        print(REPLY + json.dumps(targets.__dict__), flush=True)
        rooms = 0
        while True:
            line = await anyio.to_thread.run_sync(sys.stdin.readline)
            command = line.strip()
            if command.startswith("peer "):  # the flood's NIXL agent, loaded as a handshake would
                name, metadata = command.split()[1:]
                d.poller.add_peer(RemotePeer(name, "DRAM", []), bytes.fromhex(metadata))
                print(REPLY + "{}", flush=True)
            elif command == "rooms":
                rng = random.Random(rooms)
                for _ in range(10):
                    rooms += 1
                    src = np.array(rng.sample(range(64), 8), dtype=np.int64)
                    dst = np.array(rng.sample(range(64), 8), dtype=np.int64)
                    await run_room(c, rooms, src, dst, [3, 5], aux_slot=1)
                with anyio.fail_after(10):
                    while any(any(e.leaks().values()) for e in (p, d)):  # noqa: ASYNC110
                        await anyio.sleep(0.05)
                dropped = {}
                for engine in (p, d):
                    dropped[engine.config.role] = build_snapshot(engine).counters.dropped_by_kind
                leaks = {e.config.role: {k: v for k, v in e.leaks().items() if v} for e in (p, d)}
                print(REPLY + json.dumps({"rooms_verified": rooms, "dropped": dropped, "log_lines": counter.lines,
                                  "leaks": leaks}), flush=True)  # fmt: skip
            elif command == "trim":  # what of the RSS is freed memory that glibc kept
                import ctypes
                import gc

                gc.collect()
                ctypes.CDLL("libc.so.6").malloc_trim(0)
                print(REPLY + "{}", flush=True)
            elif command in ("quit", ""):
                return


REPLY = "flood-reply "
"""Prefix of the child's answers on stdout (NIXL prints there too)."""


def _reply(stdout: Any) -> dict[str, Any]:
    """The child's next answer, skipping whatever else it printed."""
    while True:
        line = stdout.readline()
        if not line:
            raise RuntimeError("the serving child exited")
        if line.startswith(REPLY):
            return dict(json.loads(line[len(REPLY) :]))


def _rss_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of ``pid`` in KiB."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0])
    return fields["VmRSS"], fields["VmHWM"]


TIMELINE_S = 5.0
"""The result lists the flooded child's RSS at this interval (a plateau or a slope)."""


def _sample(pid: int, seconds: float, timeline: list[float] | None = None) -> int:
    """Peak VmRSS of ``pid`` over ``seconds`` (sampled every 0.2 s), in KiB; appends the RSS in MiB
    every :data:`TIMELINE_S` seconds to ``timeline`` when given."""
    peak = 0
    start = time.monotonic()
    end = start + seconds
    next_mark = start
    while (now := time.monotonic()) < end:
        rss = _rss_kib(pid)[0]
        peak = max(peak, rss)
        if timeline is not None and now >= next_mark:
            timeline.append(round(rss / 1024, 1))
            next_mark += TIMELINE_S
        time.sleep(0.2)
    return peak


def _trim_during(child: subprocess.Popen[str], seconds: float, trimmed: list[float]) -> None:
    """Every :data:`TIMELINE_S` seconds of the flood, make ``child`` give its free heap back
    (``malloc_trim``) and append its RSS after, in MiB: the memory the flood really holds, as
    against what glibc kept after it was freed."""
    assert child.stdin is not None and child.stdout is not None
    end = time.monotonic() + seconds
    while time.monotonic() + TIMELINE_S <= end:
        time.sleep(TIMELINE_S)
        child.stdin.write("trim\n")
        child.stdin.flush()
        _reply(child.stdout)
        trimmed.append(round(_rss_kib(child.pid)[0] / 1024, 1))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="how long the flood lasts")
    parser.add_argument("--idle", type=float, default=10.0, help="how long idle RSS is sampled first")
    parser.add_argument("--frames", type=int, default=2_000_000, help="most junk messages per ZMQ endpoint")
    parser.add_argument("--connections", type=int, default=20_000, help="most TCP connections per ZMQ port")
    parser.add_argument(
        "--only",
        default=",".join(SENDERS),
        help=f"comma-separated senders to run, among {','.join(SENDERS)} (default: all)",
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=5.0,
        help="seconds idle after the flood before RSS is sampled again, then trimmed",
    )
    parser.add_argument(
        "--trim-during",
        action="store_true",
        help=f"also trim the child's free heap every {TIMELINE_S:g} s of the flood",
    )
    parser.add_argument("--max-bytes", type=int, default=MAX_JUNK_BYTES, help="largest junk frame")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the result here")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        import anyio

        anyio.run(_serve)
        return 0
    if not (0 < args.seconds <= 600 and 0 < args.idle <= 120):
        parser.error("--seconds must be in (0, 600] and --idle in (0, 120]")
    only = frozenset(args.only.split(","))
    if not only <= set(SENDERS) or not 0 < args.max_bytes <= 1 << 30:
        parser.error(f"--only takes some of {','.join(SENDERS)}; --max-bytes must be in (0, 1 GiB]")
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        targets = Targets(**_reply(child.stdout))
        notifier = notif_agent()
        child.stdin.write(f"peer {notifier.name} {notifier.get_agent_metadata().hex()}\n")
        child.stdin.flush()
        _reply(child.stdout)
        idle_kib = _sample(child.pid, args.idle)
        sampler: dict[str, int] = {}
        timeline: list[float] = []
        watcher = threading.Thread(
            target=lambda: sampler.update(peak=_sample(child.pid, args.seconds + 1, timeline))
        )
        watcher.start()
        trimmed: list[float] = []
        trimmer = threading.Thread(target=_trim_during, args=(child, args.seconds, trimmed), daemon=True)
        if args.trim_during:
            trimmer.start()
        started = time.monotonic()
        sent = flood(
            targets,
            args.seconds,
            frames=args.frames,
            connections=args.connections,
            notifier=notifier,
            only=only,
            max_bytes=args.max_bytes,
        )
        flood_s = time.monotonic() - started
        watcher.join()
        if args.trim_during:
            trimmer.join()
        after_kib, hwm_kib = _rss_kib(child.pid)
        time.sleep(args.settle)
        settled_kib = _rss_kib(child.pid)[0]
        child.stdin.write("trim\n")
        child.stdin.flush()
        _reply(child.stdout)
        trimmed_kib = _rss_kib(child.pid)[0]
        child.stdin.write("rooms\n")
        child.stdin.flush()
        report = _reply(child.stdout)
        child.stdin.write("quit\n")
        child.stdin.flush()
        child.wait(60)
    finally:
        if child.poll() is None:
            child.kill()
    result: dict[str, Any] = {
        "flood_seconds": round(flood_s, 1),
        "idle_rss_mib": round(idle_kib / 1024, 1),
        "flood_peak_rss_mib": round(sampler.get("peak", 0) / 1024, 1),
        "after_rss_mib": round(after_kib / 1024, 1),
        "vm_hwm_mib": round(hwm_kib / 1024, 1),
        "settled_rss_mib": round(settled_kib / 1024, 1),
        "trimmed_rss_mib": round(trimmed_kib / 1024, 1),
        f"rss_every_{TIMELINE_S:g}_s_mib": timeline,
        **({f"trimmed_rss_every_{TIMELINE_S:g}_s_mib": trimmed} if args.trim_during else {}),
        "senders": sorted(only),
        "max_bytes": args.max_bytes,
        "sent": sent,
        **report,
    }
    text = json.dumps(result)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if report["rooms_verified"] and not any(report["leaks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
