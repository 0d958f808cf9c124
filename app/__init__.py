"""slotserve: a text-generation server with continuous batching."""

import os

__version__ = "0.1.0"

# MKL's conditional numerical reproducibility, strict: MKL reads it at its first call, so it is
# set here, before any module of the app can run a matmul. Without it, on a 2-core AVX2 EPYC
# with 2 OpenMP threads, float32 SDPA (whose CPU kernel calls MKL's sgemm) gives a query row a
# different rounding with the number of other rows in the call, which breaks a seeded
# request's batch invariance (API.md, ``seed``) in float32; measured free there (SDPA over 64
# decode rows x 704 keys 7.8 ms either way). Strict mode is MKL's documented guarantee of the
# same results whatever the threading. A value the user set is kept.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

# The caches of oneDNN's matmul primitives, bounded. oneDNN (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``)
# and PyTorch's ideep layer over it (``LRU_CACHE_CAPACITY``) each keep one entry per distinct
# input shape, 1,024 of them by default, and a step's matmul shape is its token count, which
# varies with every mixed prefill/decode step. On a 2-core AVX2 EPYC one SmolLM2-sized packed
# float32 projection kept ~0.3 MiB per shape in each cache: 300 token counts through two
# projections grew the process by 386 MiB, and 64 slots under a 400 MiB KV pool grew it by the
# pool plus 36 MiB in one wave (plus ~4.5 MiB with every new step shape). Sixteen entries
# each hold every shape of a steady decode step (a handful of projections at one row count);
# decode steps at 1, 16 and 64 rows measured as fast as with the defaults (23.4 / 126 / 374 ms
# against 25.5 / 125 / 373). Values the user set are kept.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16")
os.environ.setdefault("LRU_CACHE_CAPACITY", "16")
