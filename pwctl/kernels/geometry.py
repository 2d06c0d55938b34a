"""Tile sizes and constants the CUDA sources share with Python, and the grid arithmetic the
launchers plan with. `DEFINES` is written into every program the runtime compiles
(`build.program_source`), so each constant has this one place; the sources check that they got
them (cuda/common.cuh)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

WARPS = 4  # warps per decode CTA: they split a block's columns
ROWS = 16  # block rows of one mma m-tile: a gate_up CTA's rows (of gate and of up)
MAX_TABLE = 256  # a row's table entries at the widest width (2^8)
PREP_THREADS = 256  # threads of a prep launch's block (decode_prep, route_prep, prefill_prep)
POPC_SPLIT = 8  # popc_planes CTAs a piece: one for each word of a k-step
POPC_STEPS = 32  # k-steps of 256 columns in one piece of x (PopcX)
PREFILL_WARPS = 4  # warps per prefill CTA
PREFILL_TOKENS = 128  # tokens of one slot per prefill pass (and of one sm_90a token tile)
GROUP_SPLIT = 2048  # pairs from which prefill_prep groups with every warp of its block
ROUTE_LOADS = 4  # route_prep's slice_dot: 16-byte loads a lane issues together, on each row
ROUTE_MAX_EXPERTS = 256  # experts route_prep's top-k reads (8 a lane)

# The CUDA names of the constants above, as each program defines them.
DEFINES = {
    "WARPS": WARPS,
    "ROWS": ROWS,
    "MAX_TABLE": MAX_TABLE,
    "PREP_THREADS": PREP_THREADS,
    "POPC_SPLIT": POPC_SPLIT,
    "POPC_STEPS": POPC_STEPS,
    "PF_WARPS": PREFILL_WARPS,
    "PF_TOKENS": PREFILL_TOKENS,
    "GROUP_SPLIT": GROUP_SPLIT,
    "ROUTE_LOADS": ROUTE_LOADS,
    "ROUTE_MAX_EXPERTS": ROUTE_MAX_EXPERTS,
}

# calls of up to this many tokens may take the popc kernels (popc.cu gate_up_popc): their slots of
# one token on the binary mma, larger slots on the lookup in one n-tile (<= 8 tokens). Mixtral,
# H200: 1.15x the lookup kernels at 6 tokens and 4 bits, even at 8 (decisions/020)
POPC_MAX_TOKENS = 8
POPC_MAX_BITS = 4  # widest block their binary mma reads (gate_up_popc<4>; wider: their lookup)
DECODE_TILES = (1, 2, 4, 8)  # n-tiles of 8 tokens per slot compiled for decode (gate_up<NT>)
DECODE_MAX_TOKENS = 8 * DECODE_TILES[-1]
PREFILL_ROWS = {"gate_up": 2 * ROWS, "down": 4 * ROWS}  # block rows per prefill CTA
CTAS_PER_SM = 8  # what a k-split aims for: enough warps in flight to cover memory latency

# Shared memory of the structs the launchers size (each prefill kernel checks its size against
# its struct). sizeof(Stage): per (row, plane) a RowPtr of 24 bytes, per row a table.
STAGE_BYTES = ROWS * 8 * 24 + ROWS * MAX_TABLE * 2
# sizeof(Prefill): a Stage a warp, and two chunks of A fragments (16 k-steps x 32 lanes x 16 bytes)
PREFILL_SMEM = PREFILL_WARPS * STAGE_BYTES + 2 * PREFILL_WARPS * 16 * 32 * 16
# sizeof(PrefillWG): a Stage a warp, two B buffers of 8 k-steps x 128 tokens, B's two mbarriers
PREFILL_WG_SMEM = 4 * STAGE_BYTES + 2 * 8 * PREFILL_TOKENS * 16 * 2 + 2 * 8
# sizeof(PopcX): a piece's A fragments, its k-steps' sums, its scale (and padding)
PIECE_BYTES = POPC_STEPS * 32 * 16 + POPC_STEPS * 4 + 16


def group_smem(experts: int, pairs: int = 0) -> int:
    """Dynamic shared memory of a launch that groups `pairs` pairs (prep.cu group_pairs): an int
    per expert and grouping warp (every warp of the block from GROUP_SPLIT pairs on)."""
    return 4 * (PREP_THREADS // 32 if pairs >= GROUP_SPLIT else 1) * experts


def n_tiles(tokens: int) -> int:
    """The smallest compiled decode tile (in n-tiles of 8 tokens) holding `tokens` a slot."""
    for nt in DECODE_TILES:
        if tokens <= 8 * nt:
            return nt
    raise ValueError(f"{tokens} tokens per slot: decode kernels take at most {DECODE_MAX_TOKENS}")


@functools.cache
def sm_count() -> int:
    """The current device's SMs: what a grid fills."""
    import torch

    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def gate_up_runs(tiles: int, wave: int) -> int:
    """CTAs of a one-token gate_up's persistent grid (lookup.cu Run): one wave when the tiles
    are more than a wave, each CTA then taking an equal share of the tiles' halves and staging
    each tile after its first without a chain of loads (`restage`); else 0, one CTA a tile."""
    return wave if tiles > wave else 0


