"""Every control message and NIXL notification of the wire protocol, in one tagged union.

All messages are frozen msgspec Structs encoded with msgpack as arrays (``array_like``): the first
element is the tag (the class name), the last the protocol version. One decoder, built once, turns
bytes into a :data:`Message` or raises :class:`~transfer_engine.errors.RemoteProtocolError`; it is
the only way bytes from a peer become objects. Nothing here pickles.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Annotated

import msgspec
import numpy as np
import numpy.typing as npt

from transfer_engine.errors import FailureReason, RemoteProtocolError

PROTOCOL_VERSION = 4
"""Bumped on any incompatible change to a message below (3: ``ChunkLanded.checksum``, docs/INTEGRITY.md;
4: ``TransferRequest.dst_pages`` as int32 bytes)."""

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
"""Default size limit of one encoded control message (page lists of very long requests fit)."""

MAX_NOTIF_BYTES = 4096
"""Size limit of one NIXL notification (they are small, fixed-shape structs)."""


class _Base(msgspec.Struct, frozen=True, array_like=True):
    pass


class KVStrides(_Base, frozen=True):
    """Where the entries of one KV tensor (K or V of a layer, or an MLA latent) live in memory.

    Head ``h`` of token ``n`` of block (page) ``b`` starts ``offset + b * block + h * head + n *
    token`` bytes past the start of registered region ``region``, and its ``head_dim`` elements are
    contiguous. Any of the serving systems' layouts is a set of these (``transfer_engine.memory.layout``).
    """

    region: Annotated[int, msgspec.Meta(ge=0, le=(1 << 31) - 1)]
    offset: Annotated[int, msgspec.Meta(ge=0, le=(1 << 62))]
    block: Annotated[int, msgspec.Meta(ge=0, le=(1 << 62))]
    head: Annotated[int, msgspec.Meta(ge=0, le=(1 << 62))]
    token: Annotated[int, msgspec.Meta(ge=0, le=(1 << 62))]


class LayoutInfo(_Base, frozen=True):
    """A rank's KV layout as its peers see it."""

    num_layers: int
    num_heads: int
    """Total KV heads of the model (unsharded); 1 for MLA."""
    head_dim: int
    """Per-head width in elements; the latent width for MLA."""
    dtype: str
    """torch dtype name without the ``torch.`` prefix, e.g. ``bfloat16``."""
    page_size: int
    mla: bool
    num_pages: int
    aux_item_bytes: int = 0
    num_aux_slots: int = 0
    strides: list[KVStrides] | None = None
    """One entry per KV tensor, in tensor order, where the rank's KV is not the contiguous
    ``[num_slots, heads_local, head_dim]`` tensor per K and V (``regions`` are then the memory the
    views live in); None for that contiguous layout."""

    @property
    def num_kv_tensors(self) -> int:
        return self.num_layers if self.mla else 2 * self.num_layers


U63 = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
"""An address or length: non-negative and below 2**63, so ``addr + length`` fits NIXL's uint64
descriptors; anything else fails decoding."""


class MemRegion(_Base, frozen=True):
    """One registered memory range: ``(addr, length, device)`` as NIXL describes memory."""

    addr: U63
    length: U63
    device: Annotated[int, msgspec.Meta(ge=0, le=(1 << 31) - 1)]

    @property
    def end(self) -> int:
        return self.addr + self.length

    def contains(self, addr: int, length: int) -> bool:
        return self.addr <= addr and addr + length <= self.end


class RankInfo(_Base, frozen=True):
    rank: int
    endpoint: str


class SliceSpec(_Base, frozen=True):
    """The heads one writer sends to one decode rank (see ``protocol.heads.HeadSlice``)."""

    prefill_rank: int
    src_head_start: int
    dst_head_start: int
    num_heads: int


