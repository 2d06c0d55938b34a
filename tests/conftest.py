"""Shared fixtures: tiny checkpoints of every supported architecture in both layouts, converted
once per session (everything is built locally; nothing is downloaded)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# two torch threads per core-pair, split between xdist workers: two workers each spinning two
# threads on two cores run many-small-op tests (the batched engine, convert) several times slower
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _workers)))

from pwctl.build import tiny  # noqa: E402
from pwctl.build.convert import ConvertOptions, convert  # noqa: E402

LAYOUTS = ("per_expert", "fused")


@pytest.fixture(autouse=True)
def _whole_device_after_each_test():
    """A test's serving engine caps torch's allocator at its budget (accounting.cap_allocator):
    the next test gets the whole device again, whatever it allocates."""
    yield
    if torch.cuda.is_available():
        from pwctl.runtime.memory.accounting import release_allocator_cap

        release_allocator_cap("cuda")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {
        (arch, layout): tiny.make_checkpoint(
            arch, root / f"{arch}-{layout}", fused=layout == "fused"
        )
        for arch in tiny.ARCHS
        for layout in LAYOUTS
    }


@pytest.fixture(scope="session")
def packs(checkpoints, tmp_path_factory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("packs")
    out = {}
    for key, src in checkpoints.items():
        out[key] = root / f"{key[0]}-{key[1]}"
        convert(src, out[key], ConvertOptions())
    return out


def pytest_configure(config):
    # pytest-xdist's load scheduling hands each worker a first chunk of consecutive tests, so the
    # NVRTC parts (sorted first, below) would all land in one worker's chunk and run one after
    # another; one test at a time spreads them (unless --maxschedchunk says otherwise)
    if getattr(config.option, "maxschedchunk", "") is None:
        config.option.maxschedchunk = 1


def pytest_collection_modifyitems(config, items):
    # the longest tests (`early`: the NVRTC parts) first, so that pytest-xdist's workers start on
    # them and the short ones fill in around them (stable: the rest keep their order)
    items.sort(key=lambda item: item.get_closest_marker("early") is None)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _bundled(name: str, root: Path, profile: bool) -> Path:
    """A bundled model converted at widths 3..6 (with a proxy profile, so budgeted policies run
    on it), built once for all xdist workers under a file lock."""
    from filelock import FileLock

    from pwctl.build.checkpoint import CALIB_SAMPLE
    from pwctl.build.profile import run_profile
    from pwctl.format.pack import Pack
    from pwctl.format.profile import PROFILE_JSON
    from pwctl.runtime.engine.engine import Engine
    from pwctl.text import spread_windows

    out = root / f"bundled-{name}-3-6"
    done = out / (PROFILE_JSON if profile else "manifest.json")
    with FileLock(str(out) + ".lock"):
        if not done.is_file():
            convert(name, out, ConvertOptions(min_bits=3, max_bits=6, force=True))
            if profile:
                engine = Engine(Pack(out))
                ids = spread_windows(engine.tokenizer, [CALIB_SAMPLE], 4, 64)
                run_profile(engine, ids, "proxy").save(engine.pack)
    return out


def _shared_root(tmp_path_factory, worker_id) -> Path:
    root = tmp_path_factory.getbasetemp()
    return root if worker_id == "master" else root.parent


@pytest.fixture(scope="session")
def bundled_pack(tmp_path_factory, worker_id) -> Path:
    """tiny-mixtral, profiled."""
    return _bundled("tiny-mixtral", _shared_root(tmp_path_factory, worker_id), profile=True)


@pytest.fixture(scope="session")
def bundled_qwen_pack(tmp_path_factory, worker_id) -> Path:
    """tiny-qwen-moe (shared expert and its gate), not profiled."""
    return _bundled("tiny-qwen-moe", _shared_root(tmp_path_factory, worker_id), profile=False)