def gate_up_shares(ctas: int, tiles: int, shared_tiles: int) -> tuple[int, int]:
    """`ctas` persistent gate_up CTAs split between `tiles` routed tiles and the shared
    expert's `shared_tiles` in proportion, each group at least one CTA and at most one a half
    tile; (0, 0) for none. With a shared expert a layer's tiles are one grid, so a second
    group's one CTA a tile ran past a wave (Qwen1.5-MoE, 4 bits: 736 tiles on 528 slots)."""
    if ctas == 0:
        return 0, 0
    if shared_tiles == 0:
        return min(ctas, 2 * tiles), 0
    routed = min(2 * tiles, max(1, min(ctas - 1, round(ctas * tiles / (tiles + shared_tiles)))))
    return routed, max(1, min(2 * shared_tiles, ctas - routed))


def down_units(words: int) -> int:
    """m-tiles of a down CTA (lookup.cu `down`): 2 side by side, 2 warps each, when rows are too
    short (< 4 iterations of 8 words) to give 4 warps a share of one tile's columns."""
    return 2 if -(-words // 8) < WARPS else 1


def k_split(ctas: int, words: int, parts: int = WARPS, wave: int | None = None) -> int:
    """CTAs sharing one tile's columns (down only: it adds with atomics), while every one of the
    `parts` warps on a tile keeps at least one 8-word iteration. The lookup kernels: enough CTAs
    to fill the GPU at CTAS_PER_SM an SM. Given `wave` (CTAs resident at once: the popc kernels,
    4-6 an SM), the most that stay within one wave: there a CTA's fixed costs (staging, sums,
    atomics) outweigh a part-empty wave (Mixtral, 4 bits, one token: 110.8 us a layer with one
    CTA a tile, 117.4 with three; docs/decisions/024-one-token-grids.md)."""
    want = -(-CTAS_PER_SM * sm_count() // max(ctas, 1)) if wave is None else wave // max(ctas, 1)
    return max(1, min(want, -(-words // 8) // parts))


def balanced_split(
    words: int, parts: int, like_words: int, like_parts: int, like_split: int
) -> int:
    """The k-split of a group launched beside another (the shared expert beside the routed ones,
    whose rows may be several times longer): enough CTAs a tile that its warps get about the
    iterations of 8 words the other group's warps get, while each keeps at least one."""
    iters, like_iters = -(-words // 8), -(-like_words // 8)
    per_warp = -(-like_iters // (like_parts * like_split))
    return max(1, min(-(-iters // (parts * per_warp)), iters // parts))


@dataclass(frozen=True)
class DownGroup:
    """One group of a decode `down` grid (lookup.cu DOWN_ENTRY): m-tiles a CTA, CTAs a slot's rows
    (one a `units` m-tiles), CTAs sharing a tile's columns."""

    units: int
    ctas: int
    split: int

    @classmethod
    def over(cls, rows: int, units: int, split: int = 1) -> DownGroup:
        return cls(units, -(-rows // (ROWS * units)), split)

    @property
    def parts(self) -> int:  # warps on one m-tile
        return WARPS // self.units

    @property
    def slot_ctas(self) -> int:  # CTAs on one slot's rows: every tile, every split
        return self.ctas * self.split


def down_groups(
    routed: tuple[int, int],
    n_routed: int,
    shared: tuple[int, int] | None,
    wave: int | None,
    split: int | None = None,
    one_wave: bool = True,
) -> tuple[DownGroup, DownGroup | None]:
    """down's grid groups for routed rows (`routed`: rows, words) on `n_routed` slots and the
    shared expert's (or None). The routed split is `split`, or `k_split`'s; the shared expert's
    evens the warps' iterations (`balanced_split`). With `wave` (the popc kernels) and
    `one_wave`, a plan whose two groups overflow the wave takes the first of these that fits:
    the routed tiles two m-tiles a CTA, then smaller routed splits (Qwen1.5-MoE at 4 bits: the
    shared expert's 3 CTAs a tile put 896 CTAs on a wave of 528, 1.7 waves; docs/decisions/
    010-shared-expert-inside.md)."""
    (rows, words), u0 = routed, down_units(routed[1])

    def top(units: int) -> int:  # k_split's routed split at `units` m-tiles a CTA
        g = DownGroup.over(rows, units)
        return k_split(g.ctas * n_routed, words, g.parts, wave)

    def plan(units: int, s: int) -> tuple[DownGroup, DownGroup | None]:
        r = DownGroup.over(rows, units, s)
        if shared is None:
            return r, None
        t = DownGroup.over(shared[0], down_units(shared[1]))
        return r, replace(t, split=balanced_split(shared[1], t.parts, words, r.parts, s))

    first = plan(u0, split if split is not None else top(u0))
    if wave is None or shared is None or split is not None or not one_wave:
        return first
    for units in dict.fromkeys((u0, 2)):  # the default's m-tiles, then two a CTA
        for s in range(top(units), 0, -1):
            r, t = plan(units, s)
            assert t is not None  # shared is not None
            if r.slot_ctas * n_routed + t.slot_ctas <= wave:
                return r, t
    return first
