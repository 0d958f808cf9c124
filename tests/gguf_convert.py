"""Write a Hugging Face checkpoint as a GGUF file laid out as llama.cpp's ``convert_hf_to_gguf.py``
lays it out, for the tests (:func:`write_gguf`).

Where the converter's rules come from (``convert_hf_to_gguf.py``, read in llama.cpp's repository):

* ``TextModel.set_gguf_parameters``: block_count, context_length (``max_position_embeddings``),
  embedding_length, feed_forward_length, head_count, head_count_kv, rope.freq_base,
  attention.layer_norm_rms_epsilon, attention.key_length/value_length when the config carries
  ``head_dim``, rope.scaling.type/factor for ``linear`` scaling, file_type.
* ``LlamaModel`` (registered for ``LlamaForCausalLM`` AND ``MistralForCausalLM``, so a Mistral
  GGUF says ``general.architecture = llama``) adds vocab_size and rope.dimension_count, permutes
  the rows of q_proj/k_proj (``permute``: within each head, the two halves of the rotary
  dimensions are interleaved), writes ``tokenizer.ggml.add_space_prefix`` from
  ``tokenizer_config.json``'s ``add_prefix_space`` and, for a 49152-token vocabulary (Granite,
  SmolLM), ``tokenizer.ggml.add_bos_token = false``. For ``rope_type: llama3`` it writes no
  rope.scaling key but a ``rope_freqs.weight`` tensor of per-frequency factors
  (``generate_extra_tensors``), with the original context read from the config's top level
  (``original_max_position_embeddings``, default 8192).
* ``Qwen2Model`` / ``Qwen3Model`` add nothing to the keys above (no vocab_size, no
  rope.dimension_count) and permute nothing.
* ``Gemma3Model`` writes rope.freq_base from the global layers' rope (``full_attention``),
  attention.sliding_window (unless the pattern is 1), neither the local rope base nor the
  layer pattern (llama.cpp then uses 10,000 and a period of 6), permutes nothing, and adds
  its ``norm_shift`` of 1 to every ``*norm.weight`` (``Gemma3RMSNorm`` multiplies by
  ``1 + w``; the GGUF stores the sum).
* ``prepare_tensors``: 1-D tensors and ``*_norm.weight`` are F32; every other tensor takes the
  file type; a tensor whose rows do not split into the type's blocks falls back to F16.
  For K-quants (which the converter cannot write; ``llama-quantize`` does) a row that is not a
  multiple of 256 falls back as ``llama-quantize`` does: Q4_K to Q5_0, Q6_K to Q8_0.
* ``_set_vocab_gpt2`` / ``get_vocab_base``: the token list is the tokenizer's vocabulary in id
  order (``[PADn]`` for holes), added tokens CONTROL when special (or looking special,
  ``<|...|>``), else USER_DEFINED; ``tokenizer.ggml.pre`` names the pre-tokenizer the converter
  recognises by hashing the ids of a fixed text (:data:`CHKTXT`); merges, special-token ids,
  add_bos/add_eos and the chat template come from ``gguf.SpecialVocab`` (the converter's own
  helper, shipped in the ``gguf`` package).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from tests.kquants import QK_K, quantize_q4_k, quantize_q6_k

# config.json "architectures" -> general.architecture, as convert_hf_to_gguf.py registers them.
GGUF_ARCHITECTURE = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "MixtralForCausalLM": "llama",
}

# The text convert_hf_to_gguf.py's get_vocab_base_pre() encodes; the sha256 of str(ids) names
# the pre-tokenizer. Written with escapes so that every character is visible.
CHKTXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n"
    "\U0001f680 (normal) \U0001f636\u200d\U0001f32b\ufe0f (multiple emojis concatenated) "
    "\u2705 \U0001f999\U0001f999 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 "
    "\u1780\u17b6\u1793\u17cb\u178f\u17c2\u1796\u17b7\u179f\u17c1\u179f\u17a2\u17b6\u1785"
    "\U0001f601 ?\u6211\u60f3\u5728apple\u5de5\u4f5c1314151\u5929\uff5e ------======= "
    "\u043d\u0435\u0449\u043e \u043d\u0430 \u0411\u044a\u043b\u0433\u0430\u0440\u0441\u043a\u0438"
    " ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? "
    "'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)

# A few of the converter's hashes (chkhsh -> tokenizer.ggml.pre).
KNOWN_PRE_TOKENIZER_HASHES = {
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",
    "35d91631860c815f952d711435f48d356ebac988362536bed955d43bfa436e34": "starcoder",
}

TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K")

_FILE_TYPE = {
    "F32": gguf.LlamaFileType.ALL_F32,
    "F16": gguf.LlamaFileType.MOSTLY_F16,
    "BF16": gguf.LlamaFileType.MOSTLY_BF16,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
    "Q5_0": gguf.LlamaFileType.MOSTLY_Q5_0,
    "Q5_1": gguf.LlamaFileType.MOSTLY_Q5_1,
    "Q4_K": gguf.LlamaFileType.MOSTLY_Q4_K_S,
    "Q6_K": gguf.LlamaFileType.MOSTLY_Q6_K,
}

# llama-quantize's fallbacks for a row that is not a multiple of QK_K.
_K_QUANT_FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}
_K_QUANTIZERS = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}


def _load_hparams(directory: Path) -> dict[str, Any]:
    """config.json as the converter reads it (``AutoConfig(...).to_dict()``)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(directory).to_dict()


