"""The OpenAI-compatible server: batched decode, the continuous-batching scheduler, the app."""
