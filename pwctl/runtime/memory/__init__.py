"""Device memory and what lives in it: the memory budget (planes + KV + fixed part) and its
accounting, the paged KV cache, the expert page table, pager and device table, the paged and
the dequantized (store) expert backends."""
