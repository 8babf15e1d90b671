"""Layer-wise sending, sans-IO: which layers of which chunk are ready, sent and landed.

A layer-wise chunk is opened with its pages (``Sender.begin_chunk``) and its KV then becomes ready
layer range by layer range while the prefill's forward goes on (``Sender.layers_ready(a, b)``).
Ranges of one chunk come in layer order, back to back, and the one that reaches ``num_layers``
closes the chunk. The engine posts one WRITE per *layer group*: consecutive ready ranges gathered
until they hold at least ``layers_per_write`` layers (or close the chunk).

- :class:`LayerChunks` (prefill handle): validates each ready range and cuts the groups.
- :class:`ChunkCut` (prefill room): a whole chunk (``send()``) written as layer groups on its own, by
  path, so that on a staging path one group's gather, WRITE and scatter overlap the next one's.
- :class:`LayerTally` (prefill room: groups written per decode rank; decode room: groups landed per
  writer): a chunk is complete for a key once its groups cover every layer exactly once.
- :func:`group_tensors`, :func:`group_tensor_runs` and :func:`group_block_runs`: which KV tensors a
  group moves, and where its bytes lie inside a writer's staged block (``protocol/staging.py``
  layout): the prefill gathers a group into its part of the block, the decode scatters it from there.

Nothing here does I/O or reads a clock; bad input raises a typed error naming the value and
changes nothing.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np
import numpy.typing as npt

from transfer_engine.errors import ConfigError, LocalProtocolError, RemoteProtocolError

__all__ = [
    "CUT_PATHS",
    "ChunkCut",
    "LayerChunks",
    "LayerGroup",
    "LayerTally",
    "check_layers_per_write",
    "group_block_runs",
    "group_tensor_runs",
    "group_tensors",
]


CUT_PATHS = frozenset({"host", "staged"})
"""The paths on which :class:`ChunkCut` may write a whole chunk as layer groups."""


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def check_layers_per_write(layers_per_write: object) -> int:
    """``layers_per_write`` as an int >= 1, or :class:`ConfigError` naming it."""
    if not _is_int(layers_per_write) or int(layers_per_write) < 1:  # type: ignore[call-overload]
        raise ConfigError(f"layers_per_write={layers_per_write!r} must be an integer >= 1")
    return int(layers_per_write)  # type: ignore[call-overload]


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Layers ``[start, end)`` of chunk ``chunk_id``, moved by one WRITE per decode rank.

    ``closes``: the group reaches the last layer, so the chunk is complete once it is written.
    """

    chunk_id: int
    start: int
    end: int
    closes: bool

    @property
    def layers(self) -> tuple[int, int]:
        return (self.start, self.end)


@dataclass(frozen=True, slots=True)
class ChunkCut:
    """When a prefill room writes a whole chunk to one decode rank as layer groups on its own.

    ``per_path`` is the table: a chunk of at least ``min_bytes`` on this rank, written on a path it
    names, goes as groups of that many layers (the last one shorter); a path it does not name, or
    names with 0, gets the chunk whole. Only the staging paths (:data:`CUT_PATHS`) may be cut: there
    a group's gather, WRITE and the decode's scatter overlap with the next group's; on the direct
    and slice paths a group's control work costs more than its copy saves. The room decides once the
    decode's request names the path, which ``send()`` cannot know (``EngineConfig.host_pipeline_layers``
    and ``staged_pipeline_layers``; docs/DECISIONS.md). Pure."""

    per_path: Mapping[str, int] = field(default_factory=dict)
    min_bytes: int = 0

    def __post_init__(self) -> None:
        table = dict(self.per_path)
        for path, per in table.items():
            if path not in CUT_PATHS:
                raise ConfigError(f"path={path!r} is not one a chunk is cut on (one of {sorted(CUT_PATHS)})")
            if not _is_int(per) or per < 0:
                raise ConfigError(f"per_path[{path!r}]={per!r} must be an integer >= 0 (0: whole)")
        if not _is_int(self.min_bytes) or self.min_bytes < 0:
            raise ConfigError(f"min_bytes={self.min_bytes!r} must be an integer >= 0")
        object.__setattr__(self, "per_path", MappingProxyType({p: int(n) for p, n in table.items()}))

    def per_group(self, path: str) -> int:
        """Layers per group on ``path``; 0: whole."""
        return self.per_path.get(path, 0)

    def groups(self, chunk_id: int, num_layers: int, nbytes: int, path: str) -> list[LayerGroup] | None:
        """The groups chunk ``chunk_id`` (``nbytes`` on this rank) is written as on ``path``, or None:
        whole (a path not cut, too small, or groups that would be the whole chunk)."""
        per = self.per_group(path)
        if not per or per >= num_layers or nbytes < self.min_bytes:
            return None
        return [
            LayerGroup(chunk_id, start, min(start + per, num_layers), start + per >= num_layers)
            for start in range(0, num_layers, per)
        ]


