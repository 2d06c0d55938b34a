"""The wheel carries the kernels' CUDA sources. Built as `python -m build` builds it (the sdist,
then the wheel from it; without build isolation: nothing is downloaded, and no build/ is left in
the checkout) and installed with --no-deps in a fresh venv, its pwctl finds them in the installed
package (pwctl/cuda, mapped from the top-level cuda/ by setup.py), not in this checkout, and its
`pwctl bench --kernels --help` runs. The fresh venv borrows this venv's packages (torch, typer,
...) through a .pth line, which adds their folder but not this venv's editable finder of the
checkout's pwctl."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*cmd, cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{cmd}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="session")
def wheel(tmp_path_factory, worker_id) -> Path:
    """Built once for all xdist workers, under a file lock: `build` makes its sdist in a folder
    of the checkout (pwctl-VERSION/), and two workers building at once removed each other's
    files there."""
    from filelock import FileLock

    if importlib.util.find_spec("build") is None:
        pytest.skip("no `build` module: the dev extra installs it")
    root = tmp_path_factory.getbasetemp()
    out = (root if worker_id == "master" else root.parent) / "wheel-dist"
    with FileLock(str(out) + ".lock"):
        if not list(out.glob("pwctl-*.whl")):
            out.mkdir(exist_ok=True)
            _run(sys.executable, "-m", "build", "--no-isolation", "-o", str(out), ".", cwd=ROOT)
    (whl,) = out.glob("pwctl-*.whl")
    return whl


def test_wheel_carries_every_cuda_source(wheel):
    sources = sorted(p for p in (ROOT / "cuda").iterdir() if p.is_file())
    assert sources, "no CUDA sources in the checkout"
    with zipfile.ZipFile(wheel) as z:
        held = {n for n in z.namelist() if n.startswith("pwctl/cuda/")}
        assert held == {f"pwctl/cuda/{p.name}" for p in sources}
        for p in sources:
            assert z.read(f"pwctl/cuda/{p.name}") == p.read_bytes()


def test_installed_wheel_finds_its_sources_and_runs_the_cli(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py, bin_dir = env_dir / "bin" / "python", env_dir / "bin"
    _run(str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel), cwd=tmp_path)
    site = Path(_run(str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))",
                     cwd=tmp_path).strip())  # fmt: skip
    (site / "borrowed.pth").write_text(sysconfig.get_path("purelib") + "\n")
    probe = (  # the whole program: every file it includes, found in the installed folder
        "from pwctl.kernels import build, registry; print(build.__file__); print(build.cuda_dir());"
        "files = build.included([f'{f}.cu' for f in registry.FAMILIES], build.cuda_dir());"
        "print(len(files), '#include' in build.program_source(registry.BY_NAME))"
    )
    module, folder, count, found = _run(str(py), "-c", probe, cwd=tmp_path).split()
    assert Path(module).is_relative_to(site) and not Path(module).is_relative_to(ROOT)
    assert Path(folder) == site / "pwctl" / "cuda" and found == "True"
    assert {p.name for p in Path(folder).iterdir()} == {p.name for p in (ROOT / "cuda").iterdir()}
    assert int(count) == len(list((ROOT / "cuda").iterdir()))  # every file of cuda/ is read
    assert "--kernels" in _run(str(bin_dir / "pwctl"), "bench", "--kernels", "--help", cwd=tmp_path)
