// Prototype of the binary tensor-core decode (recipes/perf_popc_decode.py): y = W x for one token,
// W stored as B bit planes with a per-row table, computed as
//   y[r] = sx * (c_0[r] * sum(xi) + sum over plane subsets S != {} of c_S[r] * (AND_S . xi))
// where xi = x / sx is 16-bit two's-complement fixed point and AND_S . xi is the exact integer
// that mma.m16n8k256 .and.popc adds up: A = the 16 bit planes of xi, B = the AND of the planes
// in S for 8 rows. No lookup: 2^B - 1 mma and about 2^B - B - 1 LOP3 per 32-bit word pair.
typedef unsigned u32;

__device__ __forceinline__ void mma_popc(int (&d)[4], const uint4& a, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
}

// AND of the planes in subset S (bit p of S: plane p).
template <int B, int S>
__device__ __forceinline__ u32 subset_and(const u32 (&w)[B]) {
    u32 v = 0xffffffffu;
    #pragma unroll
    for (int p = 0; p < B; ++p)
        if (S & (1 << p)) v &= w[p];
    return v;
}

template <int B, int S>
__device__ __forceinline__ void subset_mma(int (&acc)[1 << B][4], const uint4& a, const u32 (&lo)[B],
                                           const u32 (&hi)[B]) {
    if constexpr (S < (1 << B)) {
        mma_popc(acc[S], a, subset_and<B, S>(lo), subset_and<B, S>(hi));
        subset_mma<B, S + 1>(acc, a, lo, hi);
    }
}

// One k-step of a lane's 8 rows: acc[S] for every plane subset S (2^B - 1 mma), or with ADD
// (additive tables: c_S = 0 for every subset of 2 or more planes) acc[p + 1] for each plane p.
template <int B, bool ADD, int NS>
__device__ __forceinline__ void step_mma(int (&acc)[NS][4], const uint4& a, const u32 (&lo)[B],
                                         const u32 (&hi)[B]) {
    if constexpr (ADD) {
        #pragma unroll
        for (int p = 0; p < B; ++p) mma_popc(acc[p + 1], a, lo[p], hi[p]);
    } else {
        subset_mma<B, 1>(acc, a, lo, hi);
    }
}

// A lane's sums of one token into y[r0 + 2t], y[r0 + 2t + 1] (cr: row r0 + 2t's coefficients;
// e: the token's sum of xi where this k-split adds the empty subset's term, else 0). acc[j]:
// c0 (x plane g, row 2t), c1 (g, 2t + 1), c2 (g + 8, 2t), c3 (g + 8, 2t + 1). A lane's two planes
// of two's-complement x cancel across lanes by up to ~2^15 / |x|: the lane sums go to fp64
// before the reduction.
template <bool ADD, int NS>
__device__ __forceinline__ void fold_rows(const int (&acc)[NS][4], const float* cr, float sx,
                                          float e, float* y, int r0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int wg = 1 << g, w8 = g == 7 ? -32768 : 1 << (g + 8);
    double f0 = 0.0, f1 = 0.0;
    #pragma unroll
    for (int j = 1; j < NS; ++j) {
        const int S = ADD ? 1 << (j - 1) : j;
        f0 += (double)cr[S] * (double)(wg * acc[j][0] + w8 * acc[j][2]);
        f1 += (double)cr[16 + S] * (double)(wg * acc[j][1] + w8 * acc[j][3]);
    }
    #pragma unroll
    for (int m = 4; m < 32; m <<= 1) {
        f0 += __shfl_xor_sync(0xffffffffu, f0, m);
        f1 += __shfl_xor_sync(0xffffffffu, f1, m);
    }
    if (g == 0) {
        atomicAdd(y + r0 + 2 * t, sx * (float)(f0 + cr[0] * (double)e));
        atomicAdd(y + r0 + 2 * t + 1, sx * (float)(f1 + cr[16] * (double)e));
    }
}

// Lane (g, t)'s first 16-byte unit of 8-row group r0 (words 4t .. 4t + 3 of row r0 + g) and the
// units from one 16-word chunk to the next; TILED: pack format v2's tiled planes, where a warp's
// chunk is 512 contiguous bytes.
#ifdef TILED
constexpr int CHUNK = 32;
__device__ __forceinline__ const uint4* lane_base(const uint4* planes, int r0, int quads) {
    const int lane = threadIdx.x & 31;
    return planes + (long long)r0 * quads + 8 * (lane & 3) + (lane >> 2);
}
#else
constexpr int CHUNK = 4;
__device__ __forceinline__ const uint4* lane_base(const uint4* planes, int r0, int quads) {
    const int lane = threadIdx.x & 31;
    return planes + (long long)(r0 + (lane >> 2)) * quads + (lane & 3);
}
#endif

// The GEMVs' parameters: their bodies' (__restrict__), and the kernels' (`KERNEL`), which leave
// it out: with it on the entries too, ptxas turns some plane loads into LDG.CONSTANT, and the
// measured builds had plain loads.
#define GEMV_ARGS const uint4 *planes, int R, int words, const uint4 *xa, const float *coef,      \
                  const float *sx, const float *sumxi, float *y
#define GEMV_PARAMS const uint4 *__restrict__ planes, int R, int words,                           \
                    const uint4 *__restrict__ xa, const float *__restrict__ coef,                 \
                    const float *__restrict__ sx, const float *__restrict__ sumxi,                \
                    float *__restrict__ y

