"""Our router's decisions, without vLLM servers: what each leg of a request carries, and which
(prefill, decode) pair a request goes to by the transfer cost."""

from __future__ import annotations

import math
import socket
import time

import aiohttp
import pytest
from aiohttp import web

from transfer_engine import DEFAULT_PRIOR_RATE
from transfer_engine.errors import ConfigError
from transfer_engine.integrations.vllm.proxy import (
    MAX_AGE_INTERVALS,
    CostScraper,
    CostSettings,
    PeerReading,
    Router,
    decide,
    decode_body,
    forwarded,
    pair_estimate,
    prefill_body,
    prompt_tokens,
    readings_of,
    turn_order,
)

pytestmark = pytest.mark.timeout(30)

BOOTSTRAP = "tcp://127.0.0.1:8998"


@pytest.mark.parametrize(
    ("client", "prefill"),
    [
        ({"prompt": [1], "max_tokens": 50}, {"prompt": [1], "max_tokens": 1, "stream": False}),
        (  # fields that conflict with one token stay off the prefill leg
            {"prompt": [1], "max_tokens": 50, "min_tokens": 20, "stream": True, "stream_options": {"x": 1}},
            {"prompt": [1], "max_tokens": 1, "stream": False},
        ),
        (  # the chat API's own limit is one token too; n and sampling go as they are
            {"messages": [], "max_completion_tokens": 9, "n": 2, "temperature": 0.7, "seed": 3},
            {"messages": [], "max_tokens": 1, "max_completion_tokens": 1, "stream": False, "n": 2,
             "temperature": 0.7, "seed": 3},
        ),
    ],
)  # fmt: skip
def test_the_prefill_leg_asks_one_token_and_carries_the_transfer(
    client: dict[str, object], prefill: dict[str, object]
) -> None:
    params = {"do_remote_decode": True, "transfer_id": "t1"}
    assert prefill_body(client, "t1") == {**prefill, "kv_transfer_params": params}
    decode = {
        **client,
        "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": "t1", "bootstrap": BOOTSTRAP},
    }
    assert decode_body(client, "t1", BOOTSTRAP) == decode
    client_params = {**client, "kv_transfer_params": {"x": 1}}  # a client's own params are replaced
    assert decode_body(client_params, "t1", BOOTSTRAP) == decode


def test_the_client_s_headers_go_along_but_the_hop_by_hop_ones() -> None:
    headers = {
        "Authorization": "Bearer k", "X-Request-Id": "r1", "Host": "router:8000", "Content-Length": "12",
        "Connection": "keep-alive", "Transfer-Encoding": "chunked", "Content-Type": "application/json",
    }  # fmt: skip
    assert forwarded(headers) == {"Authorization": "Bearer k", "X-Request-Id": "r1"}


# ---- choosing the pair by the transfer cost (docs/INTEGRITY.md, "Choosing an instance") ----------

P0, P1 = "tcp://p0:8998", "tcp://p1:8998"
MB = 1_000_000

METRICS_TEXT = f"""\
# HELP transfer_engine_peer_backlog_seconds Decode: seconds until a new room's bytes would start moving.
# TYPE transfer_engine_peer_backlog_seconds gauge
transfer_engine_peer_backlog_seconds{{instance="{P0}"}} 0.5
transfer_engine_peer_backlog_seconds{{instance="{P1}"}} 0.0
# HELP transfer_engine_peer_rate_bytes_per_second Decode: the measured rate.
# TYPE transfer_engine_peer_rate_bytes_per_second gauge
transfer_engine_peer_rate_bytes_per_second{{instance="{P0}"}} 2e+06
# HELP transfer_engine_rooms_opened_total Rooms opened on this rank.
# TYPE transfer_engine_rooms_opened_total counter
transfer_engine_rooms_opened_total 7.0
"""


def test_a_decode_rank_s_readings_come_from_its_metrics_text() -> None:
    assert readings_of(METRICS_TEXT) == {P0: PeerReading(0.5, 2 * MB), P1: PeerReading(0.0, None)}
    assert readings_of("transfer_engine_rooms_opened_total 7.0\n") == {}  # no room with any prefill yet
    with pytest.raises(ValueError):
        readings_of("transfer_engine_peer_backlog_seconds{instance=} x\n")


@pytest.mark.parametrize(
    ("body", "tokens"),
    [
        ({"prompt": [5, 6, 7]}, 3),
        ({"prompt": [[1, 2], [3]]}, 3),  # a batch of token-ID prompts
        ({"prompt": "x" * 40}, 10),  # text: guessed at CHARS_PER_TOKEN bytes a token
        ({"prompt": ""}, 1),
        ({"messages": [{"role": "user", "content": "y" * 400}]}, 101),  # the contents, JSON-quoted
    ],
)
def test_a_request_s_prompt_tokens(body: dict[str, object], tokens: int) -> None:
    assert prompt_tokens(body) == tokens


