"""convert + the CPU reference on tiny checkpoints of every architecture and layout."""

import json

import pytest
import torch
from shared import assert_matches_transformers, kl_per_token

from pwctl.build import tiny
from pwctl.build.convert import ConvertOptions, convert
from pwctl.format.pack import Pack
from pwctl.runtime.engine.engine import Engine

CASES = [(a, layout) for a in tiny.ARCHS for layout in ("per_expert", "fused")]
_engines: dict = {}


def engine_for(packs, case) -> Engine:
    if case not in _engines:
        _engines[case] = Engine(Pack(packs[case]))
    return _engines[case]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_fp16_matches_transformers_and_kl_falls_with_width(case, checkpoints, packs):
    assert_matches_transformers(engine_for(packs, case), checkpoints[case])


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_layouts_give_identical_packs(arch, packs):
    a, b = Pack(packs[(arch, "per_expert")]), Pack(packs[(arch, "fused")])
    assert [x.name for x in a.blocks] == [x.name for x in b.blocks]
    for x, y in zip(a.blocks, b.blocks, strict=True):
        assert [p.crc32 for p in x.planes] == [p.crc32 for p in y.planes]


def test_prefix_property_in_the_pack(checkpoints, tmp_path):
    src = checkpoints[("qwen2_moe", "fused")]
    convert(src, tmp_path / "p4", ConvertOptions(max_bits=4))
    convert(src, tmp_path / "p8", ConvertOptions(max_bits=8))
    p4, p8 = Pack(tmp_path / "p4"), Pack(tmp_path / "p8")
    for b4, b8 in zip(p4.blocks, p8.blocks, strict=True):
        for p in range(4):
            assert p4.read_plane(b4, p)[0].tobytes() == p8.read_plane(b8, p)[0].tobytes()
            t4, t8 = p4.read_plane(b4, p)[1], p8.read_plane(b8, p)[1]
            assert (t4 is None and t8 is None) or t4.tobytes() == t8.tobytes()


def test_manifest_describes_every_plane(packs):
    pack = Pack(packs[("qwen2_moe", "per_expert")])
    m = pack.manifest
    assert m.weighting == "uniform" and m.min_bits == 2 and m.max_bits == 8
    shared = [b for b in pack.blocks if b.shared]
    assert len(shared) == 3 * len(m.moe_layers)
    for block in pack.blocks:
        assert len(block.planes) == 8
        assert [p.table_nbytes > 0 for p in block.planes] == [False] + [True] * 7
        assert block.bytes_at(3) < block.bytes_at(4)
        assert all(p.offset % 256 == 0 for p in block.planes)
    on_disk = json.loads((pack.path / "manifest.json").read_text())
    assert on_disk["spec"]["shared_gate"] is True


def test_calibrated_conversion_records_its_weighting(checkpoints, tmp_path):
    calib = tmp_path / "calib.txt"
    calib.write_text(tiny.TOKENIZER_TEXT * 40)
    src = checkpoints[("qwen2_moe", "per_expert")]
    convert(src, tmp_path / "pack", ConvertOptions(calib=calib, calib_tokens=1024))
    pack = Pack(tmp_path / "pack")
    assert pack.manifest.weighting == "calib-ex2"
    assert pack.manifest.calib["tokens"] > 0
    tokens = [b.importance_tokens for b in pack.blocks]
    assert all(t is not None for t in tokens)
    assert (
        max(t for b, t in zip(pack.blocks, tokens, strict=True) if b.shared)
        == pack.manifest.calib["tokens"]
    )
    engine = Engine(pack)
    ids = torch.randint(1, tiny.VOCAB, (1, 32))
    assert kl_per_token(engine, ids, "uniform:8") < 1e-3
