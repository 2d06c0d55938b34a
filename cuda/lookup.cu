// The lookup decode (`gate_up_n*`, `down_n*`: 1-64 tokens a call): a CTA's 16 rows of one block
// for up to 8 NT tokens of one slot, labels looked up into mma.m16n8k16 fragments
// (docs/KERNELS.md "Decode"). Also what the popc kernels share with it: the grid's groups (the
// shared expert beside the routed slots), gate_up's persistent runs, the staging of a tile, and
// the entry macros every decode kernel is made by (pwctl/kernels/registry.py lists them).
#ifndef PWCTL_LOOKUP_CU
#define PWCTL_LOOKUP_CU
#include "planes.cuh"

// The eight k-steps of one word w of rows g (P0) and g + 8 (P1), for every live n-tile.
// One n-tile at 5 bits decodes labels as bytes (BYTES): no spill there now, and calls of 1-2
// tokens 3-10% faster on the Qwen shapes, 2% on Mixtral's 2 tokens. At 6 bits it was 2-7% faster
// on Mixtral and Qwen1.5-MoE and 3% slower on Qwen3-MoE; at 8 bits 4.5% faster on Mixtral and
// 1-10% slower on the Qwen shapes; in the larger tiles, within 1% (decisions/033).
template <int B, int NT>
__device__ __forceinline__ void mma_word(const u32 (&P0)[8], const u32 (&P1)[8], const u32 (&L0)[8],
                                         const u32 (&L1)[8], const Stage& st, int w, int wpad,
                                         const uint4* xf, const int (&xrow)[NT], int live,
                                         float (&acc)[NT][4]) {
    const int g = (threadIdx.x & 31) >> 2;
#define PHASE(C)                                                                                  \
    {                                                                                             \
        u32 A0[4], A1[4];                                                                         \
        decode<B, C, NT == 1 && B == 5>(P0, L0, st.tbl[g], A0);                                   \
        decode<B, C, NT == 1 && B == 5>(P1, L1, st.tbl[g + 8], A1);                               \
        _Pragma("unroll") for (int nt = 0; nt < NT; ++nt) {                                       \
            if (NT > 2 && nt >= live) break; /* n-tiles past the slot's tokens */                 \
            const uint4 bx = xrow[nt] >= 0 ? __ldg(xf + ((i64)xrow[nt] * wpad + w) * 4 + C)       \
                                           : make_uint4(0u, 0u, 0u, 0u);                          \
            mma16816(acc[nt], A0[0], A1[0], A0[1], A1[1], bx.x, bx.y);                            \
            mma16816(acc[nt], A0[2], A1[2], A0[3], A1[3], bx.z, bx.w);                            \
        }                                                                                         \
    }
    PHASE(0) PHASE(1) PHASE(2) PHASE(3)
#undef PHASE
}

// acc[nt] += this warp's share of W[rows] x^T for the tokens whose fragment-order rows are
// xrow[nt] (-1: no token), W read at width B <= 4 from the staged block.
//
// Lane t takes words w = 8 it + t + 4u (u = 0, 1) of iteration it: the four lanes of a row read
// 16 contiguous bytes of a plane. Loads roll one iteration ahead without extra registers: as soon
// as word u of this iteration is decoded, its registers are refilled with word u of the next, so
// a load has half an iteration of decoding to arrive.
template <int B, int NT, bool FLAT>
__device__ __forceinline__ void mma_rows(const Stage& st, int words, int wpad, const uint4* xf,
                         const int (&xrow)[NT], int live, int part, int parts,
                         float (&acc)[NT][4]) {
    // the column iterations are shared by `parts` warps: those of a unit times the CTAs of a
    // k-split (`part`: this warp's place among them)
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    u32 L0[8], L1[8];
    lut_from(st.tbl[g], B, L0);
    lut_from(st.tbl[g + 8], B, L1);
    const RowPtr *r0 = st.ptr + g * 8, *r1 = st.ptr + (g + 8) * 8;
    const int iters = (words + 7) / 8, step = parts;
    int it = part;
    u32 Pa0[8], Pa1[8], Pb0[8], Pb1[8];  // words u = 0 (a) and 1 (b) of rows g, g + 8
    load_word<B, FLAT>(r0, r1, 8 * it + t, words, Pa0, Pa1);
    load_word<B, FLAT>(r0, r1, 8 * it + t + 4, words, Pb0, Pb1);
    for (; it < iters; it += step) {
        const int w = 8 * it + t;
        mma_word<B, NT>(Pa0, Pa1, L0, L1, st, w, wpad, xf, xrow, live, acc);
        load_word<B, FLAT>(r0, r1, w + 8 * step, words, Pa0, Pa1);
        mma_word<B, NT>(Pb0, Pb1, L0, L1, st, w + 4, wpad, xf, xrow, live, acc);
        load_word<B, FLAT>(r0, r1, w + 4 + 8 * step, words, Pb0, Pb1);
    }
}

