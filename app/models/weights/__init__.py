"""Weight formats: the record the forward consumes and the projection kinds that compute
``x @ W.T`` (dense, oneDNN-packed, int8, int4, a GGUF file's own blocks)."""
