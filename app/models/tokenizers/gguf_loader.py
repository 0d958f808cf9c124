"""The tokenizer of a GGUF file, whichever vocabulary type it holds."""

from __future__ import annotations

from app.models.checkpoints.gguf_file import GGUFFile
from app.models.tokenizers.gguf_bpe import build_gguf_bpe
from app.models.tokenizers.gguf_spm import build_gguf_spm
from app.models.tokenizers.gguf_vocab import GGUFVocab
from app.models.tokenizers.text_tokenizer import TextTokenizer


def load_gguf_tokenizer(file: GGUFFile) -> TextTokenizer:
    """The tokenizer the ``tokenizer.*`` keys of ``file`` describe: byte-level BPE for
    ``tokenizer.ggml.model == "gpt2"`` (:mod:`app.models.tokenizers.gguf_bpe`), SentencePiece for
    ``"llama"`` (:mod:`app.models.tokenizers.gguf_spm`).

    Raises:
        UnsupportedTokenizerError: another tokenizer model, or a BPE pre-tokenizer we do not
            build; the message is one line naming it.
        ValueError: inconsistent tokenizer metadata.
    """
    vocab = GGUFVocab.read(file)
    if vocab.model == "gpt2":
        return build_gguf_bpe(vocab)
    return build_gguf_spm(vocab)
