"""The connector's scheduler side (``TransferBook``): which blocks are held, and what the workers hear.

Plain Python: vLLM's ``Request`` is stood in for by the four fields the book reads.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

from transfer_engine.errors import ConfigError

with warnings.catch_warnings():  # vLLM's own imports warn about torch APIs it uses (warnings are errors here)
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.v1.request import RequestStatus

    from transfer_engine.integrations.vllm.connector import Transfer, TransferBook, room_of

pytestmark = pytest.mark.timeout(60)

BOOTSTRAP = "tcp://127.0.0.1:8998"


@dataclass
class Req:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None = None
    status: RequestStatus = RequestStatus.WAITING


def decode_req(req_id: str = "r1", tokens: int = 70) -> Req:
    params = {"do_remote_prefill": True, "transfer_id": f"t-{req_id}", "bootstrap": BOOTSTRAP}
    return Req(req_id, list(range(tokens)), params)


def prefill_req(req_id: str = "r1", tokens: int = 70) -> Req:
    return Req(req_id, list(range(tokens)), {"do_remote_decode": True, "transfer_id": f"t-{req_id}"})


def test_decode_asks_once_for_the_whole_prompt_into_its_first_blocks() -> None:
    book = TransferBook(is_prefill=False, block_size=32)
    req = decode_req(tokens=70)
    assert book.matched(req, 0) == (70, True)
    book.allocated(req, [5, 6, 7, 8], 70)
    meta = book.take_meta()
    assert meta.start == [Transfer("r1", "t-r1", (5, 6, 7), BOOTSTRAP)]
    assert book.matched(req, 0) == (0, False)
    assert book.has_work()
    book.ended(["r1"])
    assert not book.has_work()
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert book.finished(req, [5, 6, 7, 8]) == (False, None)
    assert book.take_meta() == type(meta)()  # nothing to abort or cancel: the room ended


def test_decode_request_aborted_while_its_kv_comes_holds_its_blocks_until_the_room_ended() -> None:
    book = TransferBook(is_prefill=False, block_size=32)
    req = decode_req()
    book.allocated(req, [1, 2, 3], 70)
    book.take_meta()
    req.status = RequestStatus.FINISHED_ABORTED
    assert book.finished(req, [1, 2, 3]) == (True, None)
    meta = book.take_meta()
    assert [t.req_id for t in meta.abort] == ["r1"] and not meta.cancel
    assert book.has_work()  # vLLM keeps stepping until the workers report the room ended
    book.ended(["r1"])
    assert not book.has_work()


def test_decode_request_that_ends_before_its_blocks_were_allocated_cancels_the_room_on_the_prefill() -> None:
    """Aborted in the decode's queue: no room opened here, but the prefill may open (or have
    opened) its own; without the cancel it holds the request's blocks until bootstrap_timeout."""
    book = TransferBook(is_prefill=False, block_size=32)
    req = decode_req()
    assert book.matched(req, 0) == (70, True)
    req.status = RequestStatus.FINISHED_ABORTED
    assert book.finished(req, []) == (False, None)
    assert book.has_work()
    meta = book.take_meta()
    assert meta.cancel == [Transfer("r1", "t-r1", (), BOOTSTRAP)]
    assert not meta.start and not meta.abort
    assert not book.has_work()


def test_decode_requests_without_transfer_params_are_left_to_vllm() -> None:
    book = TransferBook(is_prefill=False, block_size=32)
    plain = Req("p", list(range(10)))
    assert book.matched(plain, 0) == (0, False)
    plain.status = RequestStatus.FINISHED_ABORTED
    assert book.finished(plain, [1]) == (False, None)
    assert not book.has_work()


@pytest.mark.parametrize(
    "params",
    [
        {"do_remote_prefill": True, "bootstrap": BOOTSTRAP},
        {"do_remote_prefill": True, "transfer_id": 7, "bootstrap": BOOTSTRAP},
        {"do_remote_prefill": True, "transfer_id": "t"},
    ],
)
def test_decode_refuses_transfer_params_without_string_id_and_bootstrap_naming_them(
    params: dict[str, Any],
) -> None:
    book = TransferBook(is_prefill=False, block_size=32)
    with pytest.raises(ConfigError, match="kv_transfer_params") as info:
        book.allocated(Req("r9", [1, 2], params), [1], 2)
    assert repr(params) in str(info.value)
    assert not book.has_work() and not book.asked


@pytest.mark.parametrize("status", [RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED])
def test_prefill_holds_a_finished_requests_prompt_blocks_and_sends_them(status: RequestStatus) -> None:
    book = TransferBook(is_prefill=True, block_size=32)
    req = prefill_req(tokens=33)
    req.status = status
    held, params = book.finished(req, [9, 8, 7])
    assert held and params == {"transfer_id": "t-r1", "room": room_of("t-r1")}
    assert book.take_meta().start == [Transfer("r1", "t-r1", (9, 8))]
    assert book.has_work()
    book.ended(["r1"])
    assert not book.has_work()


