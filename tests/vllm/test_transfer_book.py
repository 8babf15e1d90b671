"""The connector's scheduler side (``TransferBook``): which blocks are held, and what the workers hear.

Plain Python: vLLM's ``Request`` is stood in for by the four fields the book reads.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

with warnings.catch_warnings():  # vLLM's own imports warn about torch APIs it uses (warnings are errors here)
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.v1.request import RequestStatus

    from transfer_engine.integrations.vllm.book import Transfer, TransferBook
    from transfer_engine.integrations.vllm.params import Plan, plan_of

pytestmark = pytest.mark.timeout(60)

BOOTSTRAP = "tcp://127.0.0.1:8998"


@dataclass
class Req:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None = None
    status: RequestStatus = RequestStatus.WAITING


def reply(transfer_id: str) -> dict[str, Any]:
    """What a prefill (of ``prefill_book``) returns for its decode."""
    return {
        "do_remote_prefill": True,
        "transfer_id": transfer_id,
        "bootstrap": BOOTSTRAP,
        "tp_size": 1,
        "block_size": 32,
    }


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


BAD_DECODE_PARAMS = [
    # (params, the key the warning names)
    ({"do_remote_prefill": True, "bootstrap": BOOTSTRAP}, "'transfer_id'=None"),
    ({"do_remote_prefill": True, "transfer_id": 7, "bootstrap": BOOTSTRAP}, "'transfer_id'=7"),
    ({"do_remote_prefill": True, "transfer_id": "", "bootstrap": BOOTSTRAP}, "'transfer_id'=''"),
    ({"do_remote_prefill": True, "transfer_id": "x" * 257, "bootstrap": BOOTSTRAP}, "'transfer_id'="),
    ({"do_remote_prefill": True, "transfer_id": "t"}, "'bootstrap'=None"),
    ({"do_remote_prefill": True, "transfer_id": "t", "bootstrap": "127.0.0.1:8998"}, "'bootstrap'="),
    ({"do_remote_prefill": True, "transfer_id": "t", "bootstrap": ["tcp://a:1"]}, "'bootstrap'="),
    ({"do_remote_prefill": "yes", "transfer_id": "t", "bootstrap": BOOTSTRAP}, "'do_remote_prefill'='yes'"),
    ({"do_remote_prefill": True, "transfer_id": "t", "bootstrap": BOOTSTRAP, "block_size": 16}, "'block_size'=16"),
    ({"do_remote_prefill": True, "transfer_id": "t", "bootstrap": BOOTSTRAP, "block_size": "32"}, "'block_size'"),
    ({"do_remote_prefill": True, "transfer_id": "t", "bootstrap": BOOTSTRAP, "tp_size": 0}, "'tp_size'=0"),
    # NixlConnector's params, as a client may send them to any vLLM decode
    (
        {"do_remote_prefill": True, "remote_engine_id": "x", "remote_block_ids": [1, 2],
         "remote_host": "127.0.0.1", "remote_port": 5600},
        "'remote_engine_id'",
    ),
    ([1, 2], "is not an object"),
]  # fmt: skip


@pytest.mark.parametrize(("params", "named"), BAD_DECODE_PARAMS)
def test_bad_decode_params_are_warned_about_once_naming_the_key_and_the_prompt_is_computed_here(
    params: Any, named: str, caplog: pytest.LogCaptureFixture
) -> None:
    book = TransferBook(is_prefill=False, block_size=32)
    req = Req("r9", list(range(40)), params)
    with caplog.at_level(logging.WARNING):
        assert book.matched(req, 0) == (0, False)
        assert book.matched(req, 0) == (0, False)  # vLLM asks again while the request waits
        book.allocated(req, [1, 2], 0)
    warnings_ = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings_ and all(w.startswith("request r9: kv_transfer_params") for w in warnings_)
    assert any(named in w for w in warnings_), warnings_
    assert len(warnings_) == len(set(warnings_))
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert book.finished(req, [1, 2]) == (False, None)
    assert not book.has_work() and not book.asked and not book.warned


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"do_remote_decode": 1}, "'do_remote_decode'=1"),
        ({"do_remote_decode": True, "transfer_id": 5}, "'transfer_id'=5"),
        ({"do_remote_decode": True, "remote_block_ids": [1]}, "'remote_block_ids'"),  # warned, still sent
        ({"do_remote_prefill": True, "transfer_id": "t"}, "'do_remote_prefill' is for a decode"),
    ],
)
def test_bad_prefill_params_are_warned_about_naming_the_key(
    params: dict[str, Any], named: str, caplog: pytest.LogCaptureFixture
) -> None:
    book = TransferBook(is_prefill=True, block_size=32, bootstrap=BOOTSTRAP)
    with caplog.at_level(logging.WARNING):
        book.allocated(Req("r9", list(range(40)), params), [1, 2], 0)
    assert any(named in r.getMessage() and "r9" in r.getMessage() for r in caplog.records)


def test_plan_of_reads_both_roles_and_gives_each_child_of_an_n_request_its_own_transfer() -> None:
    ask = {
        "do_remote_prefill": True,
        "transfer_id": "abc",
        "bootstrap": BOOTSTRAP,
        "tp_size": 2,
        "block_size": 32,
    }
    assert plan_of("cmpl-1", ask, is_prefill=False, block_size=32) == (Plan("abc", "abc", BOOTSTRAP), [])
    assert plan_of("1_cmpl-1", ask, is_prefill=False, block_size=32) == (Plan("abc", "abc#1", BOOTSTRAP), [])
    vllms = {**ask, "remote_prefill_cached_tokens": 64}  # vLLM's scheduler adds it to a prefill's answer
    assert plan_of("cmpl-1", vllms, is_prefill=False, block_size=32) == (Plan("abc", "abc", BOOTSTRAP), [])
    given = {"do_remote_decode": True, "transfer_id": "abc"}
    assert plan_of("0_cmpl-1", given, is_prefill=True, block_size=32) == (Plan("abc", "abc#0"), [])
    # no transfer_id (vLLM's sequential protocol): minted from the request id, shared by the children
    minted = {"do_remote_decode": True}
    assert plan_of("cmpl-7-0-ab12", minted, is_prefill=True, block_size=32) == (
        Plan("cmpl-7-0-ab12", "cmpl-7-0-ab12"), [],
    )  # fmt: skip
    assert plan_of("1_cmpl-7-0-ab12", minted, is_prefill=True, block_size=32) == (
        Plan("cmpl-7-0-ab12", "cmpl-7-0-ab12#1"), [],
    )  # fmt: skip
    for nothing in (None, {}, {"do_remote_decode": False}):
        assert plan_of("r", nothing, is_prefill=True, block_size=32) == (None, [])
    assert plan_of("r", {"do_remote_prefill": False}, is_prefill=False, block_size=32) == (None, [])


@pytest.mark.parametrize("status", [RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED])
def test_prefill_holds_a_finished_requests_prompt_blocks_and_sends_them(status: RequestStatus) -> None:
    book = TransferBook(is_prefill=True, block_size=32, bootstrap=BOOTSTRAP)
    req = prefill_req(tokens=33)
    req.status = status
    held, params = book.finished(req, [9, 8, 7])
    assert held and params == reply("t-r1")
    assert book.take_meta().start == [Transfer("r1", "t-r1", (9, 8))]
    assert book.has_work()
    book.ended(["r1"])
    assert not book.has_work()


def test_prefill_request_aborted_before_it_finished_aborts_its_room_and_frees_its_blocks() -> None:
    book = TransferBook(is_prefill=True, block_size=32, bootstrap=BOOTSTRAP)
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
    book = TransferBook(is_prefill=True, block_size=32, bootstrap=BOOTSTRAP)
    req = prefill_req(tokens=70)
    book.allocated(req, [4, 5, 6, 7], 0)
    book.scheduled(step([("r1", [4, 5, 6, 7], 0)], [], {"r1": 70}))
    meta = book.take_meta()
    assert meta.layerwise == [Transfer("r1", "t-r1", (4, 5, 6))] and not meta.start
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert book.finished(req, [4, 5, 6, 7]) == (True, reply("t-r1"))
    assert book.take_meta() == type(meta)()  # no second send
    assert book.has_work()
    assert book.sent({"r1"}) == {"r1"}  # vLLM frees the finished request's blocks now
    assert not book.has_work()


def test_a_prompt_over_several_steps_sends_every_block_in_its_last_step() -> None:
    book = TransferBook(is_prefill=True, block_size=32, bootstrap=BOOTSTRAP)
    book.allocated(prefill_req(tokens=70), [4], 0)
    book.scheduled(step([("r1", [4], 0)], [], {"r1": 32}))
    assert not book.take_meta().layerwise
    book.scheduled(step([], [("r1", None, 32)], {"r1": 0}))  # not scheduled this step
    assert not book.take_meta().layerwise
    book.scheduled(step([], [("r1", [5, 6], 32)], {"r1": 38}))
    assert book.take_meta().layerwise == [Transfer("r1", "t-r1", (4, 5, 6))]


def test_a_layer_wise_room_that_ends_before_its_request_finished_frees_the_blocks_at_the_finish() -> None:
    """vLLM frees blocks on finished_sending only for finished requests: the report waits."""
    book = TransferBook(is_prefill=True, block_size=32, bootstrap=BOOTSTRAP)
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
    book = TransferBook(is_prefill=True, block_size=32, bootstrap=BOOTSTRAP)
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
    book = TransferBook(is_prefill=True, block_size=32, bootstrap=BOOTSTRAP)
    book.allocated(Req("p", list(range(10))), [1], 0)
    book.scheduled(step([("p", [1], 0)], [], {"p": 10}))
    assert book.take_meta() == type(book.pending)()
    assert not book.has_work()


def test_a_sequential_router_s_prefill_request_mints_its_transfer_and_returns_what_the_decode_needs() -> None:
    """vLLM's standard protocol: the prefill gets ``{"do_remote_decode": true}`` only; the params it
    returns, given to the decode as they are, make the decode ask for the same room."""
    prefill = TransferBook(is_prefill=True, block_size=32, bootstrap=BOOTSTRAP, tp_size=2)
    req = Req("cmpl-5-0-1a2b", list(range(70)), {"do_remote_decode": True})
    prefill.allocated(req, [4, 5, 6], 0)
    prefill.scheduled(step([("cmpl-5-0-1a2b", [4, 5, 6], 0)], [], {"cmpl-5-0-1a2b": 70}))
    assert prefill.take_meta().layerwise == [Transfer("cmpl-5-0-1a2b", "cmpl-5-0-1a2b", (4, 5, 6))]
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    held, params = prefill.finished(req, [4, 5, 6])
    assert held and params == {**reply("cmpl-5-0-1a2b"), "tp_size": 2}
    decode = TransferBook(is_prefill=False, block_size=32)
    dreq = Req("cmpl-9-0-ffff", list(range(70)), params)
    assert decode.matched(dreq, 0) == (70, True)
    decode.allocated(dreq, [1, 2, 3], 70)
    assert decode.take_meta().start == [Transfer("cmpl-9-0-ffff", "cmpl-5-0-1a2b", (1, 2, 3), BOOTSTRAP)]


def test_a_decode_with_a_cached_prefix_asks_only_for_the_blocks_past_it() -> None:
    book = TransferBook(is_prefill=False, block_size=32)
    req = decode_req(tokens=100)
    assert book.matched(req, 64) == (36, True)  # two blocks cached here
    book.allocated(req, [8, 9, 10, 11], 36)  # the cached blocks come first
    assert book.take_meta().start == [Transfer("r1", "t-r1", (10, 11), BOOTSTRAP, prefix_len=64)]


def test_a_decode_with_the_whole_prompt_cached_asks_nothing_and_cancels_the_prefill_s_room_at_once() -> None:
    book = TransferBook(is_prefill=False, block_size=32)
    req = decode_req(tokens=64)
    assert book.matched(req, 64) == (0, False)
    assert book.take_meta().cancel == [Transfer("r1", "t-r1", (), BOOTSTRAP)]
    assert book.matched(req, 64) == (0, False)  # asked again: no second cancel
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert book.finished(req, [1, 2, 3]) == (False, None)
    assert book.take_meta() == type(book.pending)() and not book.has_work()


def test_a_transfer_id_live_for_another_request_is_refused_naming_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    book = TransferBook(is_prefill=False, block_size=32)
    first, second = decode_req("r1"), decode_req("r2")
    second.kv_transfer_params = first.kv_transfer_params
    assert book.matched(first, 0) == (70, True)
    book.allocated(first, [1, 2, 3], 70)
    with caplog.at_level(logging.WARNING):
        assert book.matched(second, 0) == (0, False)
    assert "request r2: kv_transfer_params key 'transfer_id'='t-r1' is live for request r1" in caplog.text
    prefill = TransferBook(is_prefill=True, block_size=32, bootstrap=BOOTSTRAP)
    prefill.allocated(prefill_req("p1"), [1], 0)
    twin = Req("p2", list(range(70)), {"do_remote_decode": True, "transfer_id": "t-p1"})
    prefill.allocated(twin, [2], 0)
    assert list(prefill.prefilling) == ["p1"]


def test_children_of_an_n_request_each_move_their_own_kv() -> None:
    decode = TransferBook(is_prefill=False, block_size=32)
    children = [Req(f"{i}_cmpl-3-0-aa", list(range(40)), decode_req().kv_transfer_params) for i in range(2)]
    for i, child in enumerate(children):
        assert decode.matched(child, 0) == (40, True)
        decode.allocated(child, [2 * i, 2 * i + 1], 40)
    assert [t.transfer_id for t in decode.take_meta().start] == ["t-r1#0", "t-r1#1"]
