// The prefill on mma.sync (`gate_up_prefill`, `down_prefill`: more than 64 tokens a call, every GPU
// but Hopper): a block's rows decoded once into shared memory, multiplied with every token.
#ifndef PWCTL_PREFILL_CU
#define PWCTL_PREFILL_CU
#include "planes.cuh"

// ---- prefill: decode once into shared memory, multiply with every token -----------------------
//
// A CTA owns 4 m-tiles (gate_up: 2 of gate and the same 2 of up, 32 rows; down: 4, 64 rows) and
// up to 128 tokens of one slot. Per 8-word chunk of columns, warp q decodes m-tile q exactly as
// the decode kernels do (same lanes, same k-steps) into shared memory; then every warp multiplies
// all 4 m-tiles with its own 4 n-tiles (a B fragment serves 4 m-tiles, an A fragment 4 n-tiles).
// Two chunk buffers: decoding chunk i + 1 (ALU) overlaps the mma of chunk i (tensor cores).
// Measured on the H200 and not kept: 8 warps of 2 n-tiles each, plane words and B fragments
// loaded a step ahead.
#define PF_NTW 4   // n-tiles per warp
static_assert(PF_TOKENS == 8 * PF_NTW * PF_WARPS, "PF_TOKENS: tokens per pass");
#define PF_STEPS 16  // mma k-steps per chunk: 2 words x 4 phases x 2 halves

struct Prefill {
    Stage st[PF_WARPS];                   // warp q's m-tile
    uint4 a[2][PF_WARPS][PF_STEPS][32];   // A fragments of a chunk: [buffer][m-tile][k-step][lane]
};

template <int B>
__device__ void decode_chunk(const Stage& st, int it, int words, uint4 (&a)[PF_STEPS][32]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    u32 L0[8], L1[8];
    if constexpr (B <= 4) {
        lut_from(st.tbl[g], B, L0);
        lut_from(st.tbl[g + 8], B, L1);
    }
    u32 P[2][2][8];
    const int w = 8 * it + 2 * t;
    load_words<B>(st.ptr + g * 8, w, words, P[0][0], P[0][1]);
    load_words<B>(st.ptr + (g + 8) * 8, w, words, P[1][0], P[1][1]);
    #pragma unroll
    for (int u = 0; u < 2; ++u) {
#define PHASE(C)                                                                                  \
        {                                                                                         \
            u32 A0[4], A1[4];                                                                     \
            decode<B, C, true>(P[0][u], L0, st.tbl[g], A0);                                       \
            decode<B, C, true>(P[1][u], L1, st.tbl[g + 8], A1);                                   \
            a[(4 * u + C) * 2][lane] = make_uint4(A0[0], A1[0], A0[1], A1[1]);                    \
            a[(4 * u + C) * 2 + 1][lane] = make_uint4(A0[2], A1[2], A0[3], A1[3]);                \
        }
        PHASE(0) PHASE(1) PHASE(2) PHASE(3)
#undef PHASE
    }
}

// live: the m-tile has a row in range (else it was never staged, and its fragments are zeros).
__device__ void decode_chunk_any(const Stage& st, int B, bool live, int it, int words,
                                 uint4 (&a)[PF_STEPS][32]) {
    if (!live) {
        const int lane = threadIdx.x & 31;
        for (int k = 0; k < PF_STEPS; ++k) a[k][lane] = make_uint4(0u, 0u, 0u, 0u);
        return;
    }
    switch (B) {
#define CASE(W) case W: decode_chunk<W>(st, it, words, a); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
    }
}

