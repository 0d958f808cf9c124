"""Sampling: the pipeline from a step's logits to its tokens (logits processors, masks, the
draw) and logprobs."""
