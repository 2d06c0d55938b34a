// The popc decode (`gate_up_p1`, `down_p1` and kin, `popc_planes`): one-token and few-token calls
// on binary tensor cores (docs/KERNELS.md; pwctl/kernels/registry.py lists the builds).
#ifndef PWCTL_POPC_CU
#define PWCTL_POPC_CU
#include "lookup.cu"
#include "pieces.cuh"

// ---- one-token decode on binary tensor cores ---------------------------------------------------
//
// With one token a slot, mma.m16n8k16 spends 7 of its 8 columns on nothing and the lookup's
// integer work bounds the kernels (docs/KERNELS.md). These kernels (`gate_up_p1`, `down_p1` and
// their 3-bit build `*_p1b3`, for the one-token calls FusedMoE._x_pieces picks) do no lookup. A row's table T at width B is
// written in the multilinear basis of its label bits: T[label] = sum over plane subsets S of c_S * prod_{p in
// S} bit_p (c_S: Moebius sums of T), so
//     y[r] = sum_S c_S[r] * (AND of r's planes in S) . x,
// and with x in 16-bit two's-complement fixed point q = round(x / sx), each (AND_S) . q is an exact
// integer that mma.m16n8k256 .and.popc adds up: A = q's 16 bit planes (rows) over 256 columns,
// B = AND_S of 8 weight rows (columns). A warp issues 2^B - 1 mma a k-step (8 rows x 256
// columns); a lane 2^B - B - 1 LOP3 per 32 of its weights, against ~100 integer operations for
// the lookup at 4 bits.
//
// Columns go in k-steps of 256: first full 16-word chunks (two k-steps; lane t holds words
// 16c + 4t .. + 3 of its row, one 16-byte load a plane), then 8-word k-steps (lane t: words
// 8j + 2t, + 1). `step_word` gives lane t's first word of a k-step, its second is the next.
// x (the token's activations for gate_up: `x_piece` in the prep launch; each pair's h for down:
// `popc_planes`) is quantized once per call, per piece of at most POPC_STEPS k-steps with the
// piece's own scale, into the A fragments in global memory (PopcX); the lanes fold their integer sums into fp64 after each
// piece (the two's-complement planes of a lane's two x bit planes cancel against other lanes' by
// up to 2^15 / |x|, too much for fp32). pwctl/kernels/popc.py is the CPU twin.

// Each pair's h (fragment-order fp16 rows, from gate_up) into its pieces: piece blockIdx.x of row
// blockIdx.y, word blockIdx.z of each k-step; rows past `rows` are the second group's (the shared
// expert's h). A warp a k-step of the longest piece (the launcher sizes the block). x's pieces are
// built in the launch that prepares the call (`x_piece`).
#define POPC_THREADS 1024
#if WANT(popc_planes)
extern "C" __global__ void __launch_bounds__(POPC_THREADS) popc_planes(
    const unsigned short* src, int wpad, int words, int rows, PopcX* dst,
    const unsigned short* t_src, int t_wpad, int t_words, PopcX* t_dst) {
    STAMP(3, 0);
    // down may launch and stage now, while gate_up runs: triggered after this grid's wait, its
    // CTAs entered only once gate_up had ended, and staged on the critical path (Qwen3-MoE, one
    // token, popc: 30.4 -> 27.8 us at 3 bits; decisions/012)
    start_next();
    int row = blockIdx.y;
    if (row >= rows) row -= rows, src = t_src, wpad = t_wpad, words = t_words, dst = t_dst;
    const int pieces = popc_pieces(words);
    if ((int)blockIdx.x >= pieces) return;
    // column `lane` of a word in fragment order: store_h's position, written as it ran on the
    // GPU (sharing store_h's expression changes either kernel's code)
    const int lane = threadIdx.x & 31;
    const int pos = 8 * (lane & 3) + 4 * (lane >> 4) + ((lane >> 2) & 3);
    src += (i64)row * wpad * 32;
    // Two passes over one copy of the build: the first, before the wait, reads h as it stands
    // and stores nothing (its values are dropped), so that what the build needs besides h (its
    // instructions, h's pages) is at hand when h lands; the second builds. The loads after the
    // wait took 1.5-2.0 us on Mixtral, 0.85 with the first pass (decisions/023)
    #pragma unroll 1
    for (int pass = 0; pass < 2; ++pass) {
        if (pass == 1) {
            wait_previous();  // h from gate_up
            __syncthreads();  // (the first pass's scale read before the second resets it)
            STAMP(3, 1);
        }
        popc_piece_of<1>([&](int w) { return h2f(src[32 * w + pos]); }, words, blockIdx.x,
                         blockIdx.z, dst + (i64)row * pieces + blockIdx.x, pass == 1, true);
    }
    STAMP(3, 7);
}
#endif

