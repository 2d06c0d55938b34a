// The prefill on sm_90a (`gate_up_prefill_wg`, `down_prefill_wg`, and `token_tiles`, which lays
// out their tokens): decoded registers straight into wgmma, tokens from shared memory.
#ifndef PWCTL_PREFILL_WG_CU
#define PWCTL_PREFILL_WG_CU
#include "prefill.cu"

// ---- prefill on sm_90a: warpgroup mma straight from decoded registers ------------------------
//
// A CTA is one warpgroup (4 warps) and owns 64 rows (gate_up: warps 0, 1 gate rows r0..r0+31,
// warps 2, 3 the same rows of up; down: 64 rows) and up to 128 tokens of one slot. Warp q decodes
// its m-tile exactly as the decode kernels do, and those registers are the A operand of
// wgmma.m64n128k16: a warpgroup's register A fragment is four mma.m16n8k16 A fragments, warp q
// holding rows 16q..16q+15. The tokens (B) come from shared memory, bulk-copied from token
// tiles (`token_tiles`; fused_moe.wgmma_tiles is the reference): 128 tokens of one (slot, pass),
// columns in "wgmma order" (per 256-column chunk and k-step, the 16 columns whose weights the
// lanes' A registers hold), laid out exactly as shared memory holds them, so a half-chunk is one
// linear 32 KB copy. The work goes by half-chunks (8 k-steps, one plane word a lane and row): the
// warps decode half-chunk i + 1 into one of two A register sets while the tensor cores run
// half-chunk i from the other, and B is double-buffered the same way. Plane words come through a
// shared-memory ring 3 chunks ahead (widths 1-4, flat rows) or registers a chunk ahead.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WG_TOKENS 128                // tokens of a pass: the wgmma's N
#define WG_GROUPS (WG_TOKENS / 8)    // 8-token core-matrix groups
#define WG_KSTEPS 8                  // k-steps of a half-chunk
static_assert(WG_TOKENS == PF_TOKENS, "one tile plan (plan_tiles) serves both prefills");

struct PrefillWG {
    Stage st[4];  // warp q's m-tile
    // B of a half-chunk as K-major core matrices (8 tokens x 8 columns, 128 contiguous bytes):
    // [buffer][k-step][token group][columns 0-7 / 8-15][token]
    uint4 b[2][WG_KSTEPS][WG_GROUPS][2][8];
    unsigned long long full[2];  // mbarriers: buffer u's bulk copy has landed (one arrival a use)
};

// mbarrier helpers for the B buffers' bulk copies.
__device__ __forceinline__ void mbar_init(void* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_u32(bar)), "r"(count)
                 : "memory");
}
__device__ __forceinline__ void mbar_wait(void* bar, u32 parity) {
    u32 done = 0;
    while (!done)
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;"
                     " selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
}

// Shared-memory matrix descriptor of one k-step of B: no swizzle, the next 8 columns 128 bytes on
// (leading byte offset), the next 8 tokens 256 bytes on (stride byte offset).
__device__ __forceinline__ unsigned long long b_desc(const void* p) {
    return (unsigned long long)((smem_u32(p) & 0x3FFFF) >> 4) | (8ull << 16) | (16ull << 32);
}

// d += A B for one k-step: A the warpgroup's register fragments, B 128 tokens from shared memory.
__device__ __forceinline__ void wgmma_n128(float (&d)[64], const u32 (&a)[4],
                                           unsigned long long desc) {
#define D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]),         \
              "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#if PROBE(PREFILL_N32)  // (probes.cuh)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
        "{%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
        : D8(0), D8(8)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
    return;
#elif PROBE(PREFILL_N64)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : D8(0), D8(8), D8(16), D8(24)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
    return;
#endif
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : D8(0), D8(8), D8(16), D8(24), D8(32), D8(40), D8(48), D8(56)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
#undef D8
}

__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>  // until at most N committed groups of this warpgroup are still running
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}

// Keeps an A register set allocated until here (after the wait that retired its wgmma): the
// compiler cannot see that an issued wgmma still reads them.
__device__ __forceinline__ void hold(const u32 (&A)[WG_KSTEPS][4]) {
    #pragma unroll
    for (int s = 0; s < WG_KSTEPS; ++s)
        asm volatile("" :: "r"(A[s][0]), "r"(A[s][1]), "r"(A[s][2]), "r"(A[s][3]));
}

// Half-chunk hc of the pass's token tile into B buffer `buf`: the tile holds it as shared memory
// does, so it is one 32 KB bulk copy (Hopper's copy engine), issued by thread 0 and awaited by
// every thread on the buffer's mbarrier. Its completion is tracked apart from any plane loads, and
// no thread spends registers or issue slots on it.
__device__ __forceinline__ void load_b(PrefillWG& sm, int buf, const unsigned short* tile, int hc) {
    if (threadIdx.x != 0) return;
#if PROBE(PREFILL_N32) || PROBE(PREFILL_N64)
    const u32 bar = smem_u32(&sm.full[buf]), bytes = sizeof(sm.b[0]) * PROBE_PREFILL_TOKENS / 128;
#else
    const u32 bar = smem_u32(&sm.full[buf]), bytes = sizeof(sm.b[0]);
#endif
#if PROBE(PREFILL_NO_B)
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
#else
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes)
                 : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
        :: "r"(smem_u32(&sm.b[buf][0][0][0][0])), "l"(tile + (i64)hc * (bytes / 2)), "r"(bytes),
           "r"(bar) : "memory");
