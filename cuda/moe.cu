// The fused mixed-precision MoE kernels (docs/KERNELS.md). Compiled by CuPy (NVRTC) at first use.
//
// Every expert block is read at its current width straight from its planes, wherever the pager
// put them: a block's plane p is a chunk [bits | table] split over fixed-size slabs of one device
// arena, and the descriptor (per-block width, per-plane first slab-map entry, slab map) lives in
// device memory, rewritten by the pager between steps. Kernels never see host-side widths, so a
// width change costs no recompile, no reallocation and no host sync.
//
// Inputs are read in "plane order": for an input vector x of K = 32*words columns, xp[8][words][4]
// holds at [q][w][i] the input of column 32w + 8(q/2) + rev3(4(q%2) + i) (the nibble order of
// `nibbles`). Lane l of a warp handles plane word w = l + 32m, so its float4 loads of x are
// consecutive across the warp (coalesced), and two float4 feed one nibble word.

// No headers: NVRTC finds none of its own, and fp16 <-> fp32 is one PTX instruction each way.
__device__ __forceinline__ float h2f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ unsigned short f2h(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

typedef unsigned int u32;
typedef long long i64;

#define WARPS 8
#define MAX_TABLE 256  // 2^max_bits, max_bits <= 8

struct Paged {
    const unsigned char* arena;  // [n_slabs, 1 << slab_shift]
    const int* slab_map;         // slab id of every (block, plane, page)
    const int* slab_off;         // [n_blocks, max_bits]: first slab-map entry of each plane
    const int* width;            // [n_blocks]: planes a kernel may read
    int slab_shift;
    int max_bits;
};

__device__ __forceinline__ const unsigned char* paged(const Paged& g, int block, int plane, i64 off) {
    int entry = __ldg(g.slab_off + block * g.max_bits + plane) + (int)(off >> g.slab_shift);
    i64 slab = __ldg(g.slab_map + entry);
    return g.arena + (slab << g.slab_shift) + (off & ((1LL << g.slab_shift) - 1));
}

// Where one plane of one block row lies: its words [0, split) from p0, the rest from p1 (a row
// crosses at most one slab boundary: slabs are at least as large as a row's plane bytes).
struct RowPtr {
    const u32* p0;
    const u32* p1;  // already offset by -split words, so word w is p1[w] past the split
    int split;
};

__device__ __forceinline__ RowPtr row_ptr(const Paged& g, int block, int plane, int row, int words) {
    const i64 off = (i64)row * words * 4;
    const i64 mask = (1LL << g.slab_shift) - 1;
    const int entry = __ldg(g.slab_off + block * g.max_bits + plane) + (int)(off >> g.slab_shift);
    RowPtr rp;
    rp.p0 = (const u32*)(g.arena + ((i64)__ldg(g.slab_map + entry) << g.slab_shift) + (off & mask));
    rp.split = (int)min((i64)words, ((mask + 1) - (off & mask)) >> 2);
    rp.p1 = rp.split < words
        ? (const u32*)(g.arena + ((i64)__ldg(g.slab_map + entry + 1) << g.slab_shift)) - rp.split
        : rp.p0;
    return rp;
}

__device__ __forceinline__ u32 word_at(const RowPtr& rp, int w) {
    return __ldg((w < rp.split ? rp.p0 : rp.p1) + w);
}

// Labels are decoded 8 columns at a time into nibbles (see `nibbles`), with the plane bits in a
// fixed but scrambled order inside each nibble; the table in shared memory is stored in that
// order, so the scramble costs nothing per weight. Plane p (p < 4) lands on nibble bit NIB[p];
// planes 4..7 make a second nibble, the high half of an 8-bit index.
__device__ __forceinline__ int nibble_bit(int p) { return (((p & 1) << 1) | ((p >> 1) & 1)) + 4 * (p >> 2); }

// Four plane words (32 columns) -> four words of 8 nibbles: word k holds columns 8k..8k+7, nibble
// n column 8k + rev3(n) (rev3: 3-bit reversal), bit NIB[p] of a nibble is plane p. A 4x4 byte
// transpose (8 PRMT) then two delta swaps per word exchanging position bits 4<->0 and 3<->1:
// about 1.25 instructions per weight for up to 4 planes, instead of 2 per plane per weight.
__device__ __forceinline__ void nibbles(u32 p0, u32 p1, u32 p2, u32 p3, u32 (&q)[4]) {
    const u32 a = __byte_perm(p0, p1, 0x5140), b = __byte_perm(p2, p3, 0x5140);
    const u32 c = __byte_perm(p0, p1, 0x7362), d = __byte_perm(p2, p3, 0x7362);
    q[0] = __byte_perm(a, b, 0x5410);
    q[1] = __byte_perm(a, b, 0x7632);
    q[2] = __byte_perm(c, d, 0x5410);
    q[3] = __byte_perm(c, d, 0x7632);
    #pragma unroll
    for (int k = 0; k < 4; ++k) {
        u32 x = q[k], t;
        t = (x ^ (x >> 15)) & 0x0000AAAAu;
        x ^= t ^ (t << 15);
        t = (x ^ (x >> 6)) & 0x00CC00CCu;
        x ^= t ^ (t << 6);
        q[k] = x;
    }
}

// acc[r][t] += sum over columns of W[row0 + r, :] * in[t, :], W read at width B.
template <int B, int R, int TM>
__device__ __forceinline__ void rows_dot(const Paged& g, int block, i64 bits_nbytes, int words,
                                         int rpt, int row0, int nrows, const float* xp,
                                         const int* in_row, int T, float (&acc)[R][TM],
                                         float* tbl, RowPtr* ptrs, int lane) {
    // Prologue: every lane issues all its table loads at once (independent, so their latencies
    // overlap; loading row by row serialised R chains of three dependent loads), then the
    // (row, plane) page pointers, then stores.
    constexpr int NT = B <= 4 ? 16 : 256;  // decoded indices per table
    constexpr int PER = (R * NT + 31) / 32;
    unsigned short hv[PER];
    #pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int e = lane + 32 * i, r = e / NT, v = e % NT;
        if (r < R) {
            int label = 0;
            #pragma unroll
            for (int p = 0; p < B; ++p) label |= ((v >> nibble_bit(p)) & 1) << (B - 1 - p);
            const i64 off = bits_nbytes + (i64)((row0 + min(r, nrows - 1)) / rpt) * (2 << B);
            hv[i] = __ldg((const unsigned short*)paged(g, block, B - 1, off + 2 * label));
        }
    }
    if (lane < R * B)  // one lane per (row, plane) finds the pages; the loop reads them from smem
        ptrs[lane] = row_ptr(g, block, lane % B, row0 + min(lane / B, nrows - 1), words);
    #pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int e = lane + 32 * i, r = e / NT, v = e % NT;
        if (r < R) tbl[r * MAX_TABLE + v] = h2f(hv[i]);
    }
    __syncwarp();
    const i64 xstride = (i64)8 * words * 4;  // floats per input row
    constexpr int HI = B > 4 ? 1 : 0;  // a second nibble word set for planes 4..7
    for (int w = lane; w < words; w += 32) {
        u32 lo[R][4], hi[R][4];
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            u32 P[8];
            #pragma unroll
            for (int p = 0; p < 8; ++p) P[p] = p < B ? word_at(ptrs[r * B + p], w) : 0u;
            nibbles(P[0], P[1], P[2], P[3], lo[r]);
            if (HI) nibbles(P[4], P[5], P[6], P[7], hi[r]);
        }
        #pragma unroll
        for (int k = 0; k < 4; ++k) {
            float4 xa[TM], xb[TM];  // the 8 inputs of nibble word k, in nibble order
            #pragma unroll
            for (int t = 0; t < TM; ++t)
                if (t < T) {
                    const float* base = xp + in_row[t] * xstride + ((i64)(2 * k) * words + w) * 4;
                    xa[t] = __ldg((const float4*)base);
                    xb[t] = __ldg((const float4*)(base + (i64)words * 4));
                }
            #pragma unroll
            for (int r = 0; r < R; ++r) {
                #pragma unroll
                for (int n = 0; n < 8; ++n) {
                    u32 v = (lo[r][k] >> (4 * n)) & 15u;
                    if (HI) v |= ((hi[r][k] >> (4 * n)) & 15u) << 4;
                    const float wv = tbl[r * MAX_TABLE + v];
                    #pragma unroll
                    for (int t = 0; t < TM; ++t) {
                        const float4& xv = n < 4 ? xa[t] : xb[t];
                        const int i = n & 3;
                        const float xi = i == 0 ? xv.x : i == 1 ? xv.y : i == 2 ? xv.z : xv.w;
                        if (t < T) acc[r][t] = fmaf(wv, xi, acc[r][t]);
                    }
                }
            }
        }
    }
    __syncwarp();
}

