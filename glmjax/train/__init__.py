"""Training the embedded model (scripts/train_embedded.py) through the one forward pass.

The training forward is `glmjax.model.forward.forward` and `mtp_forward` themselves, with
`impl="dense"` attention, attention `Taps` (the indexer's distillation target, the DSA selection
off during warm-up) and a fixed-capacity expert provider that also keeps the router loads.

- `presets`: the shipped architecture (and a tiny one for tests), fresh weights;
- `experts`: the training expert provider (fixed per-expert capacity slots);
- `objective`: the training forward and its losses (next token, MTP, indexer KL);
- `optim`: AdamW with the correction biases frozen, auxiliary-loss-free balancing, the step;
- `data`: tokenizer, token stream, the data order, the context-length curriculum;
- `state`: resumable training state and the exported HF checkpoint;
- `loop`: the training run; `evaluate`: held-out bits per byte and MTP acceptance through
  `glmjax.load`.
"""
