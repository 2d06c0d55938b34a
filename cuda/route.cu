// The router in the launch that prepares a decode call (`route_prep`: decode_prep with the router
// folded in; decisions/009).
#ifndef PWCTL_ROUTE_CU
#define PWCTL_ROUTE_CU
#include "prep.cu"

// PWCTL_ROUTER_BIAS (the program's variant, pwctl/kernels/registry.py): the router linear has a bias
// (GPT-OSS), an fp16 vector route_prep takes last, added to each logit before its fp16 rounding as
// torch's fp16 linear adds it. Without it the kernel takes no such argument.
#ifndef PWCTL_ROUTER_BIAS
#error "the program names no variant: pwctl.kernels.build writes PWCTL_ROUTER_BIAS"
#endif
#if PWCTL_ROUTER_BIAS
#define ROUTER_BIAS_ARG , const unsigned short* router_bias
#define ROUTER_BIAS , router_bias
#else
#define ROUTER_BIAS_ARG
#define ROUTER_BIAS
#endif

// ------------------------------------------------------------------------------------------------
// Routing in the launch that prepares a decode call (`route_prep`: decode_prep with the router
// folded in). An eager decode is host-bound on the many-expert shapes, and the router was 6-8 more
// small launches (linear, softmax, top-k, normalization, scaling, the shared expert's gate):
// decisions/009.
//
// Every block but x's piece blocks (popc calls) takes a share of the logits (`router_logits`:
// `slices` warps a (token, row) dot product over H in fp32, rounded to fp16 as the reference's
// fp16 linear rounds them; row `experts` is the shared expert's gate when there is one). x's
// fragment-order copy and the output's zeroing go to the piece blocks, or without them to the
// logits blocks. The last logits block to finish (a counter it resets) picks each token's top-k
// in the recipe's order, writes index / weights / the shared gate, and groups the pairs
// (`group_decode`).

__device__ __forceinline__ float hsum2(u32 a, u32 b) {  // a.lo b.lo + a.hi b.hi, fp32
    return h2f(a & 0xffff) * h2f(b & 0xffff) + h2f(a >> 16) * h2f(b >> 16);
}

__device__ __forceinline__ float warp_sum(float v) {
    #pragma unroll
    for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
    return v;
}

// This warp's share of a dot product of two fp16 rows: uint4s [lo, hi) of them (16-byte aligned
// rows). A lane issues its ROUTE_LOADS pairs of loads before it adds any: with a warp a row and
// two loads in flight, a lane's 8-16 loads were 4-8 round trips, most of route_prep's time.
__device__ float slice_dot(const uint4* a, const uint4* b, int lo, int hi) {
    float s = 0.f;
    for (int i0 = lo + (threadIdx.x & 31); i0 < hi; i0 += 32 * ROUTE_LOADS) {
        uint4 u[ROUTE_LOADS], v[ROUTE_LOADS];
        #pragma unroll
        for (int j = 0; j < ROUTE_LOADS; ++j) {
            const int i = i0 + 32 * j;
            u[j] = i < hi ? __ldg(a + i) : make_uint4(0u, 0u, 0u, 0u);
            v[j] = i < hi ? __ldg(b + i) : make_uint4(0u, 0u, 0u, 0u);
        }
        #pragma unroll
        for (int j = 0; j < ROUTE_LOADS; ++j)
            s += hsum2(u[j].x, v[j].x) + hsum2(u[j].y, v[j].y) + hsum2(u[j].z, v[j].z) + hsum2(u[j].w, v[j].w);
    }
    return warp_sum(s);
}

// Logits row d = (token d / rows, router row d % rows) over H, in fp16 as the reference's fp16
// linear rounds them. `slices` warps of a block (a power of two <= the block's warps) take a
// contiguous share of H each and add up in shared memory in slice order: the same sum on every
// launch. The block's warps take warps / slices rows at a time; every thread of the block calls.
__device__ void router_logits(const unsigned short* x, int T, int H, const unsigned short* gate_w,
                              int experts, const unsigned short* shared_gate_w, int slices,
                              float* logits, int blocks ROUTER_BIAS_ARG) {
    __shared__ float part[PREP_THREADS / 32];
    const int rows = experts + (shared_gate_w != nullptr), warps = blockDim.x / 32;
    const int wib = threadIdx.x / 32, per = warps / slices, n = H / 8, len = (n + slices - 1) / slices;
    const int sl = wib % slices, lo = sl * len, hi = min(n, lo + len);
    for (int grp = blockIdx.x; grp * per < T * rows; grp += blocks) {
        const int d = grp * per + wib / slices, t = d / rows, e = d % rows;
        float s = 0.f;
        if (d < T * rows) {
            const unsigned short* w = e < experts ? gate_w + (i64)e * H : shared_gate_w;
            s = slice_dot((const uint4*)(x + (i64)t * H), (const uint4*)w, lo, hi);
        }
        if ((threadIdx.x & 31) == 0) part[wib] = s;
        __syncthreads();
        if (threadIdx.x % (32 * slices) == 0 && d < T * rows) {
            float sum = 0.f;
            for (int j = 0; j < slices; ++j) sum += part[wib + j];
#if PWCTL_ROUTER_BIAS
            if (e < experts) sum += h2f(__ldg(router_bias + e));  // (the shared gate's has none)
#endif
            logits[d] = h2f(f2h(sum));
        }
        __syncthreads();  // part is rewritten by the next rows
    }
}

