"""Whether a prefill room may serve a decode rank's TransferRequest, and what a landed chunk must match.

Pure decisions, no I/O: the room actors (:mod:`transfer_engine.actors.room`) call them with what
they know and raise the :class:`~transfer_engine.errors.ProtocolError` these return or raise, which
fails the room with reason PROTOCOL.
"""

from __future__ import annotations

from dataclasses import dataclass

from transfer_engine.errors import ProtocolError
from transfer_engine.protocol import heads
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.paths import TransferPath, is_staged

__all__ = ["Asker", "HeldRegion", "Writer", "check_landed", "check_request"]


@dataclass(frozen=True, slots=True)
class Writer:
    """The prefill rank that judges a request: its heads, TP size and rank."""

    num_heads: int
    tp_size: int
    rank: int
    mla: bool


@dataclass(frozen=True, slots=True)
class Asker:
    """What the decode rank that sent a request said of itself in its PeerHello."""

    rank: int
    tp_size: int
    num_pages: int
    ring_bytes: int | None
    """The size of its staging ring; None when it registered none."""


def check_request(req: m.TransferRequest, asker: Asker, writer: Writer) -> m.SliceSpec | None:
    """The slice ``writer`` is to send for ``req`` (None: it writes nothing to that decode rank).

    Raises ProtocolError naming the bad field when the request contradicts the asker's PeerHello,
    asks for other heads than the head split gives, names a path this engine does not serve, a
    staged path without a ring, a ring region it cannot use, or a page outside the asker's pool.
    """
    if (req.decode_tp, req.decode_rank) != (asker.tp_size, asker.rank):
        raise ProtocolError(
            f"TransferRequest says decode rank {req.decode_rank} of {req.decode_tp}, but agent "
            f"{req.agent} said rank {asker.rank} of {asker.tp_size} in its PeerHello"
        )
    expected = heads.targets_of(writer.num_heads, writer.tp_size, req.decode_tp, writer.rank, writer.mla).get(
        req.decode_rank
    )
    got = req.slices[0] if req.slices else None
    if len(req.slices) > 1 or (expected is None) != (got is None):
        raise ProtocolError(
            f"decode rank {req.decode_rank} asked for slices {req.slices}, expected {expected}"
        )
    if got is not None and expected is not None:
        if (got.src_head_start, got.dst_head_start, got.num_heads) != (
            expected.src_head_start,
            expected.dst_head_start,
            expected.num_heads,
        ):
            raise ProtocolError(f"decode rank {req.decode_rank} asked for {got}, expected {expected}")
    if TransferPath.parse(req.path) is None:
        raise ProtocolError(f"path {req.path!r} is not served by this engine")
    if is_staged(req.path) and got is not None and asker.ring_bytes is None:
        raise ProtocolError(f"path {req.path!r} but decode rank {req.decode_rank} registered no staging ring")
    first = req.first_region
    if first is not None:
        if not is_staged(req.path) or got is None:
            why = "this rank writes nothing there" if got is None else "the path is not staged"
            raise ProtocolError(
                f"decode rank {req.decode_rank} granted ring region {first.alloc_id} with its request on "
                f"path {req.path!r}, but {why}"
            )
        assert asker.ring_bytes is not None
        if (
            first.offset + first.length > asker.ring_bytes
            or first.writer_offset + first.writer_bytes > first.length
        ):
            raise ProtocolError(
                f"decode rank {req.decode_rank} granted {first} with the request: outside its ring of "
                f"{asker.ring_bytes} bytes"
            )
    pages = req.pages
    if pages.size and (int(pages.min()) < 0 or int(pages.max()) >= asker.num_pages):
        bad = pages[(pages < 0) | (pages >= asker.num_pages)]
        raise ProtocolError(f"decode page {int(bad[0])} outside [0, {asker.num_pages})")
    return got


@dataclass(frozen=True, slots=True)
class HeldRegion:
    """The ring region a staged decode room holds for a chunk."""

    alloc_id: int
    page_start: int
    num_pages: int
    ahead: bool
    """Granted with the request: its pages are known only once the chunk lands."""


def check_landed(mail: m.ChunkLanded, path: str, held: HeldRegion | None) -> bool:
    """Whether a chunk that landed fits where the decode room expects it; True when it landed in
    the region granted with the request (whose pages the room learns from ``mail``).

    ``held`` is the region the room holds for ``mail.chunk_id`` on a staged ``path``. Raises
    ProtocolError for a chunk in another region (or in none the room holds), for other pages than
    its region holds, or in a ring region on a path that uses none.
    """
    chunk_id, sender, region = mail.chunk_id, mail.sender, mail.region
    if not is_staged(path):
        if region != -1:
            raise ProtocolError(f"chunk {chunk_id} landed in ring region {region} on the {path} path")
        return False
    if held is None or held.alloc_id != region:
        raise ProtocolError(
            f"chunk {chunk_id} from prefill rank {sender} landed in region {region}, "
            f"but the room holds {None if held is None else held.alloc_id}"
        )
    if held.ahead:
        return True
    if (held.page_start, held.num_pages) != (mail.page_start, mail.num_pages):
        raise ProtocolError(
            f"chunk {chunk_id} from prefill rank {sender} landed pages [{mail.page_start}, "
            f"+{mail.num_pages}), its region holds [{held.page_start}, +{held.num_pages})"
        )
    return False
