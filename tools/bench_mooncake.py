"""Mooncake's transfer engine as a measured peer: one room's bytes between two processes, in one run.

On the GPU machine, from the project root, with ``.whl-mc/`` from ``tools/fetch_mooncake_wheel.sh``
carried along (two device calls; the first is the self-test, a few seconds after the imports)::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl-mc/*.whl && export PYTHONPATH=/tmp/site:$PWD && timeout 240 python3 -u tools/bench_mooncake.py --self-test

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl-mc/*.whl && export PYTHONPATH=/tmp/site:$PWD && timeout 300 python3 -u tools/bench_mooncake.py --device cuda --transport nvlink_intra --timeout 270; timeout 240 python3 -u tools/bench_mooncake.py --device cuda --transport tcp --lat-samples 100 --timeout 210

Here (CPU memory, tiny sizes; the cp311 wheel of the same version, and a libcuda.so.1 on
LD_LIBRARY_PATH, since engine.so links the driver library even when it moves host memory)::

    python tools/bench_mooncake.py --device cpu

What runs. Two spawned processes, each with one Mooncake ``TransferEngine`` (metadata by
``P2PHANDSHAKE``, no metadata server): the *initiator* (GPU 0, the prefill's place) and the
*target* (GPU 1, the decode's place; GPU 0 too when the machine has one GPU). Each registers
one arena holding a room: a Qwen3-32B-shaped 4096-token chunk, 64 layers x K,V x 4096 tokens
x 8 heads x 128 x bf16 = 1.07 GB, laid out as 128 tensors of 8 MiB. The initiator WRITEs it
(``transfer_sync_write`` / ``batch_transfer_sync_write``, which return once the bytes landed):

1. throughput, ``--rounds`` rounds each of the room as one buffer (1 descriptor) and as the
   same bytes in 128 pieces (one batch of 128 descriptors). A round: the target zeroes its
   arena, the initiator fills its own with the round's bytes (a seeded random base XOR a
   per-round constant, so a stale or misplaced byte cannot pass); the clock runs from the call
   until it has returned and the initiator's CUDA work on both GPUs is done (a copy still in
   flight cannot count); then the target compares every byte with the bytes it expects
   (bit-exact). GB/s is the median over rounds; the first call of each kind is an untimed
   warm-up (it opens the peer's segment: a CUDA IPC mapping on ``nvlink_intra``);
2. small-transfer latency, ``--lat-samples`` samples each of: one page (16 tokens: one 32 KiB
   piece per layer tensor, 128 pieces in one batch, as our one-page room); a single 32 KiB
   piece; and one page with a Mooncake notification (``batch_transfer_sync`` with a
   ``TransferNotify``), timed until the target's ``get_notifies()`` returned it, the analogue
   of our small room's WRITE plus notification. p50 and p99; the pages are checked after the
   last sample. The plain WRITEs tell the target nothing: they are a floor;
3. the ceiling, measured first, in the parent process: torch ``copy_`` of the room's bytes from
   the initiator's GPU to the target's (a host memcpy on CPU), median of ``--rounds``. Every GB/s
   is also printed as a share of it, so runs on different machines compare as ratios.

Transports (``--transport``), each process installs the same one:

* ``nvlink_intra`` (``MC_INTRANODE_NVLINK=1``, the default on CUDA): Mooncake's intra-node
  transport. The target exports its arena with ``cudaIpcGetMemHandle``; the initiator opens it
  and copies with the CUDA runtime (peer copy over NVLink, or PCIe, between the two GPUs). The
  same physical path as our direct path's CUDA IPC: a fair anchor.
* ``tcp`` (``MC_FORCE_TCP=1``, the default on CPU): Mooncake's TCP transport over loopback,
  GPU memory staged through host buffers. Not a fair anchor for GPU memory (the output says so).

Mooncake 0.3.14's ``rdma`` needs an RDMA NIC (the GPU machine has none) and ``nvlink`` (MNNVL,
fabric handles) is not compiled into this wheel. ``mooncake/engine.so`` links libibverbs.so.1,
libmlx5.so.1, libnuma.so.1, libcurl.so.4, libcuda.so.1 and libcudart.so.13: load_mooncake()
loads each missing one from ``.whl-mc/lib`` (the system's copy first), libcudart.so.13 from
PyTorch's CUDA 13 wheels. ``--self-test`` checks, for each transport, that the module imports,
engines initialize, arenas register and small transfers verify.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

MOONCAKE_VERSION = "0.3.14"
ROOT = Path(__file__).resolve().parent.parent
BF16_BYTES = 2
SEGMENT_ALIGN = 2 << 20
MESSAGE_TIMEOUT_S = 300.0
SELF_TEST_LAYERS, SELF_TEST_TOKENS = 2, 64
WARMUP_SAMPLES = 5
SELF_TEST_TIMEOUT_S = 100.0
NOTIFY_TIMEOUT_S = 10.0

TRANSPORT_ENV = {"nvlink_intra": "MC_INTRANODE_NVLINK", "tcp": "MC_FORCE_TCP"}
TRANSPORT_MEANING = {
    "nvlink_intra": "CUDA IPC + cudaMemcpy between the GPUs: the same path as ours, a fair anchor",
    "tcp": "TCP over loopback",
}


class BenchError(RuntimeError):
    """A side of the benchmark failed; the message names the side, the step and Mooncake's return code."""