// Dispatch on the block's run-time width (uniform across the warp: one block per call).
template <int R, int TM>
__device__ void rows_dot_any(const Paged& g, int block, i64 bits_nbytes, int words, int rpt,
                             int row0, int nrows, const float* xp, const int* in_row, int T,
                             float (&acc)[R][TM], float* tbl, RowPtr* ptrs, int lane) {
    #pragma unroll
    for (int r = 0; r < R; ++r)
        #pragma unroll
        for (int t = 0; t < TM; ++t) acc[r][t] = 0.f;
    switch (__ldg(g.width + block)) {
#define CASE(B) case B: rows_dot<B, R, TM>(g, block, bits_nbytes, words, rpt, row0, nrows, xp, in_row, T, acc, tbl, ptrs, lane); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
    }
    #pragma unroll
    for (int r = 0; r < R; ++r)
        #pragma unroll
        for (int t = 0; t < TM; ++t)
            #pragma unroll
            for (int s = 16; s > 0; s >>= 1) acc[r][t] += __shfl_xor_sync(0xffffffffu, acc[r][t], s);
}

struct Slots {
    const int* expert;  // [n_slots]: expert of the slot (its row in block_ids)
    const int* lo;      // [n_slots]: first pair of the slot
    const int* hi;      // [n_slots]: one past its last pair
    const int* token;   // [pairs]: token of each pair (pairs sorted by slot)
    const float* weight;  // [pairs]: combine weight of each pair
    const int* block_ids;  // [experts (+ shared), 3]: block of gate, up, down
};

