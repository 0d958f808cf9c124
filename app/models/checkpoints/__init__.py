"""Checkpoint formats: the files a model comes in (GGUF, Hugging Face directories) read into
one view of named tensors and hyper-parameters."""