class SharedMemory(_Base, frozen=True):
    """One allocation a decode rank's pool lives in, exported for the kernel path (``memory/ipc.py``):
    a CUDA IPC handle of a device allocation, or a shared-memory file of a host one."""

    handle: Annotated[bytes, msgspec.Meta(max_length=64)]
    """CUDA: the allocation's 64-byte ``CUipcMemHandle``; host memory: empty."""
    path: Annotated[str, msgspec.Meta(max_length=4096)]
    """Host memory: a path the peer opens to map the file (``/dev/shm/...``, ``/proc/<pid>/fd/<n>``); CUDA: empty."""
    size: U63
    """Bytes of the allocation (CUDA) or of the file (host)."""
    file_id: tuple[int, int] = (0, 0)
    """Host memory: the file's ``(st_dev, st_ino)``, checked by the peer after opening ``path``."""


class SharedRegion(_Base, frozen=True):
    """Where one registered region (``PeerHello.regions[i]``) lies in an exported allocation."""

    memory: Annotated[int, msgspec.Meta(ge=0, le=(1 << 31) - 1)]
    """Index into ``PoolShare.memories``."""
    offset: U63


class PoolShare(_Base, frozen=True):
    """A decode rank's pool exported once at the handshake, for a prefill rank of the same host to map
    and copy into with one kernel (docs/DECISIONS.md, "One kernel between the GPUs of a host")."""

    kind: str
    """``cuda_ipc`` or ``shm``."""
    host: Annotated[str, msgspec.Meta(max_length=512)]
    """The exporter's host: hostname and boot id (``memory.ipc.host_id``)."""
    pid: int
    device: Annotated[bytes, msgspec.Meta(max_length=16)]
    """CUDA: the UUID of the GPU the pool is on; host memory: empty."""
    memories: list[SharedMemory]
    regions: list[SharedRegion]
    """One per ``PeerHello.regions`` entry, in order."""


class Message(msgspec.Struct, frozen=True, tag=True, array_like=True, kw_only=True):
    """Base of every message; ``v`` is the protocol version and travels last."""

    v: int = PROTOCOL_VERSION


# --- bootstrap ---------------------------------------------------------------------------------


class RegisterRank(Message, frozen=True):
    """prefill rank -> bootstrap: announce a rank, its control endpoint and its layout."""

    rank: int
    tp_size: int
    endpoint: str
    layout: LayoutInfo
    compat: int


class RegisterAck(Message, frozen=True):
    """bootstrap -> prefill rank: registration accepted, or refused with a reason."""

    ok: bool
    detail: str = ""


class TopologyQuery(Message, frozen=True):
    """decode rank -> bootstrap: which prefill ranks exist, and where."""


class Topology(Message, frozen=True):
    """bootstrap -> decode rank: the prefill ranks registered so far (``complete`` once all are)."""

    tp_size: int
    ranks: list[RankInfo]
    complete: bool


# --- peer handshake -----------------------------------------------------------------------------


class PeerHello(Message, frozen=True):
    """decode rank -> prefill rank: who I am, where my memory is, how my KV is laid out."""

    rank: int
    tp_size: int
    endpoint: str
    agent_name: str
    agent_metadata: bytes
    mem_type: str
    regions: list[MemRegion]
    """The KV tensors, in order K_0..K_{L-1}, V_0..V_{L-1} (or the L MLA latents)."""
    aux: MemRegion | None
    ring: MemRegion | None
    """The staging ring (staged paths), or None when this decode rank has none."""
    ring_mem_type: str
    """NIXL memory type of the ring: "VRAM", or "DRAM" for host staging."""
    layout: LayoutInfo
    compat: int
    share: PoolShare | None = None
    """The pool exported for the kernel path (``memory/ipc.py``); None when not offered, see ``unshared``."""
    unshared: str = ""
    """Why the pool is not exported (the kernel path is off, or its memory cannot be shared)."""


class PeerHelloAck(Message, frozen=True):
    """prefill rank -> decode rank: the same facts about the prefill rank, or a refusal."""

    ok: bool
    detail: str
    rank: int
    tp_size: int
    agent_name: str
    agent_metadata: bytes
    layout: LayoutInfo | None
    compat: int
    mapped: str = ""
    """How this prefill rank mapped the decode's exported pool (``cuda_ipc``, ``shm``, ``process``): the
    kernel path is open to it; empty: not mapped, see ``unmapped``."""
    unmapped: str = ""
    """Why the pool was not mapped (another host, no peer access, the mapping failed...)."""
    scratch: MemRegion | None = None
    """A few MiB of this prefill rank's memory, registered with its agent, that the decode's link
    probe WRITEs into (``transport/probe.py``): never KV. None: no probe target offered."""
    scratch_mem_type: str = ""
    """NIXL memory type of ``scratch`` ("VRAM" or "DRAM")."""
    host: str = ""
    """This prefill rank's host (``memory.ipc.host_id``): the probe names what carried its WRITE by it."""


