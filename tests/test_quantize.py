import pytest
import torch

from pwctl.build.quantize import quantize_nested
from pwctl.format.bitplanes import (
    bits_nbytes,
    dequantize,
    group_bytes,
    pack_planes,
    plane_rows,
    tile,
    unpack_labels,
    untile,
)


def heavy_tailed(rows, cols, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.distributions.StudentT(5).sample((rows, cols)) * (
        1 + torch.rand(rows, 1, generator=g)
    )


def test_labels_are_nested_and_tables_are_cluster_means():
    w = heavy_tailed(16, 512)
    q = quantize_nested(w, None, 2, 8)
    for b in range(2, 9):
        lab = q.labels.long() >> (8 - b)
        assert int(lab.max()) < 2**b
        for row in range(3):
            for c in lab[row].unique():
                members = w[row][lab[row] == c]
                torch.testing.assert_close(
                    q.tables[b][row, c], members.mean(), rtol=1e-4, atol=1e-5
                )


def test_prefix_property_is_bit_for_bit():
    w = heavy_tailed(8, 256, seed=1)
    full, short = quantize_nested(w, None, 2, 8), quantize_nested(w, None, 2, 4)
    assert torch.equal(short.labels.long(), full.labels.long() >> 4)
    for b in (2, 3, 4):
        assert torch.equal(short.tables[b], full.tables[b])
    planes8, planes4 = pack_planes(full.labels, 8), pack_planes(short.labels, 4)
    assert torch.equal(planes8[:4], planes4)


def test_error_falls_with_width_and_matches_apl_on_student_t():
    with torch.random.fork_rng():  # seeded: the global RNG's state depends on earlier tests
        torch.manual_seed(0)
        w = torch.distributions.StudentT(5).sample((64, 2048))
    q = quantize_nested(w, None, 2, 8)
    rel = [
        float(((q.tables[b].gather(1, q.labels.long() >> (8 - b)) - w) ** 2).mean() / (w**2).mean())
        for b in range(2, 9)
    ]
    assert all(a > b for a, b in zip(rel, rel[1:], strict=False))
    # APL's own scheme on Student-t(5), K=2048 (shared/notes): .179 (2b), .059 (3b), .0156 (4b)
    assert rel[0] < 0.19 and rel[1] < 0.063 and rel[2] < 0.0165


def test_importance_weighting_lowers_weighted_error():
    w = heavy_tailed(32, 512, seed=2)
    imp = torch.rand(512) ** 4 * 10 + 0.01
    plain, weighted = quantize_nested(w, None, 2, 3), quantize_nested(w, imp[None], 2, 3)

    def werr(q):
        return float((((q.tables[3].gather(1, q.labels.long() >> 0) - w) ** 2) * imp).sum())

    assert werr(weighted) < 0.9 * werr(plain)


def test_degenerate_rows_constant_and_tiny():
    w = torch.cat([torch.full((1, 64), 0.5), torch.zeros(1, 64), heavy_tailed(1, 64)])
    q = quantize_nested(w, torch.zeros(64)[None], 2, 8)  # zero importance falls back safely
    for b in range(2, 9):
        deq = q.tables[b].gather(1, q.labels.long() >> (8 - b))
        assert torch.isfinite(deq).all()
        torch.testing.assert_close(deq[:2], w[:2])


@pytest.mark.parametrize("cols", [32, 45, 100, 257])
def test_pack_unpack_round_trip(cols):
    labels = torch.randint(0, 256, (7, cols), dtype=torch.uint8)
    planes = pack_planes(labels, 8)
    assert planes.dtype == torch.int32 and planes.shape == (8, 7, (cols + 127) // 128 * 4)
    for b in (1, 3, 8):
        assert torch.equal(unpack_labels(planes[:b], cols), labels.long() >> (8 - b))


@pytest.mark.parametrize("rows", [1, 8, 13, 16])
def test_tiled_planes_round_trip_and_place_words_in_units(rows):
    """Stored order (docs/FORMAT.md): word w of row r at (r // 8) 8 words + (w // 4) 32 +
    (r % 8) 4 + w % 4, i.e. cuda/planes.cuh's row_start(r) / 4 + tiled(w); padding rows hold 0."""
    words = 12
    plane = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int64).to(torch.int32)
    stored = tile(plane)
    assert stored.shape == (plane_rows(rows) * words,) and plane_rows(rows) % 8 == 0
    assert torch.equal(untile(stored, rows, words), plane)
    for r in range(plane_rows(rows)):
        for w in range(words):
            at = (r // 8) * 8 * words + (w // 4) * 32 + (r % 8) * 4 + w % 4
            assert stored[at] == (plane[r, w] if r < rows else 0)
    assert group_bytes(words) == 8 * words * 4 and bits_nbytes(rows, words) == 4 * stored.numel()


def test_dequantize_with_shared_tables():
    labels = torch.randint(0, 8, (6, 40), dtype=torch.uint8)
    table = torch.randn(3, 8).half()
    out = dequantize(pack_planes(labels, 3), table, 2, 40)
    assert torch.equal(out, table.float().repeat_interleave(2, 0).gather(1, labels.long()))