@pytest.mark.parametrize(
    ("ranks", "nbytes", "pending", "seconds"),
    [
        ([{P0: PeerReading(0.5, 2 * MB)}], 2 * MB, 0, 1.5),  # backlog + N / rate
        ([{P0: PeerReading(0.5, 2 * MB)}], 2 * MB, 2 * MB, 2.5),  # plus what was sent since the reading
        ([{P0: PeerReading(0.0, None)}], 2 * MB, 0, 2 * MB / DEFAULT_PRIOR_RATE),  # no rate yet: the prior
        ([{}], 2 * MB, 0, 2 * MB / DEFAULT_PRIOR_RATE),  # never a room with P0: backlog-free prior
        ([{P0: PeerReading(0.0, 0.0)}], 1, 0, math.inf),
        (  # two ranks share the bytes; the slowest rank's time is the instance's
            [{P0: PeerReading(0.0, 2 * MB)}, {P0: PeerReading(0.25, 1 * MB)}], 2 * MB, 0, 1.25,
        ),
    ],
)  # fmt: skip
def test_a_pair_s_estimate(
    ranks: list[dict[str, PeerReading]], nbytes: int, pending: int, seconds: float
) -> None:
    assert pair_estimate(ranks, P0, nbytes, pending) == pytest.approx(seconds)


def test_a_pair_s_estimate_refuses_bad_input() -> None:
    with pytest.raises(ConfigError, match="nbytes=-1"):
        pair_estimate([{}], P0, -1)
    with pytest.raises(ConfigError, match="at least one rank"):
        pair_estimate([], P0, 1)


@pytest.mark.parametrize(
    ("turn", "num_prefill", "num_decode", "order"),
    [
        (0, 1, 2, [(0, 0), (0, 1)]),
        (1, 1, 2, [(0, 1), (0, 0)]),
        (3, 2, 1, [(1, 0), (0, 0)]),
        (1, 2, 2, [(1, 1), (1, 0), (0, 1), (0, 0)]),  # the first is what independent cycles give
    ],
)
def test_the_round_robin_order_of_a_turn(
    turn: int, num_prefill: int, num_decode: int, order: list[tuple[int, int]]
) -> None:
    assert turn_order(turn, num_prefill, num_decode) == order


A, B, C = (0, 0), (0, 1), (0, 2)


@pytest.mark.parametrize(
    ("order", "estimates", "chosen"),
    [
        ([A, B], {A: None, B: None}, A),  # no metrics: round robin
        ([B, A], {A: None, B: None}, B),
        ([A, B], {A: 2.0, B: 0.5}, B),  # the least estimate
        ([A, B], {A: 0.5, B: 0.5}, A),  # a tie: round-robin order
        ([B, A], {A: 0.5, B: 0.5}, B),
        ([A, B, C], {A: None, B: 0.1, C: 0.2}, A),  # unknown and its turn: it keeps its share
        ([B, A, C], {A: None, B: 0.3, C: 0.2}, C),  # unknown, not its turn: the known ones compete
        ([A, B], {A: 1.0, B: math.inf}, A),  # a rate of zero never wins
    ],
)
def test_the_pair_a_request_goes_to(
    order: list[tuple[int, int]], estimates: dict[tuple[int, int], float | None], chosen: tuple[int, int]
) -> None:
    assert decide(order, estimates) == chosen


def test_cost_settings_refuse_what_names_no_decode_instance() -> None:
    with pytest.raises(ConfigError, match="http://d9"):
        CostSettings({"http://d9": ["http://m/metrics"]}, 2048).check(["http://d0"])
    with pytest.raises(ConfigError, match="kv_bytes_per_token=0"):
        CostSettings({"http://d0": ["http://m/metrics"]}, 0).check(["http://d0"])


@pytest.mark.anyio
async def test_an_unreadable_metrics_endpoint_is_logged_once_and_its_instance_goes_round_robin(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A real socket nobody listens on: each reading fails at once, the request path never waits."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    scraper = CostScraper(f"http://127.0.0.1:{port}/metrics", interval=0.2)
    async with aiohttp.ClientSession() as session:
        for _ in range(3):
            await scraper.read(session)
    assert scraper.current(time.monotonic()) is None
    assert scraper.failing is not None
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and str(port) in r.getMessage()]
    assert len(warnings) == 1, warnings


@pytest.mark.anyio
async def test_a_reading_is_used_while_fresh_and_the_router_routes_by_it() -> None:
    """A real HTTP endpoint serving a decode rank's metrics text; the router's choice follows it."""
    text = {"body": METRICS_TEXT}

    async def serve(request: web.Request) -> web.Response:
        return web.Response(text=text["body"], content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", serve)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        costs = CostSettings({"http://d1": [f"http://127.0.0.1:{port}/metrics"]}, kv_bytes_per_token=MB)
        router = Router([("http://p0", P0)], ["http://d0", "http://d1"], costs)
        scraper = router._scrapers[1][0]
        async with aiohttp.ClientSession() as session:
            await scraper.read(session)
        assert scraper.current(time.monotonic()) is not None
        # d0 has no metrics: its turns stay its own; d1's estimate is known otherwise
        assert router.route({"prompt": [1, 2]}) == ((0, 0), 2 * MB)
        assert router.route({"prompt": [1, 2]}) == ((0, 1), 2 * MB)
        assert router.route({"prompt": [1]}) == ((0, 0), MB)
        reading = scraper.current(time.monotonic())
        assert reading is not None and reading[0][P0] == PeerReading(0.5, 2 * MB)
        late = scraper.taken_at + MAX_AGE_INTERVALS * scraper.interval + 0.01
        assert scraper.current(late) is None  # too old: not used
    finally:
        await runner.cleanup()
