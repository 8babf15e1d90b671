"""Which KV heads go where: the one head-assignment function every transfer path uses.

A model has ``H`` KV heads. With tensor parallelism ``tp`` a rank holds ``H // tp`` consecutive heads
when ``tp <= H``; when ``tp > H`` heads are replicated and rank ``r`` holds the single head
``r // (tp // H)``. Decode rank ``d`` needs ``need(d) = owned_heads(H, D, d)``; prefill rank ``p``
owns ``own(p) = owned_heads(H, P, p)``. The writers of ``d`` are, for each distinct prefill head
group intersecting ``need(d)``, exactly one owner rank; each sends ``I = need(d) ∩ own(p)``.

MLA has one latent per token that every rank holds whole: decode rank ``d`` gets it from exactly one
prefill rank, ``d % P``.

Everything here is pure and cheap; callers compute the assignment once per peer at registration.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from transfer_engine.errors import ConfigError, HeadSplitError

__all__ = [
    "HeadSlice",
    "head_assignment",
    "heads_per_rank",
    "owned_heads",
    "targets_of",
    "validate_split",
    "writers_of",
]


@dataclass(frozen=True, slots=True)
class HeadSlice:
    """What one prefill rank writes to one decode rank: ``num_heads`` consecutive local heads.

    The prefill rank's local heads ``[src_head_start, src_head_start + num_heads)`` land at the decode
    rank's local heads ``[dst_head_start, dst_head_start + num_heads)``. For MLA the slice is
    ``(p, 0, 0, 1)``: the whole latent.
    """

    prefill_rank: int
    src_head_start: int
    dst_head_start: int
    num_heads: int


def _check_positive(num_heads: int, prefill_tp: int, decode_tp: int) -> None:
    for name, value in (("H", num_heads), ("P", prefill_tp), ("D", decode_tp)):
        if value < 1:
            raise HeadSplitError(num_heads, prefill_tp, decode_tp, f"{name}={value} must be >= 1")


def validate_split(num_heads: int, prefill_tp: int, decode_tp: int) -> None:
    """Check that a head assignment exists for ``(H, P, D)`` (non-MLA).

    Raises :class:`HeadSplitError` (its message names H, P and D) when any value is below 1, or when
    for P or for D neither of H and the TP size divides the other.
    """
    _check_positive(num_heads, prefill_tp, decode_tp)
    for name, tp in (("P", prefill_tp), ("D", decode_tp)):
        if num_heads % tp != 0 and tp % num_heads != 0:
            raise HeadSplitError(
                num_heads,
                prefill_tp,
                decode_tp,
                f"neither H={num_heads} nor {name}={tp} divides the other",
            )


def _validate(num_heads: int, prefill_tp: int, decode_tp: int, mla: bool) -> None:
    if mla:
        _check_positive(num_heads, prefill_tp, decode_tp)
    else:
        validate_split(num_heads, prefill_tp, decode_tp)


def heads_per_rank(num_heads: int, tp: int) -> int:
    """Number of KV heads a rank holds locally: ``H // tp`` if ``tp <= H``, else 1 (replicated).

    Assumes ``(H, tp)`` was validated; raises :class:`ConfigError` if either is below 1.
    """
    if num_heads < 1 or tp < 1:
        raise ConfigError(f"heads_per_rank needs H >= 1 and tp >= 1, got H={num_heads}, tp={tp}")
    return num_heads // tp if tp <= num_heads else 1


def owned_heads(num_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """Global head interval ``[start, stop)`` held by ``rank`` of a TP group of size ``tp``.

    If ``tp <= H`` the rank holds ``[rank * H/tp, (rank+1) * H/tp)``; if ``tp > H`` it holds the single
    head ``rank // (tp // H)``. Raises :class:`ConfigError` naming the values when ``rank`` is outside
    ``[0, tp)`` or when neither of ``H`` and ``tp`` divides the other.
    """
    if num_heads < 1 or tp < 1:
        raise ConfigError(f"owned_heads needs H >= 1 and tp >= 1, got H={num_heads}, tp={tp}")
    if num_heads % tp != 0 and tp % num_heads != 0:
        raise ConfigError(f"owned_heads: neither H={num_heads} nor tp={tp} divides the other")
    if not 0 <= rank < tp:
        raise ConfigError(f"rank {rank} out of range for tp={tp} (valid: 0..{tp - 1})")
    if tp <= num_heads:
        per = num_heads // tp
        return rank * per, (rank + 1) * per
    head = rank // (tp // num_heads)
    return head, head + 1


@functools.lru_cache(maxsize=1024)  # pure and immutable; asked for on every room (errors not cached)
def writers_of(
    num_heads: int, prefill_tp: int, decode_tp: int, decode_rank: int, mla: bool = False
) -> tuple[HeadSlice, ...]:
    """The prefill ranks that write to ``decode_rank``, and what each writes; sorted by ``dst_head_start``.

    For each distinct prefill head group intersecting ``need(decode_rank)`` there is exactly one
    writer. When prefill heads are replicated (``P > H``, ``replicas = P // H``) the writer of head
    group ``g`` is ``g * replicas + decode_rank % replicas``, so decode ranks spread over the replicas.
    The slices of one decode rank cover its local heads exactly once.

    MLA: exactly one writer, ``HeadSlice(decode_rank % P, 0, 0, 1)``; ``num_heads`` is ignored apart
    from having to be >= 1, and P and D need not divide each other.

    Raises :class:`HeadSplitError` for an invalid ``(H, P, D)`` and :class:`ConfigError` when
    ``decode_rank`` is outside ``[0, D)``.
    """
    _validate(num_heads, prefill_tp, decode_tp, mla)
    if not 0 <= decode_rank < decode_tp:
        raise ConfigError(
            f"decode rank {decode_rank} out of range for D={decode_tp} (valid: 0..{decode_tp - 1})"
        )
    if mla:
        return (HeadSlice(decode_rank % prefill_tp, 0, 0, 1),)

    need_start, need_stop = owned_heads(num_heads, decode_tp, decode_rank)
    if prefill_tp <= num_heads:
        per = num_heads // prefill_tp
        replicas = 1
    else:
        per = 1
        replicas = prefill_tp // num_heads
    # Head groups are the disjoint intervals [g*per, (g+1)*per); those meeting need(d) are consecutive.
    first_group = need_start // per
    last_group = (need_stop - 1) // per
    slices = []
    for group in range(first_group, last_group + 1):
        own_start, own_stop = group * per, (group + 1) * per
        start, stop = max(need_start, own_start), min(need_stop, own_stop)
        prefill_rank = group * replicas + decode_rank % replicas
        slices.append(HeadSlice(prefill_rank, start - own_start, start - need_start, stop - start))
    return tuple(slices)


@functools.lru_cache(maxsize=1024)  # pure and immutable; every TransferRequest needs it
def head_assignment(
    num_heads: int, prefill_tp: int, decode_tp: int, mla: bool = False
) -> tuple[tuple[HeadSlice, ...], ...]:
    """``writers_of`` for every decode rank: element ``d`` is the writers of decode rank ``d``.

    Raises :class:`HeadSplitError` for an invalid ``(H, P, D)`` (for MLA: any value below 1).
    """
    _validate(num_heads, prefill_tp, decode_tp, mla)
    return tuple(writers_of(num_heads, prefill_tp, decode_tp, d, mla) for d in range(decode_tp))


def targets_of(
    num_heads: int, prefill_tp: int, decode_tp: int, prefill_rank: int, mla: bool = False
) -> dict[int, HeadSlice]:
    """The decode ranks ``prefill_rank`` writes to: ``{decode_rank: slice it writes there}``.

    A decode rank absent from the dict receives nothing from this prefill rank (another replica, or
    another head group, serves it). A prefill rank writes at most one slice to any decode rank.
    Raises :class:`ConfigError` when ``prefill_rank`` is outside ``[0, P)``.
    """
    _validate(num_heads, prefill_tp, decode_tp, mla)
    if not 0 <= prefill_rank < prefill_tp:
        raise ConfigError(
            f"prefill rank {prefill_rank} out of range for P={prefill_tp} (valid: 0..{prefill_tp - 1})"
        )
    targets: dict[int, HeadSlice] = {}
    for decode_rank, slices in enumerate(head_assignment(num_heads, prefill_tp, decode_tp, mla)):
        for head_slice in slices:
            if head_slice.prefill_rank == prefill_rank:
                targets[decode_rank] = head_slice
    return targets