__device__ __forceinline__ void mma_popc(int (&d)[4], const uint4& a, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc {%0,%1,%2,%3}, "
        "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
}

template <int B, int S>
__device__ __forceinline__ u32 subset_and(const u32 (&w)[B]) {
    u32 v = 0xffffffffu;
    #pragma unroll
    for (int p = 0; p < B; ++p)
        if (S >> p & 1) v &= w[p];
    return v;
}

// The integer sums of the lane's rows over one k-step (a0, lo0, hi0) or, TWO, a chunk's two, for
// every subset S != {}: the mma gives x planes g (d[0], d[1]: rows 2t, 2t + 1) and g + 8 (d[2],
// d[3]). With R = 4 registers a subset, acc[S] is that fragment. With R = 2 the two planes are
// combined after the chunk, acc[S][r] = d[r] + k8 d[2 + r] with k8 = +-256 (x's top plane is
// negative), and the fold multiplies by 2^g (exact: a piece's |acc| <= 32 * 256 * 257 < 2^22).
// Half the registers across the loop for two integer operations a subset and chunk (popc_regs
// says which builds take it).
template <int B, int R, bool TWO, int S = 1, int NS>
__device__ __forceinline__ void popc_step(int (&acc)[NS][R], int k8, const uint4& a0,
                                          const u32 (&lo0)[B], const u32 (&hi0)[B],
                                          const uint4& a1, const u32 (&lo1)[B],
                                          const u32 (&hi1)[B]) {
    if constexpr (S < (1 << B)) {
        if constexpr (R == 4) {
            static_assert(!TWO, "R = 4 takes one k-step a call");
            mma_popc(acc[S], a0, subset_and<B, S>(lo0), subset_and<B, S>(hi0));
        } else {
            int d[4] = {acc[S][0], acc[S][1], 0, 0};
            mma_popc(d, a0, subset_and<B, S>(lo0), subset_and<B, S>(hi0));
            if constexpr (TWO) mma_popc(d, a1, subset_and<B, S>(lo1), subset_and<B, S>(hi1));
            acc[S][0] = d[0] + k8 * d[2];
            acc[S][1] = d[1] + k8 * d[3];
        }
        popc_step<B, R, TWO, S + 1>(acc, k8, a0, lo0, hi0, a1, lo1, hi1);
    }
}

