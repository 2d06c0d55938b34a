"""Serving: a pack's experts at per-block widths on a transformers model. Wings: engine/ (the
engine and its step loop), memory/ (the budget, KV cache and expert pages), widths/ (which width
each block runs at), moe/ (one MoE layer's compute), serve/ (the HTTP front end); kernels.py and
popc.py (the CUDA launchers and their CPU twin). It reads format/ and never imports build/,
bench/ or commands/ (tests/test_imports.py)."""
