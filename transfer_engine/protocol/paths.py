"""The transfer paths a room can take: one enum, and what each implies.

The path is chosen by the decode rank per room and travels in its ``TransferRequest`` as the enum's
string value. ``EngineConfig.path`` is a policy (``auto`` picks one of these).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

import numpy.typing as npt

from transfer_engine.errors import ConfigError
from transfer_engine.protocol.descriptors import page_runs


class TransferPath(str, enum.Enum):
    """How a room's KV moves (see README, "Paths")."""

    DIRECT = "direct"
    """Coalesced page runs straight from prefill pages into decode pages."""
    SLICE = "slice"
    """One descriptor per (layer, K/V, token) head slice."""
    STAGED = "staged"
    """Gather into a staging buffer, one WRITE into the decode ring, scatter there."""
    HOST = "host"
    """``STAGED`` with the staging buffers and ring in pinned host memory."""
    KERNEL = "kernel"
    """One host: the writer maps the reader's pool and copies each chunk or layer group with one indexed
    copy (a Triton kernel on CUDA), then tells the reader as a WRITE's notification would."""

    @property
    def staged(self) -> bool:
        """Whether chunks go through the decode rank's staging ring."""
        return self in (TransferPath.STAGED, TransferPath.HOST)

    @classmethod
    def parse(cls, value: str) -> TransferPath | None:
        """The path named ``value``, or None when no path has that name."""
        try:
            return cls(value)
        except ValueError:
            return None


def is_staged(name: str) -> bool:
    """Whether the path (or policy) named ``name`` goes through a staging ring."""
    path = TransferPath.parse(name)
    return path is not None and path.staged


def auto_path(
    *, equal_tp: bool, same_pages: bool, has_ring: bool, host: bool, slice_pieces: float, num_tensors: int
) -> TransferPath:
    """The path ``EngineConfig.path="auto"`` takes for one prefill instance (decode side).

    ``equal_tp``: equal TP sizes (or MLA); ``same_pages``: equal page sizes on every rank;
    ``has_ring``: this decode rank runs a staging ring (``host``: in pinned host memory);
    ``slice_pieces``: the slice path's descriptors per page for the worst writer
    (``descriptors.slice_pieces_per_page``); ``num_tensors``: KV tensors per rank. Direct where it
    applies; else staged, unless the slice path moves each page in no more pieces than direct moves
    it (one per tensor), as between two vLLM CPU layouts, where gathering and scattering would only
    add two copies.
    """
    if equal_tp and same_pages:
        return TransferPath.DIRECT
    if not has_ring or slice_pieces <= num_tensors:
        return TransferPath.SLICE
    return TransferPath.HOST if host else TransferPath.STAGED


@dataclasses.dataclass(frozen=True)
class Crossover:
    """Where a direct room stops paying: direct while its descriptors are at most
    ``per_chunk + per_mib * MiB`` (MiB: the bytes the plan moves, on this decode rank).

    A direct WRITE costs about ``bytes / link + descriptors * d`` (``d``: NIXL's and UCX's work per
    descriptor, paid one after another); a staged one moves the bytes in one or two descriptors at a
    fraction ``s`` of the link (gather, WRITE and scatter), plus a fixed extra latency ``f``. Direct
    wins while ``descriptors * d < bytes / link * (1/s - 1) + f``, hence ``per_mib = MiB / link *
    (1/s - 1) / d`` and ``per_chunk = f / d``. The figures behind :data:`GPU_CROSSOVER` and
    :data:`CPU_CROSSOVER` are in their docstrings.
    """

    per_mib: float
    """Descriptors the direct plan may spend per MiB it moves."""
    per_chunk: int
    """Descriptors the direct plan may spend on top, whatever the size (small rooms stay direct)."""
    memory: str
    """What the figures were measured on ("gpu", "cpu"): named in the reason."""

    def __post_init__(self) -> None:
        if not self.per_mib >= 0:  # also refuses NaN
            raise ConfigError(f"Crossover.per_mib={self.per_mib!r} must be >= 0")
        if self.per_chunk < 0:
            raise ConfigError(f"Crossover.per_chunk={self.per_chunk!r} must be >= 0")

    def allowed(self, nbytes: int) -> float:
        """Descriptors a direct plan of ``nbytes`` may have and still go direct."""
        return self.per_chunk + self.per_mib * nbytes / (1 << 20)


GPU_CROSSOVER = Crossover(per_mib=0.5, per_chunk=256, memory="gpu")
"""KV in GPU memory (UCX's cuda_ipc between two processes), from figures taken on two H100s (NV18)
until the engine's own A/B is measured (``tools/gpu_e2e.sh pagetables``; docs/PERF.md):

- ``d`` about 4 us: ``python3 tools/nixl_descriptor_probe.py --device cuda --mib 1024 --pieces 32768
  --gapped`` moved 1 GiB in 32 KiB pieces at 8-10 GB/s against 385 GB/s in one piece (3.3-4.1 us a
  piece; about 1 us with ``NIXL_UCX_SGL_ENABLE=1``, 26-41 GB/s: raise ``per_mib`` fourfold there);
- ``s``: the engine's staged path moved 0.37 (one room in flight) to 0.67-0.71 (eight) of raw NIXL,
  so staging adds 1.1-4.6 us per MiB (2.7 us per MiB at 385 GB/s): ``per_mib`` 0.27-1.15, taken 0.5.
  A 1.07 GB room with contiguous pages (128 descriptors, 0.13 per MiB) stays direct; the same room
  over scattered pages (19,949 descriptors, 19.6 per MiB) measured 0.03 of raw direct against 0.71
  staged at eight in flight, and goes staged;
- ``f`` about 1 ms: a small staged room added 2.1 ms over raw NIXL against 1.1-1.8 direct, so
  ``per_chunk`` = 1 ms / 4 us = 256 (a one-page room's 128 descriptors stay direct).
"""

