"""Expert parallelism over torch.distributed (issue 67): which rank owns which experts
(`placement`), and one MoE layer's exchange of tokens with their experts' owners (`exchange`).
Attention stays data-parallel: each rank serves its own requests with its own KV cache."""