class PeerLeaving(Message, frozen=True):
    """either way: the sender's engine is closing normally (or refused the link to the receiver): the
    receiver forgets it now, as it would a dead peer but without waiting for its heartbeats to stop,
    and answers :class:`PeerLeavingAck`."""

    agent: str
    """NIXL agent name of the sender: how the receiver finds the peer."""

    rank: int
    side: str
    detail: str


class PeerLeavingAck(Message, frozen=True):
    """answer to :class:`PeerLeaving`: the receiver forgot the sender (or never knew it)."""

    agent: str


# --- per room -------------------------------------------------------------------------------------


class FirstRegion(_Base, frozen=True):
    """A decode ring region granted with the TransferRequest, for the room's chunk 0 (``protocol.staging``,
    "Granted with the request"): sized for ``tokens``, every token the room's pages hold.

    The writer puts its block — ``[num_kv_tensors, chunk tokens, its heads, head_dim]`` — at ``offset +
    writer_offset`` of round ``round``, once the watermark admits it; the block of a chunk of fewer
    tokens is smaller, never larger, than ``writer_bytes``. Its notification names ``alloc_id``.
    """

    alloc_id: U63
    round: U63
    offset: U63
    length: U63
    writer_offset: U63
    writer_bytes: U63
    tokens: U63


class TransferRequest(Message, frozen=True):
    """decode rank -> every prefill rank: where this room's KV goes on that decode rank.

    ``slices`` is what the receiving prefill rank must send to this decode rank; it is empty when the
    prefill rank sends nothing there (it still learns that the room exists and who serves it).
    """

    agent: str
    """NIXL agent name of the sender: how the receiver finds the peer."""

    room: int
    decode_rank: int
    decode_tp: int
    path: str
    dst_pages: bytes
    """The decode pages, in token order, as little-endian int32 (:data:`PAGE_DTYPE`; :attr:`pages`
    reads them): 4 bytes a page instead of msgpack's 1 to 9, encoded and decoded as one block. Given a
    sequence of ints or an array, the constructor packs it (:func:`pack_pages`). Whether they lie in
    the asker's pool is :func:`~transfer_engine.protocol.requests.check_request`'s to judge."""
    aux_slot: int | None
    slices: list[SliceSpec]
    decode_prefix_len: int = 0
    """Tokens of the request the decode rank already holds: ``dst_pages`` start after them, and the
    prefill application sends only the rest (``Sender.decode_prefix_len`` tells it)."""
    first_region: FirstRegion | None = None
    """Staged paths: the ring region of the room's chunk 0, granted with the request (None: chunk 0
    asks with a StagingRequest like every other chunk). Only in a writer's request."""

    def __post_init__(self) -> None:
        if not isinstance(self.dst_pages, bytes):  # built in process from ints (decoding gives bytes)
            msgspec.structs.force_setattr(self, "dst_pages", pack_pages(self.dst_pages))

    @property
    def pages(self) -> npt.NDArray[np.int32]:
        """``dst_pages`` as a read-only int32 array (a view of the bytes, no copy)."""
        return np.frombuffer(self.dst_pages, dtype=PAGE_DTYPE)


PAGE_DTYPE = np.dtype("<i4")
"""How a TransferRequest carries its pages: little-endian int32."""


def pack_pages(pages: Sequence[int] | npt.NDArray[np.integer] | bytes) -> bytes:
    """``pages`` as ``TransferRequest.dst_pages`` carries them. ValueError for a page outside int32
    (no pool has that many pages) or a list that is not 1-D."""
    if isinstance(pages, bytes):
        return pages
    array = np.asarray(pages)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise ValueError(f"pages must be a 1-D sequence of ints, got {array.dtype} of shape {array.shape}")
    if array.size and (int(array.min()) < -(1 << 31) or int(array.max()) >= 1 << 31):
        raise ValueError("pages must fit int32")
    return array.astype(PAGE_DTYPE, copy=False).tobytes()


