"""The serving engine: Engine (load a pack into a transformers model, policies, the batched API),
the step loop (Batcher), scheduler, runner, paged attention, decode CUDA graphs, sampler,
detokenizer and the model loader."""
