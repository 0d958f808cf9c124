"""Our tokenizers (``app.models.tokenizers``) give transformers' ids on the same vocabularies.

References, all built here (``tests/vocabularies.py``): for each GGUF BPE pre-tokenizer, a
``tokenizer.json`` carrying the pre-tokenizer its model family publishes, over a vocabulary
trained with ``BpeTrainer``, converted to GGUF as llama.cpp's converter does; the reference is
transformers' ``PreTrainedTokenizerFast`` over that ``tokenizer.json``. For SentencePiece, a BPE
model with byte fallback trained with ``sentencepiece``; the references are ``sentencepiece``
itself and transformers' slow, sentencepiece-backed tokenizer (in transformers 5 that is
``SentencePieceBackend``: ``LlamaTokenizer`` became the ``tokenizers``-based one).
"""

from __future__ import annotations

import dataclasses
import json
import random
import unicodedata
from pathlib import Path

import pytest

from app.models.checkpoints.gguf_file import GGUFFile
from app.models.tokenizers import (
    TextTokenizer,
    UnsupportedTokenizerError,
    gguf_spm,
    load_gguf_tokenizer,
    load_hf_tokenizer,
)
from app.models.tokenizers.byte_level import byte_level_token_bytes, byte_stand_ins
from app.models.tokenizers.gguf_bpe import build_gguf_bpe
from app.models.tokenizers.gguf_spm import spm_merges
from app.models.tokenizers.gguf_vocab import GGUFTokenType, GGUFVocab
from tests.checkpoints import smollm2_tokenizer_files, smollm2_transformers_tokenizer
from tests.gguf_convert import write_vocab_gguf
from tests.vocabularies import (
    FAMILIES,
    TEXTS,
    UNMERGED_TOKEN,
    build_bpe_tokenizer,
    build_spm_tokenizer,
)

transformers = pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")


def _mismatches(ours, reference, texts) -> list[tuple[str, list[int], list[int]]]:
    """(text, ours, reference) for every text where the two disagree."""
    return [(t, ours(t), reference(t)) for t in texts if ours(t) != reference(t)]


# ---------------------------------------------------------------------------------------------
# Byte-level BPE (GGUF "gpt2")


@pytest.fixture(scope="module")
def bpe_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """pre-tokenizer name -> (directory with tokenizer.json, its vocab-only GGUF)."""
    root = tmp_path_factory.mktemp("bpe")
    files = {}
    for pre in FAMILIES:
        directory = build_bpe_tokenizer(root / pre, pre)
        files[pre] = directory, write_vocab_gguf(directory, root / f"{pre}.gguf", tokenizer_pre=pre)
    return files


def _reference(directory: Path):
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"))


def _special_texts(pre: str) -> list[str]:
    specials = FAMILIES[pre].specials
    return [f"{specials[-1]}user\nhi{specials[0]}", f"a{specials[0]}{specials[0]} b {specials[-1]}"]


@pytest.mark.parametrize("pre", sorted(FAMILIES))
def test_gguf_bpe_ids_equal_transformers(bpe_files, pre: str) -> None:
    directory, path = bpe_files[pre]
    ours = load_gguf_tokenizer(GGUFFile(path))
    reference = _reference(directory)
    texts = [*TEXTS, *_special_texts(pre)]
    assert ours.kind == f"gguf gpt2/{pre}"
    assert (
        _mismatches(
            ours.encode_without_special_tokens,
            lambda t: reference.encode(t, add_special_tokens=False),
            texts,
        )
        == []
    )
    assert _mismatches(ours.encode, reference.encode, texts) == []  # BOS where the family adds it
    for text in TEXTS:
        assert ours.decode_bytes(ours.encode_without_special_tokens(text)) == text.encode()


@pytest.mark.parametrize("pre", sorted(FAMILIES))
def test_hf_directory_ids_equal_transformers(bpe_files, pre: str) -> None:
    directory, _ = bpe_files[pre]
    ours = load_hf_tokenizer(directory)
    reference = _reference(directory)
    texts = [*TEXTS, *_special_texts(pre)]
    assert _mismatches(ours.encode, reference.encode, texts) == []
    assert ours.kind == "tokenizer.json byte-level"
    for text in TEXTS:
        assert ours.decode_bytes(ours.encode(text)) == text.encode()


