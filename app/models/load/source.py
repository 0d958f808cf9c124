"""The model the user named (``--model smollm2|PATH``): found, opened and checked, no weights
read.

:func:`open_model` resolves the name to a file or directory, opens it with its format's reader,
finds its architecture and hyper-parameters, checks every tensor the forward needs and every
tensor type, and builds its tokenizer. Whatever is wrong becomes one :class:`ModelRefused`
naming the path and the reason; the command line prints it and exits with status 2 before the
port opens (``app/__main__.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from app.models.architectures import Architecture
from app.models.checkpoints.checkpoint import Checkpoint
from app.models.checkpoints.gguf_file import GGUFFile
from app.models.checkpoints.hf_directory import HFDirectory
from app.models.checkpoints.model_tensors import ModelTensors
from app.models.hparams import HParams
from app.models.load.smollm2 import SMOLLM2_NAME, smollm2_gguf_path
from app.models.refusal import ModelRefused, UnsupportedModel
from app.models.runner import Tokenizer
from app.models.tokenizers import load_gguf_tokenizer, load_hf_tokenizer

logger = logging.getLogger(__name__)

BUNDLED_MODELS = {"smollm2": (SMOLLM2_NAME, smollm2_gguf_path)}
GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A model ready to load.

    Attributes:
        path: the GGUF file or the Hugging Face directory.
        name: the name it is served under (``/info``, ``/v1/models``, every answer).
        checkpoint: the opened file reader.
        architecture: what the file holds.
        hparams: its hyper-parameters (context already capped at a sliding window).
        tensors: its weights by the forward's names (checked: all present, right shapes).
        tokenizer: its tokenizer.
    """

    path: Path
    name: str
    checkpoint: Checkpoint
    architecture: Architecture
    hparams: HParams
    tensors: ModelTensors
    tokenizer: Tokenizer


def open_model(model: str, *, served_model_name: str | None = None) -> ModelSource:
    """Find, open and check the model ``model`` names (a bundled name, a ``.gguf`` file, or a
    Hugging Face directory).

    Raises:
        ModelRefused: the path is missing, not a GGUF nor a model directory, of an unsupported
            architecture or tensor type, incomplete, or its tokenizer cannot be built.
    """
    if model in BUNDLED_MODELS:
        bundled_name, locate = BUNDLED_MODELS[model]
        try:
            path = locate()
        except (OSError, ImportError) as error:
            raise ModelRefused(model, f"the bundled model is not installed ({error})") from None
        default_name: str | None = bundled_name
    else:
        path, default_name = Path(model).expanduser(), None
    try:
        checkpoint = _open_checkpoint(path)
        architecture, hparams = _read_hparams(checkpoint)
        problem = hparams.inconsistency()
        if problem is not None:
            raise UnsupportedModel(problem)
        unsupported = checkpoint.unsupported_tensor()
        if unsupported is not None:
            name, kind = unsupported
            raise UnsupportedModel(f"tensor {name} has unsupported type {kind}")
        tensors = ModelTensors(checkpoint, architecture, hparams)
        tensors.check()
        tokenizer = _tokenizer(checkpoint, hparams)
    except UnsupportedModel as error:
        raise ModelRefused(path, str(error)) from None
    if hparams.sliding_window is not None:
        logger.info(
            "%s: trained with a sliding window of %d positions: context capped at %d, where "
            "full attention is exactly sliding-window attention",
            path,
            hparams.sliding_window,
            hparams.context_length,
        )
    return ModelSource(
        path=path,
        name=served_model_name or default_name or checkpoint.default_name,
        checkpoint=checkpoint,
        architecture=architecture,
        hparams=hparams,
        tensors=tensors,
        tokenizer=tokenizer,
    )


def _read_hparams(checkpoint: Checkpoint) -> tuple[Architecture, HParams]:
    """The checkpoint's architecture and hyperparameters; a metadata value of a type no
    reader checks for (found by a helper: a GGUF's context length written as a string, a
    ``config.json`` that is a list, a ``"hidden_size": "big"``) is a refusal, not a crash."""
    try:
        architecture = checkpoint.architecture()
        return architecture, checkpoint.hparams(architecture)
    except UnsupportedModel:
        raise
    except (TypeError, ValueError, AttributeError, KeyError, OverflowError) as error:
        raise UnsupportedModel(f"a metadata value of the wrong type ({error})") from None


def _open_checkpoint(path: Path) -> Checkpoint:
    if not path.exists():
        raise UnsupportedModel("no such file or directory")
    if path.is_dir():
        return HFDirectory(path)
    with path.open("rb") as stream:
        magic = stream.read(4)
    if magic != GGUF_MAGIC:
        raise UnsupportedModel("not a GGUF file (no GGUF magic) nor a model directory")
    return GGUFFile(path)


def _tokenizer(checkpoint: Checkpoint, hparams: HParams) -> Tokenizer:
    """The model's tokenizer: the GGUF's ``tokenizer.*`` keys, or the directory's
    ``tokenizer.json`` (:mod:`app.models.tokenizers`).

    Raises:
        UnsupportedModel: it cannot be built (an unknown tokenizer model or pre-tokenizer, no
            tokenizer.json, ...), or it has more tokens than the model's embedding.
    """
    try:
        if isinstance(checkpoint, GGUFFile):
            tokenizer = load_gguf_tokenizer(checkpoint)
        else:
            tokenizer = load_hf_tokenizer(checkpoint.path, vocab_size=hparams.vocab_size)
    except (ValueError, KeyError, OSError) as error:
        reason = str(error).removeprefix(f"{checkpoint.path}: ")
        raise UnsupportedModel(f"tokenizer: {reason}") from None
    if tokenizer.vocab_size > hparams.vocab_size:
        raise UnsupportedModel(
            f"the tokenizer has {tokenizer.vocab_size} tokens, the model's embedding "
            f"{hparams.vocab_size}"
        )
    return tokenizer