// The same for widths 5-8 (tables in shared memory): lane t takes words 8 it + 2t and + 1, both
// loaded at the top of the iteration (rolling them would hold 4B words a lane across the loop, and
// the kernel's register count is that of its widest path).
template <int B, int NT>
__device__ __forceinline__ void mma_rows_wide(const Stage& st, int words, int wpad, const uint4* xf,
                              const int (&xrow)[NT], int live, int part, int parts,
                              float (&acc)[NT][4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const u32 L[8] = {};  // unused: the lookups read the shared-memory table
    const int iters = (words + 7) / 8;
    for (int it = part; it < iters; it += parts) {
        const int w = 8 * it + 2 * t;
        u32 P[2][2][8];  // [row g / g + 8][word w / w + 1][plane]
        load_words<B>(st.ptr + g * 8, w, words, P[0][0], P[0][1]);
        load_words<B>(st.ptr + (g + 8) * 8, w, words, P[1][0], P[1][1]);
        mma_word<B, NT>(P[0][0], P[1][0], L, L, st, w, wpad, xf, xrow, live, acc);
        mma_word<B, NT>(P[0][1], P[1][1], L, L, st, w + 1, wpad, xf, xrow, live, acc);
    }
}

// A slot takes the loop of the smallest compiled tile that holds its tokens (a launch's NT fits
// its largest possible slot; most are smaller), so empty n-tiles cost no mma. The choice is made
// once, outside the loop: mma_word's skip past a slot's tokens, compiled into the 2-tile loop
// too, made it slower than the dead mma it saved (decisions/031).
template <int NT>
__device__ __forceinline__ void mma_tier(const Stage& st, int B, bool flat, int words, int wpad,
                         const uint4* xf, const int (&xrow)[NT], int live, int part,
                         int parts, float (&acc)[NT][4]) {
    if constexpr (NT > 1) {
        if (live <= NT / 2) {
            mma_tier<NT / 2>(st, B, flat, words, wpad, xf,
                             reinterpret_cast<const int(&)[NT / 2]>(xrow), live, part, parts,
                             reinterpret_cast<float(&)[NT / 2][4]>(acc));
            return;
        }
    }
    switch (B) {
#define CASE(W)                                                                                   \
    case W:                                                                                       \
        if (flat) mma_rows<W, NT, true>(st, words, wpad, xf, xrow, live, part, parts, acc);       \
        else mma_rows<W, NT, false>(st, words, wpad, xf, xrow, live, part, parts, acc);           \
        break;
        CASE(1) CASE(2) CASE(3) CASE(4)
#undef CASE
#define CASE(W) case W: mma_rows_wide<W, NT>(st, words, wpad, xf, xrow, live, part, parts, acc); break;
        CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
    }
}

template <int NT>
__device__ __forceinline__ void mma_block(const Stage& st, int B, bool flat, int words, int wpad,
                          const uint4* xf, const int (&xrow)[NT], int live, int part,
                          int parts, float (&acc)[NT][4]) {
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
    mma_tier<NT>(st, B, flat, words, wpad, xf, xrow, live, part, parts, acc);
}

// A gate_up CTA's work: halves [a, b) of its group's tiles (tile `at`, slot at / tiles, is halves
// 2 at and 2 at + 1, which take alternate chunks of its columns). On the per-tile grid, one tile.
// One-token calls of more tiles than a wave run a persistent grid instead (GATE_UP_ENTRY's RUN,
// a wave of CTAs, `runs` of them routed): CTA j takes the j-th of `runs` equal shares of the routed
// tiles' halves, so that every CTA gets the same work to within a half (a Mixtral layer's 1792
// tiles on 528 CTAs: 6 or 7 halves), and each tile after its first stages without a chain of
// loads (`restage`); the CTAs after them share the shared expert's tiles the same way. A share
// may begin or end in the middle of a tile, whose halves then meet in split_join.
struct Run {
    int a, b;   // halves [a, b)
    int j;      // this CTA's share (persistent grid); its first tile's scratch is j's, its last j + 1's
    int tiles;  // tiles a slot
};

// Where a tile computed in two halves meets (split_join): a scratch a share, the one that begins
// in the tile.
struct Split {
    float* sum;   // [runs + 1][2 halves][2 * ROWS]: each half's gate and up rows
    int* ticket;  // [runs + 1]: halves done; the second half resets it to 0
};

// A gate_up tile's place and what its end needs (split_join, store_h). The persistent grid keeps
// it in shared memory across the streaming: held in registers with the share's bounds, it took
// `gate_up_p1` from 127 registers to 128 and 20 bytes of spills, reloaded after the streaming
// (which has likely evicted them from L1 and L2), and a CTA a tile ran 4% slower (Mixtral, 4
// bits, one token; decisions/024).
struct TileEnd {
    int lo, row0;  // the tile's pair and first row
    int kz, kn;    // this CTA's half of the columns, and the halves (1: a whole tile)
    int idx;       // the tile's scratch in Split
};

// The warps' partial sums, added in shared memory 4 n-tiles at a time. The warps form units of
// `parts` warps that split one m-tile's columns (4 parts: one unit; 2 parts: two m-tiles side by
// side). Thread (warp w, lane l) ends with fragment register w of lane l, i.e. row (l / 4) +
// 8 (w / 2), token 2 (l % 4) + (w % 2) of each n-tile, of unit u in sum[u][nt].
#define RED_TILES 4
#define RED_FLOATS (WARPS * RED_TILES * 4 * 32)  // a CTA's `red`
template <int NT>
__device__ void reduce_units(const float (&acc)[NT][4], float* red, int parts, float (&sum)[2][NT]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    #pragma unroll
    for (int n0 = 0; n0 < NT; n0 += RED_TILES) {
        __syncthreads();  // the previous group (or caller) is done with red
        #pragma unroll
        for (int nt = n0; nt < min(NT, n0 + RED_TILES); ++nt)
            #pragma unroll
            for (int r = 0; r < 4; ++r) red[((warp * RED_TILES + nt - n0) * 4 + r) * 32 + lane] = acc[nt][r];
        __syncthreads();
        #pragma unroll
        for (int nt = n0; nt < min(NT, n0 + RED_TILES); ++nt) {
            float s0 = 0.f, s1 = 0.f;  // not sum[w / parts]: a run-time index would spill sum
            #pragma unroll
            for (int w = 0; w < WARPS; ++w) {
                const float v = red[((w * RED_TILES + nt - n0) * 4 + warp) * 32 + lane];
                if (w < parts) s0 += v;
                else s1 += v;
            }
            sum[0][nt] = s0;
            sum[1][nt] = s1;
        }
    }
}

struct PopcX;  // x's pieces for the one-token kernels (pieces.cuh); the lookup kernels ignore them

// Before its wait a gate_up CTA pulls into L2 what staging chases after it: the block ids, widths,
// slab offsets and slab-map entries of one row of block_ids (CTA j: row j), 4 of the 5 dependent
// loads before a tile's first plane word, each a miss when a layer runs cold (as in a model's
// step: the other layers' planes pass through L2 between two of this one's). The router has not
// chosen the experts yet, so every row's: ~20 KB of lines a Mixtral layer, ~100 KB a Qwen3-MoE.
__device__ void prefetch_ids(const Paged& g, const Slots& s) {
    const int j = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    if (j >= s.n_ids || threadIdx.x >= 96) return;
    const int lane = threadIdx.x & 31, b = __ldg(s.block_ids + 3 * j + (threadIdx.x >> 5));
    const int* off = g.slab_off + (i64)b * g.max_bits;
    if (lane == 0) prefetch_l2(g.width + b);
    // the block's planes' entries lie together (the last plane's first only: the array may end
    // there, and that plane is read at width max_bits alone)
    const int first = __ldg(off), last = __ldg(off + g.max_bits - 1) + 1;
    for (int e = (first & ~31) + 32 * lane; e < last; e += 32 * 32)
        prefetch_l2(g.slab_map + e);
}

// Stage rows [row0, row0 + nrows) of expert e's gate (st[0]) and up (st[1]) blocks, their widths
// out in wg, wu; ends with a barrier. Returns whether every staged row is flat (`stage`).
__device__ __forceinline__ bool stage_gate_up(const Paged& g, const Slots& s, int e,
                                              i64 bits_nbytes, int words, int rpt, int row0,
                                              int nrows, Stage (&st)[2], int& wg, int& wu,
                                              bool keep = false) {
    const int b[2] = {__ldg(s.block_ids + 3 * e), __ldg(s.block_ids + 3 * e + 1)};
    wg = __ldg(g.width + b[0]), wu = __ldg(g.width + b[1]);
    STAMP_AFTER(0, 5, wg + wu);
    const int B[2] = {wg, wu}, r0[2] = {row0, row0}, nr[2] = {nrows, nrows};
    const bool flat = stage_two(g, b, B, bits_nbytes, words, rpt, r0, nr, 2, st, keep);
    STAMP_AFTER(0, 3, (size_t)st[0].ptr[0].p0 + (size_t)st[1].ptr[0].p0);
    return __syncthreads_and(flat);
}

// Stage the `units` 16-row tiles from row0 of expert e's down block (a tile past H is neither
// staged nor streamed), its width out in wd; ends with a barrier. Returns `stage`'s flatness.
__device__ __forceinline__ bool stage_down(const Paged& g, const Slots& s, int e, i64 bits_nbytes,
                                           int words, int rpt, int row0, int units, int H,
                                           Stage (&st)[2], int& wd) {
    const int bd = __ldg(s.block_ids + 3 * e + 2);
    wd = __ldg(g.width + bd);
    // (row0 < H: the caller's)
    const int count = units == 2 && row0 + ROWS < H ? 2 : 1, second = row0 + ROWS * (count - 1);
    const int b[2] = {bd, bd}, B[2] = {wd, wd}, r0[2] = {row0, second};
    const int nr[2] = {min(ROWS, H - row0), min(ROWS, H - second)};
    const bool flat = stage_two(g, b, B, bits_nbytes, words, rpt, r0, nr, count, st, false);
    return __syncthreads_and(flat);
}

// h[pair] = glu(gate x, up x) in fragment order (`store_h`), for the down projection: the CTA's
// 16 rows for tile c of a slot (also the few-token popc kernels' slots of several tokens).
template <int NT>
__device__ __forceinline__ void gate_up_tile(const Paged& g, const Slots& s, const Tile& c,
                                             Stage (&st)[2], float (&red)[RED_FLOATS],
                                             const uint4* xf, unsigned short* hp, int I,
                                             int words_in, int wpad_in, int wpad_out,
                                             i64 bits_nbytes, int rpt) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int e = __ldg(s.expert + c.slot), nrows = min(ROWS, I - c.row0);
    float gs[NT], us[NT];
    if (nrows > 0) {
        int xrow[NT];
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const int j = c.base + 8 * nt + (lane >> 2);
            xrow[nt] = j < c.T ? __ldg(s.token + c.lo + j) : -1;
        }
        int wg, wu;
        const bool flat = stage_gate_up(g, s, e, bits_nbytes, words_in, rpt, c.row0, nrows, st, wg, wu);
        STAMP(0, 2);
        // gate, then up, each on all 4 warps (running them side by side on 2 warps each was
        // 10-20% slower on Mixtral and no faster on Qwen3-MoE); one copy of the
        // loops for both blocks (two inlined copies spilled the second's accumulators)
        #pragma unroll 1
        for (int m = 0; m < 2; ++m) {
            float acc[NT][4], sum[2][NT];
            mma_block<NT>(st[m], m ? wu : wg, flat, words_in, wpad_in, xf, xrow, c.live, warp, WARPS, acc);
            STAMP(0, 3 + 2 * m);
            reduce_units<NT>(acc, red, WARPS, sum);
            STAMP(0, 4 + 2 * m);
            #pragma unroll
            for (int nt = 0; nt < NT; ++nt) (m ? us : gs)[nt] = sum[0][nt];
        }
    }
    const int row = c.row0 + (lane >> 2) + 8 * (warp >> 1);
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const int j = c.base + 8 * nt + 2 * (lane & 3) + (warp & 1);
        if (j < c.T) STORE_H(s, e, hp, c.lo + j, row, I, wpad_out, gs[nt], us[nt]);
    }
}