@dataclass(frozen=True)
class Config:
    """One measured pair of processes: devices, transport, the room's shape (``tensors`` tensors of
    ``tensor_bytes`` bytes, pages of ``page_bytes`` in each) and how many samples to take."""

    device: str
    transport: str
    initiator: str
    target: str
    layers: int
    heads: int
    head_dim: int
    tokens: int
    page_size: int
    rounds: int
    lat_samples: int
    lib_dir: str
    verbose: bool

    @property
    def tensors(self) -> int:
        return 2 * self.layers

    @property
    def tensor_bytes(self) -> int:
        return self.tokens * self.heads * self.head_dim * BF16_BYTES

    @property
    def room_bytes(self) -> int:
        return self.tensors * self.tensor_bytes

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.heads * self.head_dim * BF16_BYTES


# -- loading the wheel ------------------------------------------------------------------------------


def _load_by_name_or_path(name: str, lib_dir: Path) -> str | None:
    """Loads ``name`` as the system finds it, else from ``lib_dir``; returns where from, None if neither."""
    try:
        ctypes.CDLL(name, mode=os.RTLD_GLOBAL)
        return "system"
    except OSError:
        pass
    try:
        ctypes.CDLL(str(lib_dir / name), mode=os.RTLD_GLOBAL)
        return "bundled"
    except OSError:
        return None


def _load_cudart() -> str:
    """Makes libcudart.so.13 resident before engine.so asks for it by name; returns where it came from.

    PyTorch's CUDA 13 build has loaded it already (``import torch``); otherwise the nvidia-* wheels
    on ``sys.path`` and the CUDA toolkit folders are searched.
    """
    try:
        ctypes.CDLL("libcudart.so.13", mode=os.RTLD_GLOBAL)
        return "by name"
    except OSError:
        pass
    patterns = [os.path.join(p, "nvidia", "*", "lib", "libcudart.so.13") for p in sys.path if p]
    patterns += ["/usr/local/cuda*/lib*/libcudart.so.13", "/usr/local/cuda*/targets/*/lib/libcudart.so.13"]
    for pattern in patterns:
        for path in sorted(glob.glob(pattern)):
            try:
                ctypes.CDLL(path, mode=os.RTLD_GLOBAL)
                return path
            except OSError:
                continue
    return "not found"


RDMA_CORE = ("libibverbs.so.1", "libmlx5.so.1")


def _load_bundle(lib_dir: Path) -> list[str]:
    """Loads what ``lib_dir`` holds and the system lacks; returns the names taken from ``lib_dir``.

    libibverbs.so.1 and libmlx5.so.1 must come from one rdma-core build (libmlx5 binds to a
    versioned private symbol set of libibverbs): both from the system if it has libmlx5, else both
    from ``lib_dir``. Every other library is taken from the system by name where it loads, from
    ``lib_dir`` otherwise, in passes until no more load, so the order of dependencies does not matter.
    """
    names = sorted(p.name for p in lib_dir.glob("*.so*")) if lib_dir.is_dir() else []
    bundled: list[str] = []
    pending = [name for name in names if name not in RDMA_CORE]
    while pending:
        remaining = []
        for name in pending:
            where = _load_by_name_or_path(name, lib_dir)
            if where is None:
                remaining.append(name)
            elif where == "bundled":
                bundled.append(name)
        if len(remaining) == len(pending):
            break
        pending = remaining
    try:
        ctypes.CDLL(RDMA_CORE[1], mode=os.RTLD_GLOBAL)
    except OSError:
        for name in RDMA_CORE:
            if (lib_dir / name).exists():
                ctypes.CDLL(str(lib_dir / name), mode=os.RTLD_GLOBAL)
                bundled.append(name)
    return bundled