// planes: [B][R][words] u32 (plane p = bit B-1-p of the label); xa: per token, per 16-word chunk c
// and lane, two uint4 A fragments (k-steps 2c, 2c + 1); coef: [R][16] fp32 subset coefficients;
// sx, sumxi: per token. A warp takes 8 rows and the chunks [c0, c1) (blockIdx.y of gridDim.y
// k-splits); lane (g, t) loads words 16c + 4t .. + 3 of row g: one 16-byte load a plane. y: [T][R],
// zeroed, the k-splits' sums added atomically. Warps loop over row groups (grid smaller than R / 32:
// persistent CTAs). MODE 1 (`popc_loads*`, a probe): the loads, no mma (the words are only
// XORed into one accumulator); MODE 2 (`popc_mma*`): the mma on words made from the lane and
// chunk, no plane loads; MODE 3 (`popc_one*`): one chunk in flight a warp, not two; MODE 4
// (`popc_planes_only*`): the plane loads only, not even x's fragments.
// ADD (`popc_add*`): additive tables (c_S = 0 for every subset of 2 or more planes), so one mma a
// plane and k-step (B, not 2^B - 1) and no ANDs: what such a table format would let decode read.
template <int B, int T, int MODE = 0, bool ROT = false, bool ADD = false>
__device__ __forceinline__ void popc_rows(GEMV_PARAMS, int r0) {
    const int lane = threadIdx.x & 31, t = lane & 3;
    const int quads = words / 4, chunks = words / 16;
    const int per = (chunks + gridDim.y - 1) / gridDim.y;
    const int c0 = blockIdx.y * per;
    int c1 = min(chunks, c0 + per);
    const uint4* base = lane_base(planes, r0, quads);
    const long long pstride = (long long)R * quads;
    constexpr int NS = ADD ? B + 1 : 1 << B;  // accumulators: ADD, plane p at p + 1
    int acc[T][NS][4] = {};
    // ROT: warp (row group) i walks its chunks from chunk i % n on, so that at any moment the
    // warps of the GPU read different offsets of their rows (otherwise all read offset 64 c)
    const int n_c = max(1, c1 - c0), rot = ROT ? (r0 >> 3) % n_c : 0;
    auto at = [&](int c) { return ROT ? c0 + (c - c0 + rot) % n_c : c; };
    auto load = [&](uint4 (&q)[B], int c_) {
        const int c = at(c_);
        #pragma unroll
        for (int p = 0; p < B; ++p) {
            if (MODE == 2) q[p] = make_uint4(c * 0x9e3779b9u ^ p, lane * 0x85ebca6bu, c + lane, p - c);
            else q[p] = c_ < c1 ? __ldg(base + p * pstride + CHUNK * c) : make_uint4(0, 0, 0, 0);
        }
    };
    auto run = [&](const uint4 (&q)[B], int c_) {
        const int c = at(c_);
        u32 lo[B], hi[B];
        #pragma unroll
        for (int s = 0; s < 2; ++s) {
            #pragma unroll
            for (int p = 0; p < B; ++p) lo[p] = s ? q[p].z : q[p].x, hi[p] = s ? q[p].w : q[p].y;
            #pragma unroll
            for (int k = 0; k < T; ++k) {
                const uint4 a = __ldg(xa + (((long long)k * chunks + c) * 32 + lane) * 2 + s);
                if (MODE == 1 || MODE == 4) {
                    #pragma unroll
                    for (int p = 0; p < B; ++p) acc[k][1][0] ^= lo[p] ^ hi[p] ^ (MODE == 1 ? a.x : 0u);
                } else {
                    step_mma<B, ADD>(acc[k], a, lo, hi);
                }
            }
        }
    };
    uint4 q[B], n[B];
    if (MODE == 3) {  // a chunk in flight a warp, loaded at the top of each (as gate_up_p1 does)
        for (int c = c0; c < c1; ++c) {
            load(q, c);
            run(q, c);
        }
        c1 = c0;  // skips the loop below
    }
    load(q, c0);
    for (int c = c0; c < c1; c += 2) {  // two chunks an iteration: no register copies
        load(n, c + 1);
        run(q, c);
        if (c + 1 >= c1) break;
        load(q, c + 2);
        run(n, c + 1);
    }
    const float* cr = coef + (long long)(r0 + 2 * t) * 16;
    #pragma unroll
    for (int k = 0; k < T; ++k)  // the empty subset's term, once: in k-split 0
        fold_rows<ADD>(acc[k], cr, sx[k], blockIdx.y == 0 ? sumxi[k] : 0.f, y + (long long)k * R, r0);
}

template <int B, int T, int MODE = 0, bool ROT = false, bool ADD = false>
__device__ void popc_gemv(GEMV_PARAMS) {
    const int warps = gridDim.x * (blockDim.x >> 5);
    for (int rg = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); rg * 8 < R; rg += warps)
        popc_rows<B, T, MODE, ROT, ADD>(planes, R, words, xa, coef, sx, sumxi, y, rg * 8);
}

// `popc_share*`: as `popc_one` (persistent, one chunk in flight a warp), but warp j takes the
// j-th of the warps' equal shares of whole row groups, as gate_up_p1's CTAs walk theirs (and
// session 28's warps-own-rows gate_up, branch gate-up-warps), where `popc_one`'s warps take
// groups j, j + warps, ... (session 28)
template <int B>
__device__ void popc_share(GEMV_PARAMS) {
    const long long warps = gridDim.x * (blockDim.x >> 5), groups = R / 8;
    const long long w = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    for (long long rg = w * groups / warps; rg < (w + 1) * groups / warps; ++rg)
        popc_rows<B, 1, 3>(planes, R, words, xa, coef, sx, sumxi, y, (int)rg * 8);
}

