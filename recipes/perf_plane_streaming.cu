// Bare plane-word streaming kernels for recipes/perf_plane_streaming.py (no lookup, no mma).
typedef unsigned u32;
__device__ __forceinline__ u32 smem(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void cp16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(smem(dst)), "l"(src) : "memory"); }

// a chain of 5 dependent loads through `chain` (entries < mask + 1): a CTA's staging before its
// first plane word. A 4 KB chain stays in cache; a 256 MB one misses like staging's loads can.
__device__ __forceinline__ int prologue(const int* chain, int mask, bool on) {
    int v = (int)((blockIdx.x * 2654435761u) & (unsigned)mask);
    if (on) for (int i = 0; i < 5; ++i) v = __ldg(chain + v);
    return v & 0;  // always 0, but the loads must complete first
}

template <int MODE, int B>  // MODE 0: reg, 1: reg64, 2: reg128
__device__ void regs(const u32* __restrict__ planes, long ps, int W, const int* chain, int mask, bool pro,
                     int streams, u32* out) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int zero = prologue(chain, mask, pro);
    const int per_it = MODE == 2 ? 16 : 8, iters = W / per_it;
    u32 acc = 0, P[B][2][4];
    for (int s = 0; s < streams; ++s) {  // gate_up: gate's rows, then up's, one drain between
    const long row0 = (long)(blockIdx.x + s * gridDim.x) * 16 + zero;
    auto load = [&](int it) {
        #pragma unroll
        for (int p = 0; p < B; ++p)
        #pragma unroll
        for (int r = 0; r < 2; ++r) {
            const u32* base = planes + p * ps + (row0 + g + 8 * r) * W;
            if (it >= iters) { P[p][r][0] = P[p][r][1] = P[p][r][2] = P[p][r][3] = 0u; continue; }
            if (MODE == 0) {
                P[p][r][0] = __ldg(base + 8 * it + t), P[p][r][1] = __ldg(base + 8 * it + 4 + t);
            } else if (MODE == 1) {
                const uint2 v = __ldg((const uint2*)(base + 8 * it + 2 * t));
                P[p][r][0] = v.x, P[p][r][1] = v.y;
            } else {
                const uint4 v = __ldg((const uint4*)(base + 16 * it + 4 * t));
                P[p][r][0] = v.x, P[p][r][1] = v.y, P[p][r][2] = v.z, P[p][r][3] = v.w;
            }
        }
    };
    load(warp);
    for (int it = warp; it < iters; it += 4) {
        #pragma unroll
        for (int p = 0; p < B; ++p)
        #pragma unroll
        for (int r = 0; r < 2; ++r)
        #pragma unroll
        for (int v = 0; v < (MODE == 2 ? 4 : 2); ++v) acc = (acc ^ P[p][r][v]) * 3u + 1u;
        load(it + 4);
    }
    }
    if (acc == 0x12345678u) out[blockIdx.x] = acc;
}

template <int B>  // per-warp ring: 2 stages x B planes x 16 rows x (8 words + 4 of padding)
__device__ void ring(const u32* __restrict__ planes, long ps, int W, const int* chain, int mask, bool pro,
                     int streams, u32* out) {
    extern __shared__ __align__(128) u32 sm[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    u32* rg = sm + warp * (2 * B * 16 * 12);
    const int zero = prologue(chain, mask, pro);
    const int iters = W / 8;
    u32 acc = 0;
    for (int s = 0; s < streams; ++s) {
    const long row0 = (long)(blockIdx.x + s * gridDim.x) * 16 + zero;
    auto issue = [&](int slot, int it) {
        if (it < iters) {
            #pragma unroll
            for (int k = 0; k < B; ++k) {
                const int piece = k * 32 + lane, half = piece & 1, r = (piece >> 1) & 15;
                cp16(rg + ((slot * B + k) * 16 + r) * 12 + 4 * half, planes + k * ps + (row0 + r) * W + 8 * it + 4 * half);
            }
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    issue(0, warp);
    issue(1, warp + 4);
    for (int it = warp, slot = 0; it < iters; it += 4, slot ^= 1) {
        asm volatile("cp.async.wait_group 1;" ::: "memory");
        __syncwarp();
        const u32* st = rg + slot * B * 16 * 12;
        #pragma unroll
        for (int p = 0; p < B; ++p)
        #pragma unroll
        for (int r = 0; r < 2; ++r)
        #pragma unroll
        for (int u = 0; u < 2; ++u) acc = (acc ^ st[(p * 16 + g + 8 * r) * 12 + 4 * u + t]) * 3u + 1u;
        __syncwarp();
        issue(slot, it + 8);
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    __syncwarp();
    }
    if (acc == 0x12345678u) out[blockIdx.x] = acc;
}

#define K(NAME, CALL) extern "C" __global__ void __launch_bounds__(128) NAME( \
    const u32* p, long s, int W, const int* c, int mask, int pro, int streams, u32* o) { \
    CALL(p, s, W, c, mask, pro != 0, streams, o); }
K(reg4, (regs<0, 4>)) K(reg64_4, (regs<1, 4>)) K(reg128_4, (regs<2, 4>)) K(ring4, ring<4>)
K(reg3, (regs<0, 3>)) K(ring3, ring<3>)