#endif
}

// Where column `col` of token n (0..127) of a tile lies: wgmma order (position 256 it + 16 s + k
// of the row, the inverse of fused_moe.wgmma_order) in the shared-memory layout of `PrefillWG::b`,
// one half-chunk (128 positions) after another.
__device__ __forceinline__ i64 tile_pos(int n, int col) {
    const int w = col >> 5, c = col & 31, j = (c >> 2) & 3;
    const int k = 2 * ((w & 7) >> 1) + (j & 1) + 8 * (j >> 1), s = 2 * (c & 3) + (c >> 4);
    const int hc = 2 * (w >> 3) + (w & 1);
    return (i64)hc * 16384 + s * 2048 + (n >> 3) * 128 + (k >> 3) * 64 + (n & 7) * 8 + (k & 7);
}

// Plane word w of rows g, g + 8 at the warp's width (zeros for a dead m-tile). flat: no staged
// row of the CTA crosses a slab edge (see `load_word`).
__device__ __forceinline__ void wg_load(const Stage& st, int B, bool live, bool flat, int w,
                                        int words, u32 (&P0)[8], u32 (&P1)[8]) {
    const int g = (threadIdx.x & 31) >> 2;
    const RowPtr *r0 = st.ptr + g * 8, *r1 = st.ptr + (g + 8) * 8;
    switch (live ? B : 0) {
#define CASE(W)                                                                                   \
    case W:                                                                                       \
        if (flat) load_word<W, true>(r0, r1, w, words, P0, P1);                                   \
        else load_word<W, false>(r0, r1, w, words, P0, P1);                                       \
        break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
        default:
            #pragma unroll
            for (int p = 0; p < 8; ++p) P0[p] = P1[p] = 0u;
    }
}

// The A fragments of the 8 k-steps of one plane word (rows g in P0, g + 8 in P1).
template <int B>
__device__ __forceinline__ void decode_word(const u32 (&P0)[8], const u32 (&P1)[8],
                                            const u32 (&L0)[8], const u32 (&L1)[8], const Stage& st,
                                            u32 (&A)[WG_KSTEPS][4]) {
    const int g = (threadIdx.x & 31) >> 2;
    u32 f[4][2][4];  // [phase C][k-step 2C + h]
    decode_frags<B, 0, true>(P0, P1, L0, L1, st.tbl[g], st.tbl[g + 8], f[0]);
    decode_frags<B, 1, true>(P0, P1, L0, L1, st.tbl[g], st.tbl[g + 8], f[1]);
    decode_frags<B, 2, true>(P0, P1, L0, L1, st.tbl[g], st.tbl[g + 8], f[2]);
    decode_frags<B, 3, true>(P0, P1, L0, L1, st.tbl[g], st.tbl[g + 8], f[3]);
    #pragma unroll
    for (int s = 0; s < WG_KSTEPS; ++s)
        #pragma unroll
        for (int j = 0; j < 4; ++j) A[s][j] = f[s >> 1][s & 1][j];
}

__device__ __forceinline__ void wg_decode(const Stage& st, int B, bool live, const u32 (&P0)[8],
                                          const u32 (&P1)[8], const u32 (&L0)[8],
                                          const u32 (&L1)[8], u32 (&A)[WG_KSTEPS][4]) {
    switch (live ? B : 0) {
#define CASE(W) case W: decode_word<W>(P0, P1, L0, L1, st, A); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
        default:
            #pragma unroll
            for (int s = 0; s < WG_KSTEPS; ++s) A[s][0] = A[s][1] = A[s][2] = A[s][3] = 0u;
    }
}

// What one warp streams: its m-tile (staged at width B; live: a row in range) and the pass's
// token tile.
struct WgJob {
    int B;
    bool live, flat;
    bool uniform;  // every warp of the CTA reads the same width (down always; gate_up mostly)
    int words;  // the row's plane words up to the job's last chunk
    int c0;     // the job's first chunk (8 plane words; down's stream-K shares start mid-row)
    const unsigned short* tile;
    STAMP_FIELD(int kind;)  // the kernel's STAMP kind: 0 gate_up, 1 down
};

// Plane loads and decode of a half-chunk at width B and flatness FLAT fixed at compile time, or,
// for B = 0, chosen per warp at run time (gate and up at different widths). A dead m-tile loads
// zeros (no words); its rows are never stored.
template <int B, bool FLAT>
__device__ __forceinline__ void wg_load_at(const Stage& st, const WgJob& job, int w, u32 (&P0)[8],
                                           u32 (&P1)[8]) {
#if PROBE(PREFILL_NO_PLANES)
    #pragma unroll
    for (int p = 0; p < 8; ++p) P0[p] = w * 0x9e3779b9u + p, P1[p] = P0[p] ^ threadIdx.x;
    return;
#endif
    if constexpr (B == 0) {
        wg_load(st, job.B, job.live, job.flat, w, job.words, P0, P1);
    } else {
        const int g = (threadIdx.x & 31) >> 2;
        const int words = job.live ? job.words : 0;
        load_word<B, FLAT>(st.ptr + g * 8, st.ptr + (g + 8) * 8, w, words, P0, P1);
    }
}