#define ROUTE_PER_LANE (ROUTE_MAX_EXPERTS / 32)
#define NEG_INF __int_as_float(0xff800000)

// atomicAdd at gpu scope with acquire-release order: what this thread (and, through a barrier
// before it, its block) wrote is visible to whoever acquires the value it leaves, and it sees
// what the adds before it released.
__device__ __forceinline__ unsigned add_acq_rel(unsigned* p, unsigned v) {
    unsigned old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;"
                 : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}

// A logit's key: the order of its fp16 value (router_logits rounds the logits to fp16) in the
// high half, 0xffff - e in the low, so that one u32 max picks the largest logit and, of equal
// ones, the lowest expert. Softmax keeps the logits' order, so the top-k of the probabilities is
// the top-k of the keys (but for two logits within ~1e-7 of each other whose probabilities round
// to one float: they rank by logit here). An absent expert's key is 0, below every real one.
__device__ __forceinline__ unsigned logit_key(float v, int e) {
    const unsigned h = f2h(v + 0.f);  // -0 + 0 = +0: they tie, as in comparisons
    return ((h ^ (h >> 15 ? 0xffffu : 0x8000u)) << 16) | (0xffffu - e);
}
__device__ __forceinline__ float key_logit(unsigned key) {
    const unsigned o = key >> 16;
    return h2f((unsigned short)(o ^ (o >> 15 ? 0x8000u : 0xffffu)));
}
__device__ __forceinline__ int key_expert(unsigned key) { return 0xffff - (int)(key & 0xffffu); }

// The warp's largest key (a tree over the lane's keys, then one REDUX).
__device__ __forceinline__ unsigned warp_max_key(const unsigned (&key)[ROUTE_PER_LANE]) {
    unsigned m[ROUTE_PER_LANE];
    #pragma unroll
    for (int j = 0; j < ROUTE_PER_LANE; ++j) m[j] = key[j];
    #pragma unroll
    for (int d = 1; d < ROUTE_PER_LANE; d <<= 1)
        #pragma unroll
        for (int j = 0; j + d < ROUTE_PER_LANE; j += 2 * d) m[j] = max(m[j], m[j + d]);
    return __reduce_max_sync(0xffffffffu, m[0]);
}

// Token t's top-k from its logits row (one warp): order 0 = softmax over all experts, then top-k
// (renormalized when `norm`); order 1 = top-k of the logits, then softmax over those k. Written to
// index / weights and to copy_index / copy_weights (the same pointers, or a shared-memory copy).
// A round is one REDUX of the lanes' largest keys, 0.11 us: comparing floats and then experts
// took two REDUX and a serial scan a round, 0.33 us, and Qwen3-MoE's top-8 2.6 of its 7.6 us
// prep (decisions/009). Renormalized, the probabilities' common denominator
// cancels, so only weights that are not renormalized wait for softmax's sum.
__device__ void route_token(const float* logits, int experts, int k, int order, int norm,
                            float scaling, i64* index, float* weights, i64* copy_index,
                            float* copy_weights) {
    const int lane = threadIdx.x & 31;
    float v[ROUTE_PER_LANE];
    unsigned key[ROUTE_PER_LANE];
    #pragma unroll
    for (int j = 0; j < ROUTE_PER_LANE; ++j) {
        const int e = lane + 32 * j;
        v[j] = e < experts ? __ldcg(logits + e) : NEG_INF;  // other blocks wrote them: L2
        key[j] = e < experts ? logit_key(v[j], e) : 0u;
    }
    unsigned top = warp_max_key(key);
    const float m = key_logit(top);  // the largest logit
    // softmax's denominator stays in the weights only when they are not renormalized
    const bool divide = order == 1 || norm;
    float s = 0.f;
    if (!divide) {
        #pragma unroll
        for (int j = 0; j < ROUTE_PER_LANE; ++j) s += lane + 32 * j < experts ? expf(v[j] - m) : 0.f;
        s = warp_sum(s);
    }
    STAMP(2, 6);
    float mine = 0.f, total = 0.f;  // lane i keeps round i's exp(logit - m)
    int mine_e = 0;
    for (int i = 0; i < k; ++i) {
        if (i > 0) top = warp_max_key(key);
        #pragma unroll
        for (int j = 0; j < ROUTE_PER_LANE; ++j)
            if (key[j] == top) key[j] = 0u;  // taken (keys are unique)
        const float p = expf(key_logit(top) - m);
        total += p;
        if (lane == i) mine = p, mine_e = key_expert(top);
    }
    if (lane < k) {
        index[lane] = copy_index[lane] = mine_e;
        weights[lane] = copy_weights[lane] = (divide ? mine / total : mine / s) * scaling;
    }
}