// Every GEMV kernel takes the same arguments; KERNEL names one and the template it runs, at
// THREADS threads and a floor of CTAS CTAs an SM (RING_KERNEL: the persistent rings, one CTA an
// SM, with the chunks of a stage as `ch`).
#define KERNEL(NAME, THREADS, CTAS, ...)                                                         \
    extern "C" __global__ void __launch_bounds__(THREADS, CTAS) NAME(GEMV_ARGS) {                \
        __VA_ARGS__(planes, R, words, xa, coef, sx, sumxi, y);                                   \
    }
#define RING_KERNEL(NAME, THREADS, ...)                                                          \
    extern "C" __global__ void __launch_bounds__(THREADS, 1) NAME(GEMV_ARGS, int ch) {          \
        __VA_ARGS__(planes, R, words, xa, coef, sx, sumxi, y, ch);                               \
    }
// The fused gate_up_p1's structure on flat planes (session 27 probes): 8 rows of a warp, its
// chunks first, first + step, ... (one in flight), folded into y (atomics). `popc_tiles*`: a CTA
// a 32-row tile at a time (16 "gate" rows, then the next 16, "up"), persistent; warp w takes
// 8-row group w & 1 and chunks w >> 1, + 2, ... of each 16 rows, with two CTA barriers after
// each (as gate_up_p1's sums); SYNC false: no barriers. `popc_own*`: warp w takes 8 rows alone,
// every chunk, gate rows then its up rows (a 64-row tile a CTA), no barriers.
template <int B>
__device__ __forceinline__ void chunk_rows(GEMV_PARAMS, int r0, int first, int step) {
    const int lane = threadIdx.x & 31, t = lane & 3;
    const int quads = words / 4, chunks = words / 16;
    const uint4* base = lane_base(planes, r0, quads);
    const long long pstride = (long long)R * quads;
    int acc[1 << B][4] = {};
    #pragma unroll 1
    for (int c = first; c < chunks; c += step) {
        uint4 q[B];
        #pragma unroll
        for (int p = 0; p < B; ++p) q[p] = __ldg(base + p * pstride + CHUNK * c);
        #pragma unroll
        for (int s = 0; s < 2; ++s) {
            u32 lo[B], hi[B];
            #pragma unroll
            for (int p = 0; p < B; ++p) lo[p] = s ? q[p].z : q[p].x, hi[p] = s ? q[p].w : q[p].y;
            step_mma<B, false>(acc, __ldg(xa + ((long long)c * 32 + lane) * 2 + s), lo, hi);
        }
    }
    fold_rows<false>(acc, coef + (long long)(r0 + 2 * t) * 16, sx[0], first == 0 ? sumxi[0] : 0.f,
                     y, r0);
}

template <int B, bool SYNC, bool OWN = false>
__device__ void popc_tiles(GEMV_PARAMS) {
    const int warp = threadIdx.x >> 5, rows = OWN ? 64 : 32;
    for (int tile = blockIdx.x; tile * rows < R; tile += gridDim.x)
        for (int m = 0; m < 2; ++m) {
            const int r0 = OWN ? 64 * tile + 32 * m + 8 * warp : 32 * tile + 16 * m + 8 * (warp & 1);
            chunk_rows<B>(planes, R, words, xa, coef, sx, sumxi, y, r0, warp >> (OWN ? 2 : 1),
                          OWN ? 1 + (warp >> 2) : 2);  // (OWN: 0, 1 at run time: as constants, ptxas spilled)
            if (SYNC) __syncthreads();
            if (SYNC) __syncthreads();
        }
}
KERNEL(popc_tiles3, 128, 4, popc_tiles<3, true>)
KERNEL(popc_tiles4, 128, 4, popc_tiles<4, true>)
KERNEL(popc_tiles_nosync3, 128, 4, popc_tiles<3, false>)
KERNEL(popc_tiles_nosync4, 128, 4, popc_tiles<4, false>)
KERNEL(popc_own3, 128, 4, popc_tiles<3, false, true>)
KERNEL(popc_own4, 128, 4, popc_tiles<4, false, true>)
KERNEL(popc_share3, 128, 4, popc_share<3>)
KERNEL(popc_share4, 128, 4, popc_share<4>)
KERNEL(popc_gemv3_1, 128, 4, popc_gemv<3, 1>)
KERNEL(popc_gemv4_1, 128, 4, popc_gemv<4, 1>)
KERNEL(popc_loads4, 128, 4, popc_gemv<4, 1, 1>)
KERNEL(popc_mma4, 128, 4, popc_gemv<4, 1, 2>)
KERNEL(popc_one3, 128, 4, popc_gemv<3, 1, 3>)
KERNEL(popc_one4, 128, 4, popc_gemv<4, 1, 3>)
KERNEL(popc_planes_only4, 128, 4, popc_gemv<4, 1, 4>)
KERNEL(popc_rot4, 128, 4, popc_gemv<4, 1, 0, true>)  // chunks walked from a per-warp offset
KERNEL(popc_planes_rot4, 128, 4, popc_gemv<4, 1, 4, true>)
// 3 bits at 4, 5 and 6 CTAs an SM (the 4-bit build's registers allow 4): does occupancy lift it?
KERNEL(popc_at4_3, 128, 4, popc_gemv<3, 1>)
KERNEL(popc_at5_3, 128, 5, popc_gemv<3, 1>)
KERNEL(popc_at6_3, 128, 6, popc_gemv<3, 1>)