@pytest.mark.parametrize("pre", sorted(FAMILIES))
def test_each_pre_tokenizer_gives_its_own_ids(bpe_files, pre: str) -> None:
    """The comparisons above can fail: another family's split of the same vocabulary gives other
    ids on the text set (except between smollm and starcoder, which llama.cpp defines alike)."""
    vocab = GGUFVocab.read(GGUFFile(bpe_files[pre][1]))
    ours = build_gguf_bpe(vocab)
    for other in sorted(FAMILIES):
        if other == pre or {pre, other} == {"smollm", "starcoder"}:
            continue
        theirs = build_gguf_bpe(dataclasses.replace(vocab, pre=other))
        assert _mismatches(
            ours.encode_without_special_tokens, theirs.encode_without_special_tokens, TEXTS
        ), f"{pre} and {other} split the text set alike"


def test_llama_bpe_takes_a_whole_token_over_the_merges(bpe_files) -> None:
    """llama.cpp's ``ignore_merges`` for llama-bpe: " zyzzyva" is a token no merge builds."""
    vocab = GGUFVocab.read(GGUFFile(bpe_files["llama-bpe"][1]))
    ours = build_gguf_bpe(vocab)
    assert ours.encode_without_special_tokens("the zyzzyva")[-1] == vocab.tokens.index(
        UNMERGED_TOKEN
    )
    merged = build_gguf_bpe(dataclasses.replace(vocab, pre="dbrx"))  # same regex, merges only
    assert len(merged.encode_without_special_tokens(" zyzzyva")) > 1


def test_bos_eos_and_end_of_generation(bpe_files) -> None:
    llama = load_gguf_tokenizer(GGUFFile(bpe_files["llama-bpe"][1]))
    assert llama.add_bos_token and llama.bos_token == "<|begin_of_text|>"
    assert llama.encode("hi")[0] == llama.bos_token_id == 0
    assert llama.encode_without_special_tokens("hi")[0] != 0
    assert llama.encode("") == [0]
    assert llama.eos_token_ids == {1, 2}  # <|end_of_text|> (EOS), <|eot_id|>
    smollm = load_gguf_tokenizer(GGUFFile(bpe_files["smollm"][1]))
    assert not smollm.add_bos_token and smollm.encode("") == []
    assert smollm.eos_token_ids == {0, 2} and smollm.eos_token == "<|im_end|>"
    assert smollm.decode_bytes(smollm.encode("<|im_start|>user<|im_end|>")) == b"user"


def test_add_bos_token_false_in_the_file_wins(tmp_path: Path) -> None:
    directory = build_bpe_tokenizer(tmp_path / "llama", "llama-bpe")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": False}))
    ours = load_gguf_tokenizer(
        GGUFFile(write_vocab_gguf(directory, tmp_path / "v.gguf", tokenizer_pre="llama-bpe"))
    )
    assert not ours.add_bos_token and ours.encode("hi") == ours.encode_without_special_tokens("hi")
    assert not load_hf_tokenizer(directory).add_bos_token


def test_qwen2_gguf_does_not_normalize_like_llama_cpp(bpe_files) -> None:
    """Qwen2's tokenizer.json composes characters (NFC); llama.cpp has no normalizer, so the
    GGUF tokenizer keeps a decomposed "é" as two characters. The HF directory keeps the NFC."""
    directory, path = bpe_files["qwen2"]
    decomposed = "Cafe\u0301 re\u0301sume\u0301"
    assert unicodedata.normalize("NFC", decomposed) != decomposed
    reference = _reference(directory)
    gguf_ids = load_gguf_tokenizer(GGUFFile(path)).encode(decomposed)
    assert gguf_ids != reference.encode(decomposed)
    reference.backend_tokenizer.normalizer = None
    assert gguf_ids == reference.encode(decomposed)
    hf_ids = load_hf_tokenizer(directory).encode(decomposed)
    assert hf_ids == _reference(directory).encode(decomposed)


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2"])
def test_transformers_gguf_loader_agrees_where_it_builds_the_split(bpe_files, pre: str) -> None:
    """transformers' GGUF tokenizer loader has a split regex for llama-bpe and qwen2 and uses
    GPT-2's for the rest; so it is a reference for those three only (for smollm, starcoder and
    default it does not isolate digits / punctuation as llama.cpp does). It does not set
    ``ignore_merges`` either, so for llama-bpe it cuts " zyzzyva", which Llama 3's own
    tokenizer.json (``ignore_merges: true``) and llama.cpp keep whole."""
    directory, path = bpe_files[pre]
    theirs = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = load_gguf_tokenizer(GGUFFile(path))
    differences = _mismatches(
        ours.encode_without_special_tokens,
        lambda t: theirs.encode(t, add_special_tokens=False),
        [*TEXTS, *_special_texts(pre)],
    )
    assert [text for text, _, _ in differences] == (["the zyzzyva"] if pre == "llama-bpe" else [])