__device__ __forceinline__ float silu(float v) { return v / (1.f + __expf(-v)); }

// h[pair] = silu(gate x) * up x for every pair of a slot, written in plane order for the down
// projection. grid: (ceil(I / (WARPS*R)), n_slots); block: 32*WARPS.
template <int R, int TM>
__device__ void gate_up(Paged g, Slots s, const float* xp, float* hp, int I, int words_in,
                        int words_out, i64 bits_nbytes, int rpt) {
    __shared__ float tables[WARPS][R * MAX_TABLE];
    __shared__ RowPtr ptrs[WARPS][32];
    __shared__ int in_row[TM];
    const int slot = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int lo = __ldg(s.lo + slot), T = __ldg(s.hi + slot) - lo;
    if (T <= 0) return;
    if (threadIdx.x < T) in_row[threadIdx.x] = __ldg(s.token + lo + threadIdx.x);
    __syncthreads();
    const int e = __ldg(s.expert + slot);
    const int row0 = (blockIdx.x * WARPS + warp) * R;
    if (row0 >= I) return;
    const int nrows = min(R, I - row0);
    float ga[R][TM], ua[R][TM];
    rows_dot_any<R, TM>(g, __ldg(s.block_ids + 3 * e), bits_nbytes, words_in, rpt, row0, nrows, xp, in_row, T, ga, tables[warp], ptrs[warp], lane);
    rows_dot_any<R, TM>(g, __ldg(s.block_ids + 3 * e + 1), bits_nbytes, words_in, rpt, row0, nrows, xp, in_row, T, ua, tables[warp], ptrs[warp], lane);
    if (lane != 0) return;
    #pragma unroll
    for (int r = 0; r < R; ++r) {
        const int n = row0 + r;
        if (r >= nrows) break;
        const int m = __brev(n & 7) >> 29;  // nibble slot of column n within its 8 (rev3)
        const int q = 2 * ((n & 31) >> 3) + (m >> 2);
        const i64 col = ((i64)q * words_out + (n >> 5)) * 4 + (m & 3);
        #pragma unroll
        for (int t = 0; t < TM; ++t)
            if (t < T) hp[(i64)(lo + t) * 8 * words_out * 4 + col] = silu(ga[r][t]) * ua[r][t];
    }
}