// Plane words w, w + 1 (w even) of rows g, g + 8: into P*a and P*b. FLAT rows (`wg_job`: every
// staged row of the CTA in one slab) take one 8-byte load a (row, plane); others two word loads.
template <int B, bool FLAT>
__device__ __forceinline__ void wg_load_pair(const Stage& st, const WgJob& job, int w,
                                             u32 (&Pa0)[8], u32 (&Pa1)[8], u32 (&Pb0)[8],
                                             u32 (&Pb1)[8]) {
#if !PROBE(PREFILL_NO_PLANES)
    if constexpr (B > 0 && FLAT) {
        const int g = (threadIdx.x & 31) >> 2;
        const RowPtr *r0 = st.ptr + g * 8, *r1 = st.ptr + (g + 8) * 8;
        const bool in = job.live && w < job.words;
        #pragma unroll
        for (int p = 0; p < 8; ++p) {
            const uint2 z = make_uint2(0u, 0u);
            const uint2 v0 = p < B && in ? __ldg((const uint2*)(r0[p].p0 + tiled(w))) : z;
            const uint2 v1 = p < B && in ? __ldg((const uint2*)(r1[p].p0 + tiled(w))) : z;
            Pa0[p] = v0.x, Pb0[p] = v0.y, Pa1[p] = v1.x, Pb1[p] = v1.y;
        }
        return;
    }
#endif
    wg_load_at<B, FLAT>(st, job, w, Pa0, Pa1);
    wg_load_at<B, FLAT>(st, job, w + 1, Pb0, Pb1);
}

template <int B>
__device__ __forceinline__ void wg_decode_at(const Stage& st, const WgJob& job, const u32 (&P0)[8],
                                             const u32 (&P1)[8], const u32 (&L0)[8],
                                             const u32 (&L1)[8], u32 (&A)[WG_KSTEPS][4]) {
    if constexpr (B == 0) wg_decode(st, job.B, job.live, P0, P1, L0, L1, A);
    else decode_word<B>(P0, P1, L0, L1, st, A);
}

// The sm_90a prefill streams a block's planes with few warps an SM (2 CTAs of 4), so each plane
// word waits on DRAM latency; from L2 it comes sooner. Every 4 chunks (8 units of each row: 8
// 128-byte lines of a tiled group, one unit of its 8 rows each), each lane asks L2 for one of the
// lines PF_AHEAD chunks on of its groups (rows g, g + 8: unit g of those 8) and planes t, t + 4
// (B: the m-tile's width). Measured (decisions/014, row-major planes: a line a row):
// Mixtral 7-19% faster, the Qwen shapes 1-5%. Also asking for the first lines at a tile's start,
// or 8 chunks ahead, was no better. The same prefetch made the decode kernels 1-7% slower and the
// mma.sync prefill (timed on the H200) 3x slower: they have none.
#define PF_AHEAD 4
__device__ __forceinline__ void prefetch_ahead(const Stage& st, int B, int words, int it) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int w = 8 * (it + PF_AHEAD) + 4 * g;
    if ((it & 3) || w >= words) return;
    #pragma unroll
    for (int p = t; p < 8; p += 4) {
        if (p >= B) break;
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const RowPtr rp = st.ptr[(g + 8 * h) * 8 + p];
            prefetch_l2(word_ptr(rp, w));
        }
    }
}

// Widths 1-4 on flat rows stream their plane words through a ring in shared memory instead of
// registers: RING_SLOTS chunks a warp, in the warp's table space (a width-4 table lives in
// registers, `lut_from`, once the loop starts). Each chunk is copied with `cp.async` RING_SLOTS - 1
// chunks ahead, so a plane word has ~6 half-chunks to arrive where a register load had one.
// A slot is [plane][row 0-15][8 words]; a lane reads rows g, g + 8 (rows g and g + 4 of a warp's
// read share banks: two-way conflicts).
#define RING_SLOTS 4
template <int B, bool FLAT>
constexpr bool kRing = B >= 1 && B <= 4 && FLAT;

// Where chunk c's slot of the warp's ring starts (shared-memory address).
template <int B>
__device__ __forceinline__ u32 ring_slot(const Stage& st, int c) {
    return smem_u32(&st.tbl[0][0]) + (c % RING_SLOTS) * (512 * B);
}