class StagingRequest(Message, frozen=True):
    """prefill writer -> decode rank: a ring region for chunk ``chunk_id`` of ``room``."""

    agent: str
    """NIXL agent name of the sender: how the receiver finds the peer."""

    room: int
    chunk_id: int
    sender: int
    page_start: int
    num_pages: int
    tokens: int


class StagingGrant(Message, frozen=True, gc=False):
    """decode rank -> prefill writer: write your block at ``offset + writer_offset`` of ``round``."""

    agent: str
    """NIXL agent name of the decode rank that owns the ring."""

    room: int
    chunk_id: int
    alloc_id: int
    round: int
    offset: int
    length: int
    writer_offset: int
    writer_bytes: int


class StagingRefused(Message, frozen=True):
    """decode rank -> prefill writer: the chunk cannot be placed; the room fails with ``detail``."""

    agent: str
    """NIXL agent name of the decode rank that owns the ring."""

    room: int
    chunk_id: int
    detail: str


class Watermark(Message, frozen=True, gc=False):
    """decode rank -> prefill peers: the ring is free up to ``(round, tail)``."""

    agent: str
    """NIXL agent name of the sender: how the receiver finds the peer."""

    rank: int
    round: int
    tail: int


class Abort(Message, frozen=True):
    """either way: stop this room. The receiver answers ``AbortAck`` once no WRITE of it is in flight."""

    agent: str
    """NIXL agent name of the sender: how the receiver finds the peer."""

    room: int
    rank: int
    reason: int
    """Why the sender stops the room (a :class:`FailureReason` value)."""
    detail: str


class AbortAck(Message, frozen=True):
    """either way: no WRITE of ``room`` from ``rank`` is in flight any more."""

    agent: str
    """NIXL agent name of the sender: how the receiver finds the peer."""

    room: int
    rank: int


class RoomFailed(Message, frozen=True):
    """either way: the room failed on the sender's side; ``reason`` is a ``FailureReason`` value."""

    agent: str
    """NIXL agent name of the sender: how the receiver finds the peer."""

    room: int
    rank: int
    reason: int
    detail: str


class Heartbeat(Message, frozen=True, gc=False):
    """both ways: the sender is alive; ``side`` is ``prefill`` or ``decode``."""

    agent: str
    """NIXL agent name of the sender: how the receiver finds the peer."""

    rank: int
    side: str
    seq: int
    rooms: list[int] | None = None
    """The rooms the sender holds live with the receiver (at most ``max_rooms``; None: none): a
    prefill's open or stashed rooms that the receiver asked for, a decode's rooms waiting on the
    receiver. Each renews the receiver's lease on that room (:mod:`~transfer_engine.protocol.leases`)."""


# --- NIXL notifications ---------------------------------------------------------------------------


class ChunkLanded(Message, frozen=True, gc=False):
    """Rides on a chunk's WRITE: the chunk's bytes from ``sender`` are in decode memory."""

    room: int
    chunk_id: int
    last: bool
    sender: int
    page_start: int
    num_pages: int
    region: int
    """Ring allocation id for staged chunks, -1 for the direct and slice paths."""
    layers: tuple[int, int] | None = None
    """Layer-wise chunks (``protocol/layers.py``): the WRITE carried layers ``[start, end)`` only,
    and the chunk has landed from ``sender`` once its groups cover every layer. None: every layer."""
    checksum: int | None = None
    """The writer's checksum of the bytes this WRITE carried, taken as it started (docs/INTEGRITY.md);
    None: the writer's ``integrity`` is off (the decode counts the chunk unchecked)."""


class AuxLanded(Message, frozen=True, gc=False):
    """Rides on the aux WRITE: the room's aux item from ``sender`` is in decode memory."""

    room: int
    sender: int


# --- introspection --------------------------------------------------------------------------------


class DumpRequest(Message, frozen=True):
    """anyone -> introspection endpoint: send a snapshot (of one room's history if ``room``)."""

    room: int | None = None


class DumpReply(Message, frozen=True):
    """introspection endpoint -> asker: a msgpack-encoded ``transfer_engine.observe.Snapshot``."""

    snapshot: bytes


