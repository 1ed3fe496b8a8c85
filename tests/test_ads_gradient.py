"""opdkit.ads.gradient and the savegrad job: the saved mean gradient against plain PyTorch, independence of
batch size and process count, the completion mask of the real Qwen3 template, files and their checks."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from opdkit import models, tiny
from opdkit.ads import gradfile, gradient
from opdkit.config import ConfigError, load_config
from opdkit.data import prompts, traces
from opdkit.data.labels import IGNORE, completion_labels, make_batches
from opdkit.jobs import savegrad
from opdkit.jobs.savegrad import holdout as savegrad_holdout
from opdkit.jobs.savegrad import report as savegrad_report
from opdkit.jobs.savegrad.config import SaveGradConfig
from opdkit.run.folders import RunDir
from opdkit.tasks import tiny as task

REPO = Path(__file__).resolve().parent.parent
TOL = 1e-5


def _proxy(path: str = "tiny:student") -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny.resolve(path), dtype=torch.float32)


def _conversations(n: int, seed: int = 0) -> list[dict]:
    """Traces of varied length (1- to 3-digit problems) with the task's own scratchpads as answers."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = task.problems(1, seed * 1000 + i, n_digits=1 + i % 3)[0]
        answer = task.scratchpad(p, rng)
        out.append(
            {
                "messages": [{"role": "user", "content": p.prompt}, {"role": "assistant", "content": answer}],
                "answer": p.answer,
            }
        )
    return out


@pytest.fixture(scope="module")
def traces_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("traces") / "holdout"
    datasets.Dataset.from_list(_conversations(11)).save_to_disk(str(path))
    return path


@pytest.fixture(scope="module")
def rows(tiny_tokenizer) -> list[dict]:
    out = []
    for c in _conversations(11):
        ids, labels = completion_labels(tiny_tokenizer, c["messages"])
        out.append({"input_ids": ids, "labels": labels})
    return out


def _reference(model: torch.nn.Module, rows: list[dict], normalization: str) -> dict[str, torch.Tensor]:
    """Plain PyTorch, one unpadded trace at a time: "trace" is Hugging Face's own mean-token loss (what the
    ADS seed backpropagates at batch size 1) averaged over traces; "token" sums every token's loss."""
    params = dict(model.named_parameters())
    total = {name: torch.zeros_like(p) for name, p in params.items()}
    n_tokens = sum(sum(t != IGNORE for t in r["labels"]) for r in rows)
    for r in rows:
        ids, labels = torch.tensor([r["input_ids"]]), torch.tensor([r["labels"]])
        if normalization == "trace":
            loss = model(input_ids=ids, labels=labels).loss / len(rows)
        else:
            logits = model(input_ids=ids).logits[0, :-1]
            loss = F.cross_entropy(logits, labels[0, 1:], ignore_index=IGNORE, reduction="sum") / n_tokens
        for name, g in zip(params, torch.autograd.grad(loss, list(params.values()))):
            total[name] += g
    return total


def _rel_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    diff = sum(((a[k].float() - b[k].float()) ** 2).sum() for k in a) ** 0.5
    return float(diff / sum((b[k].float() ** 2).sum() for k in b) ** 0.5)


def _run(tmp_path: Path, name: str, **overrides) -> RunDir:
    return savegrad.run("tiny", {"run_dir": str(tmp_path / name), **overrides})


def test_shard_by_length_takes_each_trace_once():
    lengths = [5, 3, 9, 3, 7, 1, 8]
    for world in range(1, 10):
        shards = [gradient.shard_by_length(lengths, r, world) for r in range(world)]
        assert sorted(i for s in shards for i in s) == list(range(len(lengths)))
        for s in shards:
            assert [lengths[i] for i in s] == sorted(lengths[i] for i in s)  # length-sorted: little padding
    assert gradient.shard_by_length(lengths, 8, 9) == []  # more processes than traces: some get none