CPU_CROSSOVER = Crossover(per_mib=500.0, per_chunk=1024, memory="cpu")
"""KV in host memory (UCX over shared memory or TCP, the copies made inside ``transfer()``),
measured on the 2-core CPU box (docs/PERF.md):

- ``d`` 2.4-5.6 us: ``.venv/bin/python tools/nixl_descriptor_probe.py --device cpu --mib 32 --pieces
  4096 --gapped`` (and ``--pieces 32768``): 32 MiB in one piece 14-31 ms, in 4,096 pieces 24-52 ms,
  in 32,768 pieces 137-142 ms (including 9.5 ms to prepare the lists);
- ``s`` about 0.25: staging on host memory is two more copies on the same cores (staged 0.19-0.22 of
  raw against direct 0.86-0.96), so staging adds about three copies' time, 1.2-2.7 ms per MiB at
  1.1-2.4 GB/s: ``per_mib`` = 1.2 ms / 2.4 us = 500. Pages of one tensor of at least 2 KiB never
  reach it: on CPU a scattered room stays direct;
- ``per_chunk``: 1024, a small room's few hundred descriptors cost well under its staged copies.
"""


@dataclasses.dataclass(frozen=True)
class PathChoice:
    """The path a room takes under ``path="auto"``, and why (shown in the engine's dump)."""

    path: TransferPath
    reason: str


def choose_path(
    *,
    equal_tp: bool,
    same_pages: bool,
    has_ring: bool,
    host: bool,
    slice_pieces: float,
    num_tensors: int,
    direct_descriptors: int | None,
    nbytes: int,
    crossover: Crossover,
) -> PathChoice:
    """The path ``EngineConfig.path="auto"`` takes for one room (decode side), and the reason.

    The first five arguments as :func:`auto_path`. ``direct_descriptors``: the descriptors the direct
    plan would post for the room (one per KV tensor and run of pages consecutive on both sides;
    ``None`` when its pages are not known yet); ``nbytes``: the bytes it moves to this decode rank;
    ``crossover``: :data:`GPU_CROSSOVER` or :data:`CPU_CROSSOVER` for where the KV lives. Where
    direct applies, it is taken while the descriptors stay within the crossover, else staged (host
    staging with ``host``), else direct all the same when this rank has no ring. Elsewhere as
    :func:`auto_path`. Pure: called once per room.
    """
    if nbytes < 0:
        raise ConfigError(f"nbytes={nbytes} must be >= 0")
    if direct_descriptors is not None and direct_descriptors < 0:
        raise ConfigError(f"direct_descriptors={direct_descriptors} must be >= 0")
    static = auto_path(
        equal_tp=equal_tp, same_pages=same_pages, has_ring=has_ring, host=host,
        slice_pieces=slice_pieces, num_tensors=num_tensors,
    )  # fmt: skip
    if static is not TransferPath.DIRECT:
        why = "unequal TP" if not equal_tp else "unequal page sizes"
        if static is TransferPath.SLICE:
            how = (
                "no staging ring"
                if not has_ring
                else f"{slice_pieces:g} slice pieces per page <= {num_tensors}"
            )
            return PathChoice(static, f"{why}; {how}")
        return PathChoice(static, f"{why}: staged through the ring")
    if direct_descriptors is None:
        return PathChoice(static, "equal TP and pages; pages not known when the path was chosen")
    allowed = crossover.allowed(nbytes)
    cost = f"{direct_descriptors} descriptors for {nbytes / (1 << 20):.1f} MiB"
    limit = f"{crossover.memory} crossover {allowed:.0f}"
    if direct_descriptors <= allowed:
        return PathChoice(TransferPath.DIRECT, f"{cost} <= {limit}")
    if not has_ring:
        return PathChoice(TransferPath.DIRECT, f"{cost} > {limit}, but no staging ring")
    staged = TransferPath.HOST if host else TransferPath.STAGED
    return PathChoice(staged, f"{cost} > {limit}")


def direct_descriptors_at_least(dst_pages: npt.ArrayLike, num_tensors: int) -> int:
    """The fewest descriptors a direct plan into ``dst_pages`` (this decode rank's table, token order)
    can post: one per KV tensor and run of consecutive pages. The prefill's table, which the decode
    does not know when it chooses, can only split runs further."""
    if num_tensors < 1:
        raise ConfigError(f"num_tensors={num_tensors} must be >= 1")
    return int(len(page_runs(dst_pages, dst_pages))) * num_tensors


def choose_kernel(*, enabled: bool, mapped: Sequence[tuple[str, str]]) -> tuple[bool, str]:
    """Whether a decode room takes the kernel path with a prefill instance, and why (the dump's reason).

    ``enabled``: ``EngineConfig.kernel_path`` under ``path="auto"``; ``mapped``: for each prefill rank
    of the instance, ``(how, why_not)`` from its ``PeerHelloAck`` (``how`` empty: that rank did not map
    this rank's pool, for ``why_not``). Taken only when every rank mapped it: one rank that cannot
    copy would leave its heads to NIXL, and a room has one path. Pure.
    """
    if not enabled:
        return False, "kernel path off"
    if not mapped:
        return False, "no prefill rank"
    missing = [(rank, why) for rank, (how, why) in enumerate(mapped) if not how]
    if missing:
        rank, why = missing[0]
        return False, f"kernel path: prefill rank {rank} did not map this pool: {why or 'no reason given'}"
    hows = sorted({how for how, _ in mapped})
    return True, f"one host: every prefill rank mapped this pool ({', '.join(hows)})"