// A warp's share of k-steps [k0, k1) (k0 even) for 8 rows: lane (g, t) reads row g's planes;
// px: the piece that starts at k-step `base`. Work units are full chunks, then single 8-word
// k-steps; the warp takes units part, part + parts, ... of the piece.
// rp: 8 plane pointers, the lane's row's words `at` on from theirs (`lane_rows`). HOLD: rows that
// lie in one slab stream from pointers held in registers (below).
template <int B, int R, bool HOLD, int NS>
__device__ void popc_rows(const RowPtr* rp, int at, int words, int k0, int k1, int base, int part,
                          int parts, const PopcX* px, int (&acc)[NS][R]) {
    const int lane = threadIdx.x & 31, t = lane & 3, chunks = words / 16;
    const int k8 = lane >> 2 == 7 ? -256 : 256;  // R = 2: x plane g + 8's weight against g's
    const int u_end = min(chunks, k1 / 2);
#if PROBE(POPC_NO_STREAM)  // (probes.cuh)
    return;
#endif
    // Loads at the top of each chunk: a chunk in flight a warp. Measured slower on the H200
    // (decisions/019): the next chunk in registers too (3 CTAs an SM), L2 prefetches
    // 2 or 4 chunks ahead, a 4-stage cp.async ring in shared memory.
    // row_of(p, w): where words w .. w + 3 of plane p lie (w % 4 == 0: one side of a split)
    const auto stream = [&](auto row_of) {
        const auto quad = [&](int p, int w) { return __ldg((const uint4*)row_of(p, w)); };
        for (int u = k0 / 2 + part; u < u_end; u += parts) {
            uint4 q[B];
            #pragma unroll
            for (int p = 0; p < B; ++p) q[p] = quad(p, 16 * u + 4 * t);
            if constexpr (R == 4) {  // a k-step a call, as the code was before R = 2: a rewrite
                // with unchanged registers made the 4-bit kernels 4% slower (120.5 -> 125.5 us)
                #pragma unroll
                for (int s = 0; s < 2; ++s) {
                    u32 lo[B], hi[B];
                    #pragma unroll
                    for (int p = 0; p < B; ++p)
                        lo[p] = s ? q[p].z : q[p].x, hi[p] = s ? q[p].w : q[p].y;
                    const uint4 a = __ldg(&px->a[2 * u + s - base][lane]);
                    popc_step<B, R, false>(acc, k8, a, lo, hi, a, lo, hi);
                }
            } else {
                u32 lo[2][B], hi[2][B];
                #pragma unroll
                for (int p = 0; p < B; ++p)
                    lo[0][p] = q[p].x, hi[0][p] = q[p].y, lo[1][p] = q[p].z, hi[1][p] = q[p].w;
                popc_step<B, R, true>(acc, k8, __ldg(&px->a[2 * u - base][lane]), lo[0], hi[0],
                                      __ldg(&px->a[2 * u + 1 - base][lane]), lo[1], hi[1]);
            }
        }
        // 8-word k-steps past the full chunks (the piece's part of them), 8-byte loads
        const int first = max(k0, 2 * chunks);
        for (int ks = first + part; ks < k1; ks += parts) {
            const int w = step_word(ks, chunks, t);
            u32 lo[B], hi[B];
            #pragma unroll
            for (int p = 0; p < B; ++p) {
                const uint2 v = w < words ? __ldg((const uint2*)row_of(p, w)) : make_uint2(0u, 0u);
                lo[p] = v.x, hi[p] = v.y;
            }
            const uint4 a = __ldg(&px->a[ks - base][lane]);
            popc_step<B, R, false>(acc, k8, a, lo, hi, a, lo, hi);
        }
    };
    // HOLD (`hold_rows`): rows that lie in one slab (every row of a Mixtral gate or up block: its
    // groups tile the slabs) stream from pointers held in registers. Read from shared memory at
    // each chunk, the one-token 4-bit gate_up's own rows' pointers meet in 4-way bank conflicts
    // (Mixtral 4 bits, one token: 93.3 -> 91.7 us held there, 90.5 held in every 4-bit build;
    // decisions/026). Otherwise, and for rows that straddle a slab edge, the side is
    // chosen at each load.
    const volatile RowPtr* vr = rp;
    bool flat = HOLD;
    #pragma unroll
    for (int p = 0; p < B; ++p) flat = flat && vr[p].split >= words;
    if (HOLD && __all_sync(0xffffffffu, flat)) {
        const u32* row[B];
        #pragma unroll
        for (int p = 0; p < B; ++p) row[p] = vr[p].p0 + at;
        stream([&](int p, int w) { return row[p] + tiled(w); });
    } else {
        stream([&](int p, int w) {
            const volatile RowPtr& r = vr[p];
            return (w < r.split ? r.p0 : r.p1) + at + tiled(w);
        });
    }
}

// c_S of one row's table at width B: S a plane subset (bit p: plane p, which holds label bit
// B - 1 - p, so a subset's label is its bits reversed), the Moebius transform in registers, fp32.
// Computed where the fold needs them, after the streaming: in a CTA's prologue they cost 13 us of
// a Mixtral layer's gate_up (decisions/019).
__host__ __device__ constexpr int reversed(int v, int bits) {
    int r = 0;
    for (int i = 0; i < bits; ++i) r |= ((v >> i) & 1) << (bits - 1 - i);
    return r;
}

template <int B>
__device__ __forceinline__ void row_coef(const unsigned short* tbl, float (&c)[1 << B]) {
    #pragma unroll
    for (int S = 0; S < (1 << B); ++S) c[S] = h2f(tbl[reversed(S, B)]);
    #pragma unroll
    for (int p = 0; p < B; ++p)
        #pragma unroll
        for (int S = 0; S < (1 << B); ++S)
            if (S >> p & 1) c[S] -= c[S ^ (1 << p)];
}

// The same for the 8 rows of a group at once, into coef[row][S] (16 a row), the warp's lanes
// sharing the work: lane (r, q) takes row r's subsets E q .. E q + E - 1 and the transform's
// steps over the bits of q by shuffles, where with `row_coef` the 8 lanes of a row pair repeat
// its transform. Fewer instructions, a longer chain: the few-token 3-bit build takes it (Mixtral,
// 2 tokens: 7% faster), and the others were 2-9% slower with it (the fold was 5-7% of a one-token
// Mixtral layer, most of it the coefficients: decisions/026).
template <int B>
__device__ __forceinline__ void group_coefs(const unsigned short (*tbl)[MAX_TABLE], float* coef) {
    constexpr int N = 1 << B, E = N >= 4 ? N / 4 : 1, LB = E == 4 ? 2 : E == 2 ? 1 : 0;
    const int lane = threadIdx.x & 31, r = lane >> 2, q = lane & 3;
    float c[E];
    #pragma unroll
    for (int e = 0; e < E; ++e) {
        const int S = E * q + e;
        c[e] = S < N ? h2f(tbl[r][reversed(S, B)]) : 0.f;  // (B = 1: lanes q = 2, 3 idle)
    }
    #pragma unroll
    for (int p = 0; p < LB; ++p)  // S's bits within the lane
        #pragma unroll
        for (int e = 0; e < E; ++e)
            if (e >> p & 1) c[e] -= c[e ^ (1 << p)];
    #pragma unroll
    for (int k = 0; k < B - LB; ++k)  // S's bits LB + k: bit k of q, the lane's neighbours
        #pragma unroll
        for (int e = 0; e < E; ++e) {
            const float o = __shfl_xor_sync(0xffffffffu, c[e], 1 << k);
            if (q >> k & 1) c[e] -= o;
        }
    __syncwarp();  // every lane has read the last group's
    #pragma unroll
    for (int e = 0; e < E; ++e)
        if (E * q + e < N) coef[16 * r + E * q + e] = c[e];
    __syncwarp();
}