AnyMessage = (
    RegisterRank
    | RegisterAck
    | TopologyQuery
    | Topology
    | PeerHello
    | PeerHelloAck
    | PeerLeaving
    | PeerLeavingAck
    | TransferRequest
    | StagingRequest
    | StagingGrant
    | StagingRefused
    | Watermark
    | Abort
    | AbortAck
    | RoomFailed
    | Heartbeat
    | ChunkLanded
    | AuxLanded
    | DumpRequest
    | DumpReply
)

MESSAGE_TYPES: tuple[type[Message], ...] = AnyMessage.__args__

_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[AnyMessage] = msgspec.msgpack.Decoder(AnyMessage)


def encode(message: Message) -> bytes:
    """Encode one message to msgpack bytes."""
    return _encoder.encode(message)


def decode(data: bytes | bytearray | memoryview, *, limit: int = MAX_MESSAGE_BYTES) -> AnyMessage:
    """Decode bytes from a peer into a message.

    Raises:
        RemoteProtocolError: the bytes are over ``limit``, are not a known message, have fields of
            the wrong type or the wrong number of fields, or carry another protocol version. No
            other exception escapes.
    """
    size = data.nbytes if isinstance(data, memoryview) else len(data)
    if size > limit:
        raise RemoteProtocolError(f"message of {size} bytes exceeds the limit of {limit} bytes")
    try:
        message = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RemoteProtocolError(f"undecodable message ({size} bytes): {exc}") from None
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        raise RemoteProtocolError(f"undecodable message ({size} bytes): {exc!r}") from None
    # msgspec fills a missing trailing ``v`` with its default and skips extra trailing elements, so
    # a message of another protocol version whose field count differs would decode as this one.
    # The array header says how many elements were sent: it must be the tag plus every field.
    sent = _array_length(data)
    expected = 1 + len(type(message).__struct_fields__)
    if sent != expected:
        raise RemoteProtocolError(
            f"{type(message).__name__} has {sent} elements, expected {expected} (protocol version {PROTOCOL_VERSION})"
        )
    if message.v != PROTOCOL_VERSION:
        raise RemoteProtocolError(
            f"{type(message).__name__} has protocol version {message.v}, expected {PROTOCOL_VERSION}"
        )
    if isinstance(message, TransferRequest) and len(message.dst_pages) % PAGE_DTYPE.itemsize:
        raise RemoteProtocolError(
            f"TransferRequest of room {message.room} has {len(message.dst_pages)} bytes of pages, "
            f"not a whole number of int32"
        )
    if isinstance(message, RoomFailed | Abort) and message.reason not in _REASONS:
        raise RemoteProtocolError(
            f"{type(message).__name__} of room {message.room} has unknown reason {message.reason}"
        )
    return message


_REASONS = frozenset(int(reason) for reason in FailureReason)


def _array_length(data: bytes | bytearray | memoryview) -> int:
    """The element count of the msgpack array ``data`` starts with (it decoded, so it is one)."""
    head = bytes(data[:5])
    if 0x90 <= head[0] <= 0x9F:
        return head[0] & 0x0F
    if head[0] == 0xDC:
        return int.from_bytes(head[1:3], "big")
    return int.from_bytes(head[1:5], "big")


def decode_notification(data: bytes) -> ChunkLanded | AuxLanded:
    """Decode a NIXL notification; anything but ``ChunkLanded``/``AuxLanded`` is a protocol error."""
    message = decode(data, limit=MAX_NOTIF_BYTES)
    if not isinstance(message, ChunkLanded | AuxLanded):
        raise RemoteProtocolError(f"{type(message).__name__} is not a notification")
    return message


def compat_hash(layout: LayoutInfo) -> int:
    """A stable 63-bit hash of what two ranks must agree on to exchange KV.

    Covers (layers, total heads, head_dim, dtype, MLA). Page size and page count are left out: the
    staged and slice paths move token slots, so prefill and decode page sizes may differ (the
    direct path checks page-size equality on its own).
    """
    key = _encoder.encode([layout.num_layers, layout.num_heads, layout.head_dim, layout.dtype, layout.mla])
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