def test_prefill_request_aborted_before_it_finished_aborts_its_room_and_frees_its_blocks() -> None:
    book = TransferBook(is_prefill=True, block_size=32)
    req = prefill_req()
    req.status = RequestStatus.FINISHED_ABORTED
    assert book.finished(req, [1, 2, 3]) == (False, None)
    meta = book.take_meta()
    assert [t.transfer_id for t in meta.abort] == ["t-r1"] and not meta.start
    assert not book.has_work()


def step(
    new: list[tuple[str, list[int], int]],
    cached: list[tuple[str, list[int] | None, int]],
    tokens: dict[str, int],
) -> Any:
    """A vLLM ``SchedulerOutput`` with what the book reads: (req_id, block ids, computed tokens) of
    new and of cached requests, and the tokens each computes this step."""
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r, block_ids=(b,), num_computed_tokens=c) for r, b, c in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in cached],
            resumed_req_ids=set(),
            new_block_ids=[None if b is None else (b,) for _, b, _ in cached],
            num_computed_tokens=[c for _, _, c in cached],
        ),
        num_scheduled_tokens=tokens,
        total_num_scheduled_tokens=sum(tokens.values()),
    )


def test_prefill_sends_layer_wise_in_the_step_that_computes_the_last_prompt_tokens() -> None:
    book = TransferBook(is_prefill=True, block_size=32)
    req = prefill_req(tokens=70)
    book.allocated(req, [4, 5, 6, 7], 0)
    book.scheduled(step([("r1", [4, 5, 6, 7], 0)], [], {"r1": 70}))
    meta = book.take_meta()
    assert meta.layerwise == [Transfer("r1", "t-r1", (4, 5, 6))] and not meta.start
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert book.finished(req, [4, 5, 6, 7]) == (True, {"transfer_id": "t-r1", "room": room_of("t-r1")})
    assert book.take_meta() == type(meta)()  # no second send
    assert book.has_work()
    assert book.sent({"r1"}) == {"r1"}  # vLLM frees the finished request's blocks now
    assert not book.has_work()


def test_a_prompt_over_several_steps_sends_every_block_in_its_last_step() -> None:
    book = TransferBook(is_prefill=True, block_size=32)
    book.allocated(prefill_req(tokens=70), [4], 0)
    book.scheduled(step([("r1", [4], 0)], [], {"r1": 32}))
    assert not book.take_meta().layerwise
    book.scheduled(step([], [("r1", None, 32)], {"r1": 0}))  # not scheduled this step
    assert not book.take_meta().layerwise
    book.scheduled(step([], [("r1", [5, 6], 32)], {"r1": 38}))
    assert book.take_meta().layerwise == [Transfer("r1", "t-r1", (4, 5, 6))]


def test_a_layer_wise_room_that_ends_before_its_request_finished_frees_the_blocks_at_the_finish() -> None:
    """vLLM frees blocks on finished_sending only for finished requests: the report waits."""
    book = TransferBook(is_prefill=True, block_size=32)
    req = prefill_req(tokens=10)
    book.allocated(req, [1], 0)
    book.scheduled(step([("r1", [1], 0)], [], {"r1": 10}))
    book.take_meta()
    assert book.sent({"r1"}) == set()
    req.status = RequestStatus.FINISHED_STOPPED
    held, params = book.finished(req, [1])
    assert not held and params is not None
    assert not book.has_work() and not book.sent_early and not book.layerwise


def test_a_request_aborted_after_its_layer_wise_send_started_holds_its_blocks_until_the_room_ended() -> None:
    book = TransferBook(is_prefill=True, block_size=32)
    req = prefill_req(tokens=10)
    book.allocated(req, [1], 0)
    book.scheduled(step([("r1", [1], 0)], [], {"r1": 10}))
    book.take_meta()
    req.status = RequestStatus.FINISHED_ABORTED
    assert book.finished(req, [1]) == (True, None)
    assert [t.req_id for t in book.take_meta().abort] == ["r1"]
    assert book.sent({"r1"}) == {"r1"}
    assert not book.has_work()


def test_prefill_requests_without_transfer_params_are_not_planned() -> None:
    book = TransferBook(is_prefill=True, block_size=32)
    book.allocated(Req("p", list(range(10))), [1], 0)
    book.scheduled(step([("p", [1], 0)], [], {"p": 10}))
    assert book.take_meta() == type(book.pending)()
    assert not book.has_work()