// The integer sums of k-steps [i0, i1) of a piece into the lane's fp64 partials f[0] (row 2t of
// its 8-row group, whose tables are tbl), f[1] (row 2t + 1): acc[S] as popc_step leaves it. The
// empty subset's term goes in once a row: lanes g = 0 of the `first` warp. COOP: coefficients by
// `group_coefs`, in coef (the warp's scratch, 128 floats), else by `row_coef`.
template <int B, int R, bool COOP, int NS>
__device__ __forceinline__ void popc_fold(int (&acc)[NS][R], const unsigned short (*tbl)[MAX_TABLE],
                                          const PopcX* px, int i0, int i1, bool first,
                                          double (&f)[2], float* coef) {
#if PROBE(POPC_NO_FOLD)
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        int v = 0;
        #pragma unroll
        for (int S = 1; S < (1 << B); ++S) v += acc[S][r] + (R == 4 ? acc[S][2 + r] : 0);
        f[r] += v;
    }
    return;
#endif
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int wg = 1 << g, w8 = g == 7 ? -32768 : 1 << (g + 8);
    int q = 0;
    if (first) {  // a lane a k-step (i1 - i0 <= POPC_STEPS = 32): one load, not a chain of them
        q = i0 + lane < i1 ? __ldg(&px->ksum[i0 + lane]) : 0;
        q = __reduce_add_sync(0xffffffffu, q);
        q = g == 0 ? q : 0;
    }
    const double sx = __ldg(&px->sx);
    if constexpr (COOP) group_coefs<B>(tbl, coef);
    #pragma unroll
    for (int r = 0; r < 2; ++r) {  // one row's coefficients in registers at a time
        float own[1 << B] = {};
        if constexpr (!COOP) row_coef<B>(tbl[2 * t + r] + table_shift(B, r), own);  // (row parity r)
#if PROBE(POPC_NO_COEF)
        const auto c = [&](int S) { return 1.f + S * r; };
#else
        const auto c = [&](int S) { return COOP ? coef[16 * (2 * t + r) + S] : own[S]; };
#endif
        double v = (double)c(0) * q;
        #pragma unroll
        for (int S = 1; S < (1 << B); ++S) {
            int n;
            if constexpr (R == 4) n = wg * acc[S][r] + w8 * acc[S][2 + r];
            else n = wg * acc[S][r];  // x plane g + 8 is in already
            v += (double)c(S) * (double)n;
        }
        f[r] += sx * v;
    }
}

// A warp's scratch for the fold's coefficients (`group_coefs`) in its CTA's `red` (16-byte
// aligned), past the floats `popc_rows_sum` adds there (WARPS x 2 ROWS).
__device__ __forceinline__ float* fold_scratch(float* red) {
    return red + 2 * WARPS * ROWS + 128 * (threadIdx.x >> 5);
}
static_assert(RED_FLOATS >= 2 * WARPS * ROWS + 128 * WARPS, "red holds the fold's coefficients");

// Run-time width -> template: one piece of one 8-row group (B <= MAXB). landing: the tables are
// on their way (`restage`, or `stage_two` keeping sources; every thread of the CTA passes here
// with it). COOP, coef: `popc_fold`'s.
template <int MAXB, int R, bool HOLD, bool COOP>
__device__ __forceinline__ void popc_piece(int B, const RowPtr* rp, int at,
                                           const unsigned short (*tbl)[MAX_TABLE],
                                           int words, int k0, int k1, int base, int part,
                                           int parts, const PopcX* px, double (&f)[2],
                                           float* coef, bool landing = false) {
    int acc[1 << MAXB][R] = {};  // a subset of the MAXB planes each (acc[0] unused)
    switch (B) {
#define POPC_CASE(W)                                                                              \
    case W:                                                                                       \
        if constexpr (W <= MAXB) {                                                                \
            popc_rows<W, R, HOLD>(rp, at, words, k0, k1, base, part, parts, px, acc);            \
            if (landing) tables_landed();                                                         \
            popc_fold<W, R, COOP>(acc, tbl, px, k0 - base, k1 - base, part == 0, f, coef);        \
        }                                                                                         \
        break;
        POPC_CASE(1) POPC_CASE(2) POPC_CASE(3) POPC_CASE(4) POPC_CASE(5)
#undef POPC_CASE
    }
}