def load_mooncake(lib_dir: Path) -> tuple[ModuleType, dict[str, Any]]:
    """Imports ``mooncake.engine``; where the import fails for a missing system library, loads the
    libraries of ``lib_dir`` the system lacks (see :func:`_load_bundle`) and imports again.

    Returns the module and where its libraries came from. Raises BenchError with both import
    errors if the second import fails too.
    """
    diag: dict[str, Any] = {"libcudart": _load_cudart(), "bundled": []}
    try:
        import mooncake.engine as engine
    except ImportError as first:
        try:
            diag["bundled"] = _load_bundle(lib_dir)
        except OSError as exc:
            raise BenchError(
                f"import mooncake.engine failed: {first}; loading from {lib_dir}: {exc}"
            ) from exc
        try:
            import mooncake.engine as engine
        except ImportError as second:
            raise BenchError(
                f"import mooncake.engine failed: {second} (before loading from {lib_dir}: {first}); "
                "libcuda.so.1 is the NVIDIA driver's and is never bundled"
            ) from second
    diag["module"] = engine.__file__
    diag["support"] = {
        name: bool(getattr(engine, name)) for name in dir(engine) if name.startswith("SUPPORT_")
    }
    with open("/proc/self/maps") as maps:
        resident = {line.split()[-1] for line in maps if ".so" in line}
    diag["resident"] = sorted(
        p for p in resident if any(k in p for k in ("libcudart.so", "libcuda.so", "libibverbs"))
    )
    return engine, diag


# -- one side ---------------------------------------------------------------------------------------


def _send(conn: Connection, msg: dict[str, Any]) -> None:
    conn.send_bytes(json.dumps(msg).encode())


def _send_last(conn: Connection, msg: dict[str, Any]) -> None:
    """Sends a last message (an error, a close) to a peer that may have exited already."""
    try:
        _send(conn, msg)
    except OSError:
        pass


def _recv(conn: Connection, who: str) -> dict[str, Any]:
    if not conn.poll(MESSAGE_TIMEOUT_S):
        raise BenchError(f"no message from the {who} in {MESSAGE_TIMEOUT_S:.0f} s")
    msg: dict[str, Any] = json.loads(conn.recv_bytes())
    if "error" in msg:
        raise BenchError(f"{who}: {msg['error']}")
    return msg


def _base_bytes(cfg: Config, device: torch.device) -> torch.Tensor:
    """The room's seeded random bytes, identical in both processes (numpy PCG64, then moved to ``device``)."""
    host = np.random.default_rng(20260417).integers(0, 256, size=cfg.room_bytes, dtype=np.uint8)
    return torch.from_numpy(host).to(device)


def _round_constant(step: int) -> int:
    """A nonzero byte that differs between consecutive steps, XORed over the base for that step."""
    return 1 + (step * 37) % 255