template <int NT>
__device__ void gate_up(Paged g, Slots s, Run run, const uint4* xf, unsigned short* hp, int I,
                        int words_in, int wpad_in, int wpad_out, i64 bits_nbytes, int rpt,
                        const PopcX*, Split) {
    __shared__ Stage st[2];
    __shared__ float red[RED_FLOATS];
    STAMP(0, 0);
    prefetch_ids(g, s);
    wait_previous();  // the slots and x come from decode_prep (or h's buffer is still being read)
    start_next();     // down may launch and stage while this grid runs
    STAMP(0, 1);
    const int at = run.a / 2;  // one tile a CTA
    const Tile c = tile_of(s, ROWS, at / run.tiles, at % run.tiles);
    if (c.base >= c.T) return;
    gate_up_tile<NT>(g, s, c, st, red, xf, hp, I, words_in, wpad_in, wpad_out, bits_nbytes, rpt);
    STAMP(0, 7);
}

// out[token] += weight * (down h[pair]) for every pair of a slot (fp32 atomics, so the columns may
// also be split over kn CTAs; this one is kz). `units` m-tiles a CTA: 1 (16 rows, 4 warps on its columns)
// or, for short rows, 2 (rows [row0, row0 + 16) and the 16 after, 2 warps each), so that warps
// have columns to stream.
template <int NT>
__device__ __forceinline__ void down_tile(const Paged& g, const Slots& s, const Tile& c, int kz,
                                          int kn, Stage (&st)[2], float (&red)[RED_FLOATS],
                                          const uint4* hp, float* out, int H, int words_in,
                                          int wpad_in, i64 bits_nbytes, int rpt, int units) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int parts = WARPS / units, unit = warp / parts;
    const int e = __ldg(s.expert + c.slot);
    int xrow[NT];
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const int j = c.base + 8 * nt + (lane >> 2);
        xrow[nt] = j < c.T ? c.lo + j : -1;
    }
    int wd;
    const bool flat = stage_down(g, s, e, bits_nbytes, words_in, rpt, c.row0, units, H, st, wd);
    STAMP(1, 2);
    // everything above read what was final before gate_up started (slots, descriptors); h is not
    wait_previous();
    STAMP(1, 1);
    float acc[NT][4] = {}, sum[2][NT];  // acc stays zero for a tile past H
    if (c.row0 + ROWS * unit < H)
        mma_block<NT>(st[unit], wd, flat, words_in, wpad_in, hp, xrow, c.live,
                      kz * parts + warp % parts, kn * parts, acc);
    STAMP(1, 3);
    reduce_units<NT>(acc, red, parts, sum);
    STAMP(1, 4);
    #pragma unroll
    for (int u = 0; u < 2; ++u) {
        const int row = c.row0 + ROWS * u + (lane >> 2) + 8 * (warp >> 1);
        if (u >= units || row >= H) break;
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const int j = c.base + 8 * nt + 2 * (lane & 3) + (warp & 1);
            if (j < c.T)
                atomicAdd(out + (i64)__ldg(s.token + c.lo + j) * H + row,
                          __ldg(s.weight + c.lo + j) * WITH_DOWN_BIAS(s, e, row, H, kz == 0, sum[u][nt]));
        }
    }
}

