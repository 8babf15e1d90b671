"""UCX's batched copies: when the engine turns them on (``transport.posting.batched_copies``)."""

from __future__ import annotations

import pytest

from transfer_engine.transport.posting import SGL_ENV, batched_copies


@pytest.mark.parametrize(
    ("backend", "device", "environ", "version", "value", "says"),
    [
        ("UCX", "cuda", {}, "1.5.1", "1", "NIXL_UCX_SGL_ENABLE=1: UCX's batched copies"),
        ("UCX", "cuda", {}, "2.0.0", "1", "(NIXL 2.0.0)"),
        ("UCX", "cuda", {SGL_ENV: "0"}, "1.5.1", None, "NIXL_UCX_SGL_ENABLE=0 as set"),
        ("UCX", "cuda", {SGL_ENV: "1"}, "1.0.0", None, "NIXL_UCX_SGL_ENABLE=1 as set"),
        ("UCX", "cpu", {}, "1.5.1", None, "KV on cpu"),
        ("GDS", "cuda", {}, "1.5.1", None, "backend GDS"),
        (
            "UCX",
            "cuda",
            {},
            "1.4.9",
            None,
            "fallback: one copy per descriptor): NIXL 1.4.9 is older than 1.5",
        ),
        ("UCX", "cuda", {}, None, None, "NIXL unknown is older"),
        ("UCX", "cuda", {}, "dev", None, "NIXL dev is older"),
    ],
)
def test_decision(
    backend: str, device: str, environ: dict[str, str], version: str | None, value: str | None, says: str
) -> None:
    got, line = batched_copies(backend, device, environ, version)
    assert got == value
    assert says in line