def _rope_parameters(hparams: dict[str, Any]) -> dict[str, Any]:
    """The global layers' rope (Gemma 3's ``full_attention`` entry; ``Gemma3Model`` writes its
    theta as ``rope.freq_base`` and nothing of the local layers')."""
    rope = dict(hparams.get("rope_parameters") or hparams.get("rope_scaling") or {})
    if isinstance(rope.get("full_attention"), dict):
        rope = dict(rope["full_attention"])
    if "rope_theta" not in rope and hparams.get("rope_theta") is not None:
        rope["rope_theta"] = hparams["rope_theta"]
    if "rope_type" not in rope and "type" in rope:
        rope["rope_type"] = rope["type"]
    return rope


def _head_dim(hparams: dict[str, Any]) -> int:
    return hparams.get("head_dim") or hparams["hidden_size"] // hparams["num_attention_heads"]


def _add_phi3_rope(writer: gguf.GGUFWriter, hparams: dict[str, Any], rope: dict[str, Any]) -> None:
    """``Phi3MiniModel.set_gguf_parameters``' rope keys: the rotated dimensions, and for
    longrope the original context and the attention factor (``sqrt(1 + ln(scale) /
    ln(original))``, 1 when ``scale = max_position_embeddings / original <= 1``); the factors
    are tensors (:func:`_phi3_rope_factors`)."""
    head_dim = _head_dim(hparams)
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if rope.get("rope_type") not in ("longrope", "su"):
        return
    original = (
        rope.get("original_max_position_embeddings") or hparams["original_max_position_embeddings"]
    )
    scale = hparams["max_position_embeddings"] / original
    attention = 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(original))
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_rope_scaling_attn_factors(attention)


