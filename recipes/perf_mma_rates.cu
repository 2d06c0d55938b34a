// Tensor-core issue rates of mma.sync shapes (recipes/perf_mma_rates.py): 8 independent
// accumulator chains a warp, operands fixed in registers.
typedef unsigned u32;
#define CHAINS(TYPE, MMA)                                                                        \
    TYPE d[8][4] = {};                                                                           \
    const u32 a = threadIdx.x, b = a * 3u;                                                       \
    for (int i = 0; i < iters; ++i) {                                                            \
        _Pragma("unroll") for (int c = 0; c < 8; ++c) asm volatile(MMA                          \
            : "+r"(*(u32*)&d[c][0]), "+r"(*(u32*)&d[c][1]), "+r"(*(u32*)&d[c][2]), "+r"(*(u32*)&d[c][3]) \
            : "r"(a), "r"(b));                                                                   \
    }                                                                                            \
    TYPE s = 0;                                                                                  \
    for (int c = 0; c < 8; ++c) s += d[c][0] + d[c][1] + d[c][2] + d[c][3];                      \
    out[blockIdx.x * blockDim.x + threadIdx.x] = (float)s;

#define OPS "{%0,%1,%2,%3}, {%4,%4,%4,%4}, {%5,%5}, {%0,%1,%2,%3};"
extern "C" __global__ void f16(int iters, float* out) {
    CHAINS(float, "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 " OPS)
}
extern "C" __global__ void s8(int iters, float* out) {
    CHAINS(int, "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 " OPS)
}
extern "C" __global__ void s4(int iters, float* out) {
    CHAINS(int, "mma.sync.aligned.m16n8k64.row.col.s32.s4.s4.s32 " OPS)
}
extern "C" __global__ void b1_and(int iters, float* out) {
    CHAINS(int, "mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc " OPS)
}
extern "C" __global__ void b1_xor(int iters, float* out) {
    CHAINS(int, "mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.xor.popc " OPS)
}