// The warp's partials of 8-row group `grp` summed over its lanes into out[8 grp .. + 7].
__device__ __forceinline__ void popc_warp_rows(double (&f)[2], int grp, float* out) {
    const int lane = threadIdx.x & 31;
    #pragma unroll
    for (int d = 4; d < 32; d <<= 1) {
        f[0] += __shfl_xor_sync(0xffffffffu, f[0], d);
        f[1] += __shfl_xor_sync(0xffffffffu, f[1], d);
    }
    if (lane < 4) {
        out[8 * grp + 2 * lane] = (float)f[0];
        out[8 * grp + 2 * lane + 1] = (float)f[1];
    }
}

// The lanes' partials of 8-row group `grp` (rows 8 grp .. + 7 of the CTA) summed over lanes and
// over the `parts` warps that split its columns: rows[r] for the CTA's rows. Barrier at the end.
__device__ void popc_rows_sum(double (&f)[2], int grp, int part, float (*red)[32], float* rows,
                              int nrows) {
    popc_warp_rows(f, grp, red[part]);
    __syncthreads();
    const int parts = WARPS * 8 / nrows;  // warps per 8-row group
    if (threadIdx.x < nrows) {
        float v = 0.f;
        for (int p = 0; p < parts; ++p) v += red[p][threadIdx.x];
        rows[threadIdx.x] = v;
    }
    __syncthreads();
}

// A split tile's halves meet here. Each leaves its rows in `sum`; the second to arrive adds the
// first's into `rows` (true: it stores h) and resets the ticket for the next call.
__device__ bool split_join(const Split& sp, const TileEnd& c, float (&rows)[2][ROWS]) {
    __shared__ int last;
    float* mine = sp.sum + ((i64)c.idx * 2 + c.kz) * 2 * ROWS;
    const float* other = sp.sum + ((i64)c.idx * 2 + (c.kz ^ 1)) * 2 * ROWS;
    if (threadIdx.x < 2 * ROWS) mine[threadIdx.x] = rows[threadIdx.x / ROWS][threadIdx.x % ROWS];
    __threadfence();  // the rows before the ticket
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(sp.ticket + c.idx, 1) == 1;
    __syncthreads();
    if (!last) return false;
    __threadfence();  // the other half's rows after its ticket
    if (threadIdx.x < 2 * ROWS)
        rows[threadIdx.x / ROWS][threadIdx.x % ROWS] += __ldcg(other + threadIdx.x);
    if (threadIdx.x == 0) sp.ticket[c.idx] = 0;
    __syncthreads();
    return true;
}

// Registers a subset holds across the loop (popc_step): 2 where that buys a CTA an SM, the
// one-token 3-bit build (6 CTAs an SM against 5: Mixtral 3 bits, one token, 93.9 -> 90.2 us);
// elsewhere the fragment's 4 (the 4-bit builds were 1.5-2% slower with 2 at 4 CTAs and spilled at
// 5; `pnb3` at 6 CTAs was 3% slower in the routed 4-token call; decisions/021).
__host__ __device__ constexpr int popc_regs(int maxb, bool few) {
    return maxb != 4 && !few ? 2 : 4;  // (the 5-bit build's 31 subsets: 2 registers a subset)
}

// Which builds fold with `group_coefs` (popc_fold's COOP): the few-token one up to 3 bits.
__host__ __device__ constexpr bool coop_fold(int maxb, bool few) { return maxb <= 3 && few; }

// Which builds stream rows in one slab from pointers held in registers (popc_rows' HOLD): the
// 4-bit ones; the builds up to 3 bits spilled with them.
__host__ __device__ constexpr bool hold_rows(int maxb) { return maxb == 4; }

// The plane pointers popc_rows reads for 8-row group `grp` of a tile: the group's row 0's, which
// every lane reads at once (a tiled group's rows share their split: row g's words are 4 g on, and
// `stage` keeps a group's pointers within one group of the plane past the tile's rows too);
// OWN: each lane its own row's, which meet in 4-way bank conflicts (so `popc_rows` holds them in
// registers, HOLD, for rows in one slab). The one-token 4-bit gate_up takes OWN: the other form
// left it 64 bytes of spills in the fold and 2.5% slower, where the rest gained 1-4%
// (decisions/025).
template <bool OWN>
__device__ __forceinline__ const RowPtr* lane_rows(const Stage& st, int grp) {
    return st.ptr + (8 * grp + (OWN ? (threadIdx.x & 31) >> 2 : 0)) * 8;
}