def test_trace_weights_give_the_mean():
    n_tokens_B = torch.tensor([2, 5, 3])
    assert torch.allclose(
        gradient.trace_weights(n_tokens_B, "trace", 3, 10) * n_tokens_B,
        torch.full((3,), 1 / 3, dtype=torch.float64),
    )
    assert torch.allclose(
        gradient.trace_weights(n_tokens_B, "token", 3, 10), torch.full((3,), 0.1, dtype=torch.float64)
    )
    with pytest.raises(ValueError, match="normalization"):
        gradient.trace_weights(n_tokens_B, "sequence", 3, 10)


@pytest.mark.parametrize("normalization", gradient.NORMALIZATIONS)
@pytest.mark.parametrize("batch_size", [1, 2, 4])
def test_mean_grad_equals_plain_pytorch(rows, normalization, batch_size):
    model = _proxy()
    named, stats = gradient.mean_completion_grad(model, rows, normalization, batch_size, pad_token_id=0)
    assert _rel_err(named, _reference(_proxy(), rows, normalization)) <= TOL
    assert list(named) == [n for n, _ in model.named_parameters()]
    assert stats["num_traces"] == len(rows)
    assert stats["completion_tokens"] == sum(sum(t != IGNORE for t in r["labels"]) for r in rows)


@pytest.mark.parametrize("normalization", gradient.NORMALIZATIONS)
@pytest.mark.parametrize("world", [3, 13])
def test_process_shares_sum_to_the_single_process_gradient(rows, normalization, world):
    """The cross-process math without processes: the shards' contributions (some empty) add up to the
    whole."""
    total_tokens = sum(gradient.completion_token_count(r["labels"]) for r in rows)
    lengths = [len(r["input_ids"]) for r in rows]
    model = _proxy()
    summed = None
    for rank in range(world):
        model.zero_grad(set_to_none=True)
        mine = gradient.shard_by_length(lengths, rank, world)
        batches = make_batches(rows, mine, 2, 0, "cpu")
        gradient.accumulate_mean_grad(model, batches, normalization, len(rows), total_tokens)
        gradient.all_reduce_grads(model, world=1)  # only fills in zeros where this shard reached nothing
        part = {n: p.grad.clone() for n, p in model.named_parameters()}
        summed = part if summed is None else {n: summed[n] + part[n] for n in part}
    assert _rel_err(summed, _reference(_proxy(), rows, normalization)) <= TOL


def test_job_gradient_equals_direct_computation_from_saved_traces(tmp_path):
    run = _run(tmp_path, "gen", subset_size=12)
    ds = traces.load_traces(run)
    assert len(ds) == 12
    assert {"messages", "input_ids", "labels", "answer", "correct", "truncated"} <= set(ds.column_names)
    saved = load_file(str(run.path / "grads.safetensors"))
    direct = _reference(_proxy(), [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in ds], "trace")
    assert _rel_err(saved, direct) <= TOL
    assert saved.keys() == {n for n, _ in _proxy().named_parameters()}
    assert "lm_head.weight" not in saved  # tied to the embeddings: saved once, under its parameter's name
    assert all(t.dtype == torch.float32 for t in saved.values())
    meta = json.loads((run.path / "grads.json").read_text())
    for key in (
        "proxy_model",
        "tokenizer_fingerprint",
        "num_traces",
        "completion_tokens",
        "normalization",
        "world_size",
        "batch_size",
        "grad_norm",
        "opdkit_version",
        "created",
    ):
        assert meta[key] is not None, key
    assert meta["num_traces"] == 12 and meta["world_size"] == 1
    assert meta["grad_norm"] == pytest.approx(gradient.global_norm(saved), rel=1e-5)
    summary = run.read_summary()
    assert summary["status"] == "done"
    assert summary["teacher_accuracy"] == pytest.approx(sum(ds["correct"]) / 12)
    assert (
        summary["completion_tokens"]
        == meta["completion_tokens"]
        == sum(savegrad_report.completion_lengths(run))
    )


def test_saved_traces_label_exactly_the_answer(tmp_path, tiny_tokenizer):
    run = _run(tmp_path, "gen", subset_size=4)
    for row in traces.load_traces(run):
        completion = [t for t in row["labels"] if t != IGNORE]
        assert tiny_tokenizer.decode(completion) == row["messages"][-1]["content"] + "<|im_end|>"
        assert row["correct"] == (task.extract_answer(row["messages"][-1]["content"]) == row["answer"])
    assert "⟦" in savegrad_report.show_traces(run, n=2)