// Additive tables at 4, 6 and 8 CTAs an SM, 1, 2 and 4 tokens (`popc_add{B}_{T}_{CTAs}`)
#define ADD_KERNELS(B, T)                                                                        \
    KERNEL(popc_add##B##_##T##_4, 128, 4, popc_gemv<B, T, 0, false, true>)                       \
    KERNEL(popc_add##B##_##T##_6, 128, 6, popc_gemv<B, T, 0, false, true>)                       \
    KERNEL(popc_add##B##_##T##_8, 128, 8, popc_gemv<B, T, 0, false, true>)
ADD_KERNELS(3, 1)
ADD_KERNELS(4, 1)
ADD_KERNELS(3, 2)
ADD_KERNELS(4, 2)
ADD_KERNELS(3, 4)
ADD_KERNELS(4, 4)

// Additive tables, one token, D chunks in flight a warp (a ring of registers: chunk c + D is
// loaded into the registers chunk c leaves) and persistent warps (row groups gridDim.x * warps
// apart): how many bytes in flight the format would let a warp keep (`popc_deep{B}_{D}_{CTAs}`);
// ADD false (`popc_deepf*`): today's tables, every plane subset, the same loop.
template <int B, int D, bool ADD = true>
__device__ void popc_deep(GEMV_PARAMS) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int quads = words / 4, chunks = words / 16;
    const int per = (chunks + gridDim.y - 1) / gridDim.y;
    const int c0 = blockIdx.y * per, c1 = min(chunks, c0 + per);
    const long long pstride = (long long)R * quads;
    const int warps = gridDim.x * (blockDim.x >> 5);
    for (int rg = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); rg * 8 < R; rg += warps) {
        const int r0 = rg * 8;
        const uint4* base = planes + (long long)(r0 + g) * quads + t;
        constexpr int NS = ADD ? B + 1 : 1 << B;
        int acc[NS][4] = {};
        uint4 q[D][B];
        #pragma unroll
        for (int d = 0; d < D; ++d)
            #pragma unroll
            for (int p = 0; p < B; ++p)
                q[d][p] = c0 + d < c1 ? __ldg(base + p * pstride + 4 * (c0 + d)) : make_uint4(0, 0, 0, 0);
        for (int c = c0; c < c1; c += D) {
            #pragma unroll
            for (int d = 0; d < D; ++d) {
                if (c + d < c1) {
                    #pragma unroll
                    for (int s = 0; s < 2; ++s) {
                        const uint4 a = __ldg(xa + ((long long)(c + d) * 32 + lane) * 2 + s);
                        u32 lo[B], hi[B];
                        #pragma unroll
                        for (int p = 0; p < B; ++p) lo[p] = s ? q[d][p].z : q[d][p].x, hi[p] = s ? q[d][p].w : q[d][p].y;
                        step_mma<B, ADD>(acc, a, lo, hi);
                    }
                }
                #pragma unroll
                for (int p = 0; p < B; ++p)
                    q[d][p] = c + d + D < c1 ? __ldg(base + p * pstride + 4 * (c + d + D))
                                             : make_uint4(0, 0, 0, 0);
            }
        }
        const float* cr = coef + (long long)(r0 + 2 * t) * 16;
        fold_rows<ADD>(acc, cr, sx[0], blockIdx.y == 0 ? sumxi[0] : 0.f, y, r0);
    }
}
KERNEL(popc_deep4_2_4, 128, 4, popc_deep<4, 2>)
KERNEL(popc_deep4_4_4, 128, 4, popc_deep<4, 4>)
KERNEL(popc_deep4_4_5, 128, 5, popc_deep<4, 4>)
KERNEL(popc_deep4_8_3, 128, 3, popc_deep<4, 8>)
KERNEL(popc_deep3_4_5, 128, 5, popc_deep<3, 4>)
KERNEL(popc_deep3_8_4, 128, 4, popc_deep<3, 8>)
KERNEL(popc_deepf4_1_4, 128, 4, popc_deep<4, 1, false>)
KERNEL(popc_deepf4_2_4, 128, 4, popc_deep<4, 2, false>)
KERNEL(popc_deepf3_2_4, 128, 4, popc_deep<3, 2, false>)
KERNEL(popc_deepf3_2_5, 128, 5, popc_deep<3, 2, false>)

// The plane loads only, as session 9's streaming kernel issues them: 16 rows a warp (rows g and
// g + 8 of lane (g, t)), a chunk of both rows and every plane in flight (4 KB a warp).
extern "C" __global__ void __launch_bounds__(128, 4) popc_loads16_4(GEMV_ARGS) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int r0 = (blockIdx.x * 4 + (threadIdx.x >> 5)) * 16;
    if (r0 >= R) return;
    const int quads = words / 4, chunks = words / 16;
    const uint4* base = planes + (long long)(r0 + g) * quads + t;
    const long long pstride = (long long)R * quads;
    unsigned acc = 0;
    for (int c = 0; c < chunks; ++c) {
        uint4 v[4][2];
        #pragma unroll
        for (int p = 0; p < 4; ++p)
            #pragma unroll
            for (int r = 0; r < 2; ++r) v[p][r] = __ldg(base + p * pstride + 8 * r * quads + 4 * c);
        #pragma unroll
        for (int p = 0; p < 4; ++p)
            #pragma unroll
            for (int r = 0; r < 2; ++r) acc ^= v[p][r].x ^ v[p][r].y ^ v[p][r].z ^ v[p][r].w;
    }
    y[r0 + lane % 16] = (float)acc;
}
KERNEL(popc_gemv3_2, 128, 3, popc_gemv<3, 2>)
KERNEL(popc_gemv4_2, 128, 2, popc_gemv<4, 2>)