template <int NT>
__device__ void down(Paged g, Slots s, int slot, int tile, int kz, int kn, const uint4* hp,
                     float* out, int H, int words_in, int wpad_in, i64 bits_nbytes, int rpt,
                     int units, const PopcX*) {
    __shared__ Stage st[2];
    __shared__ float red[RED_FLOATS];
    STAMP(1, 0);
    const Tile c = tile_of(s, ROWS * units, slot, tile);
    if (c.base >= c.T || c.row0 >= H) return;
    down_tile<NT>(g, s, c, kz, kn, st, red, hp, out, H, words_in, wpad_in, bits_nbytes, rpt, units);
    STAMP(1, 7);
}

// One launch covers two groups of slots. Rows blockIdx.y < n_routed are the routed experts'
// slots (blockIdx.x: row tile, blockIdx.z: k-split). The shared expert's slot (its own slots, h
// buffer and shapes: the t_ arguments) has t_tiles row tiles of t_split parts each, numbered
// through the CTAs of the rows after them, so that it streams beside the routed experts instead
// of after them, with a k-split of its own (its rows may be much longer). Without a shared expert
// the launcher passes the routed group twice and n_routed = gridDim.y.
#define SHARED_SLOT_ARGS const int *t_expert, const int *t_lo, const int *t_hi, const int *t_token,   \
                         const float *t_weight