def test_an_unknown_pre_tokenizer_is_refused_by_name(bpe_files) -> None:
    vocab = GGUFVocab.read(GGUFFile(bpe_files["gpt-2"][1]))
    with pytest.raises(UnsupportedTokenizerError, match="'tekken' is not supported") as caught:
        build_gguf_bpe(dataclasses.replace(vocab, pre="tekken"))
    assert "\n" not in str(caught.value) and "smollm" in str(caught.value)


def test_an_unknown_tokenizer_model_is_refused_by_name(tmp_path: Path) -> None:
    import gguf

    writer = gguf.GGUFWriter(tmp_path / "bert.gguf", "bert")
    writer.add_tokenizer_model("bert")
    writer.add_token_list(["[PAD]", "[UNK]"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedTokenizerError, match="tokenizer model 'bert' is not supported"):
        load_gguf_tokenizer(GGUFFile(tmp_path / "bert.gguf"))


# ---------------------------------------------------------------------------------------------
# SentencePiece (GGUF "llama")


@pytest.fixture(scope="module")
def spm_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(directory with tokenizer.model, its vocab-only GGUF)."""
    root = tmp_path_factory.mktemp("spm")
    directory = build_spm_tokenizer(root / "spm")
    return directory, write_vocab_gguf(directory, root / "spm.gguf")


@pytest.fixture(scope="module")
def spm(spm_files) -> TextTokenizer:
    return load_gguf_tokenizer(GGUFFile(spm_files[1]))


def test_gguf_spm_ids_equal_sentencepiece_and_transformers_slow(spm_files, spm) -> None:
    import sentencepiece
    from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

    model = str(spm_files[0] / "tokenizer.model")
    processor = sentencepiece.SentencePieceProcessor(model_file=model)
    slow = SentencePieceBackend(
        vocab_file=model, legacy=True, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    assert spm.kind == "gguf llama" and spm.vocab_size == processor.vocab_size()
    assert _mismatches(spm.encode_without_special_tokens, processor.encode, TEXTS) == []
    specials = ["<s>[INST] hi [/INST]", "a</s>b", "<unk> x"]
    assert (
        _mismatches(
            spm.encode_without_special_tokens,
            lambda t: slow.encode(t, add_special_tokens=False),
            [*TEXTS, *specials],
        )
        == []
    )
    assert any(processor.IsByte(i) for text in TEXTS for i in processor.encode(text))  # fallback


def test_gguf_spm_bos_spaces_and_bytes(spm) -> None:
    assert spm.add_bos_token and not spm.add_eos_token
    assert (spm.bos_token, spm.eos_token, spm.eos_token_ids) == ("<s>", "</s>", {2})
    assert spm.encode("hi") == [1, *spm.encode_without_special_tokens("hi")]
    assert spm.encode("") == [1]
    for text in TEXTS:  # "▁" is a space, the dummy prefix included
        expected = (" " + text).encode() if text else b""
        assert spm.decode_bytes(spm.encode(text)) == expected
    ids = spm.encode_without_special_tokens("🦙")  # not in the training text: byte fallback
    pieces = [spm.decode_bytes([i]) for i in ids]
    assert b"".join(pieces) == " 🦙".encode() and all(len(p) == 1 for p in pieces[-4:])
    with pytest.raises(UnicodeDecodeError):
        pieces[-4].decode("utf-8")


def test_spm_merges_rank_splits_by_score_then_id_then_cut() -> None:
    """Every split of a mergeable token into two mergeable tokens, best score first; equal
    scores by token id (not by text), a token's splits left to right; a BYTE token is no merge
    result, and a text stored twice ranks as its last id (as SentencePiece's table reads)."""
    normal, byte = GGUFTokenType.NORMAL, GGUFTokenType.BYTE
    table = [
        ("a", 0.0, normal),
        ("b", 0.0, normal),
        ("c", 0.0, normal),
        ("bc", -1.0, normal),  # id 3: before "ab" at the same score
        ("ab", -1.0, normal),
        ("abc", -2.0, normal),
        ("cb", -0.5, byte),  # not a merge result
        ("ca", -0.5, normal),
        ("cc", -9.0, normal),
        ("cc", -0.25, normal),  # the same text again: its last id and score count
    ]
    vocab = GGUFVocab(
        model="llama",
        pre="default",
        tokens=tuple(t for t, _, _ in table),
        token_types=tuple(k for _, _, k in table),
        scores=tuple(s for _, s, _ in table),
        merges=(),
        bos_token_id=None,
        eos_token_id=None,
        unknown_token_id=None,
        end_of_turn_ids=frozenset(),
        add_bos_token=None,
        add_eos_token=None,
        add_space_prefix=None,
        chat_template=None,
    )
    assert spm_merges(vocab) == [
        ("c", "c"),
        ("c", "a"),
        ("b", "c"),
        ("a", "b"),
        ("a", "bc"),
        ("ab", "c"),
    ]


def test_a_large_vocabularys_merges_are_ranked_once_and_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spm_files
) -> None:
    """From CACHE_FROM_TOKENS tokens the ranked merges are kept on disk: a second build reads
    them (the ranking is not run), the same tokenizer; an unreadable file is ranked again."""
    monkeypatch.setenv("SLOTSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gguf_spm, "CACHE_FROM_TOKENS", 0)
    vocab = GGUFVocab.read(GGUFFile(spm_files[1]))
    first = gguf_spm.cached_spm_merges(vocab)
    assert first == gguf_spm.spm_merges(vocab) and len(first) > 10
    (kept,) = tmp_path.glob("spm-merges-*.pickle")

    def not_again(vocab: GGUFVocab) -> list[tuple[str, str]]:
        raise AssertionError("ranked again")

    monkeypatch.setattr(gguf_spm, "spm_merges", not_again)
    assert gguf_spm.cached_spm_merges(vocab) == first
    built = gguf_spm.build_gguf_spm(vocab)
    assert built.encode("hello world") == load_gguf_tokenizer(GGUFFile(spm_files[1])).encode(
        "hello world"
    )
    monkeypatch.undo()
    monkeypatch.setenv("SLOTSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gguf_spm, "CACHE_FROM_TOKENS", 0)
    kept.write_bytes(b"not a pickle")
    assert gguf_spm.cached_spm_merges(vocab) == first
    assert kept.read_bytes() != b"not a pickle"  # written again
    other = dataclasses.replace(vocab, scores=tuple(-s for s in vocab.scores))
    assert gguf_spm.cached_spm_merges(other) == gguf_spm.spm_merges(other)
    assert len(list(tmp_path.glob("spm-merges-*.pickle"))) == 2  # keyed by the scores too


def test_gguf_spm_keys_override_the_defaults(tmp_path: Path, spm_files) -> None:
    """add_space_prefix, add_bos_token and add_eos_token, as the converter writes them from
    tokenizer_config.json (add_prefix_space, add_bos_token, add_eos_token)."""
    import shutil

    directory = tmp_path / "spm"
    shutil.copytree(spm_files[0], directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    settings = {"add_prefix_space": False, "add_bos_token": False, "add_eos_token": True}
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, **settings}))
    ours = load_gguf_tokenizer(GGUFFile(write_vocab_gguf(directory, tmp_path / "v.gguf")))
    assert ours.decode_bytes(ours.encode_without_special_tokens("hello world")) == b"hello world"
    assert ours.encode("hello") == [*ours.encode_without_special_tokens("hello"), 2]


def test_transformers_gguf_loader_agrees_on_spm_but_for_leading_spaces(spm_files, spm) -> None:
    """transformers' GGUF loader builds ``Metaspace``, which adds the "▁" prefix only when the
    text does not start with a space already (" one" gives "▁one", SentencePiece and llama.cpp
    "▁▁one") and not after a special token: a reference for the other texts."""
    path = spm_files[1]
    theirs = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = [t for t in TEXTS if not t[:1].isspace()]
    assert (
        _mismatches(
            spm.encode_without_special_tokens,
            lambda t: theirs.encode(t, add_special_tokens=False),
            texts,
        )
        == []
    )


def test_spm_style_tokenizer_json_directory(tmp_path: Path, spm_files, spm) -> None:
    """An HF directory whose tokenizer.json is SentencePiece-style (TinyLlama's layout:
    Prepend + Replace normalizer, byte fallback, ``<s> $A`` post-processor)."""
    import sentencepiece

    spec = json.loads(spm._hf.to_str())
    spec["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<s>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"})
    )
    ours = load_hf_tokenizer(tmp_path)
    processor = sentencepiece.SentencePieceProcessor(
        model_file=str(spm_files[0] / "tokenizer.model")
    )
    assert ours.kind == "tokenizer.json sentencepiece" and ours.add_bos_token
    assert _mismatches(ours.encode, lambda t: [1, *processor.encode(t)], TEXTS) == []
    for text in TEXTS:
        assert ours.decode_bytes(ours.encode(text)) == spm.decode_bytes(spm.encode(text))