class Side:
    """One process's engine and registered arena. Built by :meth:`open`, released by :meth:`close`."""

    def __init__(self, cfg: Config, role: str) -> None:
        self.cfg = cfg
        self.role = role
        self.device = torch.device(cfg.initiator if role == "initiator" else cfg.target)
        # The initiator's clock stops once its CUDA work on both GPUs is done, so that a copy still in
        # flight when Mooncake's call returns cannot count as landed.
        names = {cfg.initiator, cfg.target} if role == "initiator" else {cfg.target}
        self.settled = [torch.device(n) for n in sorted(names) if torch.device(n).type == "cuda"]
        self.mc: Any = None
        self.engine: Any = None
        self.registered = False
        self.diag: dict[str, Any] = {}

    def open(self) -> None:
        """Loads Mooncake, allocates the arena first (so that it starts its own cudaMalloc segment) and
        registers it whole. Raises BenchError if any step fails."""
        cfg = self.cfg
        os.environ[TRANSPORT_ENV[cfg.transport]] = "1"
        if not cfg.verbose:
            os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        size = math.ceil(cfg.room_bytes / SEGMENT_ALIGN) * SEGMENT_ALIGN
        self.arena = torch.zeros(size, dtype=torch.uint8, device=self.device)
        self.room = self.arena[: cfg.room_bytes]
        self.addr = self.arena.data_ptr()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            segments = {s["address"]: s["total_size"] for s in torch.cuda.memory_snapshot()}
            if segments.get(self.addr, 0) < size:
                raise BenchError(
                    f"{self.role}: the arena at {self.addr:#x} does not start its own CUDA allocation "
                    "(CUDA IPC exports whole allocations); set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False"
                )
        self.mc, self.diag = load_mooncake(Path(cfg.lib_dir))
        self.engine = self.mc.TransferEngine()
        rc = self.engine.initialize("127.0.0.1", "P2PHANDSHAKE", cfg.transport, "")
        if rc != 0:
            raise BenchError(f"{self.role}: TransferEngine.initialize(..., {cfg.transport!r}) returned {rc}")
        self.session = f"127.0.0.1:{self.engine.get_rpc_port()}"
        rc = self.engine.register_memory(self.addr, size)
        if rc != 0:
            raise BenchError(
                f"{self.role}: register_memory({self.addr:#x}, {size}) on {self.device} returned {rc}"
            )
        self.registered = True
        self.base = _base_bytes(cfg, self.device)
        self.settle()

    def close(self) -> None:
        """Unregisters the arena; safe after a partial :meth:`open`."""
        if self.registered:
            self.engine.unregister_memory(self.addr)
            self.registered = False

    def settle(self) -> None:
        """Returns once this process's CUDA work on its GPUs has finished (at once on CPU)."""
        for device in self.settled:
            torch.cuda.synchronize(device)

    def fill(self, step: int) -> None:
        """The initiator's room holds the step's bytes when this returns."""
        torch.bitwise_xor(self.base, _round_constant(step), out=self.room)
        self.settle()

    def zero(self) -> None:
        self.room.zero_()
        self.settle()

    def check(self, step: int, tensors: int, tensor_bytes: int, prefix: int) -> int:
        """Counts the bytes of ``room.view(tensors, tensor_bytes)[:, :prefix]`` that differ from the step's."""
        expected = torch.bitwise_xor(self.base, _round_constant(step))
        got = self.room.view(tensors, tensor_bytes)[:, :prefix]
        want = expected.view(tensors, tensor_bytes)[:, :prefix]
        return 0 if torch.equal(got, want) else int((got != want).sum().item())

    def watch(self, msg: str, timeout_s: float) -> float | None:
        """Polls Mooncake's notifications until one carries ``msg``; returns when (perf_counter), or None."""
        deadline = time.perf_counter() + timeout_s
        while time.perf_counter() < deadline:
            for notify in self.engine.get_notifies():
                if notify.msg == msg:
                    return time.perf_counter()
        return None


def _target_main(peer: Connection, cfg_json: str) -> None:
    """The target process: answers the initiator's ``prepare`` (zero the room), ``verify``, ``watch``
    (report when a notification arrives) and ``close``."""
    cfg = Config(**json.loads(cfg_json))
    side = Side(cfg, "target")
    try:
        side.open()
        _send(peer, {"session": side.session, "addr": side.addr, "diag": side.diag})
        while True:
            msg = _recv(peer, "initiator")
            match msg["op"]:
                case "prepare":
                    side.zero()
                    _send(peer, {"ok": True})
                case "verify":
                    bad = side.check(msg["step"], msg["tensors"], msg["tensor_bytes"], msg["prefix"])
                    _send(peer, {"mismatched": bad})
                case "watch":
                    _send(peer, {"ok": True})
                    _send(peer, {"seen": side.watch(msg["msg"], NOTIFY_TIMEOUT_S)})
                case "close":
                    break
                case op:
                    raise BenchError(f"target: unknown op {op!r}")
    except Exception as exc:
        traceback.print_exc()
        _send_last(peer, {"error": f"{type(exc).__name__}: {exc}"})
    finally:
        side.close()


