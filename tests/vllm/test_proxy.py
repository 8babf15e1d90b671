"""Our router's decisions, without servers: what each leg of a request carries."""

from __future__ import annotations

import pytest

from transfer_engine.integrations.vllm.proxy import decode_body, forwarded, prefill_body

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