#if WANT(route_prep)
extern "C" __global__ void route_prep(const unsigned short* x, int T, int H,
                                      const unsigned short* gate_w, int experts,
                                      const unsigned short* shared_gate_w, int k, int order,
                                      int norm, float scaling, float* logits, unsigned* done,
                                      i64* index, float* weights, float* shared_scale, int slots,
                                      int* token, float* weight, int* s_expert, int* s_lo,
                                      int* s_hi, int wpad, unsigned short* xf, float* out,
                                      int out_n, int words, PopcX* px, int px_blocks, int slices
                                      ROUTER_BIAS_ARG) {
    STAMP(2, 0);
    const int rows = experts + (shared_gate_w != nullptr), warps = blockDim.x / 32;
    const int blocks = gridDim.x - px_blocks;  // the last px_blocks build x's pieces
    // x's pieces and the routing need nothing of each other, so the routing does not wait for the
    // piece blocks (it once did: Mixtral, 1 token, 0.2-0.4 us a layer, decisions/009)
    // x's layout and out's zeroing: by the piece blocks when there are any, which nothing waits
    // for until the grid ends (the last logits block's share was on the routing's path: Mixtral,
    // one token, 1.1 us, decisions/009); else by the logits blocks, before the counter
    // (after it, the last block's share followed the routing: Mixtral's route_prep, 4 blocks, 7.2
    // -> 9.4 us, decisions/009)
    if ((int)blockIdx.x >= blocks) {
        const int b = blockIdx.x - blocks;
        const int first = b * blockDim.x + threadIdx.x;
        lay_out_x<1>(x, T, H, wpad, xf, out, out_n, first, px_blocks * blockDim.x);
        return x_piece(x, T, H, words, px, b);
    }
    router_logits(x, T, H, gate_w, experts, shared_gate_w, slices, logits, blocks ROUTER_BIAS);
    STAMP(2, 1);
    if (px_blocks == 0) {
        const int first = blockIdx.x * blockDim.x + threadIdx.x;
        lay_out_x<1>(x, T, H, wpad, xf, out, out_n, first, blocks * blockDim.x);
    }
    STAMP(2, 2);
    // the last logits block to get here routes: every other block's logits are written by then
    // (the counter's add releases this block's logits and acquires the others': two fence.sc
    // around a relaxed add cost ~0.3 us each on the last block's path, decisions/009)
    __shared__ bool last;
    __syncthreads();
    if (threadIdx.x == 0) last = add_acq_rel(done, 1u) == (unsigned)blocks - 1;
    __syncthreads();
    if (!last) return;
    // gate_up's CTAs may launch now (every other block has exited); they wait for this grid to
    // finish. Let in at this grid's start, they sat on the SMs through the router: a one-token
    // Qwen3-MoE layer 35.4 us against 32.8 launched after it; from here 31.9, and no shape slower
    // than either (decisions/012)
    start_next();
    STAMP(2, 3);
    STAMP(2, 5);
    // a call of at most GROUP_FEW pairs hands them to the grouping in shared memory too
    __shared__ i64 few_index[GROUP_FEW];
    __shared__ float few_weights[GROUP_FEW];
    const bool few = T * k <= GROUP_FEW;
    for (int t = threadIdx.x / 32; t < T; t += warps) {
        const i64 at = (i64)t * k;
        route_token(logits + (i64)t * rows, experts, k, order, norm, scaling, index + at,
                    weights + at, few ? few_index + at : index + at, few ? few_weights + at : weights + at);
        if (shared_gate_w != nullptr && (threadIdx.x & 31) == 0) {
            const float g = __ldcg(logits + (i64)t * rows + experts);
            shared_scale[t] = h2f(f2h(1.f / (1.f + expf(-g))));  // an fp16 sigmoid, as torch's
        }
    }
    if (threadIdx.x == 0) *done = 0u;  // for the next launch
    STAMP(2, 4);
    __syncthreads();  // index and weights, written by this block, are visible to it
    group_decode(few ? few_index : index, few ? few_weights : weights, T * k, k, experts, slots,
                 token, weight, s_expert, s_lo, s_hi);
    STAMP(2, 7);
}
#endif
#endif  // PWCTL_ROUTE_CU