// acc[m][j] = W[m-tile m] x^T for n-tile (warp + 4j) of the pass, over all columns. The m-tiles
// are staged in sm.st by the caller (warp q: m-tile q, width wq, live: any row in range). ntok:
// the pass's tokens; xrow: each lane's activation row per n-tile, lanes past the pass's tokens
// naming a live one (finite; the output columns they make are never stored).
__device__ void prefill_mma(Prefill& sm, int wq, bool live, int words, int wpad, const uint4* xf,
                            const int (&xrow)[PF_NTW], int ntok, float (&acc)[4][PF_NTW][4]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t = lane & 3;
    const int iters = (words + 7) / 8;
    #pragma unroll
    for (int m = 0; m < 4; ++m)
        #pragma unroll
        for (int j = 0; j < PF_NTW; ++j) acc[m][j][0] = acc[m][j][1] = acc[m][j][2] = acc[m][j][3] = 0.f;
    // n-tiles of this warp that hold a token: a prefix, warp-uniform (empty ones skip their mma)
    int live_j = 0;
    const uint4* xb[PF_NTW];
    #pragma unroll
    for (int j = 0; j < PF_NTW; ++j) {
        live_j += 8 * (warp + PF_WARPS * j) < ntok ? 1 : 0;
        xb[j] = xf + (i64)xrow[j] * wpad * 4 + 8 * t;
    }
    decode_chunk_any(sm.st[warp], wq, live, 0, words, sm.a[0][warp]);
    __syncthreads();
    for (int it = 0; it < iters; ++it) {
        if (it + 1 < iters) decode_chunk_any(sm.st[warp], wq, live, it + 1, words, sm.a[(it + 1) & 1][warp]);
        const uint4 (*a)[PF_STEPS][32] = sm.a[it & 1];
        // k-step pair s (= 4u + c) takes B piece 4u + c of the lane's words 8it + 2t, 8it + 2t + 1.
        // The mma run m-tiles innermost, so no two adjacent mma share an accumulator (7-10% faster
        // than n-tiles innermost; loading the next pair's B ahead as well measured slower)
        #pragma unroll
        for (int s = 0; s < PF_STEPS / 2; ++s) {
            uint4 b[PF_NTW];
            #pragma unroll
            for (int j = 0; j < PF_NTW; ++j) b[j] = __ldg(xb[j] + 32 * it + s);
            uint4 af[2][4];  // [k-step 2s + h][m-tile]
            #pragma unroll
            for (int m = 0; m < 4; ++m) {
                af[0][m] = a[m][2 * s][lane];
                af[1][m] = a[m][2 * s + 1][lane];
            }
            #pragma unroll
            for (int h = 0; h < 2; ++h)
                #pragma unroll
                for (int j = 0; j < PF_NTW; ++j)
                    if (j < live_j)
                        #pragma unroll
                        for (int m = 0; m < 4; ++m) {
                            const uint4 f = af[h][m];
                            mma16816(acc[m][j], f.x, f.y, f.z, f.w, h ? b[j].z : b[j].x, h ? b[j].w : b[j].y);
                        }
        }
        __syncthreads();
    }
}

__device__ __forceinline__ void check_smem(unsigned need) {
    unsigned have;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));
    if (have < need) __trap();  // the launcher's size (geometry.PREFILL_SMEM) is out of date
}

// The kernel's dynamic shared memory as a T (the launcher sized it: geometry.PREFILL*_SMEM).
template <class T>
__device__ __forceinline__ T& shared_as() {
    extern __shared__ __align__(16) unsigned char smem[];
    check_smem(sizeof(T));
    return *reinterpret_cast<T*>(smem);
}

// Pass and tile of a prefill CTA: blockIdx.x = row tile * passes + pass (passes fastest).
__device__ __forceinline__ Tile prefill_tile(const Slots& s, int passes, int rows_per_cta) {
    Tile c;
    c.slot = blockIdx.y;
    c.lo = __ldg(s.lo + c.slot);
    c.T = __ldg(s.hi + c.slot) - c.lo;
    c.base = (blockIdx.x % passes) * PF_TOKENS;
    c.row0 = (blockIdx.x / passes) * rows_per_cta;
    return c;
}

// The token of the slot (0 = its first) whose activation row a lane reads in n-tile j of the
// pass; lanes past the pass's tokens read its first one (see `prefill_mma`).
__device__ __forceinline__ int pass_token(const Tile& c, int j) {
    const int k = c.base + 8 * ((threadIdx.x >> 5) + PF_WARPS * j) + ((threadIdx.x & 31) >> 2);
    return k < c.T ? k : c.base;
}

