"""docs/states.md is rendered from the transition tables and must not drift from them (STYLE §2)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from transfer_engine.protocol.rooms import RECEIVER_TRANSITIONS, SENDER_TRANSITIONS

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "state_diagram.py"
DOC = ROOT / "docs" / "states.md"


@pytest.fixture(scope="module")
def tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("state_diagram", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_doc_matches_the_tables(tool: ModuleType) -> None:
    assert DOC.read_text(encoding="utf-8") == tool.render(), (
        "docs/states.md is out of date; run: python tools/state_diagram.py"
    )


@pytest.mark.parametrize("table", [SENDER_TRANSITIONS, RECEIVER_TRANSITIONS], ids=["sender", "receiver"])
def test_block_has_an_arrow_per_table_entry(tool: ModuleType, table: dict) -> None:
    block = tool.render_table(table)
    lines = block.splitlines()
    assert lines[:3] == ["```mermaid", "stateDiagram-v2", "    [*] --> Bootstrapping"]
    assert lines[-1] == "```"
    arrows = [line.strip() for line in lines if ": " in line]
    expected = [
        f"{tool.state_name(state)} --> {tool.state_name(nxt)}: {event.__name__}"
        for state, events in table.items()
        for event, nxt in events.items()
    ]
    assert arrows == expected
    assert "    Success --> [*]" in lines and "    Failed --> [*]" in lines
    assert block in tool.render()


def test_state_names_follow_the_design(tool: ModuleType) -> None:
    names = [tool.state_name(s) for s in SENDER_TRANSITIONS]
    assert names == ["Bootstrapping", "WaitingForInput", "Transferring", "Success", "Failed"]


def test_check_and_write(tool: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "docs" / "states.md"
    assert tool.main(["--check", "--output", str(out)]) == 1  # missing
    assert tool.main(["--output", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == tool.render()
    assert tool.main(["--check", "--output", str(out)]) == 0
    out.write_text(tool.render().replace("Landed", "Arrived"), encoding="utf-8")
    assert tool.main(["--check", "--output", str(out)]) == 1
    assert "out of date" in capsys.readouterr().err