def test_batch_size_does_not_change_the_saved_gradient(tmp_path, traces_folder, rows):
    for normalization in gradient.NORMALIZATIONS:
        reference = _reference(_proxy(), rows, normalization)
        for bs in (1, 2, 4):
            run = _run(
                tmp_path,
                f"{normalization}-{bs}",
                traces_path=str(traces_folder),
                normalization=normalization,
                batch_size=bs,
            )
            assert _rel_err(load_file(str(run.path / "grads.safetensors")), reference) <= TOL, (
                normalization,
                bs,
            )


_TWO_PROCESSES = """
import sys
import torch
from opdkit.jobs import savegrad
torch.set_num_threads(1)
for norm in ("trace", "token"):
    savegrad.run("tiny", {"traces_path": sys.argv[1], "run_dir": f"{sys.argv[2]}/{norm}", "num_processes": 2,
                          "normalization": norm, "batch_size": 3})
"""


@pytest.mark.timeout(600)
def test_two_processes_save_the_one_process_gradient(tmp_path, traces_folder, rows):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _TWO_PROCESSES, str(traces_folder), str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    for normalization in gradient.NORMALIZATIONS:
        run = RunDir.attach(tmp_path / normalization)
        assert run.read_summary()["world_size"] == 2
        saved = load_file(str(run.path / "grads.safetensors"))
        assert not any(k.startswith("module.") for k in saved)
        assert _rel_err(saved, _reference(_proxy(), rows, normalization)) <= TOL, normalization


def _nan_proxy(tmp_path: Path, char: str) -> Path:
    """The tiny student with a NaN embedding row for `char`: any trace containing it has a NaN loss, and
    only those (the head is untied first, or its NaN row would poison every trace's softmax)."""
    folder = tmp_path / "nan-proxy"
    shutil.copytree(tiny.resolve("tiny:student"), folder)
    model = _proxy()
    tok = AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
        model.get_input_embeddings().weight[tok.convert_tokens_to_ids(char)] = float("nan")
    model.save_pretrained(folder)
    return folder


def test_nonfinite_loss_names_the_trace_and_saves_nothing(tmp_path):
    convos = [
        {
            "messages": [
                {"role": "user", "content": "12+34"},
                {"role": "assistant", "content": "2+4=6,1+3=4;46"},
            ],
            "answer": "46",
        }
    ] * 5
    convos = (
        convos[:3]
        + [
            {
                "messages": [{"role": "user", "content": "5+4"}, {"role": "assistant", "content": "5+4=9;9"}],
                "answer": "9",
            }
        ]
        + convos[3:]
    )
    datasets.Dataset.from_list(convos).save_to_disk(str(tmp_path / "t"))
    proxy = _nan_proxy(tmp_path, "9")
    with pytest.raises(
        gradient.NonFiniteGradient, match=r"trace 3 \(row 3 of the traces dataset\) gives a non-finite loss"
    ):
        _run(tmp_path, "nan", traces_path=str(tmp_path / "t"), proxy_model=str(proxy), batch_size=2)
    run = RunDir.attach(tmp_path / "nan")
    assert not (run.path / "grads.safetensors").exists() and not (run.path / "grads.json").exists()
    assert run.read_summary()["status"].startswith("failed")
    assert not list(run.path.glob(".*tmp*"))


