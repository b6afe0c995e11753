"""On-disk formats and what makes them: safetensors, HF checkpoints, the expert store and its
converter, the quantizers (`quantize`, calibrated int4: `calibrated`, `scale_search`), the
calibration statistics they use (`calibration`, gathered by `calibrate`) and the quality
report of a quantized store against its float model (`quality`), the embedded model and its
training corpus."""