// out[token] += weight * (down h[pair]) for every pair of a slot. grid: (ceil(H / (WARPS*R)), n_slots).
template <int R, int TM>
__device__ void down(Paged g, Slots s, const float* hp, float* out, int H, int words_in,
                     i64 bits_nbytes, int rpt) {
    __shared__ float tables[WARPS][R * MAX_TABLE];
    __shared__ RowPtr ptrs[WARPS][32];
    __shared__ int in_row[TM];
    const int slot = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int lo = __ldg(s.lo + slot), T = __ldg(s.hi + slot) - lo;
    if (T <= 0) return;
    if (threadIdx.x < T) in_row[threadIdx.x] = lo + threadIdx.x;
    __syncthreads();
    const int e = __ldg(s.expert + slot);
    const int row0 = (blockIdx.x * WARPS + warp) * R;
    if (row0 >= H) return;
    const int nrows = min(R, H - row0);
    float acc[R][TM];
    rows_dot_any<R, TM>(g, __ldg(s.block_ids + 3 * e + 2), bits_nbytes, words_in, rpt, row0, nrows, hp, in_row, T, acc, tables[warp], ptrs[warp], lane);
    if (lane != 0) return;
    #pragma unroll
    for (int r = 0; r < R; ++r) {
        if (r >= nrows) break;
        #pragma unroll
        for (int t = 0; t < TM; ++t)
            if (t < T) atomicAdd(out + (i64)__ldg(s.token + lo + t) * H + row0 + r, __ldg(s.weight + lo + t) * acc[r][t]);
    }
}

// Flat kernel parameters (CuPy passes scalars and raw pointers): the descriptor, then the slots.
#define PAGED_ARGS const unsigned char *arena, const int *slab_map, const int *slab_off,             \
                   const int *width, int slab_shift, int max_bits
#define SLOT_ARGS const int *s_expert, const int *s_lo, const int *s_hi, const int *s_token,          \
                  const float *s_weight, const int *block_ids
#define PAGED Paged{arena, slab_map, slab_off, width, slab_shift, max_bits}
#define SLOTS Slots{s_expert, s_lo, s_hi, s_token, s_weight, block_ids}

#define ENTRY(TM, R)                                                                              \
    extern "C" __global__ void __launch_bounds__(32 * WARPS, 2) gate_up_t##TM(                    \
        PAGED_ARGS, SLOT_ARGS, const float* xp, float* hp, int I, int words_in, int words_out,   \
        i64 bits_nbytes, int rpt) {                                                              \
        gate_up<R, TM>(PAGED, SLOTS, xp, hp, I, words_in, words_out, bits_nbytes, rpt);          \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(32 * WARPS, 2) down_t##TM(                       \
        PAGED_ARGS, SLOT_ARGS, const float* hp, float* out, int H, int words_in,                 \
        i64 bits_nbytes, int rpt) {                                                              \
        down<R, TM>(PAGED, SLOTS, hp, out, H, words_in, bits_nbytes, rpt);                       \
    }

ENTRY(1, 4)
ENTRY(2, 4)
ENTRY(4, 2)
ENTRY(8, 1)

