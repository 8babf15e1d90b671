"""One-way latency of a small per-room request between two processes of one host, by channel.

    python tools/bench_channels.py [--n 300] [--gap-ms 2] [--size 120]

The decode side of a room sends one small message (a TransferRequest of a one-page room is about
``--size`` bytes) to the prefill, whose asyncio loop is otherwise idle; what the prefill's loop sees
is timed against the monotonic clock both processes share. Channels:

- ``tcp-asyncio``: a synchronous DEALER over ``tcp://`` into a ``zmq.asyncio`` ROUTER (the control
  channel today);
- ``ipc-asyncio``: the same over ``ipc://``;
- ``tcp-reader`` / ``ipc-reader``: a plain ROUTER read from ``loop.add_reader`` on its ZMQ_FD,
  drained with NOBLOCK receives (no asyncio Future per message);
- ``unix-dgram``: a Unix datagram socket (abstract name) read from ``loop.add_reader``, sent with one
  non-blocking ``sendto``: no I/O thread on either side, so one thread wake per message (the
  receiver's loop) against ZMQ's hand-offs through each side's I/O thread;
- ``nixl-notif``: NIXL ``send_notif`` on the agents' established UCX endpoint, read by
  ``get_new_notifs`` every ``--poll-us`` (the decode poller's quick cadence; a prefill poller with
  nothing in flight looks every ``poll_interval * 50``, 10 ms by default).

For each: p50/p99 of arrival minus send (us), and the sender's own cost of the send call (us).
Samples are ``--gap-ms`` apart, so each measures one message on an idle channel.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import zmq
import zmq.asyncio


def _stats(xs: list[float]) -> str:
    xs = sorted(xs)
    p99 = xs[min(len(xs) - 1, int(len(xs) * 0.99))]
    return f"p50 {statistics.median(xs):7.1f} p99 {p99:7.1f}"


def _payload(size: int, t: int) -> bytes:
    return t.to_bytes(8, "little") + bytes(size - 8)


def _zmq_receiver(endpoint: str, mode: str, n: int, pipe: Connection) -> None:
    arrivals: list[float] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        done = asyncio.Event()
        if mode == "asyncio":
            ctx = zmq.asyncio.Context()
            sock = ctx.socket(zmq.ROUTER)
            sock.bind(endpoint)
            pipe.send("ready")

            async def reader() -> None:
                while len(arrivals) < n:
                    frames = await sock.recv_multipart()
                    arrivals.append((time.monotonic_ns() - int.from_bytes(frames[1][:8], "little")) / 1e3)
                done.set()

            task = asyncio.ensure_future(reader())
            await done.wait()
            await task
        else:
            ctx = zmq.Context()
            sock = ctx.socket(zmq.ROUTER)
            sock.bind(endpoint)
            pipe.send("ready")

            def readable() -> None:
                while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    arrivals.append((time.monotonic_ns() - int.from_bytes(frames[1][:8], "little")) / 1e3)
                if len(arrivals) >= n:
                    done.set()

            loop.add_reader(sock.getsockopt(zmq.FD), readable)
            readable()
            await done.wait()
            loop.remove_reader(sock.getsockopt(zmq.FD))
        sock.close(linger=0)
        ctx.term()

    asyncio.run(main())
    pipe.send(arrivals)


def _dgram_receiver(name: bytes, n: int, pipe: Connection) -> None:
    arrivals: list[float] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        done = asyncio.Event()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(name)
        sock.setblocking(False)
        pipe.send("ready")

        def readable() -> None:
            while True:
                try:
                    data = sock.recv(65536)
                except BlockingIOError:
                    break
                arrivals.append((time.monotonic_ns() - int.from_bytes(data[:8], "little")) / 1e3)
            if len(arrivals) >= n:
                done.set()

        loop.add_reader(sock.fileno(), readable)
        await done.wait()
        loop.remove_reader(sock.fileno())
        sock.close()

    asyncio.run(main())
    pipe.send(arrivals)


def _dgram_sender(name: bytes, n: int, gap: float, size: int) -> list[float]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setblocking(False)
    costs = []
    for _ in range(n):
        t = time.monotonic_ns()
        sock.sendto(_payload(size, t), name)
        costs.append((time.monotonic_ns() - t) / 1e3)
        time.sleep(gap)
    sock.close()
    return costs


def _zmq_sender(endpoint: str, n: int, gap: float, size: int) -> list[float]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    time.sleep(0.2)
    costs = []
    for _ in range(n):
        t = time.monotonic_ns()
        sock.send(_payload(size, t), zmq.NOBLOCK)
        costs.append((time.monotonic_ns() - t) / 1e3)
        time.sleep(gap)
    time.sleep(0.1)
    sock.close(linger=0)
    ctx.term()
    return costs


def _nixl_receiver(n: int, poll_us: float, pipe: Connection) -> None:
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("bench-prefill", nixl_agent_config(backends=["UCX"]))
    pipe.send(agent.get_agent_metadata())
    arrivals: list[float] = []
    while len(arrivals) < n:
        for items in agent.get_new_notifs().values():
            for raw in items:
                arrivals.append((time.monotonic_ns() - int.from_bytes(raw[:8], "little")) / 1e3)
        until = time.perf_counter() + poll_us / 1e6
        while time.perf_counter() < until:  # a fine timer's sleep, without a loop
            time.sleep(0)
    pipe.send(arrivals)


def _nixl_sender(meta: bytes, n: int, gap: float, size: int) -> list[float]:
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("bench-decode", nixl_agent_config(backends=["UCX"]))
    name = agent.add_remote_agent(meta)
    agent.send_notif(name, _payload(size, time.monotonic_ns()))  # the endpoint is made on first use
    time.sleep(0.3)
    costs = []
    for _ in range(n):
        t = time.monotonic_ns()
        agent.send_notif(name, _payload(size, t))
        costs.append((time.monotonic_ns() - t) / 1e3)
        time.sleep(gap)
    return costs


def _pair(
    name: str, mp_ctx: Any, receiver: Callable[..., None], rargs: tuple, send: Callable[[], list[float]]
) -> None:
    """One channel: its receiver in a process (it says "ready", then sends its arrivals), ``send`` here."""
    here, there = mp_ctx.Pipe()
    proc = mp_ctx.Process(target=receiver, args=(*rargs, there))
    proc.start()
    assert here.recv() == "ready"
    costs = send()
    arrivals = here.recv()
    proc.join()
    print(f"{name:12s} arrival-send us {_stats(arrivals)}   send() us {_stats(costs)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--gap-ms", type=float, default=2.0)
    parser.add_argument("--size", type=int, default=120)
    parser.add_argument("--poll-us", type=float, default=50.0)
    parser.add_argument("--only", default="")
    args = parser.parse_args()
    gap = args.gap_ms / 1e3
    mp_ctx = mp.get_context("spawn")
    tmp = tempfile.mkdtemp()
    print(f"load average {os.getloadavg()}, {args.n} samples {args.gap_ms} ms apart, {args.size} bytes")
    channels = {
        "tcp-asyncio": ("tcp://127.0.0.1:{port}", "asyncio"),
        "ipc-asyncio": (f"ipc://{tmp}/a", "asyncio"),
        "tcp-reader": ("tcp://127.0.0.1:{port}", "reader"),
        "ipc-reader": (f"ipc://{tmp}/b", "reader"),
    }
    port = 47000 + os.getpid() % 1000
    for name, (endpoint, mode) in channels.items():
        if args.only and args.only not in name:
            continue
        endpoint = endpoint.format(port=port)
        port += 1
        _pair(
            name,
            mp_ctx,
            _zmq_receiver,
            (endpoint, mode, args.n),
            lambda e=endpoint: _zmq_sender(e, args.n, gap, args.size),
        )
    if not args.only or args.only in "unix-dgram":
        address = f"\0bench-channels-{os.getpid()}".encode()
        _pair(
            "unix-dgram",
            mp_ctx,
            _dgram_receiver,
            (address, args.n),
            lambda: _dgram_sender(address, args.n, gap, args.size),
        )
    if not args.only or "nixl" in args.only:
        here, there = mp_ctx.Pipe()
        proc = mp_ctx.Process(target=_nixl_receiver, args=(args.n + 1, args.poll_us, there))
        proc.start()
        costs = _nixl_sender(here.recv(), args.n, gap, args.size)
        arrivals = here.recv()[1:]
        proc.join()
        print(
            f"{'nixl-notif':12s} arrival-send us {_stats(arrivals)}   send() us {_stats(costs)}"
            f"   (polled every {args.poll_us} us)"
        )


if __name__ == "__main__":
    main()
