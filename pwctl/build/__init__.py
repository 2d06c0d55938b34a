"""Offline: from a Hugging Face checkpoint to a pack the runtime serves. Checkpoint reading,
the nested quantizer, calibration, convert (blocks streamed into a PackWriter), the profile run
(per-block damage on the store engine) and the residual fit. It may use the runtime (the profile
run drives an Engine); the runtime never imports it."""
