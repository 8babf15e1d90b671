"""End-to-end integrity of a chunk's bytes: what is checksummed, and what a comparison decides.

Pure (docs/INTEGRITY.md). The checksum itself (``transfer_engine.kernels.checksum``) is a
position-weighted sum of 32-bit words over a chunk's **gather layout**: ``[T, tokens, num_heads,
head_dim]`` over the tensors its WRITE carries (every layer's K then V, or one layer group's
``[K_a..K_b, V_a..V_b]``), the chunk's tokens (``actors.worker.plan.chunk_slots``) and the writer's
head slice. The prefill takes it once the bytes are final, starts the WRITE once it is known, and
carries it in ``ChunkLanded.checksum``; the decode takes it over the bytes that landed, and the
chunk counts only once they match. Sums over parts add (each part's words at their offset in the whole), which is how a
layer group's two runs of a staged block (its K tensors, then its V tensors) are checked.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "MASK64",
    "WORD",
    "Run",
    "Verdict",
    "combine",
    "mismatch_detail",
    "staged_runs",
    "verdict",
]

WORD = 4
"""Bytes per checksummed word (``kernels.checksum.WORD``)."""
MASK64 = (1 << 64) - 1


class Verdict(enum.Enum):
    """What the decode concludes of one landed chunk (or layer group) of one writer."""

    MATCH = "match"
    """The landed bytes sum to what the writer carried: the chunk counts."""
    MISMATCH = "mismatch"
    """They do not: the room fails with ``FailureReason.INTEGRITY``; the chunk never counts."""
    UNCHECKED = "unchecked"
    """Nothing to compare: the writer carried no checksum (its ``integrity`` is off) or this
    side's is off. The chunk counts, and the engine counts it unchecked."""


def verdict(carried: int | None, landed: int | None) -> Verdict:
    """Compare a writer's ``carried`` checksum with the one over the ``landed`` bytes (None: not taken)."""
    if carried is None or landed is None:
        return Verdict.UNCHECKED
    return Verdict.MATCH if carried & MASK64 == landed & MASK64 else Verdict.MISMATCH


def combine(parts: Iterable[int]) -> int:
    """The checksum of a whole from its parts' (each taken with its words' offset in the whole)."""
    return sum(parts) & MASK64


@dataclass(frozen=True)
class Run:
    """A contiguous byte range to checksum: ``length`` bytes at ``offset``, word ``start`` of the whole."""

    offset: int
    length: int
    start: int


def staged_runs(
    block_offset: int,
    tensor_bytes: int,
    num_tensors: int,
    tensor_runs: Sequence[tuple[int, int]] | None,
) -> list[Run]:
    """The byte ranges of a staged region that hold one writer's landed chunk or layer group.

    ``block_offset``: the writer's block in the region; ``tensor_bytes``: one tensor's part of the
    block (``tokens * num_heads * head_dim * itemsize``); ``num_tensors``: tensors per block;
    ``tensor_runs``: a layer group's ``(first tensor, count)`` runs (``protocol.layers.
    group_tensor_runs``), or None for the whole block. Raises ValueError for ranges that are not
    whole words or runs outside the block.
    """
    if tensor_bytes % WORD or block_offset % WORD:
        raise ValueError(
            f"block at {block_offset} with {tensor_bytes} bytes per tensor is not whole {WORD}-byte words"
        )
    if tensor_runs is None:
        return [Run(block_offset, num_tensors * tensor_bytes, 0)]
    runs, start = [], 0
    for first, count in tensor_runs:
        if first < 0 or count < 1 or first + count > num_tensors:
            raise ValueError(f"tensor run ({first}, {count}) is outside the block's {num_tensors} tensors")
        runs.append(Run(block_offset + first * tensor_bytes, count * tensor_bytes, start))
        start += count * tensor_bytes // WORD
    return runs


def mismatch_detail(
    chunk_id: int, sender: int, layers: tuple[int, int] | None, carried: int, landed: int
) -> str:
    """The failure detail of a mismatch: which bytes, from whom, and both sums."""
    what = f"chunk {chunk_id}" if layers is None else f"layers [{layers[0]}, {layers[1]}) of chunk {chunk_id}"
    return (
        f"integrity: {what} from prefill rank {sender} landed with checksum {landed & MASK64:#018x}, "
        f"the writer's was {carried & MASK64:#018x}"
    )
