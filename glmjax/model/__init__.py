"""The model: config, weight declaration, layers, attention, MoE, MTP, the forward pass and the
quantized tensor type. Pure functions over explicit pytrees: no I/O, no global state."""
