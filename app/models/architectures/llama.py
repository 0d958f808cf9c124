"""Llama (Llama 2, 3, 3.1, 3.2; TinyLlama; SmolLM and SmolLM2): the base of the family.

llama.cpp's converter permutes the Q/K rows of this architecture (``LlamaModel.permute`` in
``convert_hf_to_gguf.py``); a Llama 3.1 ``rope_scaling`` of type ``llama3`` becomes a
``rope_freqs.weight`` tensor in the GGUF. ``attention_bias: true`` configs (Q/K/V/O biases) are
read like Qwen2's biases: they are loaded when the checkpoint holds them.
"""

from __future__ import annotations

from app.models.architectures.spec import Architecture

LLAMA = Architecture(
    name="llama",
    hf_model_types=("llama",),
    gguf_architectures=("llama",),
    gguf_permutes_qk=True,
)