# ---------------------------------------------------------------------------------------------
# SmolLM2's own GGUF, and an HF directory's files


def test_smollm2_gguf_equals_smollm2s_tokenizer_json(
    tokenizer: TextTokenizer, tmp_path: Path
) -> None:
    """SmolLM2's GGUF against SmolLM2's published tokenizer pipeline (its tokenizer.json
    pre-tokenizer over the GGUF's vocabulary: ``tests/checkpoints.py``)."""
    for name, content in smollm2_tokenizer_files().items():
        (tmp_path / name).write_bytes(content)
    reference = _reference(tmp_path)
    texts = [*TEXTS, *_special_texts("smollm"), "² ³ ½"]
    assert _mismatches(tokenizer.encode, reference.encode, texts) == []
    assert _mismatches(load_hf_tokenizer(tmp_path).encode, reference.encode, texts) == []


def test_smollm2_gguf_against_transformers_gguf_loader(tokenizer: TextTokenizer) -> None:
    """transformers' tokenizer from the same GGUF agrees except where a numeric character that
    is not an ASCII digit meets others: it does not isolate \\p{N} (``"² ³"``, see
    test_gguf_tokenizer.py)."""
    theirs = smollm2_transformers_tokenizer()
    texts = [
        t
        for t in [*TEXTS, *_special_texts("smollm")]
        if not any(unicodedata.category(c).startswith("N") and not c.isascii() for c in t)
    ]
    assert len(texts) == len(TEXTS) + 1  # only "x² + y³" is left out
    assert (
        _mismatches(tokenizer.encode, lambda t: theirs.encode(t, add_special_tokens=False), texts)
        == []
    )