def test_nonfinite_loss_stops_every_process(tmp_path):
    """One process meets the NaN; the other must stop too, not wait forever in the gradient's all_reduce."""
    convos = [
        {
            "messages": [
                {"role": "user", "content": "12+34"},
                {"role": "assistant", "content": "2+4=6,1+3=4;46"},
            ]
        }
    ] * 3
    convos.append(
        {"messages": [{"role": "user", "content": "5+4"}, {"role": "assistant", "content": "5+4=9;9"}]}
    )
    datasets.Dataset.from_list(convos).save_to_disk(str(tmp_path / "t"))
    proxy, run_dir = _nan_proxy(tmp_path, "9"), tmp_path / "nan2"
    sets = [f"traces_path={tmp_path / 't'}", f"proxy_model={proxy}", f"run_dir={run_dir}", "num_processes=2"]
    proc = subprocess.run(
        [sys.executable, "-m", "opdkit.savegrad", "--mode", "tiny", "--set", *sets],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "trace 3 (row 3 of the traces dataset) gives a non-finite loss" in proc.stderr
    # the exception lines themselves (a traceback also prints the source line of the raise)
    assert "NonFiniteGradient: another process found a trace with a non-finite loss" in proc.stderr
    assert not (run_dir / "grads.safetensors").exists()


def test_resume_reuses_the_saved_traces(tmp_path):
    run = _run(tmp_path, "r", subset_size=6)
    first = load_file(str(run.path / "grads.safetensors"))
    traces = run.path / "traces" / "data-00000-of-00001.arrow"
    stamp = traces.stat().st_mtime_ns
    (run.path / "grads.safetensors").unlink()
    _run(tmp_path, "r", subset_size=6, resume=True)
    assert traces.stat().st_mtime_ns == stamp
    assert _rel_err(load_file(str(run.path / "grads.safetensors")), first) == 0.0


def test_nonfinite_gradient_names_a_trace(rows):
    model = _proxy()
    model.model.norm.weight.register_hook(lambda g: g * float("inf"))
    with pytest.raises(gradient.NonFiniteGradient, match=r"trace \d+ .* non-finite gradient"):
        gradient.mean_completion_grad(model, rows, "trace", 4, pad_token_id=0)


def test_traces_without_completion_tokens_are_refused():
    with pytest.raises(ValueError, match=r"trace\(s\) \[1\] have no completion tokens"):
        gradient.mean_completion_grad(
            _proxy(),
            [{"input_ids": [5, 6], "labels": [IGNORE, 6]}, {"input_ids": [5, 6], "labels": [IGNORE, IGNORE]}],
            "trace",
            2,
            0,
        )


def test_save_is_atomic(tmp_path, monkeypatch):
    def interrupted(tensors, path, metadata=None):
        Path(path).write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(gradfile, "save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        gradfile.save_grads(tmp_path, {"w": torch.ones(2)}, {"proxy_model": "x"})
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory, traces_folder) -> RunDir:
    return savegrad.run(
        "tiny", {"run_dir": str(tmp_path_factory.mktemp("saved") / "run"), "traces_path": str(traces_folder)}
    )


def test_load_grads_accepts_its_own_model(saved_run, tiny_tokenizer):
    g = gradfile.load_grads(saved_run.path, _proxy(), tiny_tokenizer)
    assert _rel_err(g, load_file(str(saved_run.path / "grads.safetensors"))) == 0.0
    gradfile.load_grads(saved_run.path / "grads.safetensors", _proxy())  # tokenizer from the model's folder
    meta = gradfile.check_grads(saved_run.path, models.model_skeleton("tiny:student"), tiny_tokenizer)
    assert meta["proxy_model"] == "tiny:student"


def test_reported_figures_match_the_saved_gradient(saved_run):
    saved = load_file(str(saved_run.path / "grads.safetensors"))
    norms = {k: float(v.norm()) for k, v in saved.items()}
    top = savegrad_report.largest_tensors(saved_run, k=3)
    assert [t["tensor"] for t in top] == sorted(norms, key=norms.get, reverse=True)[:3]
    for t in top:
        assert t["norm"] == pytest.approx(norms[t["tensor"]], rel=1e-6)
        assert t["shape"] == tuple(saved[t["tensor"]].shape)
    assert sum(t["share"] for t in savegrad_report.largest_tensors(saved_run, k=10**6)) == pytest.approx(1.0)
    layers = gradient.norms_by_layer(gradfile.read_meta(saved_run.path)["tensor_norms"])
    assert sum(v**2 for v in layers.values()) ** 0.5 == pytest.approx(
        saved_run.read_summary()["grad_norm"], rel=1e-5
    )
    savegrad_report.length_histogram(saved_run)
    savegrad_report.layer_norm_bars(saved_run)
    assert {p.name for p in (saved_run.path / "figures").iterdir()} == {
        "completion_lengths.png",
        "grad_norm_by_layer.png",
    }


def test_load_grads_rejects_another_model(saved_run, tiny_tokenizer):
    folder = tiny.resolve("tiny:student")
    wider = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder, intermediate_size=96))
    with pytest.raises(gradfile.GradsMismatch, match="other shapes.*mlp"):
        gradfile.load_grads(saved_run.path, wider, tiny_tokenizer)
    config = AutoConfig.from_pretrained(folder, num_hidden_layers=3, layer_types=["full_attention"] * 3)
    with pytest.raises(gradfile.GradsMismatch, match=r"11 parameter\(s\) have no gradient"):
        gradfile.load_grads(saved_run.path, AutoModelForCausalLM.from_config(config), tiny_tokenizer)
    with pytest.raises(FileNotFoundError, match="no saved gradient"):
        gradfile.load_grads(saved_run.path / "missing", _proxy(), tiny_tokenizer)


