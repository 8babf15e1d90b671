"""The plugin loads in SGLang's launcher without torchvision, and patches SGLang's scheduler modules
when they are imported after it (each in a fresh interpreter, as SGLang's processes start).

SGLang's launcher loads every general plugin; a CPU machine has no usable torchvision, which
``sglang.srt.disaggregation.utils`` imports through SGLang's model configs. The plugin must not
import that module at load time (it printed ``Failed to execute general plugin: transfer_engine``
and a traceback); a scheduler process imports it later, and then gets the backend.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LAUNCHER = """
import sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES
assert "transfer_engine" in DISAGG_TRANSFER_BACKEND_CHOICES, DISAGG_TRANSFER_BACKEND_CHOICES
assert "sglang.srt.disaggregation.utils" not in sys.modules
assert "torchvision" not in sys.modules
print("launcher ok")
"""

SCHEDULER = """
from sglang.srt.plugins import load_plugins
load_plugins()
import tests.sglang.conftest  # torchvision's path, then SGLang's scheduler modules: after the plugin
from sglang.srt.disaggregation import decode, prefill, utils
from transfer_engine.integrations.sglang import KVManager, KVReceiver, KVSender
backend = utils.TransferBackend("transfer_engine")
assert backend.name == "TRANSFER_ENGINE" and utils.TransferBackend("nixl").name == "NIXL"
assert utils.get_kv_class(backend, utils.KVClassType.MANAGER) is KVManager
assert prefill.get_kv_class(prefill.TransferBackend("transfer_engine"), utils.KVClassType.SENDER) is KVSender
assert decode.get_kv_class(backend, utils.KVClassType.RECEIVER) is KVReceiver
assert utils.get_kv_class(utils.TransferBackend.FAKE, utils.KVClassType.SENDER).__name__ == "FakeKVSender"
assert utils.__loader__.get_source("sglang.srt.disaggregation.utils")
print("scheduler ok")
"""


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240)


def test_launcher_loads_the_plugin_without_torchvision() -> None:
    done = run(LAUNCHER)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "launcher ok"
    assert "Failed to execute" not in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_scheduler_modules_imported_after_the_plugin_are_patched() -> None:
    done = run(SCHEDULER)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("scheduler ok")
    assert "Failed to" not in done.stderr and "Traceback" not in done.stderr, done.stderr
