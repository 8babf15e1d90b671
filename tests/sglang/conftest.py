"""Make SGLang's scheduler modules (``sglang.srt.disaggregation.{prefill,decode,utils}``) importable.

They import SGLang's model configs, which import torchvision. PyPI has no CPU build of torchvision
for torch 2.13: its wheel (0.28.0, the one pinned to torch==2.13.0) links CUDA torch's libraries,
so its C++ ops (``nms``, ``roi_align``...) cannot load on the CPU torch here, and the wheel's own
``_meta_registrations`` then fails at import ("operator torchvision::nms does not exist") while it
registers fake kernels for ``nms`` and ``qnms``. Installed into the virtualenv it breaks vLLM, so
``make setup`` puts it in ``.venv/sglang-cpu`` (docs/sglang.md), which only this directory's
tests add to ``sys.path``; the two op schemas are declared here, without kernels, before
torchvision is imported. Everything else of torchvision is its own code; calling one of its C++ ops
raises (no CPU kernel), and nothing on SGLang's text path calls one.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

SGLANG_CPU = Path(sys.prefix) / "sglang-cpu"
"""Where ``make setup`` installs torchvision for these tests only."""

_TORCHVISION_OPS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_library: torch.library.Library | None = None


def _op_exists(name: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(name, "")
    except RuntimeError:
        return False
    return True


def enable_sglang_scheduler_imports() -> None:
    """Put torchvision where SGLang finds it, import SGLang's scheduler modules and load its plugins
    (this backend's among them); idempotent. Helper processes import this module too."""
    global _library
    if str(SGLANG_CPU) not in sys.path and SGLANG_CPU.is_dir():
        sys.path.append(str(SGLANG_CPU))
    if _library is None and not _op_exists("torchvision::nms"):
        _library = torch.library.Library("torchvision", "DEF")
        for schema in _TORCHVISION_OPS:
            _library.define(schema)
    with warnings.catch_warnings():
        # their import-time notices: torchvision's torch.jit.script_method, "Only CUDA ... AWQ"...
        warnings.simplefilter("ignore")
        import sglang.srt.disaggregation.decode  # noqa: F401
        import sglang.srt.disaggregation.prefill  # noqa: F401
        import sglang.srt.disaggregation.utils  # noqa: F401
        from sglang.srt.plugins import load_plugins

    load_plugins()  # as every SGLang process does first: this package's entry point among them


enable_sglang_scheduler_imports()
