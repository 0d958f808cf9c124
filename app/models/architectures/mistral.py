"""Mistral (7B v0.1-v0.3 and its fine-tunes): Llama's block, trained with or without a sliding
attention window.

A config with ``sliding_window`` set is served with its context capped at the window: a
sequence that never holds more positions than the window attends exactly as sliding-window
attention would (nothing ever slides out), so the cap changes no output, only the longest
request. Its GGUF says ``general.architecture = llama`` (the converter registers
``MistralForCausalLM`` under ``LlamaModel``), so GGUFs are read by the llama architecture.
"""

from __future__ import annotations

from app.models.architectures.spec import Architecture

MISTRAL = Architecture(
    name="mistral",
    hf_model_types=("mistral",),
    gguf_architectures=(),
    gguf_permutes_qk=True,
)
