"""Serving: a pack's experts at per-block widths on a transformers model. Wings: engine/ (the
engine and its step loop), memory/ (the budget, KV cache and expert pages), widths/ (which width
each block runs at), moe/ (one MoE layer's compute), serve/ (the HTTP front end). It reads
format/, launches the kernels through pwctl/kernels/ (which never imports the runtime) and never
imports build/, bench/ or commands/ (tests/test_imports.py)."""