// Copy chunk c of the warp's 16 rows into its slot (lane: row lane / 2, words 4 (lane % 2) on),
// then commit a cp.async group (an empty one past the last chunk or for a dead m-tile).
template <int B>
__device__ __forceinline__ void ring_fill(const Stage& st, const WgJob& job, int c) {
    const int lane = threadIdx.x & 31, r = lane >> 1, h = lane & 1, w = 8 * c + 4 * h;
    const u32 dst = ring_slot<B>(st, c) + 32 * r + 16 * h;
    if (job.live && w < job.words) {  // (a row is whole 16-byte units)
        #pragma unroll
        for (int p = 0; p < B; ++p)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                         :: "r"(dst + 512 * p), "l"(st.ptr[r * 8 + p].p0 + tiled(w)) : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// Word 2t + U of chunk c, rows g (P0) and g + 8 (P1), from the ring (zeros for a dead m-tile).
template <int B>
__device__ __forceinline__ void ring_read(const Stage& st, const WgJob& job, int c, int U,
                                          u32 (&P0)[8], u32 (&P1)[8]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const u32 at = ring_slot<B>(st, c) + 32 * g + 4 * (2 * t + U);
    #pragma unroll
    for (int p = 0; p < 8; ++p) {
        P0[p] = P1[p] = 0u;
        if (p < B && job.live) {
            asm volatile("ld.shared.u32 %0, [%1];" : "=r"(P0[p]) : "r"(at + 512 * p));
            asm volatile("ld.shared.u32 %0, [%1];" : "=r"(P1[p]) : "r"(at + 512 * p + 256));
        }
    }
}

// At chunk c's start: wait for its copies (RING_SLOTS - 2 newer groups may still run), and refill
// the slot chunk c - 1 used (every lane read it before the warp barrier) with chunk c + 3.
template <int B>
__device__ __forceinline__ void ring_next(const Stage& st, const WgJob& job, int c) {
    asm volatile("cp.async.wait_group %0;" :: "n"(RING_SLOTS - 2) : "memory");
    __syncwarp();
    ring_fill<B>(st, job, c + RING_SLOTS - 1);
}

// One half-chunk: decode word U of the lane's chunk into A (overlapping the previous
// half-chunk's wgmma); after word 1, load both words of the lane's next chunk (one 8-byte load a
// row and plane); wait for this half-chunk's B, issue its 8 wgmma, retire the previous
// half-chunk's (then `other`, its A set, is free) and start copying the next half-chunk's B into
// the buffer that frees.
template <int B, bool FLAT, int U>
__device__ __forceinline__ void wg_half(PrefillWG& sm, const WgJob& job, int hc, int halves,
                                        const u32 (&L0)[8], const u32 (&L1)[8], u32 (&Pa0)[8],
                                        u32 (&Pa1)[8], u32 (&Pb0)[8], u32 (&Pb1)[8],
                                        u32 (&A)[WG_KSTEPS][4], const u32 (&other)[WG_KSTEPS][4],
                                        float (&d)[64]) {
    const Stage& st = sm.st[threadIdx.x >> 5];
    if constexpr (kRing<B, FLAT>) {
        if (U == 0) ring_next<B>(st, job, hc / 2);
        ring_read<B>(st, job, hc / 2, U, Pa0, Pa1);
        wg_decode_at<B>(st, job, Pa0, Pa1, L0, L1, A);
    } else if (U == 0) {
        if (job.live) prefetch_ahead(st, B == 0 ? job.B : B, job.words, hc / 2);
        wg_decode_at<B>(st, job, Pa0, Pa1, L0, L1, A);
    } else {
        wg_decode_at<B>(st, job, Pb0, Pb1, L0, L1, A);
        wg_load_pair<B, FLAT>(st, job, 8 * (hc / 2 + 1) + 2 * (threadIdx.x & 3), Pa0, Pa1, Pb0,
                              Pb1);
    }
    mbar_wait(&sm.full[U], (hc / 2) & 1);  // buffer U's copy for chunk hc / 2 (wg_job's phase)
    wgmma_fence();
    const unsigned long long desc = b_desc(&sm.b[U][0][0][0][0]);
    #pragma unroll
    for (int s = 0; s < WG_KSTEPS; ++s)  // the descriptor counts 16-byte units
        wgmma_n128(d, A[s], desc + s * (sizeof(sm.b[0][0]) >> 4));
    wgmma_commit();
    wgmma_wait<1>();
    hold(other);
    if (hc + 1 < halves) load_b(sm, U ^ 1, job.tile, hc + 1);
}

// d = W[64 rows] x^T for the 128 tokens of the job's tile, over its chunks' columns, at width B
// (0: each warp's own, chosen per half-chunk). Lane (g, t) of warp q ends with row
// 16q + g + 8(r / 2), token 8j + 2t + (r % 2) in d[4j + r].
template <int B, bool FLAT>
__device__ __forceinline__ void prefill_wg_at(PrefillWG& sm, const WgJob& job, float (&d)[64]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const Stage& st = sm.st[threadIdx.x >> 5];
    u32 L0[8], L1[8];
    lut_from(st.tbl[g], min(job.B, 4), L0);
    lut_from(st.tbl[g + 8], min(job.B, 4), L1);
    const int halves = 2 * ((job.words + 7) / 8);
    u32 Pa0[8], Pa1[8], Pb0[8], Pb1[8];  // word 8 it + 2t + u of rows g, g + 8: u = 0 (a), 1 (b)
    if constexpr (kRing<B, FLAT>) {
        __syncwarp();  // every lane has its table in registers: the ring may overwrite it
        #pragma unroll
        for (int c = 0; c < RING_SLOTS - 1; ++c) ring_fill<B>(st, job, job.c0 + c);
    } else {
        wg_load_pair<B, FLAT>(st, job, 8 * job.c0 + 2 * t, Pa0, Pa1, Pb0, Pb1);
    }
    #pragma unroll
    for (int i = 0; i < 64; ++i) d[i] = 0.f;
    u32 Aa[WG_KSTEPS][4], Ab[WG_KSTEPS][4];
    #pragma unroll
    for (int s = 0; s < WG_KSTEPS; ++s) Ab[s][0] = Ab[s][1] = Ab[s][2] = Ab[s][3] = 0u;
    STAMP(job.kind, 4);
    for (int hc = 2 * job.c0; hc < halves; hc += 2) {
        wg_half<B, FLAT, 0>(sm, job, hc, halves, L0, L1, Pa0, Pa1, Pb0, Pb1, Aa, Ab, d);
        if (hc == 2 * job.c0) STAMP(job.kind, 5);
        wg_half<B, FLAT, 1>(sm, job, hc + 1, halves, L0, L1, Pa0, Pa1, Pb0, Pb1, Ab, Aa, d);
        if (hc == 2 * job.c0) STAMP(job.kind, 6);
    }
    wgmma_wait<0>();
    hold(Ab);
    #pragma unroll
    for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}

// (Everything from the kernel entry down to here is inlined: a call boundary anywhere around the
// wgmma makes ptxas serialize them, warning C7510.)
// One loop per (width, flatness) when the CTA's warps share a width: the compiler then schedules
// loads and decode across a whole half-chunk, and the hot loop is short. Mixed widths: the loop
// that switches per half-chunk.
__device__ __forceinline__ void prefill_wg(PrefillWG& sm, const WgJob& job, float (&d)[64]) {
    if (!job.uniform) return prefill_wg_at<0, false>(sm, job, d);
    switch (job.B) {
#define CASE(W)                                                                                   \
    case W:                                                                                       \
        if (job.flat) prefill_wg_at<W, true>(sm, job, d);                                         \
        else prefill_wg_at<W, false>(sm, job, d);                                                 \
        break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
    }
}

// Row tile `rt` of token tile `tile`: tile_info[tile] = (slot, pass), slot -1 past the last tile
// (the launcher sizes the grid by a bound: no host sync).
__device__ __forceinline__ Tile wg_tile(const Slots& s, const int* tile_info, int tile, int rt,
                                        int rows_per_cta) {
    Tile c;
    c.slot = __ldg(tile_info + 2 * tile);
    c.row0 = rt * rows_per_cta;
    c.base = WG_TOKENS * __ldg(tile_info + 2 * tile + 1);
    c.lo = c.slot < 0 ? 0 : __ldg(s.lo + c.slot);
    c.T = c.slot < 0 ? 0 : __ldg(s.hi + c.slot) - c.lo;
    return c;
}

// Chunks [c0, c1) of a row (c1 = WHOLE_ROW: to its end); `phases`: the phases B's mbarriers
// completed in the CTA's earlier jobs (down's stream-K shares; each buffer completes as many).
struct Chunks {
    int c0, c1, phases;
};
#define WHOLE_ROW (1 << 27)

// The phases B's mbarriers have completed after a job of chunks `ch` (wg_job).
__device__ __forceinline__ int phases_after(Chunks ch) {
    return ch.phases + ((ch.phases - ch.c0) & 1) + ch.c1 - ch.c0;
}

// Stage warp q's m-tile (rows mrow0..+15 of `block`) and describe the CTA's job: token tile
// `tile` over chunks `ch`. The CTA's first job (ch.phases = 0) sets up B's mbarriers; a later
// one must follow a barrier behind the last one's wgmma. Chunk c's copies wait on parity c & 1
// (wg_half), so where the phases so far and c0 differ in parity, one arrival completes an empty
// phase of each buffer first: the loop keeps no parity of its own (a register more made ptxas
// serialize down's wgmma, C7512).
__device__ __forceinline__ WgJob wg_job(PrefillWG& sm, const Paged& g, int block, int mrow0,
                                        int rows, i64 bits_nbytes, int words, int rpt,
                                        const unsigned short* tiles, int tile, Chunks ch, int wpad,
                                        bool uniform) {
    const int warp = threadIdx.x >> 5, nrows = min(ROWS, rows - mrow0);
    WgJob job;
    job.B = __ldg(g.width + block);
    job.uniform = uniform;
    job.live = nrows > 0;
    job.words = ch.c1 == WHOLE_ROW ? words : min(words, 8 * ch.c1);
    job.c0 = ch.c0;
    job.tile = tiles + (i64)tile * WG_TOKENS * 32 * wpad;
    bool flat = true;
    if (job.live)
        flat = stage(g, block, job.B, bits_nbytes, words, rpt, mrow0, nrows, sm.st[warp],
                     threadIdx.x & 31, 32);
    if (threadIdx.x == 0) {  // B's mbarriers, visible to every thread after the barrier below
        if (ch.phases == 0) {
            mbar_init(&sm.full[0], 1);
            mbar_init(&sm.full[1], 1);
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
        if ((ch.phases - ch.c0) & 1)
            for (int u = 0; u < 2; ++u)
                asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smem_u32(&sm.full[u]))
                             : "memory");
        load_b(sm, 0, job.tile, 2 * ch.c0);  // the first half-chunk of B lands while the CTA stages
    }
    job.flat = __syncthreads_and(flat);
    return job;
}

// h = glu(gate x, up x) for the 128 tokens of a tile, into the same tile of h (down_prefill_wg's
// B): 32 rows, warps 0, 1 gate, warps 2, 3 up. Gate and up warps swap half their sums through
// shared memory, so that each warp forms h for 64 of the tile's tokens (before: the gate warps
// formed all 128 while the up warps sat idle at the CTA's end).
__device__ __forceinline__ void gate_up_prefill_wg(Paged g, Slots s, const unsigned short* x,
                                                   unsigned short* hp, int I, int words_in,
                                                   int wpad_in, int wpad_out, i64 bits_nbytes,
                                                   int rpt, const int* tile_info) {
    PrefillWG& sm = shared_as<PrefillWG>();
    STAMP(0, 0);
    const Tile c = wg_tile(s, tile_info, blockIdx.y, blockIdx.x, 2 * ROWS);
    if (c.base >= c.T) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int e = __ldg(s.expert + c.slot), block = __ldg(s.block_ids + 3 * e + (warp >> 1));
    const int mrow0 = c.row0 + ROWS * (warp & 1);
    const int wg = __ldg(g.width + __ldg(s.block_ids + 3 * e));
    const bool uniform = wg == __ldg(g.width + __ldg(s.block_ids + 3 * e + 1));  // gate, up
    const Chunks all{0, WHOLE_ROW, 0};
    WgJob job = wg_job(sm, g, block, mrow0, I, bits_nbytes, words_in, rpt, x, blockIdx.y, all,
                       wpad_in, uniform);
    STAMP_KIND(job, 0);
    STAMP(0, 2);
    float d[64];
    prefill_wg(sm, job, d);
    STAMP(0, 3);
    __syncthreads();  // every warp is past its last wgmma: B's buffers are free
    // warp w (gate: tokens 0-63, d[0..31]; up: tokens 64-127, d[32..63]) hands the other half to
    // its partner w ^ 2, which holds the same rows of the other projection
    const bool gate = warp < 2;
    float* swap = reinterpret_cast<float*>(&sm.b[0][0][0][0][0]);  // [warp][32][lane]
    #pragma unroll
    for (int i = 0; i < 32; ++i) swap[(warp * 32 + i) * 32 + lane] = gate ? d[32 + i] : d[i];
    __syncthreads();
    const float* other = swap + (warp ^ 2) * 32 * 32 + lane;
    const int ntok = c.T - c.base, row0 = mrow0 + (lane >> 2), half = gate ? 0 : 64;
    unsigned short* h = hp + (i64)blockIdx.y * WG_TOKENS * 32 * wpad_out;
    // Rows r and r + 4 (r % 8 < 4) of a token are adjacent in h's tile (`tile_pos`), and lanes
    // l, l ^ 16 hold them: the two lanes swap one token's value so that each stores a pair.
    const bool low = !(lane & 16);
    #pragma unroll
    for (int i = 0; i < 32; i += 2) {
        u32 v[2];  // tokens k, k + 1 of this lane's row (rows past I: zeros, so down reads none)
        #pragma unroll
        for (int u = 0; u < 2; ++u) {
            const float mine = gate ? d[i + u] : d[32 + i + u], theirs = other[(i + u) * 32];
            const int row = row0 + 8 * (((i + u) & 3) >> 1);
#if PWCTL_EXPERT_BIAS  // (the silu build keeps its expression: planes.cuh GLU)
            float gv = gate ? mine : theirs, uv = gate ? theirs : mine;
            add_gate_up_bias(s, e, row, I, gv, uv);
            v[u] = row < I ? f2h(GLU(gv, uv)) : 0u;
#else
            v[u] = row < I ? f2h(GLU(gate ? mine : theirs, gate ? theirs : mine)) : 0u;
#endif
        }
        const u32 got = __shfl_xor_sync(0xffffffffu, low ? v[1] : v[0], 16);
        const int k = half + 8 * (i >> 2) + 2 * (lane & 3) + (low ? 0 : 1);
        const int row = row0 + 8 * ((i & 3) >> 1) - (low ? 0 : 4);
        if (k < ntok && row < 32 * wpad_out)
            *reinterpret_cast<u32*>(h + tile_pos(k, row)) = low ? v[0] | got << 16 : got | v[1] << 16;
    }
    STAMP(0, 7);
}

// One job of down: 64 rows of tile `tile` (warp q: rows 16q..16q+15) over chunks `ch` of their
// columns, out[token] += weight * (down h) for the tile's tokens.
__device__ __forceinline__ void down_prefill_job(PrefillWG& sm, const Paged& g, const Slots& s,
                                                 const unsigned short* hp, float* out, int H,
                                                 int words_in, int wpad_in, i64 bits_nbytes,
                                                 int rpt, const Tile& c, int tile, Chunks ch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int e = __ldg(s.expert + c.slot), block = __ldg(s.block_ids + 3 * e + 2);
    const int mrow0 = c.row0 + ROWS * warp;
    WgJob job = wg_job(sm, g, block, mrow0, H, bits_nbytes, words_in, rpt, hp, tile, ch, wpad_in,
                       true);
    STAMP_KIND(job, 1);
    STAMP(1, 2);
    float d[64];
    prefill_wg(sm, job, d);
    STAMP(1, 3);
    const int ntok = c.T - c.base, row0 = mrow0 + (lane >> 2);
    // Rows r, r + 1 (r even) of a token are adjacent in `out` (H is even: the launcher takes the
    // mma.sync prefill otherwise), and lanes l, l ^ 4 hold them: the two lanes swap one token's
    // value so that each adds a pair (one vector reduction).
    const bool low = !(lane & 4);
    #pragma unroll
    for (int i = 0; i < 64; i += 2) {
        const float got = __shfl_xor_sync(0xffffffffu, low ? d[i + 1] : d[i], 4);
        const int k = 8 * (i >> 2) + 2 * (lane & 3) + (low ? 0 : 1);
        const int row = row0 + 8 * ((i & 3) >> 1) - (low ? 0 : 1);
        if (k < ntok && row < H) {
            const int pair = c.lo + c.base + k;
            const float w = __ldg(s.weight + pair);
            float* at = out + (i64)__ldg(s.token + pair) * H + row;
            // (the bias variant: the down bias by the job whose chunks start the row)
            asm volatile("red.global.add.v2.f32 [%0], {%1, %2};"
                         :: "l"(at),
                            "f"(w * WITH_DOWN_BIAS(s, e, row, H, ch.c0 == 0, low ? d[i] : got)),
                            "f"(w * WITH_DOWN_BIAS(s, e, row + 1, H, ch.c0 == 0, low ? got : d[i + 1]))
                         : "memory");
        }
    }
    STAMP(1, 7);
}

// down's work is units (token tile, row tile of 64 rows), unit = tile * row_tiles + row tile, of
// `chunks` chunks (8 plane words of a row) each; a CTA's span is a range of chunks in unit order.
// sk = 0: CTA (x, y) takes unit (y, x) whole. sk > 0 (a wave of CTAs; the launcher's rule: long
// rows, e.g. Mixtral's 56 chunks), a 1-D grid: of the N units of the plan's live tiles, CTAs
// b < D = (N / sk) sk take unit b whole, and when the N - D units left would fill at most half
// a wave, the next sk CTAs take equal shares of their chunks (at most half a unit each; else
// those units go whole too). One CTA a unit left them to run as a partial wave at the end: Mixtral at
// 512 tokens, 832 units on 264 CTAs, took 4 waves' time for 3.15 waves' work (decisions/017).
// A share may end or begin inside a unit: its partial sums are added as a whole
// unit's are (atomics, which down needs anyway).
struct Span {
    int lo, hi;
};

__device__ __forceinline__ Span down_span(const int* tile_info, int tiles, int row_tiles,
                                          int chunks, int sk) {
    if (sk == 0) {
        const int u = blockIdx.y * row_tiles + blockIdx.x;
        return Span{u * chunks, (u + 1) * chunks};
    }
    // a plan ends with a dead tile whose pass is the count of live tiles (plan_tiles)
    const int n = __ldg(tile_info + 2 * tiles - 1) * row_tiles, b = blockIdx.x;
    const int d = 2 * (n % sk) > sk ? n : n / sk * sk;
    if (b < d) return Span{b * chunks, (b + 1) * chunks};
    if (b - d >= sk) return Span{0, 0};
    const i64 rest = (i64)(n - d) * chunks;
    return Span{d * chunks + (int)((b - d) * rest / sk), d * chunks + (int)((b - d + 1) * rest / sk)};
}

// Job k (0 or 1) of the CTA's span, which covers at most two: the end of one unit and the start
// of the next. Each job computes the span anew from opaque copies of the arguments, so that
// nothing of it is held in registers across the first job's loop (a loop over jobs, or 3 more
// live registers, made ptxas serialize the wgmma: C7512).
__device__ __forceinline__ void down_prefill_part(PrefillWG& sm, const Paged& g, const Slots& s,
                                                  const unsigned short* hp, float* out, int H,
                                                  int words_in, int wpad_in, i64 bits_nbytes,
                                                  int rpt, const int* tile_info, int sk,
                                                  int row_tiles, int tiles, int k) {
    asm volatile("" : "+r"(words_in), "+r"(row_tiles), "+r"(tiles), "+r"(sk), "+l"(tile_info));
    const int chunks = (words_in + 7) / 8;
    const Span span = down_span(tile_info, tiles, row_tiles, chunks, sk);
    const int unit0 = span.lo / chunks, mid = min(span.hi, (unit0 + 1) * chunks);
    const Chunks first{span.lo - unit0 * chunks, mid - unit0 * chunks, 0};
    if (k == 1 && mid >= span.hi) return;
    const int unit = unit0 + k;
    const Chunks ch = k == 0 ? first : Chunks{0, span.hi - unit * chunks, phases_after(first)};
    if (ch.c0 >= ch.c1) return;
    const Tile c = wg_tile(s, tile_info, unit / row_tiles, unit % row_tiles, 4 * ROWS);
    if (c.base >= c.T || c.row0 >= H) return;  // (sk = 0 only: the wave's units are live)
    if (k == 1) __syncthreads();  // every warp is past the first job's wgmma: B is free
    down_prefill_job(sm, g, s, hp, out, H, words_in, wpad_in, bits_nbytes, rpt, c,
                     unit / row_tiles, ch);
}

// out[token] += weight * (down h) for the tokens of h's tiles: each job 64 rows (warp q:
// 16q..16q+15) of one tile over a range of its columns (down_span).
__device__ __forceinline__ void down_prefill_wg(Paged g, Slots s, const unsigned short* hp,
                                                float* out, int H, int words_in, int wpad_in,
                                                i64 bits_nbytes, int rpt, const int* tile_info,
                                                int sk, int row_tiles, int tiles) {
    PrefillWG& sm = shared_as<PrefillWG>();
    STAMP(1, 0);
    down_prefill_part(sm, g, s, hp, out, H, words_in, wpad_in, bits_nbytes, rpt, tile_info, sk,
                      row_tiles, tiles, 0);
    if (sk > 0)
        down_prefill_part(sm, g, s, hp, out, H, words_in, wpad_in, bits_nbytes, rpt, tile_info,
                          sk, row_tiles, tiles, 1);
}
#endif

// sm_90a only (the launcher checks the device); elsewhere they compile to a trap.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WG_BODY(call) call;
#else
#define WG_BODY(call) __trap();
#endif
#if WANT(gate_up_prefill_wg)
extern "C" __global__ void __launch_bounds__(128, 2) gate_up_prefill_wg(
    PAGED_ARGS, SLOT_ARGS, const unsigned short* x, unsigned short* hp, int I, int words_in,
    int wpad_in, int wpad_out, i64 bits_nbytes, int rpt, const int* tile_info) {
    WG_BODY(gate_up_prefill_wg(PAGED, SLOTS, x, hp, I, words_in, wpad_in, wpad_out, bits_nbytes,
                               rpt, tile_info))
}
#endif
#if WANT(down_prefill_wg)
extern "C" __global__ void __launch_bounds__(128, 2) down_prefill_wg(
    PAGED_ARGS, SLOT_ARGS, const unsigned short* hp, float* out, int H, int words_in, int wpad_in,
    i64 bits_nbytes, int rpt, const int* tile_info, int sk, int row_tiles, int tiles) {
    WG_BODY(down_prefill_wg(PAGED, SLOTS, hp, out, H, words_in, wpad_in, bits_nbytes, rpt,
                            tile_info, sk, row_tiles, tiles))
}
#endif

// The sm_90a prefill's token tiles in one pass (fused_moe.wgmma_tiles, which gathers, reorders
// and permutes in torch): tile t holds the tokens of pairs pair[128 t ..], each a row of x (fp16
// [T, H]) in wgmma order, laid out as `PrefillWG::b` holds it (the inverse of `tile_pos`). A
// thread writes one 16-byte unit: 8 k of one token's k-step. Tiles past the last real one (slot
// -1 in tile_info) are left unwritten: no CTA reads them.
#if WANT(token_tiles)
extern "C" __global__ void token_tiles(const unsigned short* x, int H, int wpad, const int* token,
                                       const int* s_lo, const int* s_hi, const int* tile_info,
                                       uint4* xt) {
    const int t = blockIdx.y, units = wpad / 4 * 2048;  // half-chunks x (8 x 16 x 2 x 8) units
    const int slot = tile_info[2 * t];
    if (slot < 0) return;
    // the tile's first pair; tokens past the slot's end repeat its last (computed, never stored)
    const int first = s_lo[slot] + PF_TOKENS * tile_info[2 * t + 1], last = s_hi[slot] - 1;
    for (int u = blockIdx.x * blockDim.x + threadIdx.x; u < units; u += gridDim.x * blockDim.x) {
        // unit u = [half-chunk hc][k-step s 8][token group 16][k half 2][token 8]
        const int hc = u >> 11, s = (u >> 8) & 7, kh = (u >> 3) & 1;
        const int n = ((u >> 4) & 15) * 8 + (u & 7);
        const unsigned short* row = x + (i64)token[min(first + n, last)] * H;
        u32 v[4];
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            u32 two = 0;
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int k = 8 * kh + 2 * i + h, j = (k & 1) + 2 * (k >> 3);
                const int w = 8 * (hc >> 1) + 2 * ((k & 7) >> 1) + (hc & 1);
                const int col = 32 * w + (s >> 1) + 4 * j + 16 * (s & 1);
                two |= (u32)(col < H ? row[col] : (unsigned short)0) << (16 * h);
            }
            v[i] = two;
        }
        xt[(i64)t * units + u] = make_uint4(v[0], v[1], v[2], v[3]);
    }
}
#endif
#endif  // PWCTL_PREFILL_WG_CU