#define SHARED_SLOTS Slots{t_expert, t_lo, t_hi, t_token, t_weight, block_ids, n_ids NO_BIAS}
#define WHICH_GROUP                                                                              \
    const bool t = (int)blockIdx.y >= n_routed;                                                  \
    int slot = blockIdx.y, tile = blockIdx.x, kz = blockIdx.z, kn = gridDim.z;                   \
    if (t) {                                                                                     \
        const int at = ((blockIdx.y - n_routed) * gridDim.z + blockIdx.z) * gridDim.x + blockIdx.x; \
        if (at >= t_tiles * t_split) return;                                                     \
        slot = 0, tile = at % t_tiles, kz = at / t_tiles, kn = t_split;                          \
    }
// gate_up's group: WHICH_GROUP's, or with `runs` > 0 (one-token calls: a persistent grid of
// gridDim.x CTAs, one row) the routed tiles' on CTAs [0, runs), the shared expert's on the rest.
#define GATE_UP_GROUP                                                                            \
    const bool t = runs > 0 ? (int)blockIdx.x >= runs : (int)blockIdx.y >= n_routed;           \
    int slot = blockIdx.y, tile = blockIdx.x;                                                    \
    if (t && runs == 0) {                                                                        \
        const int at = (blockIdx.y - n_routed) * gridDim.x + blockIdx.x; /* t_split = 1 */     \
        if (at >= t_tiles) return;                                                               \
        slot = 0, tile = at;                                                                     \
    }