// Prefill: rows [row0, row0 + gridDim.x) of one block at its current width, as fp16 [n, cols],
// into a workspace small enough to stay in L2; cuBLAS multiplies it next. Each thread makes 8
// consecutive columns (one byte of each plane) and stores them as one 16-byte write, so a warp
// writes 512 contiguous bytes. grid: (n, 1); block: 128.
template <int B>
__device__ void dequant_row(const Paged& g, int block, i64 bits_nbytes, int words, int cols,
                            int rpt, int row, unsigned short* dst, float* tbl, RowPtr* ptrs) {
    const i64 tbase = bits_nbytes + (i64)(row / rpt) * (2 << B);
    for (int i = threadIdx.x; i < (1 << B); i += blockDim.x)
        tbl[i] = h2f(*(const unsigned short*)paged(g, block, B - 1, tbase + 2 * i));
    if (threadIdx.x < B) ptrs[threadIdx.x] = row_ptr(g, block, threadIdx.x, row, words);
    __syncthreads();
    for (int c8 = threadIdx.x; c8 < words * 4; c8 += blockDim.x) {
        const int w = c8 >> 2, shift = 8 * (c8 & 3);
        u32 P[B];
        #pragma unroll
        for (int p = 0; p < B; ++p) P[p] = word_at(ptrs[p], w) >> shift;
        u32 out[4];
        #pragma unroll
        for (int j = 0; j < 8; j += 2) {
            u32 l0 = 0, l1 = 0;
            #pragma unroll
            for (int p = 0; p < B; ++p) {
                l0 |= ((P[p] >> j) & 1u) << (B - 1 - p);
                l1 |= ((P[p] >> (j + 1)) & 1u) << (B - 1 - p);
            }
            out[j / 2] = (u32)f2h(tbl[l0]) | ((u32)f2h(tbl[l1]) << 16);
        }
        const int c = 8 * c8;
        if (c + 8 <= cols && (cols & 7) == 0) {
            *(uint4*)(dst + c) = make_uint4(out[0], out[1], out[2], out[3]);
        } else {
            for (int j = 0; j < 8 && c + j < cols; ++j) dst[c + j] = (unsigned short)(out[j / 2] >> (16 * (j & 1)));
        }
    }
}

extern "C" __global__ void __launch_bounds__(128) dequant_rows(PAGED_ARGS, int block,
        i64 bits_nbytes, int words, int cols, int rpt, int row0, unsigned short* out) {
    const Paged g = PAGED;
    __shared__ float tbl[MAX_TABLE];
    __shared__ RowPtr ptrs[8];
    unsigned short* dst = out + (i64)blockIdx.x * cols;
    const int row = row0 + blockIdx.x;
    switch (__ldg(g.width + block)) {
#define CASE(B) case B: dequant_row<B>(g, block, bits_nbytes, words, cols, rpt, row, dst, tbl, ptrs); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
    }
}

// Decode-time grouping of (token, expert) pairs by expert, in one launch (it replaced ~20 small
// torch kernels: 53 us of a Mixtral decode step on the H200). Pairs are placed stably (sorted by
// expert, then by token); slots list the active experts in increasing order, empty slots after.
// One block; dynamic shared memory: experts ints. For <= a few hundred pairs (decode).
extern "C" __global__ void group_pairs(const i64* index, const float* weights, int pairs, int k,
                                       int experts, int slots, int* token, float* weight,
                                       int* s_expert, int* s_lo, int* s_hi) {
    extern __shared__ int first[];  // per expert: count, then its first pair
    for (int e = threadIdx.x; e < experts; e += blockDim.x) first[e] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < pairs; i += blockDim.x) atomicAdd(&first[(int)index[i]], 1);
    __syncthreads();
    if (threadIdx.x == 0) {
        int start = 0, n = 0;
        for (int e = 0; e < experts; ++e) {
            const int c = first[e];
            first[e] = start;
            if (c > 0 && n < slots) {
                s_expert[n] = e;
                s_lo[n] = start;
                s_hi[n] = start + c;
                ++n;
            }
            start += c;
        }
        for (; n < slots; ++n) s_expert[n] = s_lo[n] = s_hi[n] = 0;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
        const i64 e = index[i];
        int rank = 0;
        for (int j = 0; j < i; ++j) rank += index[j] == e;
        const int pos = first[e] + rank;
        token[pos] = i / k;
        weight[pos] = weights[i];
    }
}
