"""The architectures the model layer serves, and how a file names its architecture.

Adding one is a module with an :class:`Architecture` and a line in :data:`ARCHITECTURES`
(``docs/ARCHITECTURE.md``, "Adding an architecture").
"""

from __future__ import annotations

from app.models.architectures.gemma3 import GEMMA3
from app.models.architectures.llama import LLAMA
from app.models.architectures.mistral import MISTRAL
from app.models.architectures.mixtral import MIXTRAL
from app.models.architectures.phi3 import PHI3
from app.models.architectures.qwen2 import QWEN2
from app.models.architectures.qwen3 import QWEN3
from app.models.architectures.qwen3moe import QWEN3MOE
from app.models.architectures.spec import GGUF_NAMES, HF_NAMES, Architecture, TensorNames
from app.models.refusal import UnsupportedModel

ARCHITECTURES: tuple[Architecture, ...] = (
    LLAMA,
    MISTRAL,
    QWEN2,
    QWEN3,
    GEMMA3,
    PHI3,
    QWEN3MOE,
    MIXTRAL,
)
# config.json model types of multimodal checkpoints whose language model is served only from
# its text-only form: Gemma 3 4B-27B's Gemma3ForConditionalGeneration directories.
MULTIMODAL_MODEL_TYPES = {"gemma3": "gemma3_text"}

__all__ = [
    "ARCHITECTURES",
    "GGUF_NAMES",
    "HF_NAMES",
    "Architecture",
    "TensorNames",
    "UnsupportedArchitecture",
    "for_gguf",
    "for_hf_model_type",
    "supported_names",
]


class UnsupportedArchitecture(UnsupportedModel):
    """A file of an architecture this server does not serve; the message names it and lists
    the supported ones."""


def supported_names() -> str:
    """``"llama, mistral, qwen2, qwen3, gemma3, phi3, qwen3moe, mixtral"``."""
    return ", ".join(architecture.name for architecture in ARCHITECTURES)


def for_hf_model_type(model_type: str) -> Architecture:
    """The architecture of a config.json ``model_type``. Raises UnsupportedArchitecture."""
    for architecture in ARCHITECTURES:
        if model_type in architecture.hf_model_types:
            return architecture
    if model_type in MULTIMODAL_MODEL_TYPES:
        raise UnsupportedArchitecture(
            f"model_type {model_type!r} is a multimodal checkpoint (not supported); its language "
            f"model is served from a {MULTIMODAL_MODEL_TYPES[model_type]!r} directory or a GGUF"
        )
    raise UnsupportedArchitecture(
        f"unsupported architecture {model_type!r} (supported: {supported_names()})"
    )


def for_gguf(general_architecture: str) -> Architecture:
    """The architecture of a GGUF's ``general.architecture``. Raises UnsupportedArchitecture."""
    for architecture in ARCHITECTURES:
        if general_architecture in architecture.gguf_architectures:
            return architecture
    raise UnsupportedArchitecture(
        f"unsupported architecture {general_architecture!r} (supported: {supported_names()})"
    )