// One mma.m16n8k256 .and.popc with fragments as given: a [32 lanes][4], b [32][2] -> d [32][4]
// (the layout check of perf_popc_decode.py).
extern "C" __global__ void probe(const uint4* a, const uint2* b, int4* d) {
    int acc[4] = {};
    const uint2 bb = b[threadIdx.x];
    mma_popc(acc, a[threadIdx.x], bb.x, bb.y);
    d[threadIdx.x] = make_int4(acc[0], acc[1], acc[2], acc[3]);
}

// ---- the same GEMV with every plane word a CTA needs copied into shared memory up front ----------
// (cp.async.bulk, Hopper's bulk copy engine; one mbarrier per column half). A CTA takes 16 rows:
// warp w reads 8-row group w % 2 over column half w / 2 of its k-split. Nothing streams through
// registers: every byte the CTA reads is in flight from its first microseconds.
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ void bar_init(unsigned bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void bar_expect(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void bar_wait(unsigned bar, unsigned phase) {
    unsigned done = 0;
    while (!done)
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;"
                     " selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(bar), "r"(phase) : "memory");
}
__device__ __forceinline__ void bulk_copy(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// Two mbarriers of one arrival each, visible to the CTA (and to the copy engine) after the barrier.
__device__ __forceinline__ void init_bars(unsigned long long (&bars)[2]) {
    if (threadIdx.x == 0) {
        bar_init(smem_addr(&bars[0]), 1);
        bar_init(smem_addr(&bars[1]), 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
}

// The bulk-copy kernels' shared parts: chunks [a0, a1) of the lane's row from shared memory
// (`mine`: chunk a0 of its plane 0; planes `plane` bytes apart), and the fold of a lane's sums
// into rows row, row + 1 (e: the empty subset's sum of x, or 0 where another warp adds it).
template <int B, bool XS = false>  // XS: xa points to shared memory (no __ldg)
__device__ __forceinline__ void smem_chunks(int (&acc)[1 << B][4], const unsigned char* mine,
                                            int plane, int a0, int a1, const uint4* xa) {
    const int lane = threadIdx.x & 31;
    for (int c = a0; c < a1; ++c) {
        uint4 q[B];
        #pragma unroll
        for (int p = 0; p < B; ++p) q[p] = *(const uint4*)(mine + p * plane + 64 * (c - a0));
        #pragma unroll
        for (int s = 0; s < 2; ++s) {
            unsigned lo[B], hi[B];
            #pragma unroll
            for (int p = 0; p < B; ++p) lo[p] = s ? q[p].z : q[p].x, hi[p] = s ? q[p].w : q[p].y;
            const uint4* at = xa + ((long long)c * 32 + lane) * 2 + s;
            const uint4 a = XS ? *at : __ldg(at);
            subset_mma<B, 1>(acc, a, lo, hi);
        }
    }
}

// The fold of a lane's sums of subsets [S0, S1) (acc[s - OFF]) into rows row, row + 1 (e: the
// empty subset's sum of x, or 0 where another warp adds it).
template <int B, int S0, int S1, int OFF = S0, int N>
__device__ __forceinline__ void fold_range(const int (&acc)[N][4], const float* coef, int row,
                                           float sx, float e, float* y) {
    const int lane = threadIdx.x & 31, g = lane >> 2;
    const int wg = 1 << g, w8 = g == 7 ? -32768 : 1 << (g + 8);
    const float* cr = coef + (long long)row * 16;
    double f0 = 0.0, f1 = 0.0;
    #pragma unroll
    for (int s = S0; s < S1; ++s) {
        f0 += (double)cr[s] * (double)(wg * acc[s - OFF][0] + w8 * acc[s - OFF][2]);
        f1 += (double)cr[16 + s] * (double)(wg * acc[s - OFF][1] + w8 * acc[s - OFF][3]);
    }
    #pragma unroll
    for (int m = 4; m < 32; m <<= 1) {
        f0 += __shfl_xor_sync(0xffffffffu, f0, m);
        f1 += __shfl_xor_sync(0xffffffffu, f1, m);
    }
    if (g == 0) {
        atomicAdd(y + row, sx * (float)(f0 + cr[0] * (double)e));
        atomicAdd(y + row + 1, sx * (float)(f1 + cr[16] * (double)e));
    }
}

template <int B>
__device__ __forceinline__ void fold_store(const int (&acc)[1 << B][4], const float* coef, int row,
                                           float sx, float e, float* y) {
    fold_range<B, 1, 1 << B, 0>(acc, coef, row, sx, e, y);
}

template <int B>
__device__ void popc_tma(GEMV_PARAMS) {
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) unsigned long long bars[2];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int grp = warp & 1, part = warp >> 1, r0 = blockIdx.x * 16;
    const int quads = words / 4, chunks = words / 16;
    const int per = (chunks + gridDim.y - 1) / gridDim.y;
    const int c0 = blockIdx.y * per, c1 = min(chunks, c0 + per);
    const int h0 = (c1 - c0 + 1) / 2;  // chunks of half 0; half 1 has the rest
    const int stride = (h0 * 64 + 127) / 128 * 128 + 64;  // bytes a (half, plane, row): banks differ by row
    const long long pstride = (long long)R * quads;
    init_bars(bars);
    if (warp == 0) {
        if (lane == 0) {
            bar_expect(smem_addr(&bars[0]), 16 * B * h0 * 64);
            bar_expect(smem_addr(&bars[1]), 16 * B * (c1 - c0 - h0) * 64);
        }
        __syncwarp();
        for (int e = lane; e < 2 * B * 16; e += 32) {
            const int h = e / (B * 16), p = e / 16 % B, r = e % 16;
            const int n = h ? c1 - c0 - h0 : h0;
            if (n > 0)
                bulk_copy(smem_addr(smem + e * stride),
                          planes + p * pstride + (long long)(r0 + r) * quads + 4 * (c0 + h * h0),
                          n * 64, smem_addr(&bars[h]));
        }
    }
    const int a0 = part ? c0 + h0 : c0, a1 = part ? c1 : c0 + h0;
    int acc[1 << B][4] = {};
    if (a1 > a0) bar_wait(smem_addr(&bars[part]), 0);
    smem_chunks<B>(acc, smem + (part * B * 16 + 8 * grp + g) * stride + 16 * t, 16 * stride, a0,
                   a1, xa);
    fold_store<B>(acc, coef, r0 + 8 * grp + 2 * t, sx[0], blockIdx.y == 0 && part == 0 ? sumxi[0] : 0.f, y);
}

KERNEL(popc_tma3, 128, 4, popc_tma<3>)
KERNEL(popc_tma4, 128, 4, popc_tma<4>)

// The same, but a copy per (plane, 8-row group): 8 rows of a plane are contiguous (no k-split,
// so each copy is 8 x words x 4 bytes). Warp w reads group w % 2 over column half w / 2.
template <int B>
__device__ void popc_tma_rows(GEMV_PARAMS) {
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) unsigned long long bars[2];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int grp = warp & 1, part = warp >> 1, r0 = blockIdx.x * 16;
    const int quads = words / 4, chunks = words / 16, bytes = 8 * words * 4;
    const long long pstride = (long long)R * quads;
    init_bars(bars);
    if (warp == 0) {
        if (lane < 2) bar_expect(smem_addr(&bars[lane]), B * bytes);
        __syncwarp();
        if (lane < 2 * B) {  // lane: group lane % 2, plane lane / 2
            const int h = lane & 1, p = lane >> 1;
            bulk_copy(smem_addr(smem + (h * B + p) * bytes),
                      planes + p * pstride + (long long)(r0 + 8 * h) * quads, bytes,
                      smem_addr(&bars[h]));
        }
    }
    const int a0 = part ? chunks / 2 : 0, a1 = part ? chunks : chunks / 2;
    int acc[1 << B][4] = {};
    bar_wait(smem_addr(&bars[grp]), 0);
    smem_chunks<B>(acc, smem + grp * B * bytes + g * words * 4 + 16 * t + 64 * a0, bytes, a0, a1,
                   xa);
    fold_store<B>(acc, coef, r0 + 8 * grp + 2 * t, sx[0], part == 0 ? sumxi[0] : 0.f, y);
}

KERNEL(popc_tma_rows3, 128, 4, popc_tma_rows<3>)
KERNEL(popc_tma_rows4, 128, 4, popc_tma_rows<4>)

// ---- a persistent ring: every warp keeps S stages of its plane words in flight ----------------
// (session 13). `popc_tma_rows` put all of a CTA's words in flight, then computed: an SM's bytes
// in flight drop while its CTAs compute. Here CTAs stay (one an SM: grid = SMs) and each warp
// owns a ring of S stages in shared memory, each stage one work item: 8 rows x `ch` chunks
// (16 words) of every plane. A stage is filled by bulk copies (one per plane when the item is
// whole rows: 8 rows of a plane are contiguous; else one per (plane, row)) that complete on the
// stage's mbarrier; the warp computes item k from stage k % S, then refills that stage with item
// k + S. So the copies of S - 1 items stay in flight while the warp computes, whatever its
// registers. Items go row group by row group, `chunks / ch` pieces each; the lanes fold a group
// after its last piece.
// XS: x's fragments copied into shared memory first (one bulk copy; L1 is small next to the
// ring); PIPE: the next chunk's plane words read from the stage while this one computes.
template <int B>
__device__ __forceinline__ void smem_chunks_pipe(int (&acc)[1 << B][4], const unsigned char* mine,
                                                 int plane, int a0, int a1, const uint4* xa) {
    const int lane = threadIdx.x & 31;
    uint4 q[B], n[B];
    auto ld = [&](uint4 (&v)[B], int c) {
        #pragma unroll
        for (int p = 0; p < B; ++p) v[p] = *(const uint4*)(mine + p * plane + 64 * (c - a0));
    };
    auto run = [&](const uint4 (&v)[B], int c) {
        #pragma unroll
        for (int s = 0; s < 2; ++s) {
            unsigned lo[B], hi[B];
            #pragma unroll
            for (int p = 0; p < B; ++p) lo[p] = s ? v[p].z : v[p].x, hi[p] = s ? v[p].w : v[p].y;
            subset_mma<B, 1>(acc, xa[(c * 32 + lane) * 2 + s], lo, hi);
        }
    };
    ld(q, a0);
    for (int c = a0; c < a1; c += 2) {
        if (c + 1 < a1) ld(n, c + 1);
        run(q, c);
        if (c + 1 >= a1) break;
        if (c + 2 < a1) ld(q, c + 2);
        run(n, c + 1);
    }
}

// One ring: its stages, the row groups its items cover (`first`, then every `nw`-th) and the
// stage geometry (both warps of a pair compute the same).
struct Ring {
    int quads, chunks, pieces, rbytes, pbytes, sbytes, first, nw, items;
    long long pstride;
    unsigned char* ring;
    const uint4* xs;
};

// Item k into stage k % S (one warp).
__device__ __forceinline__ void ring_issue(const Ring& r, int S, int B, const uint4* planes,
                                           unsigned long long* bars, int k, int ch) {
    const int lane = threadIdx.x & 31;
    const int rg = r.first + (k / r.pieces) * r.nw, pc = k % r.pieces;
    const unsigned bar = smem_addr(&bars[k % S]);
    unsigned char* dst = r.ring + (k % S) * r.sbytes;
    if (lane == 0) bar_expect(bar, r.sbytes);
    __syncwarp();
    if (ch == r.chunks) {
        if (lane < B)
            bulk_copy(smem_addr(dst + lane * r.pbytes),
                      planes + lane * r.pstride + (long long)rg * 8 * r.quads, r.pbytes, bar);
    } else if (lane < 8 * B) {
        const int p = lane >> 3, w = lane & 7;
        bulk_copy(smem_addr(dst + p * r.pbytes + w * r.rbytes),
                  planes + p * r.pstride + (long long)(rg * 8 + w) * r.quads + 4 * ch * pc,
                  r.rbytes, bar);
    }
}

// Ring `index` of `rings` in a CTA's shared memory; x's fragments follow the rings.
__device__ __forceinline__ Ring ring_at(unsigned char* smem, int index, int rings, int S, int B,
                                        int R, int words, int ch) {
    Ring r;
    r.quads = words / 4, r.chunks = words / 16, r.pieces = r.chunks / ch;
    r.rbytes = ch * 64, r.pbytes = 8 * r.rbytes, r.sbytes = B * r.pbytes;  // row, plane, stage
    r.ring = smem + index * S * r.sbytes;
    r.xs = (const uint4*)(smem + rings * S * r.sbytes);
    r.pstride = (long long)R * r.quads;
    const int groups = R / 8;
    r.nw = gridDim.x * rings, r.first = blockIdx.x * rings + index;
    r.items = r.first < groups ? (groups - r.first + r.nw - 1) / r.nw * r.pieces : 0;
    return r;
}

template <int B, int S, bool XS = false, bool PIPE = false>
__device__ void popc_ring(GEMV_PARAMS, int ch) {
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) unsigned long long bars[16][S];  // [warp][stage]
    __shared__ __align__(8) unsigned long long xbar;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const Ring r = ring_at(smem, warp, blockDim.x >> 5, S, B, R, words, ch);
    const uint4* xs = XS ? r.xs : xa;
    if constexpr (XS) {
        if (threadIdx.x == 0) {
            bar_init(smem_addr(&xbar), 1);
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
            bar_expect(smem_addr(&xbar), r.chunks * 1024);
            bulk_copy(smem_addr(xs), xa, r.chunks * 1024, smem_addr(&xbar));
        }
        __syncthreads();
    }
    if (lane < S) bar_init(smem_addr(&bars[warp][lane]), 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncwarp();
    for (int k = 0; k < min(S, r.items); ++k) ring_issue(r, S, B, planes, bars[warp], k, ch);
    if constexpr (XS) bar_wait(smem_addr(&xbar), 0);
    int acc[1 << B][4];
    for (int k = 0; k < r.items; ++k) {
        const int pc = k % r.pieces, rg = r.first + (k / r.pieces) * r.nw;
        if (pc == 0) {
            #pragma unroll
            for (int s = 0; s < (1 << B); ++s) acc[s][0] = acc[s][1] = acc[s][2] = acc[s][3] = 0;
        }
        bar_wait(smem_addr(&bars[warp][k % S]), (k / S) & 1);
        const unsigned char* mine = r.ring + (k % S) * r.sbytes + g * r.rbytes + 16 * t;
        if constexpr (PIPE) smem_chunks_pipe<B>(acc, mine, r.pbytes, pc * ch, pc * ch + ch, xs);
        else smem_chunks<B, XS>(acc, mine, r.pbytes, pc * ch, pc * ch + ch, xs);
        __syncwarp();  // every lane has read the stage: refill it
        if (k + S < r.items) ring_issue(r, S, B, planes, bars[warp], k + S, ch);
        if (pc == r.pieces - 1) fold_store<B>(acc, coef, rg * 8 + 2 * t, sx[0], sumxi[0], y);
    }
}

RING_KERNEL(popc_ringx4_2, 512, popc_ring<4, 2, true, false>)
RING_KERNEL(popc_ringx4_3, 512, popc_ring<4, 3, true, false>)
RING_KERNEL(popc_ringp4_2, 512, popc_ring<4, 2, true, true>)
RING_KERNEL(popc_ringp4_3, 512, popc_ring<4, 3, true, true>)
RING_KERNEL(popc_ringp3_2, 512, popc_ring<3, 2, true, true>)
RING_KERNEL(popc_ring3_2, 512, popc_ring<3, 2>)
RING_KERNEL(popc_ring3_3, 512, popc_ring<3, 3>)
RING_KERNEL(popc_ring3_4, 512, popc_ring<3, 4>)
RING_KERNEL(popc_ring4_2, 512, popc_ring<4, 2>)
RING_KERNEL(popc_ring4_3, 512, popc_ring<4, 3>)
RING_KERNEL(popc_ring4_4, 512, popc_ring<4, 4>)
RING_KERNEL(popc_ring4_6, 512, popc_ring<4, 6>)

// ---- the ring shared by a pair of warps that split the subsets (session 13) --------------------
// Warps 2i and 2i + 1 share ring i: both read every stage, warp 2i runs the subsets of planes
// 0..B-2 (S < 2^(B-1)), warp 2i + 1 those with plane B-1 (S >= 2^(B-1)). Each holds half the
// accumulators, so an SM runs more warps, and no plane word is loaded twice. The pair meets at a
// named barrier after each stage; then warp 2i refills it.
template <int B, int S0, int S1>
__device__ __forceinline__ void subset_mma_range(int (&acc)[S1 - S0][4], const uint4& a,
                                                 const unsigned (&lo)[B], const unsigned (&hi)[B]) {
    #pragma unroll
    for (int s = S0; s < S1; ++s) {
        unsigned l = 0xffffffffu, h = 0xffffffffu;
        #pragma unroll
        for (int p = 0; p < B; ++p)
            if (s & (1 << p)) l &= lo[p], h &= hi[p];
        mma_popc(acc[s - S0], a, l, h);
    }
}

template <int B, int S0, int S1>
__device__ __forceinline__ void pair_chunks(int (&acc)[S1 - S0][4], const unsigned char* mine,
                                            int plane, int a0, int a1, const uint4* xs) {
    const int lane = threadIdx.x & 31;
    constexpr int NP = S1 <= (1 << (B - 1)) ? B - 1 : B;  // planes this half reads
    for (int c = a0; c < a1; ++c) {
        uint4 q[B];
        #pragma unroll
        for (int p = 0; p < B; ++p)
            q[p] = p < NP ? *(const uint4*)(mine + p * plane + 64 * (c - a0)) : make_uint4(0, 0, 0, 0);
        #pragma unroll
        for (int s = 0; s < 2; ++s) {
            unsigned lo[B], hi[B];
            #pragma unroll
            for (int p = 0; p < B; ++p) lo[p] = s ? q[p].z : q[p].x, hi[p] = s ? q[p].w : q[p].y;
            subset_mma_range<B, S0, S1>(acc, xs[(c * 32 + lane) * 2 + s], lo, hi);
        }
    }
}

template <int B, int S, int A0, int A1>
__device__ __forceinline__ void pair_run(const Ring& r, const uint4* planes,
                                         unsigned long long* bars, const float* coef,
                                         const float* sx, const float* sumxi, float* y, int ch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int pair = warp >> 1, half = warp & 1;
    int acc[A1 - A0][4];
    for (int k = 0; k < r.items; ++k) {
        const int pc = k % r.pieces, rg = r.first + (k / r.pieces) * r.nw;
        if (pc == 0) {
            #pragma unroll
            for (int s = 0; s < A1 - A0; ++s) acc[s][0] = acc[s][1] = acc[s][2] = acc[s][3] = 0;
        }
        bar_wait(smem_addr(&bars[k % S]), (k / S) & 1);
        pair_chunks<B, A0, A1>(acc, r.ring + (k % S) * r.sbytes + g * r.rbytes + 16 * t, r.pbytes,
                               pc * ch, pc * ch + ch, r.xs);
        asm volatile("bar.sync %0, 64;" :: "r"(1 + pair) : "memory");  // the pair has read it
        if (half == 0 && k + S < r.items) ring_issue(r, S, B, planes, bars, k + S, ch);
        if (pc == r.pieces - 1)
            fold_range<B, A0, A1>(acc, coef, rg * 8 + 2 * t, sx[0], half ? 0.f : sumxi[0], y);
    }
}

template <int B, int S>
__device__ void popc_pair(GEMV_PARAMS, int ch) {
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) unsigned long long bars[15][S];  // [pair][stage]
    __shared__ __align__(8) unsigned long long xbar;
    constexpr int HALF = 1 << (B - 1);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int pair = warp >> 1, half = warp & 1, pairs = blockDim.x >> 6;
    const Ring r = ring_at(smem, pair, pairs, S, B, R, words, ch);
    if (threadIdx.x == 0) {
        bar_init(smem_addr(&xbar), 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        bar_expect(smem_addr(&xbar), r.chunks * 1024);
        bulk_copy(smem_addr(r.xs), xa, r.chunks * 1024, smem_addr(&xbar));
    }
    if (half == 0 && lane < S) bar_init(smem_addr(&bars[pair][lane]), 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncthreads();
    if (half == 0)
        for (int k = 0; k < min(S, r.items); ++k) ring_issue(r, S, B, planes, bars[pair], k, ch);
    bar_wait(smem_addr(&xbar), 0);
    if (half == 0) pair_run<B, S, 1, HALF>(r, planes, bars[pair], coef, sx, sumxi, y, ch);
    else pair_run<B, S, HALF, 2 * HALF>(r, planes, bars[pair], coef, sx, sumxi, y, ch);
}

RING_KERNEL(popc_pair4_2_512, 512, popc_pair<4, 2>)
RING_KERNEL(popc_pair4_3_512, 512, popc_pair<4, 3>)
RING_KERNEL(popc_pair4_2_768, 768, popc_pair<4, 2>)
RING_KERNEL(popc_pair4_2_960, 960, popc_pair<4, 2>)
RING_KERNEL(popc_pair3_2_768, 768, popc_pair<3, 2>)
RING_KERNEL(popc_pair3_2_960, 960, popc_pair<3, 2>)