class Initiator:
    """Drives the measurement from the initiator's side; every WRITE goes to the target's arena."""

    def __init__(self, side: Side, peer: Connection, target: dict[str, Any]) -> None:
        self.side = side
        self.peer = peer
        self.session: str = target["session"]
        self.remote: int = target["addr"]
        self.mismatched = 0
        self.checks = 0

    def ask(self, msg: dict[str, Any]) -> dict[str, Any]:
        _send(self.peer, msg)
        return _recv(self.peer, "target")

    def verify(self, step: int, tensors: int, tensor_bytes: int, prefix: int, what: str) -> None:
        bad = self.ask(
            {"op": "verify", "step": step, "tensors": tensors, "tensor_bytes": tensor_bytes, "prefix": prefix}
        )
        self.checks += 1
        self.mismatched += bad["mismatched"]
        if bad["mismatched"]:
            raise BenchError(f"{what}: {bad['mismatched']} bytes differ on the target after the transfer")

    def write(self, offsets: list[int], lengths: list[int], notify: str | None = None) -> float:
        """One synchronous WRITE of these pieces (same offsets on both sides), with a notification
        carrying ``notify`` if given; returns the wall seconds until it landed."""
        engine, mc, local = self.side.engine, self.side.mc, self.side.addr
        sources, sinks = [local + o for o in offsets], [self.remote + o for o in offsets]
        t0 = time.perf_counter()
        if notify is not None:
            note = mc.TransferNotify("bench_mooncake", notify)
            rc = engine.batch_transfer_sync(
                self.session, sources, sinks, lengths, mc.TransferOpcode.Write, note
            )
        elif len(offsets) == 1:
            rc = engine.transfer_sync_write(self.session, sources[0], sinks[0], lengths[0])
        else:
            rc = engine.batch_transfer_sync_write(self.session, sources, sinks, lengths)
        self.side.settle()
        elapsed = time.perf_counter() - t0
        if rc != 0:
            raise BenchError(
                f"initiator: WRITE of {len(offsets)} piece(s), {sum(lengths)} bytes, returned {rc}"
            )
        return elapsed

    def room_rounds(self, pieces: int, first_step: int) -> list[float]:
        """``rounds`` timed WRITEs of the room in ``pieces`` pieces, after an untimed warm-up; GB/s each."""
        cfg = self.side.cfg
        piece = cfg.room_bytes // pieces
        offsets, lengths = [i * piece for i in range(pieces)], [piece] * pieces
        self.write(offsets, lengths)
        rates = []
        for r in range(cfg.rounds):
            step = first_step + r
            self.ask({"op": "prepare"})
            self.side.fill(step)
            elapsed = self.write(offsets, lengths)
            self.verify(step, 1, cfg.room_bytes, cfg.room_bytes, f"room in {pieces} piece(s), round {r}")
            rates.append(cfg.room_bytes / elapsed / 1e9)
        return rates

    def _page(self, per_tensor: bool) -> tuple[int, int, Callable[[int], list[int]]]:
        """(tensors, stride, offsets of sample j): sample ``j`` writes page ``j`` modulo the pages there
        are, in every tensor or in the room taken as one tensor."""
        cfg = self.side.cfg
        tensors = cfg.tensors if per_tensor else 1
        stride = cfg.tensor_bytes if per_tensor else cfg.room_bytes
        pages = stride // cfg.page_bytes
        return tensors, stride, lambda j: [t * stride + (j % pages) * cfg.page_bytes for t in range(tensors)]

    def latency(self, per_tensor: bool, step: int) -> list[float]:
        """``lat_samples`` timed WRITEs of one page (a piece in every tensor, or a single piece); ms each.
        The pages the samples wrote are checked after the last one."""
        cfg = self.side.cfg
        tensors, stride, offsets = self._page(per_tensor)
        lengths = [cfg.page_bytes] * tensors
        for j in range(WARMUP_SAMPLES):
            self.write(offsets(j), lengths)
        self.ask({"op": "prepare"})
        self.side.fill(step)
        samples = [self.write(offsets(j), lengths) * 1e3 for j in range(cfg.lat_samples)]
        prefix = min(cfg.lat_samples, stride // cfg.page_bytes) * cfg.page_bytes
        self.verify(step, tensors, stride, prefix, f"latency ({tensors} piece(s) a sample)")
        return samples

    def notified_latency(self, step: int) -> list[float]:
        """``lat_samples`` one-page WRITEs with a notification: ms from the call to the target seeing
        the notification (both clocks are the host's CLOCK_MONOTONIC). Raises BenchError if a
        notification does not arrive."""
        cfg = self.side.cfg
        tensors, stride, offsets = self._page(per_tensor=True)
        lengths = [cfg.page_bytes] * tensors

        def sample(j: int) -> float:
            self.ask({"op": "watch", "msg": f"{step}:{j}"})
            t0 = time.perf_counter()
            self.write(offsets(j), lengths, notify=f"{step}:{j}")
            seen = _recv(self.peer, "target")["seen"]
            if seen is None:
                raise BenchError(f"the target saw no notification in {NOTIFY_TIMEOUT_S:.0f} s")
            return (seen - t0) * 1e3

        for j in range(WARMUP_SAMPLES):
            sample(cfg.lat_samples + j)
        self.ask({"op": "prepare"})
        self.side.fill(step)
        samples = [sample(j) for j in range(cfg.lat_samples)]
        prefix = min(cfg.lat_samples, stride // cfg.page_bytes) * cfg.page_bytes
        self.verify(step, tensors, stride, prefix, "latency with notification")
        return samples


def _initiator_main(peer: Connection, results: Connection, cfg_json: str) -> None:
    """The initiator process: opens its side, measures, sends one result dict (or an error) to the parent."""
    cfg = Config(**json.loads(cfg_json))
    side = Side(cfg, "initiator")
    try:
        side.open()
        target = _recv(peer, "target")
        run = Initiator(side, peer, target)
        result: dict[str, Any] = {
            "room_1": run.room_rounds(1, first_step=0),
            "room_pieces": run.room_rounds(cfg.tensors, first_step=cfg.rounds),
            "page_ms": run.latency(per_tensor=True, step=2 * cfg.rounds),
            "piece_ms": run.latency(per_tensor=False, step=2 * cfg.rounds + 1),
        }
        try:
            result["notify_ms"] = run.notified_latency(step=2 * cfg.rounds + 2)
        except BenchError as exc:
            result["notify_error"] = str(exc)
        _send(peer, {"op": "close"})
        result |= {
            "checks": run.checks,
            "mismatched": run.mismatched,
            "diag": {"initiator": side.diag, "target": target["diag"]},
        }
        _send(results, result)
    except Exception as exc:
        traceback.print_exc()
        _send_last(results, {"error": f"{type(exc).__name__}: {exc}"})
        _send_last(peer, {"op": "close"})
    finally:
        side.close()


def run_pair(cfg: Config, timeout_s: float) -> dict[str, Any]:
    """Spawns the target and the initiator, returns the initiator's result; raises BenchError on failure."""
    ctx = mp.get_context("spawn")
    to_target, to_initiator = ctx.Pipe()
    results_read, results_write = ctx.Pipe(duplex=False)
    cfg_json = json.dumps(asdict(cfg))
    target = ctx.Process(target=_target_main, args=(to_initiator, cfg_json), name="mooncake-target")
    initiator = ctx.Process(
        target=_initiator_main, args=(to_target, results_write, cfg_json), name="mooncake-initiator"
    )
    target.start()
    initiator.start()
    for end in (to_target, to_initiator, results_write):
        end.close()  # the children hold their own copies: a child that dies is an EOF here, not a hang
    try:
        if not results_read.poll(timeout_s):
            raise BenchError(f"no result from the initiator in {timeout_s:.0f} s ({cfg.transport})")
        result: dict[str, Any] = json.loads(results_read.recv_bytes())
    except EOFError as exc:
        raise BenchError(f"the initiator exited with code {initiator.exitcode} before its result") from exc
    finally:
        for proc in (initiator, target):
            proc.join(30)
            if proc.is_alive():
                proc.terminate()
                proc.join(10)
    if "error" in result:
        raise BenchError(f"{cfg.transport}: {result['error']}")
    return result


# -- the ceiling and the report ---------------------------------------------------------------------


def copy_ceiling(cfg: Config) -> list[float]:
    """GB/s of torch ``copy_`` of the room's bytes, initiator device -> target device, ``rounds`` times.

    On CPU the copy runs on one thread: the CPU run is a check on a small, shared machine, where
    torch's thread pool made the same copy read anywhere from 0.26 to 27 GB/s."""
    if cfg.device == "cpu":
        torch.set_num_threads(1)
    src = torch.randint(0, 256, (cfg.room_bytes,), dtype=torch.uint8, device=cfg.initiator)
    dst = torch.empty(cfg.room_bytes, dtype=torch.uint8, device=cfg.target)

    devices = {src.device, dst.device}

    def sync() -> None:
        for device in devices:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

    dst.copy_(src)
    sync()
    rates = []
    for _ in range(cfg.rounds):
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        rates.append(cfg.room_bytes / (time.perf_counter() - t0) / 1e9)
    if not torch.equal(dst.to(src.device), src):
        raise BenchError("the ceiling's copy is not bit-exact")
    del src, dst
    if cfg.device == "cuda":
        torch.cuda.empty_cache()
    return rates


def _pct(samples: list[float], q: float) -> float:
    return float(np.percentile(samples, q))


def report(cfg: Config, ceiling: list[float], result: dict[str, Any]) -> dict[str, Any]:
    """Prints the table; returns the JSON record."""
    copy = statistics.median(ceiling)
    one, many = statistics.median(result["room_1"]), statistics.median(result["room_pieces"])
    fair = cfg.transport == "nvlink_intra"
    same_gpu = cfg.device == "cuda" and cfg.initiator == cfg.target
    record = {
        "bench": "mooncake",
        "mooncake": MOONCAKE_VERSION,
        "transport": cfg.transport,
        "fair_anchor": fair,
        "device": cfg.device,
        "initiator": cfg.initiator,
        "target": cfg.target,
        "room_bytes": cfg.room_bytes,
        "pieces": cfg.tensors,
        "rounds": cfg.rounds,
        "room_1_gbps": round(one, 2),
        "room_pieces_gbps": round(many, 2),
        "copy_gbps": round(copy, 2),
        "room_1_of_copy": round(one / copy, 3),
        "room_pieces_of_copy": round(many / copy, 3),
        "room_1_rounds": [round(x, 2) for x in result["room_1"]],
        "room_pieces_rounds": [round(x, 2) for x in result["room_pieces"]],
        "copy_rounds": [round(x, 2) for x in ceiling],
        "page_bytes": cfg.page_bytes,
        "lat_samples": cfg.lat_samples,
        "page_p50_ms": round(_pct(result["page_ms"], 50), 4),
        "page_p99_ms": round(_pct(result["page_ms"], 99), 4),
        "piece_p50_ms": round(_pct(result["piece_ms"], 50), 4),
        "piece_p99_ms": round(_pct(result["piece_ms"], 99), 4),
        "page_notify_p50_ms": round(_pct(result["notify_ms"], 50), 4) if "notify_ms" in result else None,
        "page_notify_p99_ms": round(_pct(result["notify_ms"], 99), 4) if "notify_ms" in result else None,
        "notify_error": result.get("notify_error"),
        "gpu": torch.cuda.get_device_name(torch.device(cfg.initiator)) if cfg.device == "cuda" else None,
        "verified_checks": result["checks"],
        "mismatched_bytes": result["mismatched"],
    }
    mb = cfg.room_bytes / 1e6
    print(
        f"Mooncake {MOONCAKE_VERSION} transfer engine, transport {cfg.transport}: {TRANSPORT_MEANING[cfg.transport]}"
    )
    if cfg.device == "cpu":
        print(
            "CPU MEMORY: DRAM over Mooncake's TCP transport on loopback checks that this script works; it is no"
        )
        print("anchor (our CPU figures move DRAM through UCX shared memory).")
    elif not fair:
        print("NOT A FAIR ANCHOR: GPU memory over Mooncake's TCP transport is staged through host memory in")
        print("64 KiB pieces and sent over loopback sockets; our engine moves GPU memory by CUDA IPC.")
    if same_gpu:
        print(
            f"ONE GPU: both processes on {cfg.initiator}; the ceiling is a copy within one GPU, not a link."
        )
    print(
        f"initiator {cfg.initiator} -> target {cfg.target}; room {cfg.layers} layers x K,V x {cfg.tokens} tokens x "
        f"{cfg.heads} heads x {cfg.head_dim} x bf16 = {mb:.1f} MB as {cfg.tensors} tensors"
    )
    ceiling_name = (
        "host memcpy (torch copy_, 1 thread)" if cfg.device == "cpu" else "device copy (torch copy_)"
    )
    rows = [
        ("room, 1 buffer", f"{one:.2f} GB/s", f"{one / copy:.3f}", record["room_1_rounds"]),
        (
            f"room, {cfg.tensors} pieces (1 batch)",
            f"{many:.2f} GB/s",
            f"{many / copy:.3f}",
            record["room_pieces_rounds"],
        ),
        (ceiling_name, f"{copy:.2f} GB/s", "1.000", record["copy_rounds"]),
    ]
    print(f"\n| what | median of {cfg.rounds} | of the copy | rounds |\n|---|---|---|---|")
    for name, figure, share, rounds in rows:
        print(f"| {name} | {figure} | {share} | {', '.join(f'{x:.2f}' for x in rounds)} |")
    kib = cfg.page_bytes // 1024
    print(f"\n| small WRITE ({cfg.lat_samples} samples) | p50 ms | p99 ms |\n|---|---|---|")
    print(
        f"| one page: {cfg.tensors} x {kib} KiB (1 batch) | {record['page_p50_ms']:.4f} | {record['page_p99_ms']:.4f} |"
    )
    print(f"| one piece: 1 x {kib} KiB | {record['piece_p50_ms']:.4f} | {record['piece_p99_ms']:.4f} |")
    if "notify_ms" in result:
        print(
            f"| one page + notification, until the target saw it | {record['page_notify_p50_ms']:.4f} "
            f"| {record['page_notify_p99_ms']:.4f} |"
        )
    else:
        print(f"| one page + notification | failed: {result['notify_error']} | |")
    if max(result["room_1"] + result["room_pieces"]) > 1.05 * copy:
        print("\nA ROUND BEAT THE COPY CEILING by more than 5%: check how the ceiling ran on this machine.")
    print(f"\nverified after the clock: {result['checks']} checks, {result['mismatched']} bytes mismatched")
    return record


# -- command line -----------------------------------------------------------------------------------


def _config(args: argparse.Namespace, transport: str, **sizes: int) -> Config:
    if args.device == "cuda":
        first, second = (int(x) for x in args.gpus.split(","))
        if torch.cuda.device_count() < 2:
            second = first
        initiator, target = f"cuda:{first}", f"cuda:{second}"
    else:
        initiator = target = "cpu"
    tiny = args.device == "cpu"
    return Config(
        device=args.device,
        transport=transport,
        initiator=initiator,
        target=target,
        layers=sizes.get("layers", args.layers or (4 if tiny else 64)),
        heads=args.heads,
        head_dim=args.head_dim,
        tokens=sizes.get("tokens", args.tokens or (256 if tiny else 4096)),
        page_size=args.page_size,
        rounds=sizes.get("rounds", args.rounds or 5),
        lat_samples=sizes.get("lat_samples", args.lat_samples or (30 if tiny else 200)),
        lib_dir=str(args.lib_dir),
        verbose=args.verbose,
    )


def self_test(args: argparse.Namespace) -> int:
    """Each transport the device has: import, initialize, register, tiny transfers verified. Exit code."""
    transports = ["nvlink_intra", "tcp"] if args.device == "cuda" else ["tcp"]
    failed = 0
    for transport in transports:
        cfg = _config(
            args, transport, layers=SELF_TEST_LAYERS, tokens=SELF_TEST_TOKENS, rounds=1, lat_samples=3
        )
        t0 = time.perf_counter()
        try:
            result = run_pair(cfg, min(args.timeout, SELF_TEST_TIMEOUT_S))
        except BenchError as exc:
            failed += 1
            print(f"self-test {transport}: FAILED: {exc}")
            continue
        diag = result["diag"]["initiator"]
        print(
            f"self-test {transport}: ok in {time.perf_counter() - t0:.1f} s, {cfg.initiator} -> {cfg.target}, "
            f"{result['checks']} checks, {result['mismatched']} bytes mismatched, "
            f"room {statistics.median(result['room_1']):.3f} GB/s, page p50 {statistics.median(result['page_ms']):.3f} ms"
        )
        print(
            f"  module {diag['module']}; libcudart {diag['libcudart']}; loaded from {args.lib_dir}: {diag['bundled'] or 'none'}"
        )
        print(f"  resident {diag['resident']}; {diag['support']}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--transport", choices=["auto", "nvlink_intra", "tcp"], default="auto")
    parser.add_argument(
        "--gpus", default="0,1", help="initiator,target GPU indices (one GPU: both on the first)"
    )
    parser.add_argument("--layers", type=int, help="64 on cuda, 4 on cpu")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--tokens", type=int, help="4096 on cuda, 256 on cpu")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=None, help="5")
    parser.add_argument("--lat-samples", type=int, help="200 on cuda, 30 on cpu")
    parser.add_argument("--lib-dir", type=Path, default=ROOT / ".whl-mc" / "lib")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds to wait for the initiator's result"
    )
    parser.add_argument("--self-test", action="store_true")
    parser.add_argument("--verbose", action="store_true", help="Mooncake's INFO log lines too")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no GPU")
    if args.self_test:
        return self_test(args)
    transport = (
        args.transport if args.transport != "auto" else ("nvlink_intra" if args.device == "cuda" else "tcp")
    )
    if transport == "nvlink_intra" and args.device == "cpu":
        parser.error("--transport nvlink_intra moves GPU memory only")
    cfg = _config(args, transport)
    if cfg.tokens % cfg.page_size:
        parser.error(f"--tokens {cfg.tokens} is not a multiple of --page-size {cfg.page_size}")
    ceiling = copy_ceiling(cfg)
    try:
        result = run_pair(cfg, args.timeout)
    except BenchError as exc:
        print(f"bench_mooncake: {exc}", file=sys.stderr)
        return 1
    record = report(cfg, ceiling, result)
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
