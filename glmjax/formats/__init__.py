"""On-disk formats: safetensors, HF checkpoints, the expert store and its converter, the embedded
model and its training corpus."""
