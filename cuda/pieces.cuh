// x's and h's pieces for the popc kernels (popc.cu): each row of x quantized to 16-bit fixed point
// per piece of at most POPC_STEPS k-steps, as the A fragments of mma.m16n8k256 .and.popc (PopcX),
// built by `popc_planes` for h and by the prep launches' `x_piece` blocks for x.
#ifndef PWCTL_PIECES_CUH
#define PWCTL_PIECES_CUH
#include "common.cuh"

static_assert(POPC_STEPS <= 32, "popc_fold sums a piece's k-step sums a lane a k-step");

__device__ __forceinline__ int step_word(int ks, int chunks, int t) {
    return ks < 2 * chunks ? 16 * (ks >> 1) + 4 * t + 2 * (ks & 1)
                           : 16 * chunks + 8 * (ks - 2 * chunks) + 2 * t;
}

// k-steps of a row of `words` words (words % 4 == 0)
__device__ __forceinline__ int popc_steps(int words) {
    return 2 * (words / 16) + (words % 16 + 7) / 8;
}

struct PopcX {  // one piece of one row of x (popc.PIECE_BYTES)
    uint4 a[POPC_STEPS][32];  // [k-step][lane]: planes g, g + 8 at the step's two words
    int ksum[POPC_STEPS];     // sum of q over each k-step (the empty subset's term)
    float sx;                 // the piece's scale: x = sx * q
    int pad[3];
};

__device__ __forceinline__ int popc_pieces(int words) {
    return (popc_steps(words) + POPC_STEPS - 1) / POPC_STEPS;
}

// Piece `pc` of one row into PopcX, word z of each k-step's 8 (POPC_SPLIT CTAs share a piece: one
// CTA doing all 8 words' ballots took 16 us on one SM, Nsight Compute, decisions/023). `at(w)`: the
// row's value at column 32 w + lane (w < words; words past the row read the last one, and a load
// must not sit behind a branch). Warp i takes the piece's k-steps i, i + warps,
// ... (SPW at most: SPW x warps >= the piece's k-steps), every load in flight at once, for the
// piece's scale; then it turns word z of each of its k-steps into planes. Steps past the row are
// neither built nor read. A warp's instructions are the cost (each waits ~10 cycles on the last
// with a few warps an SM: Nsight Compute, decisions/023), so no warp takes more steps than it must.
template <int SPW, class At>
__device__ void popc_piece_of(At at, int words, int pc, int z, PopcX* dst, bool store = true,
                              bool stamped = false) {
    __shared__ float amax;
    const int ks = popc_steps(words), chunks = words / 16, k0 = pc * POPC_STEPS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if (threadIdx.x == 0) amax = 0.f;
    float v[SPW][8], m = 0.f;
    #pragma unroll
    for (int j = 0; j < SPW; ++j) {
        const int i = warp + j * warps, step = k0 + i;
        if (i >= POPC_STEPS || step >= ks) break;  // warp-uniform; nobody reads past the row
        #pragma unroll
        for (int h = 0; h < 8; ++h) {  // word h % 2 of lane t = h / 2 of the k-step
            // every word loaded, past the row from its last word, so that the 8 loads go out
            // together: under `w < words` each waited on the one before (8 L2 round trips,
            // 3 us of popc_planes' 4.3 on Mixtral; decisions/023)
            const int w = step_word(step, chunks, h >> 1) + (h & 1);
            const float a = at(min(w, words - 1));
            v[j][h] = w < words ? a : 0.f;
            m = fmaxf(m, fabsf(v[j][h]));
        }
    }
    #pragma unroll
    for (int d = 16; d > 0; d >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, d));
    if (stamped && store) STAMP(3, 2);  // (popc_planes' phases: the warp's loads are in)
    __syncthreads();
    if (lane == 0) atomicMax((int*)&amax, __float_as_int(m));  // m >= 0: ints order as floats
    __syncthreads();
    if (stamped && store) STAMP(3, 3);
    const float inv = amax > 0.f ? 32767.f / amax : 0.f;
    #pragma unroll
    for (int j = 0; j < SPW; ++j) {
        const int i = warp + j * warps;
        if (i >= POPC_STEPS || k0 + i >= ks) break;
        float mine_v = 0.f;
        #pragma unroll
        for (int h = 0; h < 8; ++h)
            if (h == z) mine_v = v[j][h];
        const int q = __float2int_rn(mine_v * inv);
        u32 mine = 0;
        #pragma unroll
        for (int k = 0; k < 16; ++k) {
            const u32 b = __ballot_sync(0xffffffffu, (q >> k) & 1);
            if (lane == k) mine = b;
        }
        // plane `lane` of word (t, h) = z: lane (lane % 8, t) of the k-step, register 2h + lane / 8
        if (store && lane < 16)
            ((u32*)&dst->a[i][4 * (lane & 7) + (z >> 1)])[2 * (z & 1) + (lane >> 3)] = mine;
        if (z == 0) {  // the k-step's sum of q, once
            int s = 0;
            #pragma unroll
            for (int h = 0; h < 8; ++h) s += __float2int_rn(v[j][h] * inv);
            #pragma unroll
            for (int d = 16; d > 0; d >>= 1) s += __shfl_xor_sync(0xffffffffu, s, d);
            if (store && lane == 0) dst->ksum[i] = s;
        }
    }
    if (store && z == 0 && threadIdx.x == 0) dst->sx = amax / 32767.f;  // the piece's scale
}

// Block b of a prep launch's x-piece blocks (256 threads): piece, token and word z as
// `popc_planes`'s grid numbers them, from row-major fp16 x [T, H] (words: the gate rows').
__device__ void x_piece(const unsigned short* x, int T, int H, int words, PopcX* px, int b) {
    const int z = b % POPC_SPLIT, row = b / POPC_SPLIT % T, pc = b / POPC_SPLIT / T;
    const int lane = threadIdx.x & 31, pieces = popc_pieces(words);
    const unsigned short* xr = x + (i64)row * H;
    popc_piece_of<POPC_STEPS * 32 / PREP_THREADS>(
        [&](int w) {  // loaded at a column inside the row either way (popc_piece_of)
            const float v = h2f(xr[min(32 * w + lane, H - 1)]);
            return 32 * w + lane < H ? v : 0.f;
        },
        words, pc, z, px + (i64)row * pieces + pc);
}

#endif  // PWCTL_PIECES_CUH