@dataclass
class LayerChunks:
    """The prefill handle's view of one room's layer-wise chunks (one open at a time).

    ``open(chunk_id)`` starts a chunk; ``ready(start, end)`` records that layers ``[start, end)`` of
    it are written and returns the groups to post now (none, or one). A range must start where the
    previous one ended (the first at 0) and end in ``(start, num_layers]``.
    """

    num_layers: int
    layers_per_write: int
    chunk_id: int | None = None
    """The open chunk, or None (none opened yet, or the last one closed)."""
    next_layer: int = 0
    """The first layer of the open chunk not reported ready."""
    group_start: int = 0
    """The first layer of the open chunk not in a group yet."""
    closed: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if not _is_int(self.num_layers) or self.num_layers < 1:
            raise ConfigError(f"num_layers={self.num_layers!r} must be an integer >= 1")
        self.layers_per_write = check_layers_per_write(self.layers_per_write)

    @property
    def is_open(self) -> bool:
        return self.chunk_id is not None

    def check_open(self, chunk_id: int) -> None:
        """LocalProtocolError when chunk ``chunk_id`` may not be opened now (another one is open)."""
        if self.chunk_id is not None:
            raise LocalProtocolError(
                f"chunk {self.chunk_id} is still open at layer {self.next_layer} of {self.num_layers}: "
                f"its layers must all be ready before chunk {chunk_id} begins"
            )
        if chunk_id in self.closed:
            raise LocalProtocolError(f"chunk {chunk_id} was already sent")

    def open(self, chunk_id: int) -> None:
        """Start chunk ``chunk_id`` at layer 0 (after :meth:`check_open`)."""
        self.check_open(chunk_id)
        self.chunk_id = chunk_id
        self.next_layer = 0
        self.group_start = 0

    def check_ready(self, start: object, end: object) -> None:
        """The error ``ready(start, end)`` would raise, or nothing; changes nothing.

        ConfigError for non-integers or a range outside ``[0, num_layers]`` or empty;
        LocalProtocolError when no chunk is open or the range does not start where the last ended.
        """
        if not _is_int(start) or not _is_int(end):
            raise ConfigError(f"layers [{start!r}, {end!r}) must be integers")
        a, b = int(start), int(end)  # type: ignore[call-overload]
        if not 0 <= a < b <= self.num_layers:
            raise ConfigError(
                f"layers [{a}, {b}) must satisfy 0 <= start < end <= num_layers={self.num_layers}"
            )
        if self.chunk_id is None:
            closed = f" (chunk {max(self.closed)} closed)" if self.closed else ""
            raise LocalProtocolError(f"layers [{a}, {b}) but no layer-wise chunk is open{closed}")
        if a != self.next_layer:
            kind = "overlap layers already ready" if a < self.next_layer else "skip layers"
            raise LocalProtocolError(
                f"layers [{a}, {b}) of chunk {self.chunk_id} {kind}: the next range must start at "
                f"layer {self.next_layer}"
            )

    def ready(self, start: int, end: int) -> LayerGroup | None:
        """Layers ``[start, end)`` of the open chunk are written; the group to post now, if any."""
        self.check_ready(start, end)
        chunk_id = self.chunk_id
        assert chunk_id is not None
        self.next_layer = int(end)
        closes = self.next_layer == self.num_layers
        if not closes and self.next_layer - self.group_start < self.layers_per_write:
            return None
        group = LayerGroup(chunk_id, self.group_start, self.next_layer, closes)
        self.group_start = self.next_layer
        if closes:
            self.closed.add(chunk_id)
            self.chunk_id = None
        return group


