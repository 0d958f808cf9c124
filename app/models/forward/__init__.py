"""The forward pass shared by every architecture: decoder, attention, rope, the step's plan and
the paged KV cache."""