// gate_up for one-token slots: the CTA's 16 rows of gate and up, then h as `gate_up` stores it.
// px: x's pieces (popc_planes), a row per token. Blocks wider than MAXB bits take `mma_block` (the
// lookup) on the fragment-order x. MAXB = 4: `gate_up_p1`; MAXB = 3: `gate_up_p1b3`, whose
// accumulators take a quarter of the registers (7 subsets, popc_regs), so that 6 CTAs an SM fit
// instead of 4 (the launcher takes it when no block of the layer is wider than 3 bits: more warps
// an SM are more loads in flight, decisions/021).
template <int MAXB, bool FEW>
__device__ void gate_up_popc(Paged g, Slots s, Run run, const uint4* xf, unsigned short* hp, int I,
                             int words_in, int wpad_in, int wpad_out, i64 bits_nbytes, int rpt,
                             const PopcX* px, Split sp) {
    __shared__ Stage st[2];
    __shared__ __align__(16) float red[RED_FLOATS];
    __shared__ float rows[2][ROWS];
    __shared__ Run share;  // read where needed: held in registers across the streaming, it spilled
    // by tile parity: a tile's end is read before the next tile but one stages (a barrier), and
    // only then does thread 0 write that tile's
    __shared__ TileEnd ends[2];
    STAMP(0, 0);
    if constexpr (!FEW)
        if (threadIdx.x == 0) share = run;
    prefetch_ids(g, s);
    wait_previous();  // the slots and x's pieces come from the prep launch
    start_next();
    if constexpr (!FEW) __syncthreads();
    STAMP(0, 1);
    // FEW grids hold a tile a CTA (the loop runs once, and the compiler knows it): their state
    // stays in registers, as before the shares (read from shared memory it cost `pnb3` 1-14%)
    const auto last = [&] { return FEW ? run.a + 2 : share.b; };
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int wg = 0, wu = 0;  // the widths of the blocks st holds
    for (int h = FEW ? run.a : share.a; h < last();) {
        const int at = h >> 1, kz = h & 1, kn = kz == 0 && h + 2 <= last() ? 1 : 2;
        // a tile after the share's first stays in st's block (every share walks its tiles in order)
        const bool after = !FEW && at > share.a >> 1;
        h += kn == 1 ? 2 : 1;
        const int tiles = FEW ? run.tiles : share.tiles;
        const Tile c = tile_of(s, ROWS, at / tiles, at % tiles);
        const int e = __ldg(s.expert + c.slot);  // (out with the slot's bounds, not after them)
        if (c.T <= 0) continue;
        // FEW (`gate_up_pn`: calls of up to POPC_MAX_TOKENS tokens; one tile a CTA): a slot of
        // several tokens takes the lookup, whose work does not grow with tokens as the binary
        // mma's does. Compiled out of the one-token build: there it took 8 bytes of stack (121
        // against 117-118 us, one run)
        if constexpr (FEW)
            if (c.T > 1) {
                gate_up_tile<1>(g, s, c, st, red, xf, hp, I, words_in, wpad_in, wpad_out,
                                bits_nbytes, rpt);
                continue;  // FEW grids hold a tile a CTA: nothing to restage after it
            }
        const int nrows = min(ROWS, I - c.row0);
        if (nrows <= 0) {  // a tile of h's padding columns: zeros
            if (threadIdx.x < ROWS) STORE_H(s, e, hp, c.lo, c.row0 + threadIdx.x, I, wpad_out, 0.f, 0.f);
            continue;
        }
        TileEnd end{c.lo, c.row0, kz, kn, (FEW ? run.j : share.j) + 1 - kz};
        if constexpr (!FEW)  // (a tile a CTA: in registers, as it fits there)
            if (threadIdx.x == 0) ends[at & 1] = end;
        const int token = __ldg(s.token + c.lo);
        STAMP_AFTER(0, 4, e);
        // the next tile of the block st holds (tile at - 1, which is full when this one is and
        // shares its slot), its sources kept: no chain
        const bool moved = after && c.row0 > 0 && nrows == ROWS &&
                           max(wg, wu) <= min(MAXB, KEEPS_SOURCES);
        bool flat = true;  // (only the lookup asks, and a moved tile's blocks never take it)
        if (moved) {
            restage(g, __ldg(s.block_ids + 3 * e), wg, bits_nbytes, words_in, rpt, c.row0, st[0]);
            restage(g, __ldg(s.block_ids + 3 * e + 1), wu, bits_nbytes, words_in, rpt, c.row0,
                    st[1]);
            __syncthreads();
        } else {
            flat = stage_gate_up(g, s, e, bits_nbytes, words_in, rpt, c.row0, nrows, st, wg, wu,
                                 true);
        }
        STAMP(0, 2);
        const int ks = popc_steps(words_in);
        const PopcX* x = px + (i64)token * popc_pieces(words_in);
        const int grp = warp & 1;
        constexpr int R = popc_regs(MAXB, FEW);
        constexpr bool OWN = MAXB == 4 && !FEW;  // (lane_rows)
        constexpr bool HOLD = hold_rows(MAXB), COOP = coop_fold(MAXB, FEW);
        if (max(wg, wu) <= MAXB) {
            // gate on warps 0-1, up on 2-3 (8-row group warp % 2), each warp every chunk of its
            // rows in the tile's share: one fold a warp and tile, one barrier. Gate then up on all
            // 4 warps (a column half a warp, a fold every 4 chunks, 4 barriers) was 6% slower at
            // one token (decisions/026). A split tile's halves take alternate chunks.
            const int m = warp >> 1;
            double f[2] = {};
            for (int k0 = 0, i = 0; k0 < ks; k0 += POPC_STEPS, ++i)
                popc_piece<MAXB, R, HOLD, COOP>(m ? wu : wg, lane_rows<OWN>(st[m], grp),
                                                OWN ? 0 : lane & ~3, st[m].tbl + 8 * grp, words_in,
                                                k0, min(ks, k0 + POPC_STEPS), k0, kz, kn, x + i, f,
                                                fold_scratch(red), i == 0);
#if !PROBE(STAMPS_CHAIN)
            STAMP(0, 3);
#endif
            popc_warp_rows(f, grp, rows[m]);
            __syncthreads();
#if !PROBE(STAMPS_CHAIN)  // (phase 6 stamps stage_two's quotients there)
            STAMP(0, 6);
#endif
        } else {
            // a block wider than MAXB: both by the lookup (token 0 of n-tile 0 is fragment register
            // w of lanes 4i), which reads every width; a popc path beside the one above for the
            // narrower block spilled 40 bytes
            tables_landed();  // (a block of up to KEEPS_SOURCES bits staged its tables by cp.async)
            const int kpart = kz * 2 + (warp >> 1), kparts = 2 * kn;
            int xrow[1] = {lane >> 2 == 0 ? token : -1};
            #pragma unroll 1
            for (int m = 0; m < 2; ++m) {
                float acc[1][4], sum[2][1];
                mma_block<1>(st[m], m ? wu : wg, flat, words_in, wpad_in, xf, xrow, 1,
                             (kpart >> 1) * WARPS + warp, kparts / 2 * WARPS, acc);
                reduce_units<1>(acc, red, WARPS, sum);
                if ((lane & 3) == 0 && (warp & 1) == 0)
                    rows[m][(lane >> 2) + 8 * (warp >> 1)] = sum[0][0];
                __syncthreads();
            }
        }
        if constexpr (!FEW) end = ends[((h - 1) >> 1) & 1];  // this tile's (h has moved on)
        if (end.kn > 1 && !split_join(sp, end, rows))
            continue;  // the other half stores h
        if (threadIdx.x < ROWS)
            STORE_H(s, e, hp, end.lo, end.row0 + threadIdx.x, I, wpad_out, rows[0][threadIdx.x],
                    rows[1][threadIdx.x]);
    }
    STAMP(0, 7);
}

