"""Control-plane CURVE: the right certificate transfers rooms; any other key gets no answer at all."""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import zmq
import zmq.asyncio

from tests.integration.harness import run_room, shuffled_pages
from transfer_engine.config import EngineConfig
from transfer_engine.errors import ConfigError, PeerUnreachableError
from transfer_engine.protocol import messages as m
from transfer_engine.transport.security import Curve

from .helpers import certificate, engines, make_engine

pytestmark = pytest.mark.timeout(60)


def keys(tmp_path: Path, name: str) -> dict[str, Any]:
    """A deployment's CURVE settings: its own shared certificate, and a directory holding its public key."""
    public, secret = certificate(tmp_path / name / "certs", name)
    allowed = tmp_path / name / "allowed"
    allowed.mkdir()
    shutil.copy(public, allowed)
    return {"curve_secret_key_file": str(secret), "curve_public_keys_dir": str(allowed)}


async def ask(
    endpoint: str, curve: Curve | None, wait_s: float = 0.3, message: m.Message | None = None
) -> bytes | None:
    """Send ``message`` (a TopologyQuery) from a raw DEALER (a CURVE client when ``curve``); the answer, or None."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        curve.client(sock)
    try:
        sock.connect(endpoint)
        await sock.send(m.encode(message or m.TopologyQuery()))
        with anyio.move_on_after(wait_s):
            return bytes(await sock.recv())
        return None
    finally:
        sock.close(0)
        ctx.term()


@pytest.mark.anyio
async def test_shared_certificate_transfers_and_strangers_get_no_answer(tmp_path: Path) -> None:
    good = keys(tmp_path, "deployment")
    other = keys(tmp_path, "intruder")
    rng = random.Random(3)
    async with engines(1, 1, **good) as c:
        prefill, decode = c.prefill[0], c.decode[0]
        assert prefill.curve is not None and decode.curve is not None
        await run_room(c, 11, shuffled_pages(rng, 64, 5), shuffled_pages(rng, 64, 5), [2, 3], aux_slot=1)
        # a datagram carries no CURVE authentication: no rank binds one for landing notices
        assert prefill.control.local is None and decode.control.local is None
        assert prefill.curve.stats["allowed"] >= 2  # the decode's topology query and handshake
        assert prefill.curve.stats["denied"] == 0

        # Right server key but a client key nobody allowed: the ZAP authenticator refuses it.
        public, secret = zmq.auth.load_certificate(certificate(tmp_path / "stranger", "stranger")[1])
        assert public is not None and secret is not None
        stranger = Curve(public, secret, frozenset(), server_key=prefill.curve.public_key)
        assert await ask(c.bootstrap, stranger) is None
        assert await ask(prefill.endpoint, stranger) is None
        assert prefill.curve.stats["denied"] >= 2
        # Another deployment's certificate (wrong server key) and plain TCP: no answer either.
        assert await ask(c.bootstrap, Curve.from_config(EngineConfig(role="decode", **other))) is None
        assert await ask(c.bootstrap, None) is None
        # The right key is answered, over the same sockets.
        assert await ask(c.bootstrap, decode.curve) is not None
        # The introspection endpoint is secured the same way (``secure=curve.server``).
        dump = m.DumpRequest()
        assert await ask(prefill.introspect_endpoint, stranger, message=dump) is None
        assert await ask(prefill.introspect_endpoint, None, message=dump) is None
        assert isinstance(
            m.decode(await ask(prefill.introspect_endpoint, decode.curve, message=dump) or b""), m.DumpReply
        )

        # A decode rank with another certificate cannot find or reach the prefill instance.
        async with make_engine("decode", 1, 0, 0, connect_timeout=0.3, **other) as intruder:
            started = time.monotonic()
            with pytest.raises(PeerUnreachableError):
                await intruder.connect(c.bootstrap)
            with pytest.raises(PeerUnreachableError):
                await intruder.receiver(12, c.bootstrap, [0, 1])
            assert time.monotonic() - started < 3.0
            assert intruder.leaks()["rooms"] == 0

        # A prefill rank with another certificate cannot register with the bootstrap.
        port = int(c.bootstrap.rsplit(":", 1)[1])
        rogue = make_engine(
            "prefill", 1, 0, port, host_bootstrap=False, bootstrap_timeout=0.5, connect_timeout=0.3, **other
        )
        with pytest.raises(PeerUnreachableError):
            async with rogue:
                pytest.fail("a prefill rank with a foreign certificate registered")
        assert prefill.bootstrap is not None
        assert prefill.bootstrap.ranks == {0: prefill.endpoint}

        # The deployment keeps serving.
        await run_room(c, 13, shuffled_pages(rng, 64, 4), shuffled_pages(rng, 64, 4), [4])
        c.assert_no_leaks()


def test_config_needs_both_curve_fields_and_existing_paths(tmp_path: Path) -> None:
    good = keys(tmp_path, "deployment")
    with pytest.raises(ConfigError, match="curve_public_keys_dir=''"):
        EngineConfig(role="prefill", curve_secret_key_file=good["curve_secret_key_file"])
    with pytest.raises(ConfigError, match="curve_secret_key_file=''"):
        EngineConfig(role="prefill", curve_public_keys_dir=good["curve_public_keys_dir"])
    missing = str(tmp_path / "nope.key_secret")
    with pytest.raises(ConfigError, match="nope.key_secret"):
        EngineConfig(role="prefill", **good | {"curve_secret_key_file": missing})
    with pytest.raises(ConfigError, match="curve_public_keys_dir=.*not a directory"):
        EngineConfig(role="prefill", **good | {"curve_public_keys_dir": good["curve_secret_key_file"]})
    env = {f"TE_{k.upper()}": v for k, v in good.items()}
    assert EngineConfig.from_env(env, role="decode").curve_public_keys_dir == good["curve_public_keys_dir"]


def test_curve_load_names_the_bad_file(tmp_path: Path) -> None:
    good = keys(tmp_path, "deployment")
    public = next(Path(good["curve_public_keys_dir"]).iterdir())
    with pytest.raises(ConfigError, match=r"holds no secret key"):
        Curve.load(public, good["curve_public_keys_dir"])
    garbage = tmp_path / "garbage.key_secret"
    garbage.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match="garbage.key_secret"):
        Curve.load(garbage, good["curve_public_keys_dir"])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="holds no"):
        Curve.load(good["curve_secret_key_file"], empty)
    curve = Curve.load(good["curve_secret_key_file"], good["curve_public_keys_dir"])
    assert curve.server_key == curve.public_key and curve.allowed == {curve.public_key}
    assert Curve.from_config(EngineConfig(role="prefill")) is None


def test_authenticator_decisions(tmp_path: Path) -> None:
    good = keys(tmp_path, "deployment")
    curve = Curve.load(good["curve_secret_key_file"], good["curve_public_keys_dir"])
    raw = zmq.utils.z85.decode(curve.public_key)
    head = [b"1.0", b"7", b"transfer_engine", b"127.0.0.1", b""]
    assert curve.decide([*head, b"CURVE", raw])[0] == b"200"
    assert curve.decide([*head, b"CURVE", bytes(32)])[:2] == (b"400", b"unknown key")
    assert curve.decide([*head, b"NULL"])[0] == b"400"
    assert curve.decide([b"2.0", *head[1:], b"CURVE", raw])[0] == b"400"
    assert curve.decide([b"1.0"])[0] == b"400"
    assert curve.stats == {"allowed": 1, "denied": 2, "malformed": 2}
