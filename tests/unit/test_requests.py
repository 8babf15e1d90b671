"""The request and landing checks (protocol.requests): one row per rule, the valid cases included."""

from __future__ import annotations

import msgspec
import pytest

from transfer_engine.errors import ProtocolError
from transfer_engine.protocol import messages as m
from transfer_engine.protocol.requests import Asker, HeldRegion, Writer, check_landed, check_request

pytestmark = pytest.mark.timeout(10)

WRITER = Writer(num_heads=8, tp_size=1, rank=0, mla=False)
"""One prefill rank of eight heads; decode TP 2 takes heads [0, 4) on rank 0 and [4, 8) on rank 1."""
ASKER = Asker(rank=1, tp_size=2, num_pages=16, ring_bytes=1 << 20)
FIRST = m.FirstRegion(3, 0, 0, 4096, 0, 2048, 16)


def request(**changes: object) -> m.TransferRequest:
    base = m.TransferRequest(
        agent="decode-1",
        room=7,
        decode_rank=1,
        decode_tp=2,
        path="direct",
        dst_pages=[0, 5, 15],
        aux_slot=None,
        slices=[m.SliceSpec(0, 4, 0, 4)],
    )
    return msgspec.structs.replace(base, **changes)


@pytest.mark.parametrize(
    ("req", "asker", "error"),
    [
        (request(), ASKER, None),
        (request(path="staged"), ASKER, None),
        (request(path="staged", first_region=FIRST), ASKER, None),
        (request(decode_rank=0), ASKER, "says decode rank 0 of 2, but agent decode-1 said rank 1 of 2"),
        (request(decode_tp=4), ASKER, "says decode rank 1 of 4"),
        (request(slices=[]), ASKER, "asked for slices [], expected"),
        (request(slices=[m.SliceSpec(0, 4, 0, 4)] * 2), ASKER, "asked for slices"),
        (request(slices=[m.SliceSpec(0, 0, 0, 4)]), ASKER, "expected HeadSlice"),
        (request(path="teleport"), ASKER, "path 'teleport' is not served"),
        (request(path="staged"), Asker(1, 2, 16, None), "registered no staging ring"),
        (request(first_region=FIRST), ASKER, "the path is not staged"),
        (
            request(path="staged", first_region=m.FirstRegion(3, 0, (1 << 20) - 100, 4096, 0, 2048, 16)),
            ASKER,
            "outside its ring of 1048576 bytes",
        ),
        (
            request(path="staged", first_region=m.FirstRegion(3, 0, 0, 4096, 3000, 2048, 16)),
            ASKER,
            "outside its ring",
        ),
        (request(dst_pages=[0, 16]), ASKER, "decode page 16 outside [0, 16)"),
        (request(dst_pages=[-1]), ASKER, "decode page -1 outside"),
        (request(dst_pages=[3, 15, 1 << 30, -5]), ASKER, "decode page 1073741824 outside"),
        (request(dst_pages=[]), ASKER, None),
    ],
)
def test_check_request(req: m.TransferRequest, asker: Asker, error: str | None) -> None:
    if error is None:
        assert check_request(req, asker, WRITER) == req.slices[0]
    else:
        with pytest.raises(ProtocolError) as info:
            check_request(req, asker, WRITER)
        assert error in str(info.value)


def test_a_rank_that_writes_nothing_there_gets_no_slice() -> None:
    """Prefill TP 2 to decode TP 4: prefill rank 0 writes to decode ranks 0 and 1 only."""
    writer = Writer(num_heads=8, tp_size=2, rank=0, mla=False)
    asker = Asker(rank=2, tp_size=4, num_pages=16, ring_bytes=None)
    quiet = request(decode_rank=2, decode_tp=4, slices=[], path="staged")
    assert check_request(quiet, asker, writer) is None
    with pytest.raises(ProtocolError, match="this rank writes nothing there"):
        check_request(msgspec.structs.replace(quiet, first_region=FIRST), Asker(2, 4, 16, 1 << 20), writer)
    with pytest.raises(ProtocolError, match="expected None"):
        check_request(msgspec.structs.replace(quiet, slices=[m.SliceSpec(0, 0, 0, 2)]), asker, writer)


def landed(region: int = 3, page_start: int = 4, num_pages: int = 2) -> m.ChunkLanded:
    return m.ChunkLanded(
        room=7, chunk_id=1, last=False, sender=0, page_start=page_start, num_pages=num_pages, region=region
    )


HELD = HeldRegion(alloc_id=3, page_start=4, num_pages=2, ahead=False)


@pytest.mark.parametrize(
    ("mail", "path", "held", "result"),
    [
        (landed(region=-1), "direct", None, False),
        (landed(region=-1), "slice", None, False),
        (landed(region=3), "direct", None, "landed in ring region 3 on the direct path"),
        (landed(), "staged", HELD, False),
        (landed(), "host", HELD, False),
        (landed(), "staged", HeldRegion(3, 0, 0, ahead=True), True),
        (landed(), "staged", None, "landed in region 3, but the room holds None"),
        (landed(region=9), "staged", HELD, "landed in region 9, but the room holds 3"),
        (landed(page_start=6), "staged", HELD, "landed pages [6, +2), its region holds [4, +2)"),
        (landed(num_pages=1), "staged", HELD, "landed pages [4, +1)"),
    ],
)
def test_check_landed(mail: m.ChunkLanded, path: str, held: HeldRegion | None, result: bool | str) -> None:
    if isinstance(result, bool):
        assert check_landed(mail, path, held) is result
    else:
        with pytest.raises(ProtocolError) as info:
            check_landed(mail, path, held)
        assert result in str(info.value)
