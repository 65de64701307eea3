"""From logits to tokens: the sampler, logits processing (penalties, bias, logprobs) and
guided decoding (grammar masks)."""