def test_load_grads_rejects_another_tokenizer(saved_run, tiny_tokenizer, qwen3_tokenizer):
    with pytest.raises(gradfile.GradsMismatch, match="another tokenizer"):
        gradfile.load_grads(saved_run.path, _proxy(), qwen3_tokenizer)
    changed = AutoTokenizer.from_pretrained(tiny.resolve("tiny:tokenizer"))
    changed.chat_template = changed.chat_template.replace("assistant", "bot")
    with pytest.raises(gradfile.GradsMismatch, match="another tokenizer"):
        gradfile.load_grads(saved_run.path, _proxy(), changed)


def test_load_grads_explains_ddp_prefixes(tmp_path, tiny_tokenizer):
    named = {f"module.{n}": torch.zeros_like(p) for n, p in _proxy().named_parameters()}
    save_file(named, str(tmp_path / "grads.safetensors"))  # the ADS seed's names, no metadata
    with pytest.raises(gradfile.GradsMismatch, match="module.*prefix"):
        gradfile.load_grads(tmp_path, _proxy(), tiny_tokenizer)


def _qwen3_trace(thinking: bool) -> tuple[list[dict], str]:
    content = (
        "<think>\nTwo plus three is five.\n</think>\n\nThe answer is $\\boxed{5}$."
        if thinking
        else "The answer is $\\boxed{5}$."
    )
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": content},
    ], content


@pytest.mark.parametrize("thinking", [False, True])
def test_qwen3_template_completion_mask(qwen3_tokenizer, thinking):
    assert qwen3_tokenizer.bos_token is None
    messages, content = _qwen3_trace(thinking)
    ids, labels = completion_labels(qwen3_tokenizer, messages, enable_thinking=thinking)
    completion = [t for t in labels if t != IGNORE]
    assert completion == qwen3_tokenizer.encode(content + "<|im_end|>", add_special_tokens=False)
    start = labels.index(completion[0])
    assert labels[start : start + len(completion)] == completion  # one contiguous span
    assert (
        ids[:start]
        == qwen3_tokenizer.apply_chat_template(
            messages[:-1],
            add_generation_prompt=True,
            enable_thinking=thinking,
            tokenize=True,
            return_dict=True,
        )["input_ids"]
    )  # everything before it is the prompt as the model was asked
    assert (
        qwen3_tokenizer.decode(ids[start + len(completion) :]) == "\n"
    )  # the newline after the turn: no label


def test_base_model_eos_still_ends_the_completion_at_the_turn(qwen3_tokenizer_dir):
    """A base model's tokenizer (Qwen2.5-3B: EOS <|endoftext|>) with a chat template ending turns in
    <|im_end|>."""
    tok = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)
    tok.eos_token = "<|endoftext|>"
    messages, content = _qwen3_trace(False)
    _, labels = completion_labels(tok, messages)
    assert tok.decode([t for t in labels if t != IGNORE]) == content + "<|im_end|>"


