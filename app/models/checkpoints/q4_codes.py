"""4-bit weights as GGUF's Q4_0 / Q4_1 store them: codes with a scale and a minimum per block.

:meth:`app.models.checkpoints.gguf_file.GGUFFile.q4_codes` reads them;
:mod:`app.models.weights.int4` computes with
them as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

Q4_BLOCK = 32  # weights per Q4_0 / Q4_1 block


@dataclass(frozen=True, slots=True)
class Q4Codes:
    """A 4-bit matrix as stored: ``w[r, c] == d[r, c // 32] * codes[r, c] + m[r, c // 32]``.

    Attributes:
        codes: uint8 ``[out, in]``, each in ``0..15``.
        d: float32 ``[out, in / 32]``, the block scales (fp16 values in the file, exact here).
        m: float32 ``[out, in / 32]``, the block minima (Q4_0: ``-8 d``).
    """

    codes: np.ndarray
    d: np.ndarray
    m: np.ndarray

    def dequantize(self) -> np.ndarray:
        """float32 ``[out, in]``: ``d * codes + m`` per block, as ``gguf.quants.dequantize``."""
        out_features, in_features = self.codes.shape
        blocks = self.codes.reshape(out_features, -1, Q4_BLOCK).astype(np.float32)
        weight = self.d[:, :, None] * blocks + self.m[:, :, None]
        return weight.reshape(out_features, in_features)

    def rows_permuted(self, order: np.ndarray) -> Q4Codes:
        """The same matrix with its rows in ``order`` (blocks stay whole: a row permutation)."""
        return Q4Codes(
            np.ascontiguousarray(self.codes[order]),
            np.ascontiguousarray(self.d[order]),
            np.ascontiguousarray(self.m[order]),
        )
