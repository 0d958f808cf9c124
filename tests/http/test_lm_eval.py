"""A real client: lm-evaluation-harness (``lm_eval``, model type ``local-completions``) runs a
small local task against the live server (a loglikelihood task and a ``generate_until`` task,
from a JSONL file written here), and its loglikelihoods equal those of lm_eval's own ``hf``
backend on the same weights (a tiny random-weight Llama served by path, float32). Nothing is
downloaded: the data is a local file, the tokenizer and weights a local directory, and the
Hugging Face libraries run offline."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from harness.threaded_server import serve_in_thread

from app.api.server import create_app
from app.config import ServerConfig
from app.models.load.plan import load_checkpoint

pytestmark = pytest.mark.slow

DOCS = [
    {"context": "The quick brown fox jumps over the", "continuation": " lazy dog"},
    {"context": "One, two, three,", "continuation": " four"},
    {"context": "Paris is the capital of", "continuation": " France"},
]


def _task_files(directory: Path) -> None:
    data = directory / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    common = {
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "doc_to_text": "{{context}}",
        "doc_to_target": "{{continuation}}",
    }
    loglikelihood = {
        **common,
        "task": "slotserve_loglikelihood",
        "output_type": "loglikelihood",
        "metric_list": [
            {"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
        ],
    }
    generate = {
        **common,
        "task": "slotserve_generate",
        "output_type": "generate_until",
        "generation_kwargs": {"until": ["\n"], "max_gen_toks": 6, "do_sample": False},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
    }
    # YAML is a superset of JSON: lm_eval reads these as its task files
    (directory / "loglikelihood.yaml").write_text(json.dumps(loglikelihood))
    (directory / "generate.yaml").write_text(json.dumps(generate))


def _evaluate(model: str, model_args: str, tasks_dir: Path) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["slotserve_loglikelihood", "slotserve_generate"],
        # only the two local tasks: lm_eval's ~28k built-in task files are not indexed (~30 s)
        task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False),
        batch_size=1,
        log_samples=True,
    )


def _loglikelihoods(results: dict) -> list[float]:
    samples = sorted(results["samples"]["slotserve_loglikelihood"], key=lambda s: s["doc_id"])
    return [float(sample["filtered_resps"][0][0]) for sample in samples]


def test_lm_eval_scores_through_the_server_equal_its_hf_backend(
    tiny_checkpoints, tmp_path, monkeypatch
) -> None:
    pytest.importorskip("lm_eval", reason="lm_eval is in the test extra")
    for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(variable, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    path = tiny_checkpoints.hf("llama")
    _task_files(tmp_path)
    runner = load_checkpoint(path, max_num_seqs=2, max_model_len=256, dtype="float32")
    app = create_app(ServerConfig(model="mock", max_num_seqs=2), model=runner)
    with serve_in_thread(app) as server:
        served = _evaluate(
            "local-completions",
            f"base_url={server.url}/v1/completions,model=tiny,tokenizer={path},"
            "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1,max_length=256",
            tmp_path,
        )
    reference = _evaluate("hf", f"pretrained={path},dtype=float32,device=cpu", tmp_path)
    got, want = _loglikelihoods(served), _loglikelihoods(reference)
    assert len(got) == len(DOCS)
    assert got == pytest.approx(want, abs=1e-3)
    for name in ("slotserve_loglikelihood", "slotserve_generate"):
        assert name in served["results"]
    generated = served["samples"]["slotserve_generate"]
    assert len(generated) == len(DOCS)
    assert all(isinstance(sample["filtered_resps"][0], str) for sample in generated)
    assert os.environ["HF_HUB_OFFLINE"] == "1"
