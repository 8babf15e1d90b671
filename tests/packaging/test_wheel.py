"""The package as a user installs it: a wheel, not the editable checkout CI otherwise runs.

The wheel is built from this checkout (``pip wheel --no-deps``) and installed without its
dependencies into a fresh virtual environment whose only other path is the test venv's
site-packages (torch, NIXL and the rest are large; they are the same packages either way). The
editable install's import hook lives in a ``.pth`` file of that site-packages, which a path added
this way does not run, and every command runs outside the checkout, so only the wheel can answer
``import transfer_engine``. Checked: every module of the source tree is in the wheel (the kernels
under ``transfer_engine/kernels``), every one of them imports from the installed copy, the
``transfer-engine`` command runs, and a small CPU transfer through the public API moves its bytes
intact (``wheel_smoke.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _source_modules() -> set[str]:
    """Every module path the wheel must carry, as it is named inside the wheel."""
    found = {str(p.relative_to(ROOT)) for p in (ROOT / "transfer_engine").rglob("*.py")}
    found |= {
        "transfer_engine/kernels/" + str(p.relative_to(ROOT / "kernels"))
        for p in (ROOT / "kernels").rglob("*.py")
    }
    return {f for f in found if "__pycache__" not in f}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the built wheel, the fresh environment's python) with the wheel installed in it."""
    tmp = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp / "dist"),
            str(ROOT),
        ],
        check=True,
        cwd=tmp,
    )
    (wheel,) = (tmp / "dist").glob("transfer_engine-*.whl")
    env_dir = tmp / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (Path(purelib) / "test_venv_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            str(wheel),
        ],
        check=True,
        cwd=tmp,
    )
    return wheel, python


def _run(python: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{python.parent}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run([str(python), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_wheel_carries_every_module(installed: tuple[Path, Path]) -> None:
    wheel, _ = installed
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    missing = _source_modules() - names
    assert not missing, f"the wheel lacks {sorted(missing)}"
    assert "transfer_engine/py.typed" in names
    assert not any(n.startswith(("tests/", "tools/", "examples/")) for n in names)


def test_every_module_imports_from_the_installed_wheel(installed: tuple[Path, Path], tmp_path: Path) -> None:
    _, python = installed
    script = (
        "import importlib, pkgutil, transfer_engine\n"
        "bad = [m.name for m in pkgutil.walk_packages(transfer_engine.__path__, 'transfer_engine.')\n"
        "       if not importlib.import_module(m.name).__file__.startswith(transfer_engine.__path__[0])]\n"
        "assert not bad, bad\n"
        "import transfer_engine.kernels as k\n"
        "print(transfer_engine.__file__, k.__file__)\n"
    )
    done = _run(python, "-c", script, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    package_file, kernels_file = done.stdout.split()
    assert not package_file.startswith(str(ROOT)), package_file
    assert kernels_file.startswith(str(Path(package_file).parent)), kernels_file


def test_cli_runs_from_the_wheel(installed: tuple[Path, Path], tmp_path: Path) -> None:
    _, python = installed
    done = subprocess.run(
        [str(python.parent / "transfer-engine"), "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dump" in done.stdout


def test_a_cpu_transfer_from_the_wheel(installed: tuple[Path, Path], tmp_path: Path) -> None:
    _, python = installed
    done = _run(python, str(Path(__file__).with_name("wheel_smoke.py")), cwd=tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("ok 4096 bytes"), last
    assert str(ROOT) not in last, last