@dataclass
class LayerTally:
    """Layer groups done per key (a ``(chunk, decode rank)`` or ``(writer, chunk)``), for one room.

    :meth:`add` records layers ``[start, end)`` of a key and says whether the key now covers every
    layer. Groups may come in any order (WRITEs are not ordered); a range out of bounds, overlapping
    one already recorded, or added to a complete key raises ``error`` (RemoteProtocolError by
    default: on the decode side the ranges come from the wire) and records nothing.
    """

    num_layers: int
    error: type[Exception] = RemoteProtocolError
    _ranges: dict[Hashable, list[tuple[int, int]]] = field(default_factory=dict)
    _complete: set[Hashable] = field(default_factory=set)

    def __post_init__(self) -> None:
        if not _is_int(self.num_layers) or self.num_layers < 1:
            raise ConfigError(f"num_layers={self.num_layers!r} must be an integer >= 1")

    def has(self, key: Hashable, start: int, end: int) -> bool:
        """Whether exactly ``[start, end)`` is recorded for ``key`` (a repeated notification)."""
        return key in self._complete or (start, end) in self._ranges.get(key, ())

    def complete(self, key: Hashable) -> bool:
        return key in self._complete

    def partial(self, key: Hashable) -> bool:
        """Some but not every layer of ``key`` is recorded."""
        return key in self._ranges

    def partial_keys(self) -> list[Hashable]:
        """The keys with some but not every layer recorded."""
        return list(self._ranges)

    def layers(self, key: Hashable) -> int:
        """How many layers of ``key`` are recorded."""
        if key in self._complete:
            return self.num_layers
        return sum(b - a for a, b in self._ranges.get(key, ()))

    def add(self, key: Hashable, start: int, end: int) -> bool:
        """Record layers ``[start, end)`` of ``key``; True when ``key`` now covers every layer."""
        if not 0 <= start < end <= self.num_layers:
            raise self.error(
                f"layers [{start}, {end}) of {key} must satisfy 0 <= start < end <= {self.num_layers}"
            )
        if key in self._complete:
            raise self.error(f"layers [{start}, {end}) of {key}, which already has every layer")
        ranges = self._ranges.get(key, [])
        for a, b in ranges:
            if start < b and a < end:
                raise self.error(
                    f"layers [{start}, {end}) of {key} overlap layers [{a}, {b}) recorded before"
                )
        ranges = [*ranges, (start, end)]
        if sum(b - a for a, b in ranges) == self.num_layers:
            self._ranges.pop(key, None)
            self._complete.add(key)
            return True
        self._ranges[key] = ranges
        return False


def group_tensors(num_layers: int, mla: bool, start: int, end: int) -> npt.NDArray[np.int64]:
    """Indices of the KV tensors of layers ``[start, end)`` in the ``[K_0..K_{L-1}, V_0..V_{L-1}]``
    order (``[C_0..C_{L-1}]`` for MLA): K of each layer, then V of each layer."""
    if not 0 <= start < end <= num_layers:
        raise ConfigError(f"layers [{start}, {end}) must satisfy 0 <= start < end <= num_layers={num_layers}")
    layers = np.arange(start, end, dtype=np.int64)
    return layers if mla else np.concatenate([layers, layers + num_layers])


def group_tensor_runs(num_layers: int, mla: bool, start: int, end: int) -> list[tuple[int, int]]:
    """The tensors of layers ``[start, end)`` as runs of consecutive tensor indices ``(first, count)``:
    the K layers, then the V layers (one run for MLA). A writer's staged block holds its tensors in
    index order, so each run is one contiguous part of it, at ``first * tensor_bytes``."""
    if not 0 <= start < end <= num_layers:
        raise ConfigError(f"layers [{start}, {end}) must satisfy 0 <= start < end <= num_layers={num_layers}")
    runs = [(start, end - start)]
    if not mla:
        runs.append((num_layers + start, end - start))
    return runs


def group_block_runs(
    num_layers: int, mla: bool, tensor_bytes: int, start: int, end: int
) -> list[tuple[int, int, int]]:
    """Where layers ``[start, end)`` lie in a writer's staged block and in their own gather.

    A writer's block holds its head slice of every tensor in tensor order, ``tensor_bytes`` per
    tensor (``protocol/staging.py``). A group gathers its own tensors (:func:`group_tensors` order)
    back to back; returns ``(offset in the group's gather, offset in the block, bytes)`` runs: the
    K layers and the V layers (one run for MLA).
    """
    if tensor_bytes < 1:
        raise ConfigError(f"tensor_bytes={tensor_bytes} must be >= 1")
    tensors = group_tensors(num_layers, mla, start, end)
    count = end - start
    runs = [(0, start * tensor_bytes, count * tensor_bytes)]
    if not mla:
        runs.append((count * tensor_bytes, (num_layers + start) * tensor_bytes, count * tensor_bytes))
    assert sum(r[2] for r in runs) == tensors.size * tensor_bytes
    return runs