// Chunks a warp of down_popc pulls into L2 before its wait: 2 took 0.5-1.5 us off one-token
// layers, 1 less, 8 (a Qwen warp's whole slice) nothing (decisions/027).
#define DOWN_PREFETCH_CHUNKS 2

// Before its wait a down_popc warp pulls into L2 the first `n` chunks it streams after it (units
// u0, u0 + step, ... below u_end, `popc_rows`' order): a chunk of an 8-row group's plane is 4
// lines of 128 bytes (docs/FORMAT.md, tiled), so 4 wd lanes a chunk. rp: the group's row 0.
__device__ void prefetch_chunks(const RowPtr* rp, int wd, int words, int u0, int u_end, int step,
                                int n) {
    for (int l = threadIdx.x & 31; l < 4 * wd * n; l += 32) {
        const int q = l & 3, p = (l >> 2) % wd, u = u0 + (l >> 2) / wd * step;
        if (u < u_end) prefetch_l2(word_ptr(rp[p], 16 * u + 4 * q));
    }
}

// down for one-token slots: `units` m-tiles of 16 rows (8-row groups over the warps, which
// split the columns when there are fewer groups than warps), columns split kn ways (this CTA:
// kz). hpx: h's pieces (popc_planes), a row per pair. Blocks wider than MAXB: the lookup.
template <int MAXB, bool FEW>
__device__ void down_popc(Paged g, Slots s, int slot, int tile, int kz, int kn, const uint4* hp,
                          float* out, int H, int words_in, int wpad_in, i64 bits_nbytes, int rpt,
                          int units, const PopcX* hpx) {
    __shared__ Stage st[2];
    __shared__ __align__(16) float red[RED_FLOATS];
    __shared__ float rows[2 * ROWS];
    STAMP(1, 0);
    const Tile c = tile_of(s, ROWS * units, slot, tile);
    if (c.T <= 0 || c.row0 >= H) return;
    if constexpr (FEW)  // as in gate_up_popc: the lookup, on h from gate_up_tile
        if (c.T > 1)
            return down_tile<1>(g, s, c, kz, kn, st, red, hp, out, H, words_in, wpad_in,
                                bits_nbytes, rpt, units);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int e = __ldg(s.expert + c.slot);
    int wd;
    const bool flat = stage_down(g, s, e, bits_nbytes, words_in, rpt, c.row0, units, H, st, wd);
    STAMP(1, 2);
    const int nrows = ROWS * units;
    if (wd <= MAXB) {
        const int groups = 2 * units, parts = WARPS / groups;
        const int grp = warp % groups, part = warp / groups, unit = grp >> 1;
        const RowPtr* rp = lane_rows<false>(st[unit], grp & 1);
        const int ks = popc_steps(words_in);
        const int per = ((ks + kn - 1) / kn + 1) & ~1;  // even: a slice starts on a full chunk
        const int lo = min(ks, kz * per), hi = min(ks, lo + per);
        const PopcX* x = hpx + (i64)c.lo * popc_pieces(words_in);
        constexpr int R = popc_regs(MAXB, FEW);
        constexpr bool HOLD = hold_rows(MAXB), COOP = coop_fold(MAXB, FEW);
        if (c.row0 + ROWS * unit < H)
            prefetch_chunks(rp, wd, words_in, lo / 2 + part, min(words_in / 16, hi / 2), parts,
                            DOWN_PREFETCH_CHUNKS);
        wait_previous();  // h's pieces come from popc_planes
        STAMP(1, 1);
        double f[2] = {};
        if (c.row0 + ROWS * unit < H)
            for (int k0 = lo; k0 < hi;) {  // the slice's parts of the pieces it meets
                const int i = k0 / POPC_STEPS, k1 = min(hi, (i + 1) * POPC_STEPS);
                popc_piece<MAXB, R, HOLD, COOP>(wd, rp, lane & ~3, st[unit].tbl + 8 * (grp & 1),
                                                words_in, k0, k1, i * POPC_STEPS, part, parts,
                                                x + i, f, fold_scratch(red));
                k0 = k1;
            }
        STAMP(1, 3);
        popc_rows_sum(f, grp, part, (float (*)[2 * ROWS])red, rows, nrows);
        STAMP(1, 4);
    } else {  // the lookup, as `down` does it for n-tile 0
        const int parts = WARPS / units, unit = warp / parts;
        int xrow[1] = {lane >> 2 == 0 ? c.lo : -1};
        wait_previous();
        float acc[1][4] = {}, sum[2][1];
        if (c.row0 + ROWS * unit < H)
            mma_block<1>(st[unit], wd, flat, words_in, wpad_in, hp, xrow, 1,
                         kz * parts + warp % parts, kn * parts, acc);
        reduce_units<1>(acc, red, parts, sum);
        if ((lane & 3) == 0 && (warp & 1) == 0)
            for (int u = 0; u < units; ++u) rows[ROWS * u + (lane >> 2) + 8 * (warp >> 1)] = sum[u][0];
        __syncthreads();
    }
    if (threadIdx.x < nrows && c.row0 + threadIdx.x < H)
        atomicAdd(out + (i64)__ldg(s.token + c.lo) * H + c.row0 + threadIdx.x,
                  __ldg(s.weight + c.lo) *
                      WITH_DOWN_BIAS(s, e, c.row0 + threadIdx.x, H, kz == 0, rows[threadIdx.x]));
    STAMP(1, 7);
}

// up to 5 bits: 31 subsets at 2 registers each (popc_regs), for one-token layers with blocks
// wider than 4 bits, whose 5-bit blocks the other builds read by the lookup. 3 CTAs an SM: 168
// registers and ~130 bytes of spills (NVRTC 13, sm_90a); at 4, ~750 bytes; at 2, 252 and none
#ifndef P1B5_CTAS
#define P1B5_CTAS 3
#endif
#endif  // PWCTL_POPC_CU