def test_supplied_text_traces(tmp_path):
    rows = [
        {"question": "2+3", "trace": "3+2=5;5", "answer": "5"},
        {"question": "4+4", "trace": "4+4=8;8", "answer": "8"},
    ]
    datasets.Dataset.from_list(rows).to_json(str(tmp_path / "t.jsonl"))
    prep = savegrad.prepare("tiny", {"traces_path": str(tmp_path / "t.jsonl"), "trace_column": "trace"})
    assert prep.traces[0]["messages"][-1] == {"role": "assistant", "content": "3+2=5;5"}
    assert "⟦3+2=5;5<|im_end|>⟧" in prep.first_example
    rendered = [
        {"question": "2+3", "trace": "<|im_start|>user\n2+3<|im_end|>\n<|im_start|>assistant\n3+2=5;5"}
    ]
    datasets.Dataset.from_list(rendered).to_json(str(tmp_path / "r.jsonl"))
    with pytest.raises(ConfigError, match="contains its own prompt"):
        savegrad.prepare("tiny", {"traces_path": str(tmp_path / "r.jsonl"), "trace_column": "trace"})
    with pytest.raises(ConfigError, match="no column 'messages'"):
        savegrad.prepare("tiny", {"traces_path": str(tmp_path / "t.jsonl")})


def test_max_length_caps_prompt_plus_trace():
    prep = savegrad.prepare("tiny", {"subset_size": 6, "max_prompt_length": 40, "max_length": 45})
    ids = [prompts.prompt_ids(prep.teacher_tokenizer, m) for m in prep.train_messages]
    sampler = savegrad_holdout.TeacherSampler(prep.cfg, prep.teacher_tokenizer, "cpu", world=1)
    out = savegrad_holdout.generate_batch(sampler, ids, "cpu")
    for prompt, (text, truncated, _) in zip(ids, out):
        assert len(prompt) + len(prep.teacher_tokenizer.encode(text, add_special_tokens=False)) <= 45
        assert truncated
    with pytest.raises(ConfigError, match="leaves no room"):
        savegrad.prepare("tiny", {"max_length": 64})


@pytest.mark.parametrize("config_eos", [None, 7, [5, 7]], ids=["generation_config.json", "int", "list"])
def test_both_engines_stop_at_the_same_ids(tmp_path, config_eos):
    """01's vLLM path stops where the HF loop does: in a folder without generation_config.json, at the
    tokenizer's EOS and config.json's eos_token_id, as transformers derives the loaded model's generation
    config (issue 21; it stopped at the tokenizer's EOS alone)."""
    folder = tmp_path / "teacher"
    shutil.copytree(tiny.resolve("tiny:teacher"), folder)
    if config_eos is not None:
        (folder / "generation_config.json").unlink()
        config = json.loads((folder / "config.json").read_text())
        config["eos_token_id"] = config_eos
        (folder / "config.json").write_text(json.dumps(config))
    tok = AutoTokenizer.from_pretrained(folder)
    hf_loop = models.eos_ids(tok, models.load_model(str(folder)))  # TeacherSampler's HF branch
    assert savegrad_holdout.teacher_stop_ids(tok, str(folder)) == hf_loop
    extra = [] if config_eos is None else [config_eos] if isinstance(config_eos, int) else config_eos
    assert hf_loop == sorted({tok.eos_token_id, *extra})


def test_holdout_is_the_tail_of_the_shuffle(dapo_parquet):
    cfg = SaveGradConfig(dataset_path=str(dapo_parquet), holdout_fraction=0.3, subset_size=-1)
    shuffled = prompts.load_prompts(str(dapo_parquet), seed=cfg.seed)  # as whitebox draws its prompts
    assert (
        list(savegrad_holdout.holdout_prompts(cfg)["answer"]) == list(shuffled["answer"])[-4:]
    )  # round(12 x 0.3)
    tiny_holdout = savegrad_holdout.holdout_prompts(SaveGradConfig(subset_size=50))
    assert (
        tiny_holdout["messages"] != task.TinyTask().load_prompts("tiny", subset_size=50, seed=42)["messages"]
    )
    with pytest.raises(ConfigError, match="holdout .* is empty"):
        savegrad_holdout.holdout_prompts(
            SaveGradConfig(dataset_path=str(dapo_parquet), holdout_fraction=0.01)
        )


