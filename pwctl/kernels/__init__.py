"""The fused MoE kernels' Python side (the CUDA sources: the top-level cuda/, docs/KERNELS.md).

- `registry`: every kernel, one row each: its family file, its compile part and, for the
  template kernels, its entry; the parts, the entries and the names the tests check come from it.
- `geometry`: the constants the CUDA sources share with Python (written into every program as
  #defines) and the tile and grid arithmetic the launchers plan with.
- `build`: each part's program, compiled by NVRTC through CuPy (cached by source hash).
- `launch`: the launches, on torch's current stream, and the driver's occupancy figures.
- `popc`: the CPU twin of the popc kernels' arithmetic.

CuPy is imported by `build` only, lazily: the CPU path never needs it."""