def _smollm2_directory(tmp_path: Path) -> Path:
    for name, content in smollm2_tokenizer_files().items():
        (tmp_path / name).write_bytes(content)
    return tmp_path


def test_hf_directory_metadata(tmp_path: Path) -> None:
    directory = _smollm2_directory(tmp_path)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    ours = load_hf_tokenizer(directory)
    assert ours.eos_token_ids == {0, 2, 5}  # generation_config's list, <|endoftext|>
    assert (ours.bos_token, ours.eos_token, ours.bos_token_id) == ("<|im_start|>", "<|im_end|>", 1)
    assert not ours.add_bos_token and not ours.add_eos_token
    assert ours.chat_template == (directory / "chat_template.jinja").read_text()
    config = json.loads((directory / "tokenizer_config.json").read_text())
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": named}))
    assert load_hf_tokenizer(directory).chat_template == "D"
    (directory / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": "S", "add_eos_token": True})
    )
    ours = load_hf_tokenizer(directory)
    assert ours.chat_template == "S" and ours.encode("hi")[-1] == 2


def test_hf_directory_padded_vocabulary(tmp_path: Path) -> None:
    ours = load_hf_tokenizer(_smollm2_directory(tmp_path), vocab_size=49216)
    assert ours.vocab_size == 49216 and ours.decode_bytes([49200, 49215]) == b""
    with pytest.raises(IndexError):
        ours.decode_bytes([49216])


def test_hf_directory_refusals(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_hf_tokenizer(tmp_path)
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]")).save(
        str(tmp_path / "tokenizer.json")
    )
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    spec["decoder"] = {"type": "WordPiece", "prefix": "##", "cleanup": True}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(UnsupportedTokenizerError, match="decoder 'WordPiece' is not supported"):
        load_hf_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_hf_tokenizer(tmp_path)


def test_byte_level_token_bytes_fast_path_is_the_character_rule() -> None:
    # translate + Latin-1 for a well-formed token, the character-by-character rule otherwise:
    # both give what each character spells (a stand-in its byte, any other its UTF-8 bytes)
    stand_ins = byte_stand_ins()

    def rule(text: str) -> bytes:
        return b"".join(
            bytes((stand_ins[c],)) if c in stand_ins else c.encode("utf-8") for c in text
        )

    alphabet = list(stand_ins)
    malformed = ["\x00", " ", "\xa0", "\xad", "\u0144", "\uffff", "é", "中", "😀"]
    rng = random.Random(3)
    texts = ["".join(alphabet), "", "Ġthe", "ĊĊ", *malformed]
    for _ in range(2000):
        pool = alphabet if rng.random() < 0.7 else alphabet + malformed
        texts.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 8))))
    for text in texts:
        assert byte_level_token_bytes(text) == rule(text), repr(text)
    assert byte_level_token_bytes("".join(alphabet)) == bytes(stand_ins[c] for c in alphabet)
