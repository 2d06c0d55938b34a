"""What the runtime reads from disk, written by the build: the pack (manifest, planes, reference
tensors, CRCs), the bit-plane format code, architecture recipes (resolved into an MoESpec), the
profile (`Profile`) and the prompt-residual model (`ResidualModel`). No torch model, no engine:
build/ writes these files and runtime/ reads them."""
