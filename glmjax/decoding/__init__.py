"""Decoding: the sampler, MTP speculative decoding, tokenizer and chat text."""