// gate_up's work (Run): the CTA's tile, or with `runs` > 0 the j-th of its group's CTAs' equal
// shares of the group's tiles' halves. The shared expert's shares (a layer whose routed and
// shared tiles fill more than a wave: Qwen1.5-MoE at 4 bits, where one CTA a tile ran 1.4 waves,
// decisions/024) take the scratch indices after the routed ones' [0, runs].
#define RUN                                                                                      \
    const int tiles = t ? t_tiles : 32 * wpad_out / ROWS, at = slot * tiles + tile;              \
    Run run{2 * at, 2 * at + 2, 0, tiles};                                                       \
    if (runs > 0) {                                                                              \
        const int n = t ? gridDim.x - runs : runs, j = t ? blockIdx.x - runs : blockIdx.x;     \
        const i64 halves = 2LL * (t ? 1 : n_routed) * tiles;                                     \
        run = Run{(int)(j * halves / n), (int)((j + 1) * halves / n), t ? runs + 1 + j : j,      \
                  tiles};                                                                        \
    }
// The decode kernels: a program writes one line a kernel, from pwctl/kernels/registry.py, e.g.
// GATE_UP_ENTRY(gate_up_n8, __launch_bounds__(32 * WARPS, 4), gate_up<8>) (a template's commas in
// parentheses: (gate_up_popc<4, false>)).
#define GATE_UP_ENTRY(NAME, BOUNDS, GATE_UP)                                                      \
    extern "C" __global__ void BOUNDS NAME(                                                       \
        PAGED_ARGS, SLOT_ARGS, const uint4* xf, unsigned short* hp, int I, int words_in,         \
        int wpad_in, int wpad_out, i64 bits_nbytes, int rpt, int n_routed, SHARED_SLOT_ARGS,    \
        unsigned short* t_hp, int t_I, int t_wpad_out, i64 t_bits_nbytes, int t_rpt,            \
        int t_tiles, int t_split, const PopcX* px, int runs, float* split_sum,                  \
        int* split_ticket) {                                                                     \
        GATE_UP_GROUP                                                                            \
        (void)t_split; /* 1: gate_up splits no columns on the per-tile grid */                    \
        RUN                                                                                      \
        GATE_UP(PAGED, t ? SHARED_SLOTS : SLOTS, run, xf, t ? t_hp : hp, t ? t_I : I,            \
                words_in, wpad_in, t ? t_wpad_out : wpad_out,                                    \
                t ? t_bits_nbytes : bits_nbytes, t ? t_rpt : rpt, px,                            \
                Split{split_sum, split_ticket});                                                 \
    }
#define DOWN_ENTRY(NAME, BOUNDS, DOWN)                                                            \
    extern "C" __global__ void BOUNDS NAME(                                                       \
        PAGED_ARGS, SLOT_ARGS, const uint4* hp, float* out, int H, int words_in, int wpad_in,    \
        i64 bits_nbytes, int rpt, int units, int n_routed, SHARED_SLOT_ARGS, const uint4* t_hp, \
        int t_words_in, int t_wpad_in, i64 t_bits_nbytes, int t_rpt, int t_units, int t_tiles,  \
        int t_split, const PopcX* hpx, const PopcX* t_hpx) {                                     \
        WHICH_GROUP                                                                              \
        DOWN(PAGED, t ? SHARED_SLOTS : SLOTS, slot, tile, kz, kn, t ? t_hp : hp, out, H,         \
             t ? t_words_in : words_in, t ? t_wpad_in : wpad_in,                                 \
             t ? t_bits_nbytes : bits_nbytes, t ? t_rpt : rpt, t ? t_units : units,              \
             t ? t_hpx : hpx);                                                                   \
    }

#endif  // PWCTL_LOOKUP_CU
