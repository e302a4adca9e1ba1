"""The package as a user installs it: the built wheel, its metadata, and a fresh import of it.

The wheel is built from a copy of the source tree (nothing written into the checkout), installed
with `--target` into a temporary directory, and imported from there in a subprocess whose
`PYTHONPATH` puts that directory first (the dependencies come from this environment).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from eventbus.version import __version__

ROOT = Path(__file__).resolve().parent.parent

USER_CODE = """\
import eventbus
from eventbus.events import Loss


def main() -> str:
    bus: eventbus.EventBus = eventbus.EventBus()
    bus.publish(Loss(step=1, value=1.0))
    return eventbus.__version__
"""


def _run(cmd: list[str], cwd: Path, *, ok: bool = True, **env: str) -> str:
    """`cmd`'s stdout and stderr; it must exit 0 (or, with `ok=False`, must not)."""
    proc = subprocess.run(
        cmd,
        cwd=cwd,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert (proc.returncode == 0) == ok, f"{' '.join(cmd)}: exit {proc.returncode}\n{out[-4000:]}"
    return out


def test_pyproject_reads_the_version_and_license_from_one_place() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert project["license"] == "MIT" and project["license-files"] == ["LICENSE"]
    assert "MIT License" in (ROOT / "LICENSE").read_text(encoding="utf-8")
    extras = project["optional-dependencies"]
    assert any(r.startswith("lightning>") for r in extras["lightning"])  # the current name
    assert any(r.startswith("pytorch-lightning>") for r in extras["pytorch-lightning"])
    assert any(r.startswith("pandas") for r in extras["pandas"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_wheel_installs_and_imports_typed_in_a_fresh_directory(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(
        ROOT / "eventbus", src / "eventbus", ignore=shutil.ignore_patterns("__pycache__")
    )
    py = sys.executable
    pip = [py, "-m", "pip", "--disable-pip-version-check"]
    wheel_cmd = [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-v"]
    build = _run([*wheel_cmd, "-w", str(tmp_path / "dist"), str(src)], tmp_path)
    # setuptools' deprecation warnings (license as a table, ...) are `...Warning:` lines
    assert not re.findall(r"\w+Warning: .*", build), re.findall(r"\w+Warning: .*", build)
    (wheel,) = (tmp_path / "dist").glob("eventbus-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "eventbus/py.typed" in names
    assert f"eventbus-{__version__}.dist-info/licenses/LICENSE" in names

    site = tmp_path / "site"
    _run([*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)], tmp_path)
    (dist,) = importlib.metadata.distributions(name="eventbus", path=[str(site)])
    assert dist.metadata["License-Expression"] == "MIT"

    # cwd is tmp_path: neither the checkout nor its editable install comes first
    probe = (
        "import json, pathlib, eventbus; pkg = pathlib.Path(eventbus.__file__).parent; "
        "print(json.dumps([str(pkg), eventbus.__version__, (pkg / 'py.typed').is_file()]))"
    )
    out = _run([py, "-c", probe], tmp_path, PYTHONPATH=str(site))
    pkg, version, typed = json.loads(out.strip().splitlines()[-1])
    assert Path(pkg) == site / "eventbus"
    assert version == dist.version == __version__
    assert typed

    user = tmp_path / "user"
    user.mkdir()
    (user / "app.py").write_text(USER_CODE, encoding="utf-8")
    (user / "mypy.ini").write_text("[mypy]\n", encoding="utf-8")  # not the checkout's config
    mypy = [py, "-m", "mypy", "--strict", "--config-file", "mypy.ini"]
    mypy += ["--cache-dir", str(tmp_path / "cache"), "app.py"]
    checked = _run(mypy, user, PYTHONPATH=str(site))
    assert "import-untyped" not in checked and "Success" in checked
    (site / "eventbus" / "py.typed").unlink()  # the check can fail: without the marker...
    assert "import-untyped" in _run(mypy, user, ok=False, PYTHONPATH=str(site))


@pytest.mark.parametrize(
    ("installed", "framework"),
    [("lightning", "lightning.pytorch"), ("pytorch_lightning", "pytorch_lightning")],
)
def test_the_lightning_bridge_takes_either_package_name(
    tmp_path: Path, installed: str, framework: str
) -> None:
    """`lightning.pytorch` first (the current package), else the standalone `pytorch_lightning`."""
    pytest.importorskip("pytorch_lightning")
    if installed == "lightning":  # the unified package, stood in for by the standalone one
        (tmp_path / "lightning" / "pytorch").mkdir(parents=True)
        (tmp_path / "lightning" / "__init__.py").write_text("", encoding="utf-8")
        (tmp_path / "lightning" / "pytorch" / "__init__.py").write_text(
            "from pytorch_lightning import Callback, LightningModule, Trainer\n", encoding="utf-8"
        )
    else:  # hide a `lightning` this environment may have
        (tmp_path / "lightning.py").write_text("raise ImportError('hidden')\n", encoding="utf-8")
    probe = "from eventbus.integrations import lightning; print(lightning.FRAMEWORK)"
    out = _run([sys.executable, "-c", probe], tmp_path, PYTHONPATH=str(tmp_path))
    assert out.split()[-1] == framework