def _phi3_rope_factors(hparams: dict[str, Any]) -> list[tuple[str, np.ndarray]]:
    """``Phi3MiniModel.generate_extra_tensors``: the longrope factors as F32 tensors."""
    rope = _rope_parameters(hparams)
    if rope.get("rope_type") not in ("longrope", "su"):
        return []
    return [
        ("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32)),
        ("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32)),
    ]


def _add_hyperparameters(
    writer: gguf.GGUFWriter, hparams: dict[str, Any], arch: str, tensor_type: str
) -> None:
    writer.add_block_count(hparams["num_hidden_layers"])
    writer.add_context_length(hparams["max_position_embeddings"])
    writer.add_embedding_length(hparams["hidden_size"])
    writer.add_feed_forward_length(hparams["intermediate_size"])
    writer.add_head_count(hparams["num_attention_heads"])
    writer.add_head_count_kv(hparams["num_key_value_heads"])
    rope = _rope_parameters(hparams)
    rope_type = rope.get("rope_type", "default")
    if arch == "phi3":
        _add_phi3_rope(writer, hparams, rope)
    elif rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif rope_type not in ("default", "llama3"):  # llama3: the rope_freqs tensor
        raise ValueError(f"this writer does not write rope_type {rope_type!r}")
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(hparams["rms_norm_eps"])
    if hparams.get("head_dim") is not None:
        writer.add_key_length(hparams["head_dim"])
        writer.add_value_length(hparams["head_dim"])
    experts = hparams.get("num_experts") or hparams.get("num_local_experts")
    if experts:  # TextModel: expert_count / expert_used_count; Qwen3MoeModel: expert length
        writer.add_expert_count(experts)
        writer.add_expert_used_count(hparams["num_experts_per_tok"])
        if hparams.get("moe_intermediate_size"):
            writer.add_expert_feed_forward_length(hparams["moe_intermediate_size"])
    if arch == "gemma3" and hparams.get("sliding_window_pattern") != 1:
        writer.add_sliding_window(hparams["sliding_window"])
    writer.add_file_type(_FILE_TYPE[tensor_type])
    if arch == "llama":
        writer.add_vocab_size(hparams["vocab_size"])
        writer.add_rope_dimension_count(_head_dim(hparams))


def _looks_special(token: str) -> bool:
    """The converter's ``does_token_look_special`` for the tokens our vocabularies have."""
    return token in ("<pad>", "<mask>") or (token.startswith("<|") and token.endswith("|>"))


def pre_tokenizer_name(tokenizer: Any) -> str:
    """``tokenizer.ggml.pre`` for a transformers tokenizer, recognised as the converter does.

    Raises:
        ValueError: the hash of the ids of :data:`CHKTXT` is not one we know (the converter
            raises NotImplementedError there); pass ``tokenizer_pre`` to :func:`write_gguf`.
    """
    digest = hashlib.sha256(str(tokenizer.encode(CHKTXT)).encode()).hexdigest()
    if digest not in KNOWN_PRE_TOKENIZER_HASHES:
        raise ValueError(f"BPE pre-tokenizer not recognised (chkhsh {digest})")
    return KNOWN_PRE_TOKENIZER_HASHES[digest]


def _add_bpe_vocabulary(
    writer: gguf.GGUFWriter, directory: Path, hparams: dict[str, Any], tokenizer_pre: str | None
) -> None:
    """``_set_vocab_gpt2``: tokens, types, pre-tokenizer name, then ``gguf.SpecialVocab``.

    The converter loads the tokenizer with ``AutoTokenizer``; we load ``tokenizer.json`` itself
    (``PreTrainedTokenizerFast(tokenizer_file=...)``) because transformers 5's ``AutoTokenizer``
    gives a ``qwen2``/``qwen3`` config ``Qwen2Tokenizer``, whose pre-tokenizer replaces the one
    in ``tokenizer.json`` (the SmolLM2 tokenizer of our tiny Qwen models would be hashed as
    another). For a real Qwen checkpoint the two are the same."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"))
    vocab = tokenizer.get_vocab()
    vocab_size = hparams.get("vocab_size", len(vocab))
    by_id = {token_id: token for token, token_id in vocab.items()}
    added = tokenizer.get_added_vocab()
    added_decoder = tokenizer.added_tokens_decoder
    tokens: list[str] = []
    types: list[int] = []
    for token_id in range(vocab_size):
        token = by_id.get(token_id)
        if token is None:
            tokens.append(f"[PAD{token_id}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        kind = gguf.TokenType.NORMAL
        if token in added:
            if not added_decoder[token_id].normalized:
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
            if added_decoder[token_id].special or _looks_special(token):
                kind = gguf.TokenType.CONTROL
            else:
                token = token.replace("\u2581", " ")
                kind = gguf.TokenType.USER_DEFINED
        tokens.append(token)
        types.append(kind)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(tokenizer_pre or pre_tokenizer_name(tokenizer))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(directory, load_merges=True).add_to_gguf(writer, quiet=True)


def _add_spm_vocabulary(writer: gguf.GGUFWriter, directory: Path, hparams: dict[str, Any]) -> None:
    """``_set_vocab_sentencepiece`` / ``_create_vocab_sentencepiece``: every piece of
    ``tokenizer.model`` with its score and type (NORMAL, UNKNOWN, CONTROL, UNUSED, BYTE), the
    added tokens of ``added_tokens.json`` and ``tokenizer_config.json`` (CONTROL when special,
    else USER_DEFINED with ``▁`` written as a space; score -1000), ``[PADn]`` up to the model's
    vocabulary size; model "llama", pre "default"; then ``gguf.SpecialVocab``."""
    from sentencepiece import SentencePieceProcessor

    processor = SentencePieceProcessor()
    processor.LoadFromFile(str(directory / "tokenizer.model"))
    vocab_size = hparams.get("vocab_size") or processor.vocab_size()
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    scores = [-10000.0] * vocab_size
    types = [gguf.TokenType.UNUSED] * vocab_size
    for token_id in range(min(processor.vocab_size(), vocab_size)):
        tokens[token_id] = processor.IdToPiece(token_id)
        scores[token_id] = processor.GetScore(token_id)
        types[token_id] = (
            gguf.TokenType.UNKNOWN
            if processor.IsUnknown(token_id)
            else gguf.TokenType.CONTROL
            if processor.IsControl(token_id)
            else gguf.TokenType.UNUSED
            if processor.IsUnused(token_id)
            else gguf.TokenType.BYTE
            if processor.IsByte(token_id)
            else gguf.TokenType.NORMAL
        )
    added_tokens = directory / "added_tokens.json"
    if added_tokens.is_file():
        for text, token_id in json.loads(added_tokens.read_text(encoding="utf-8")).items():
            if token_id < vocab_size:
                tokens[token_id], scores[token_id] = text, -1000.0
                types[token_id] = gguf.TokenType.USER_DEFINED
    tokenizer_config = directory / "tokenizer_config.json"
    if tokenizer_config.is_file():
        decoder = json.loads(tokenizer_config.read_text(encoding="utf-8"))
        for key, entry in decoder.get("added_tokens_decoder", {}).items():
            token_id, text = int(key), entry["content"]
            if token_id >= vocab_size:
                continue
            if entry.get("special") or _looks_special(text):
                types[token_id] = gguf.TokenType.CONTROL
            else:
                text = text.replace("\u2581", " ")
                types[token_id] = gguf.TokenType.USER_DEFINED
            tokens[token_id], scores[token_id] = text, -1000.0
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    gguf.SpecialVocab(directory, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)


def _add_vocabulary(
    writer: gguf.GGUFWriter,
    directory: Path,
    hparams: dict[str, Any],
    arch: str,
    tokenizer_pre: str | None,
) -> None:
    """The converter's ``set_vocab``: SentencePiece when the directory has ``tokenizer.model``
    (``LlamaModel`` and ``Qwen2Model`` both try it first), else byte-level BPE."""
    if (directory / "tokenizer.model").is_file():
        _add_spm_vocabulary(writer, directory, hparams)
    else:
        _add_bpe_vocabulary(writer, directory, hparams, tokenizer_pre)
    if arch != "llama":
        return
    tokenizer_config = directory / "tokenizer_config.json"
    if tokenizer_config.is_file():
        settings = json.loads(tokenizer_config.read_text(encoding="utf-8"))
        if "add_prefix_space" in settings:
            writer.add_add_space_prefix(settings["add_prefix_space"])
    if hparams.get("vocab_size", 32000) == 49152:
        writer.add_add_bos_token(False)


def permute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """The converter's ``LlamaModel.permute`` (rows ``[heads * head_dim, ...]``): within each
    head, row ``i`` of the first half goes to ``2i`` and row ``i`` of the second half to
    ``2i + 1``, so llama.cpp's adjacent-pair rope computes Hugging Face's split-half rope."""
    shape = weight.shape
    return (
        weight.reshape(num_heads, 2, shape[0] // num_heads // 2, *shape[1:])
        .swapaxes(1, 2)
        .reshape(shape)
    )


def llama3_rope_factors(hparams: dict[str, Any]) -> np.ndarray:
    """float32 ``[head_dim / 2]``: ``rope_freqs.weight`` as the converter computes it: 1 for
    wavelengths under ``original / high_freq_factor``, ``factor`` above ``original /
    low_freq_factor``, a smooth blend between (Llama 3.1's ``apply_scaling``)."""
    rope = _rope_parameters(hparams)
    base = rope.get("rope_theta", 10000.0)
    dim = _head_dim(hparams)
    factor = rope.get("factor", 8.0)
    low_freq_factor = rope.get("low_freq_factor", 1.0)
    high_freq_factor = rope.get("high_freq_factor", 4.0)
    original = hparams.get("original_max_position_embeddings", 8192)  # the converter's lookup
    low_freq_wavelen = original / low_freq_factor
    high_freq_wavelen = original / high_freq_factor
    factors = []
    for freq in 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float32) / dim):
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1.0)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _hf_tensors(directory: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Every tensor of the checkpoint as float32 numpy, shard by shard."""
    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    for file_name in files:
        with safe_open(directory / file_name, framework="pt") as part:
            for name in part.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield name, part.get_tensor(name).float().numpy()


_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def _stacked_experts(tensors: Iterator[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
    """The converters' expert stacking (``Qwen2MoeModel`` / ``LlamaModel.modify_tensors``):
    each expert's matrix of one layer and kind (``...experts.{e}.gate_proj``) becomes one
    ``[experts, out, in]`` tensor named without the index (``...experts.gate_proj``), emitted
    once every expert's is seen; other tensors pass."""
    pending: dict[str, dict[int, np.ndarray]] = {}
    for name, array in tensors:
        match = _EXPERT.search(name)
        if match is None:
            yield name, array
            continue
        stacked = name[: match.start()] + ".experts." + name[match.end() :]
        pending.setdefault(stacked, {})[int(match.group(1))] = array
    for stacked, by_expert in pending.items():
        yield stacked, np.stack([by_expert[e] for e in sorted(by_expert)])


def _encode(array: np.ndarray, tensor_type: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """``array`` in ``tensor_type``, or in its fallback when its rows do not split into blocks."""
    if tensor_type in _K_QUANTIZERS:
        if array.shape[-1] % QK_K == 0:
            return _K_QUANTIZERS[tensor_type](array), gguf.GGMLQuantizationType[tensor_type]
        tensor_type = _K_QUANT_FALLBACK[tensor_type]
    qtype = gguf.GGMLQuantizationType[tensor_type]
    try:
        return gguf.quants.quantize(array, qtype), qtype
    except gguf.QuantError:
        qtype = gguf.GGMLQuantizationType.F16
        return gguf.quants.quantize(array, qtype), qtype


def _gguf_tensors(
    directory: Path,
    hparams: dict[str, Any],
    arch: str,
    tensor_type: str,
    embedding_type: str,
) -> Iterator[tuple[str, np.ndarray, gguf.GGMLQuantizationType]]:
    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    tensor_map = gguf.get_tensor_name_map(model_arch, hparams["num_hidden_layers"])
    extra: list[tuple[str, np.ndarray]] = []
    if arch == "llama" and _rope_parameters(hparams).get("rope_type") == "llama3":
        extra.append(("rope_freqs.weight", llama3_rope_factors(hparams)))
    if arch == "phi3":
        extra += _phi3_rope_factors(hparams)
    for name, array in itertools.chain(extra, _stacked_experts(_hf_tensors(directory))):
        if name.endswith(".rotary_emb.inv_freq"):
            continue
        if arch == "gemma3" and name.endswith("norm.weight"):
            array = array + np.float32(1.0)  # Gemma3Model.norm_shift: the stored 1 + w
        if arch == "llama":
            if name.endswith(("q_proj.weight", "q_proj.bias")):
                array = permute_rope_rows(array, hparams["num_attention_heads"])
            elif name.endswith(("k_proj.weight", "k_proj.bias")):
                array = permute_rope_rows(array, hparams["num_key_value_heads"])
        new_name = (
            name
            if name.startswith("rope_f")  # rope_freqs, rope_factors_long/short
            else tensor_map.get_name(name, try_suffixes=(".weight", ".bias"))
        )
        if new_name is None:
            raise ValueError(f"no GGUF name for tensor {name!r}")
        # the converter keeps 1-D tensors, norms and the experts' router in F32
        if array.ndim <= 1 or new_name.endswith(("_norm.weight", "ffn_gate_inp.weight")):
            yield new_name, array.astype(np.float32), gguf.GGMLQuantizationType.F32
            continue
        wanted = (
            embedding_type if new_name in ("token_embd.weight", "output.weight") else tensor_type
        )
        data, qtype = _encode(array, wanted)
        yield new_name, data, qtype


def write_gguf(
    hf_directory: Path | str,
    out_path: Path | str,
    *,
    tensor_type: str = "F32",
    architecture: str | None = None,
    embedding_type: str | None = None,
    tokenizer_pre: str | None = None,
    name: str | None = None,
) -> Path:
    """Write the checkpoint in ``hf_directory`` as a GGUF file laid out as llama.cpp's converter
    lays it out (see the module docstring) and return ``out_path``.

    Args:
        tensor_type: one of :data:`TENSOR_TYPES`, for every 2-D tensor (norms and 1-D tensors
            stay F32); rows that do not split into the type's blocks fall back (module docstring).
        architecture: write this ``general.architecture`` (and key prefix) instead of the one
            the converter would (for refusal tests); tensor names stay the real architecture's.
        embedding_type: the type of ``token_embd``/``output`` (default: ``tensor_type``), e.g.
            "Q8_0" with Q4_1 projections as in SmolLM2's own file.
        tokenizer_pre: ``tokenizer.ggml.pre`` (default: recognised from the tokenizer's output on
            :data:`CHKTXT`, as the converter does).
        name: ``general.name`` (default: the directory's name, the converter's fallback).

    Raises:
        ValueError: an unknown tensor type, model architecture or rope type; a tokenizer whose
            pre-tokenizer is not recognised and no ``tokenizer_pre``.
    """
    if tensor_type not in TENSOR_TYPES or (embedding_type or tensor_type) not in TENSOR_TYPES:
        raise ValueError(f"tensor types must be in {TENSOR_TYPES}")
    hf_directory, out_path = Path(hf_directory), Path(out_path)
    hparams = _load_hparams(hf_directory)
    hf_architecture = hparams["architectures"][0]
    if hf_architecture not in GGUF_ARCHITECTURE:
        raise ValueError(f"no GGUF architecture for {hf_architecture!r}")
    arch = GGUF_ARCHITECTURE[hf_architecture]
    writer = gguf.GGUFWriter(out_path, architecture or arch)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name or hf_directory.name)
    _add_hyperparameters(writer, hparams, arch, tensor_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_vocabulary(writer, hf_directory, hparams, arch, tokenizer_pre)
    tensors = _gguf_tensors(hf_directory, hparams, arch, tensor_type, embedding_type or tensor_type)
    for tensor_name, data, qtype in tensors:
        writer.add_tensor(tensor_name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def write_vocab_gguf(
    directory: Path | str,
    out_path: Path | str,
    *,
    tokenizer_pre: str | None = None,
    architecture: str = "llama",
) -> Path:
    """A GGUF file with only the tokenizer keys the converter writes for the tokenizer in
    ``directory`` (``tokenizer.json``, or ``tokenizer.model`` for SentencePiece), as its
    ``--vocab-only`` mode does; ``config.json`` is optional. Returns ``out_path``.

    Raises:
        ValueError: an unrecognised BPE pre-tokenizer and no ``tokenizer_pre``.
    """
    directory, out_path = Path(directory), Path(out_path)
    config = directory / "config.json"
    hparams = json.loads(config.read_text()) if config.is_file() else {}
    writer = gguf.GGUFWriter(out_path, architecture)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(directory.name)
    _add_vocabulary(writer, directory, hparams, architecture, tokenizer_pre)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path
