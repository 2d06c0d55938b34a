// The fused mixed-precision MoE kernels (docs/KERNELS.md): what every family file includes.
// ("decisions/NNN" in these files: docs/decisions/NNN-*.md, the record with the figure behind a
// choice.) Every expert block is read at its current width straight from its planes, wherever the
// pager put them: a block's plane p is a chunk [bits | table] split over fixed-size slabs of one
// device arena, and the descriptor (per-block width, per-plane first slab-map entry, slab map)
// lives in device memory, rewritten by the pager between steps. Kernels never see host-side
// widths, so a width change costs no recompile, no reallocation and no host sync.
//
// Activations are read in "fragment order" (fused_moe.fragment_order): fp16 [rows, wpad, 32], where
// element [n][w][4s + i] is column 32w + (s >> 1) + 16(s & 1) + 4i, so that one 16-byte load is a
// lane's B fragment for two mma k-steps (see `mma_rows`). wpad: words rounded up to 8.
//
// Programs: pwctl/kernels/build.py writes each program the runtime compiles, one part of one
// family (pwctl/kernels/registry.py): the geometry shared with Python as #defines
// (pwctl/kernels/geometry.py: WARPS, ROWS, ...), PWCTL_WANT_<kernel> = 1 for each of the part's
// kernels written out in a family file (`#if WANT(kernel)`; an undefined one reads 0), the
// family's file, then the entries of the part's template kernels (GATE_UP_ENTRY, DOWN_ENTRY).
#ifndef PWCTL_COMMON_CUH
#define PWCTL_COMMON_CUH

#ifndef WARPS
#error "the geometry (WARPS, ROWS, ...) comes from pwctl/kernels/geometry.py: build with pwctl.kernels.build"
#endif
#define WANT(kernel) PWCTL_WANT_##kernel

// No headers: NVRTC finds none of its own, and fp32 -> fp16 is one PTX instruction.
__device__ __forceinline__ unsigned short f2h(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

typedef unsigned int u32;
typedef long long i64;

__device__ __forceinline__ float h2f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// PRMT, as PTX defines it: byte i of the result is byte (s >> 4i) & 7 of {b, a} (bit 3 of a
// nibble would replicate a sign; every selector here keeps it clear). Not `__byte_perm`: CUDA
// documents that one as ignoring bit 3, so the compiler masks each run-time selector first.
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 s) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(s));
    return d;
}

__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// The line holding p into L2 (a hint: nothing waits for it).
__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// A 4-byte word from global to shared memory by cp.async (`tables_landed` waits for them).
__device__ __forceinline__ void copy_word_async(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_u32(dst)), "l"(src)
                 : "memory");
}

// Programmatic dependent launch (pwctl.kernels.launch, early=True; Hopper on). `wait_previous`: block
// until the previous kernel on the stream has finished and its writes are visible; `start_next`:
// let the next kernel's CTAs launch now (they wait in their own `wait_previous`). Both are no-ops
// for a plain launch and compile to nothing before sm_90.
__device__ __forceinline__ void wait_previous() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void start_next() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

#include "probes.cuh"

#endif  // PWCTL_COMMON_CUH