def test_system_prompt_comes_first():
    prep = savegrad.prepare("tiny", {"subset_size": 2, "system_prompt": "Add."})
    assert prep.train_messages[0][0] == {"role": "system", "content": "Add."}


def test_presets_resolve():
    for mode in ("tiny", "full", "ads-paper"):
        cfg = load_config(SaveGradConfig, mode)
        assert cfg.trace_temperature == 0.0
    ads = load_config(SaveGradConfig, "ads-paper")
    assert (ads.max_prompt_length, ads.max_length, ads.holdout_fraction) == (512, 1024, 0.3)
    assert "\\boxed{ANSWER}" in ads.system_prompt


def test_norms_by_layer():
    norms = {
        "model.embed_tokens.weight": 3.0,
        "model.layers.0.a.weight": 3.0,
        "model.layers.0.b.weight": 4.0,
        "model.layers.10.a.weight": 1.0,
        "model.norm.weight": 2.0,
        "lm_head.weight": 1.0,
    }
    assert gradient.norms_by_layer(norms) == {
        "model.embed_tokens": 3.0,
        "model.layers.0": 5.0,
        "model.layers.10": 1.0,
        "model.norm": 2.0,
        "lm_head": 1.0,
    }


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_notebook_runs(tmp_path, monkeypatch):
    import papermill

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the kernel's torch: one thread on a shared CPU
    run_dir = tmp_path / "run"
    papermill.execute_notebook(
        str(REPO / "notebooks" / "01_save_grad.ipynb"),
        str(tmp_path / "out.ipynb"),
        parameters={"run_dir": str(run_dir)},
        kernel_name="python3",
        cwd=str(REPO / "notebooks"),
        progress_bar=False,
    )
    for name in ("grads.safetensors", "grads.json", "traces", "summary.json", "config.yaml"):
        assert (run_dir / name).exists(), name
    assert {p.name for p in (run_dir / "figures").iterdir()} >= {
        "completion_lengths.png",
        "grad_norm_by_layer.png",
    }
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "done"


def test_head_cross_entropy_matches_autograd_in_every_chunk(monkeypatch):
    """The fused head cross-entropy against autograd on full logits, with chunks of 3 rows and an
    upstream gradient that is not 1."""
    monkeypatch.setattr(gradient, "_CHUNK_BYTES", 3 * 4 * 11)
    gen = torch.Generator().manual_seed(3)
    hidden_NH = torch.randn(8, 5, generator=gen, dtype=torch.float64).requires_grad_()
    weight_VH = torch.randn(11, 5, generator=gen, dtype=torch.float64).requires_grad_()
    targets_N, row_weight_N = (
        torch.randint(0, 11, (8,), generator=gen),
        torch.rand(8, generator=gen, dtype=torch.float64),
    )
    loss_N, loss = gradient._HeadCrossEntropy.apply(hidden_NH, weight_VH, targets_N, row_weight_N)
    expected_N = F.cross_entropy(hidden_NH @ weight_VH.T, targets_N, reduction="none")
    expected = torch.autograd.grad(2.5 * (expected_N * row_weight_N).sum(), (hidden_NH, weight_VH))
    (2.5 * loss).backward()
    torch.testing.assert_close(loss_N, expected_N.detach())
    assert not loss_N.requires_grad
    torch.testing.assert_close(hidden_NH.grad, expected[0])
    torch.testing.assert_close(weight_VH.grad, expected[1])


def test_heads_that_are_not_plain_use_full_logits(rows, monkeypatch):
    model = _proxy()
    assert gradient.plain_head(model)
    monkeypatch.setattr(gradient, "plain_head", lambda m: False)
    named, _ = gradient.mean_completion_grad(model, rows, "token", 4, pad_token_id=0)
    assert _rel_err(named, _reference(_proxy(), rows, "token")) <= TOL
