"""Nothing on the engine's path pickles: checked in the source, and at run time.

Pickle-family modules turn bytes from a peer into arbitrary code; NIXL's ``get_serialized_descs`` /
``deserialize_descs`` pickle under the hood. The AST scan covers every Python file we ship or run
(``transfer_engine/``, ``kernels/``, ``examples/``, ``tools/``). The runtime check makes every
pickle entry point raise while a room transfers, which also covers code we did not write (NIXL's
Python layer, msgspec, zmq).
"""

from __future__ import annotations

import ast
import pickle
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import run_room, shuffled_pages

from .helpers import engines

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("transfer_engine", "kernels", "examples", "tools")
FORBIDDEN_MODULES = frozenset({"pickle", "_pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle"})
FORBIDDEN_NAMES = frozenset({"get_serialized_descs", "deserialize_descs"})


def python_files() -> Iterator[Path]:
    for top in SCANNED:
        yield from sorted((ROOT / top).rglob("*.py"))


def violations(path: Path, root: Path = ROOT) -> list[str]:
    """``file:line: what`` for each pickle-family import or use of NIXL's pickling descriptor calls."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        for what in _offences(node):
            found.append(f"{path.relative_to(root)}:{getattr(node, 'lineno', '?')}: {what}")
    return found


def _offences(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        modules = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        modules = [node.module or ""]
    else:
        modules = []
    out = [f"imports {name}" for name in modules if name.split(".")[0] in FORBIDDEN_MODULES]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "__import__":
        out += [
            f"__import__({a.value!r})"
            for a in node.args[:1]
            if isinstance(a, ast.Constant) and str(a.value).split(".")[0] in FORBIDDEN_MODULES
        ]
    used = {ast.Attribute: "attr", ast.Name: "id", ast.alias: "name"}.get(type(node))
    if used is not None and getattr(node, used) in FORBIDDEN_NAMES:
        out.append(f"uses {getattr(node, used)}")
    return out


def test_the_scan_sees_every_kind_of_violation(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import pickle\nfrom cloudpickle import dumps\nimport dill as d\nimport os, marshal\n"
        "from shelve import open as o\n__import__('pickle')\nagent.get_serialized_descs(x)\n"
        "from nixl import deserialize_descs\n"
    )
    found = sorted(violations(sample, tmp_path))
    assert found == [
        "sample.py:1: imports pickle",
        "sample.py:2: imports cloudpickle",
        "sample.py:3: imports dill",
        "sample.py:4: imports marshal",
        "sample.py:5: imports shelve",
        "sample.py:6: __import__('pickle')",
        "sample.py:7: uses get_serialized_descs",
        "sample.py:8: uses deserialize_descs",
    ]


def test_no_pickle_in_the_source() -> None:
    files = list(python_files())
    assert len(files) > 20, f"scanned only {len(files)} files under {ROOT}"
    found = [v for path in files for v in violations(path)]
    assert not found, "\n".join(found)


def _refuse(*args: object, **kwargs: object) -> None:
    raise AssertionError("pickle was called on the engine's path")


@pytest.mark.anyio
async def test_a_room_transfers_while_pickle_is_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("dumps", "loads", "dump", "load", "Pickler", "Unpickler"):
        monkeypatch.setattr(pickle, name, _refuse)
    rng = random.Random(5)
    async with engines(1, 2) as c:  # handshake, topology, requests, notifications, aux, heartbeats
        await run_room(c, 21, shuffled_pages(rng, 64, 6), shuffled_pages(rng, 64, 6), [1, 2, 3], aux_slot=2)
        await run_room(c, 22, shuffled_pages(rng, 64, 3), shuffled_pages(rng, 64, 3), [3])
        c.assert_no_leaks()
    with pytest.raises(AssertionError, match="pickle was called"):
        pickle.dumps(1)
