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