// gate_up for prefill: 32 rows (warps 0, 1: gate rows 0-15, 16-31; warps 2, 3: up), then h
// as in `gate_up`. Dynamic shared memory: sizeof(Prefill).
__device__ void gate_up_prefill(Paged g, Slots s, const uint4* xf, unsigned short* hp, int I,
                                int words_in, int wpad_in, int wpad_out, i64 bits_nbytes, int rpt,
                                int passes) {
    Prefill& sm = shared_as<Prefill>();
    const Tile c = prefill_tile(s, passes, 2 * ROWS);
    if (c.base >= c.T) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int e = __ldg(s.expert + c.slot);
    const int block = __ldg(s.block_ids + 3 * e + (warp >> 1)), wq = __ldg(g.width + block);
    const int mrow0 = c.row0 + ROWS * (warp & 1), nrows = min(ROWS, I - mrow0);
    if (nrows > 0) stage(g, block, wq, bits_nbytes, words_in, rpt, mrow0, nrows, sm.st[warp], lane, 32);
    __syncwarp();
    int xrow[PF_NTW];
    #pragma unroll
    for (int j = 0; j < PF_NTW; ++j) xrow[j] = __ldg(s.token + c.lo + pass_token(c, j));
    float acc[4][PF_NTW][4];
    prefill_mma(sm, wq, nrows > 0, words_in, wpad_in, xf, xrow, c.T - c.base, acc);
    #pragma unroll
    for (int mt = 0; mt < 2; ++mt)
        #pragma unroll
        for (int j = 0; j < PF_NTW; ++j)
            #pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int row = c.row0 + ROWS * mt + (lane >> 2) + 8 * (r >> 1);
                const int k = c.base + 8 * (warp + PF_WARPS * j) + 2 * (lane & 3) + (r & 1);
                if (k < c.T) STORE_H(s, e, hp, c.lo + k, row, I, wpad_out, acc[mt][j][r], acc[2 + mt][j][r]);
            }
}

// down for prefill: 64 rows (warp q: rows 16q..16q+15), out[token] += weight * (down h).
__device__ void down_prefill(Paged g, Slots s, const uint4* hp, float* out, int H, int words_in,
                             int wpad_in, i64 bits_nbytes, int rpt, int passes) {
    Prefill& sm = shared_as<Prefill>();
    const Tile c = prefill_tile(s, passes, 4 * ROWS);
    if (c.base >= c.T || c.row0 >= H) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int e = __ldg(s.expert + c.slot);
    const int block = __ldg(s.block_ids + 3 * e + 2), wq = __ldg(g.width + block);
    const int mrow0 = c.row0 + ROWS * warp, nrows = min(ROWS, H - mrow0);
    if (nrows > 0) stage(g, block, wq, bits_nbytes, words_in, rpt, mrow0, nrows, sm.st[warp], lane, 32);
    __syncwarp();
    int xrow[PF_NTW];
    #pragma unroll
    for (int j = 0; j < PF_NTW; ++j) xrow[j] = c.lo + pass_token(c, j);
    float acc[4][PF_NTW][4];
    prefill_mma(sm, wq, nrows > 0, words_in, wpad_in, hp, xrow, c.T - c.base, acc);
    #pragma unroll
    for (int mt = 0; mt < 4; ++mt)
        #pragma unroll
        for (int j = 0; j < PF_NTW; ++j)
            #pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int row = c.row0 + ROWS * mt + (lane >> 2) + 8 * (r >> 1);
                const int k = c.base + 8 * (warp + PF_WARPS * j) + 2 * (lane & 3) + (r & 1);
                if (k < c.T && row < H)
                    atomicAdd(out + (i64)__ldg(s.token + c.lo + k) * H + row,
                              __ldg(s.weight + c.lo + k) * WITH_DOWN_BIAS(s, e, row, H, true, acc[mt][j][r]));
            }
}

#if WANT(gate_up_prefill)
extern "C" __global__ void __launch_bounds__(32 * PF_WARPS) gate_up_prefill(
    PAGED_ARGS, SLOT_ARGS, const uint4* xf, unsigned short* hp, int I, int words_in, int wpad_in,
    int wpad_out, i64 bits_nbytes, int rpt, int passes) {
    gate_up_prefill(PAGED, SLOTS, xf, hp, I, words_in, wpad_in, wpad_out, bits_nbytes, rpt, passes);
}
#endif
#if WANT(down_prefill)
extern "C" __global__ void __launch_bounds__(32 * PF_WARPS) down_prefill(
    PAGED_ARGS, SLOT_ARGS, const uint4* hp, float* out, int H, int words_in, int wpad_in,
    i64 bits_nbytes, int rpt, int passes) {
    down_prefill(PAGED, SLOTS, hp, out, H, words_in, wpad_in, bits_nbytes, rpt, passes);
}
#endif
#endif  // PWCTL_PREFILL_CU
