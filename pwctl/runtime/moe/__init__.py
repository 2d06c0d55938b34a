"""One MoE layer's compute: the block that replaces a transformers MoE module, the router, the
fused paged experts (pair grouping, activation layouts and tile plans, launch prep, dispatch rules,
the FusedMoE call) and the 16-bit dense experts."""
