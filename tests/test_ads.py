"""Antidistillation sampling (opdkit.ads) and the 04_antidistill job: the finite difference against the exact
JVP, λ = 0 as plain sampling, KV-cached proxies against recomputation, fp32 perturbations, the sign of the
ADS term measured on the proxy itself, the gradient checks, and a small trade-off run end to end."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from opdkit.jobs.antidistill.lens import TokenLens
from transformers import AutoModelForCausalLM, LogitsProcessorList

from opdkit import models, tasks, tiny
from opdkit.ads import gradfile, gradient, sampler
from opdkit.ads.direction import JVP, Direction, FiniteDifference, make_direction, rounded_away_fraction
from opdkit.ads.sampler import ADSLogitsProcessor, ads_processors, ads_sample
from opdkit.config import ConfigError, load_config
from opdkit.data import traces
from opdkit.data.labels import IGNORE, completion_labels
from opdkit.jobs import antidistill, savegrad
from opdkit.jobs.antidistill import figures, report, steering, students
from opdkit.jobs.antidistill import points as ad_points
from opdkit.jobs.antidistill import sweep as ad_sweep
from opdkit.jobs.antidistill.config import AntidistillConfig
from opdkit.rollout import sampling
from opdkit.tasks import tiny as task

REPO = Path(__file__).resolve().parent.parent


def _model(name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny.resolve(name), dtype=dtype).eval()


@pytest.fixture(scope="module")
def grads_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real 01_save_grad run: the tiny teacher's greedy traces for 48 holdout prompts, the proxy's
    gradient."""
    path = tmp_path_factory.mktemp("ads") / "grads"
    savegrad.run("tiny", {"run_dir": str(path), "subset_size": 48})
    return path


@pytest.fixture(scope="module")
def tok():
    return models.load_tokenizer("tiny:teacher")


@pytest.fixture(scope="module")
def proxy() -> torch.nn.Module:
    return _model("tiny:student")


@pytest.fixture(scope="module")
def teacher() -> torch.nn.Module:
    return _model("tiny:teacher")


@pytest.fixture(scope="module")
def g(grads_run, proxy, tok) -> dict[str, torch.Tensor]:
    return gradfile.load_grads(grads_run, proxy, tok)


def _prompts(tok, n: int = 6, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of different lengths (1- to 3-digit problems), so padding is exercised."""
    probs = [task.problems(1, seed + i, n_digits=1 + i % 3)[0] for i in range(n)]
    return sampling.encode_prompts(tok, [[{"role": "user", "content": p.prompt}] for p in probs])


def _rollout(teacher, tok, seed: int = 0) -> sampling.Rollout:
    ids, mask = _prompts(tok)
    torch.manual_seed(seed)
    return sampling.sample(
        teacher,
        ids,
        mask,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_new_tokens=task.MAX_COMPLETION_TOKENS,
    )


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("eps,tol", [(1e-3, 2e-3), (1e-2, 2e-2)])
def test_finite_difference_matches_the_exact_jvp(teacher, proxy, g, tok, eps, tol):
    r = _rollout(teacher, tok)
    fd = FiniteDifference(proxy, g, eps).full(r.input_ids_BT, r.attention_mask_BT)
    exact = JVP(proxy, g).full(r.input_ids_BT, r.attention_mask_BT)
    real = r.attention_mask_BT.bool()
    assert exact[real].abs().max() > 1.0  # a direction that moves the logits, not a trivial zero
    assert _rel_err(fd[real], exact[real]) < tol


def test_jvp_is_the_directional_derivative_autograd_gives(proxy, g, tok):
    """Δ_v = g·∇θ z_v, by reverse mode on one prefix, against the JVP."""
    ids, mask = _prompts(tok, 1)
    exact = JVP(proxy, g).full(ids, mask)[0, -1]
    model = copy.deepcopy(proxy)
    for v in (5, 17, 40):
        model.zero_grad()
        model(input_ids=ids, attention_mask=mask).logits[0, -1, v].backward()
        dot = sum((p.grad * g[n]).sum() for n, p in model.named_parameters())
        assert float(dot) == pytest.approx(float(exact[v]), rel=1e-4, abs=1e-4)


class _Recorder:
    """A Direction that records what it returns at every step of a generate call."""

    def __init__(self, inner: Direction):
        self.inner, self.deltas = inner, []

    def start(self, ids, mask):
        self.deltas = [self.inner.start(ids, mask)]
        return self.deltas[-1]

    def step(self, new):
        self.deltas.append(self.inner.step(new))
        return self.deltas[-1]

    def full(self, ids, mask):
        return self.inner.full(ids, mask)


@pytest.mark.parametrize("method", ["fd", "jvp"])
def test_cached_steps_give_the_delta_of_a_full_recomputation(teacher, proxy, g, tok, method):
    """Inside generate, with left-padded prompts: each step's Δ equals Δ recomputed on the whole prefix."""
    direction = make_direction(method, proxy, g, 1e-2)
    rec = _Recorder(direction)
    ids, mask = _prompts(tok)
    torch.manual_seed(0)
    r = ads_sample(
        teacher,
        ids,
        mask,
        direction=rec,
        lam=0.05,
        temperature=1.0,
        top_p=1.0,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_new_tokens=40,
    )
    full = direction.full(r.input_ids_BT, r.attention_mask_BT)
    P = r.prompt_len
    assert len(rec.deltas) >= 10
    for k, d in enumerate(rec.deltas):
        # the step predicting completion token k saw the prompt and tokens < k; rows already past their EOS
        # were fed padding by generate and are not part of any trace
        live = torch.ones(len(d), dtype=torch.bool) if k == 0 else r.completion_mask_BC[:, k - 1].bool()
        torch.testing.assert_close(d[live], full[live, P - 1 + k], rtol=1e-4, atol=2e-3)


def test_lambda_zero_is_plain_sampling_token_for_token(teacher, proxy, g, tok):
    ids, mask = _prompts(tok)
    kwargs = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_new_tokens=40)
    torch.manual_seed(7)
    plain = sampling.sample(teacher, ids, mask, temperature=1.3, top_p=0.9, **kwargs)
    torch.manual_seed(7)
    zero = ads_sample(
        teacher,
        ids,
        mask,
        direction=FiniteDifference(proxy, g),
        lam=0.0,
        temperature=1.3,
        top_p=0.9,
        **kwargs,
    )
    assert torch.equal(plain.input_ids_BT, zero.input_ids_BT)
    torch.manual_seed(7)
    steered = ads_sample(
        teacher,
        ids,
        mask,
        direction=FiniteDifference(proxy, g),
        lam=0.3,
        temperature=1.3,
        top_p=0.9,
        **kwargs,
    )
    assert not torch.equal(plain.input_ids_BT, steered.input_ids_BT)


def test_the_ads_term_comes_before_temperature_and_top_p(proxy, g, tok):
    """The processor chain gives top_p((z + λΔ) / τ), the reference's order."""
    ids, mask = _prompts(tok, 3)
    direction = FiniteDifference(proxy, g)
    delta = FiniteDifference(proxy, g).start(ids, mask)
    scores = torch.randn(3, delta.shape[-1]) * 3
    got = ads_processors(direction, 0.2, mask, temperature=0.7, top_p=0.8)(ids, scores)
    want = (scores + 0.2 * delta) / 0.7
    keep = torch.isfinite(got)
    assert keep.any(dim=1).all() and (~keep).any()  # top-p cut something, kept something
    torch.testing.assert_close(got[keep], want[keep])
    sorted_p = want.softmax(-1).sort(dim=-1, descending=True)
    # what was kept is the smallest prefix of the sorted distribution reaching 0.8
    for b in range(3):
        n = int(keep[b].sum())
        assert sorted_p.values[b, : n - 1].sum() < 0.8 <= sorted_p.values[b, :n].sum() + 1e-6


def test_processor_refuses_a_second_batch(proxy, g, tok):
    ids, mask = _prompts(tok, 2)
    proc = ADSLogitsProcessor(FiniteDifference(proxy, g), 0.1, mask)
    proc(ids, torch.zeros(2, len(tok)))
    with pytest.raises(RuntimeError, match="new processor for each batch"):
        proc(torch.cat([ids, ids[:, :3]], dim=1), torch.zeros(2, len(tok)))


def test_perturbations_are_kept_in_fp32_even_for_a_bf16_proxy(g):
    bf16 = _model("tiny:student", torch.bfloat16)
    eps = 1e-2
    fd = FiniteDifference(bf16, g, eps)
    name = "model.layers.0.mlp.down_proj.weight"
    plus, minus = dict(fd.plus.model.named_parameters())[name], dict(fd.minus.model.named_parameters())[name]
    base = dict(bf16.named_parameters())[name].float()
    assert plus.dtype == minus.dtype == torch.float32
    torch.testing.assert_close(plus - minus, 2 * eps * g[name], rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(plus - base, eps * g[name], rtol=1e-3, atol=1e-6)
    # why: stored in bf16, most of θ + εg would round back to θ (the ADS reference keeps fp16 copies)
    assert rounded_away_fraction(base, eps * g[name], torch.bfloat16) > 0.5
    assert rounded_away_fraction(base, eps * g[name], torch.float32) < 0.01


def test_gradient_that_does_not_fit_the_proxy_is_refused(grads_run, tok, g):
    with pytest.raises(gradfile.GradsMismatch, match="does not fit this model"):
        gradfile.load_grads(grads_run, _model("tiny:teacher"), tok)
    with pytest.raises(ValueError, match="does not fit the proxy"):
        FiniteDifference(_model("tiny:teacher"), g)


def test_job_checks_the_gradient_before_writing_anything(grads_run, tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(gradfile.GradsMismatch):
        antidistill.run(
            "tiny", {"grads_run": str(grads_run), "proxy_model": "tiny:teacher", "run_dir": str(run_dir)}
        )
    assert not run_dir.exists()
    with pytest.raises(FileNotFoundError, match="grads.safetensors"):
        antidistill.prepare("tiny", {"grads_run": str(tmp_path)})
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in (gradfile.GRADS_FILE, gradfile.META_FILE):
        (bare / name).write_bytes((grads_run / name).read_bytes())
    with pytest.raises(ConfigError, match="answer_lams needs the traces"):
        antidistill.prepare("tiny", {"grads_run": str(bare)})
    antidistill.prepare("tiny", {"grads_run": str(bare), "answer_lams": []})


def _holdout_loss(model: torch.nn.Module, rows: list[dict], pad: int) -> float:
    """The proxy's mean-over-traces completion NLL: the loss whose gradient 01_save_grad saved."""
    with torch.no_grad():
        batch = next(gradient.make_batches(rows, list(range(len(rows))), len(rows), pad, "cpu"))
        loss_sum, n = gradient.token_losses(model, batch)
        return float((loss_sum / n).mean())


def test_positive_lambda_makes_a_distillation_step_raise_the_holdout_loss(grads_run, proxy, teacher, g, tok):
    """The sign, measured: one small SGD step of the proxy on a token v changes its held-out loss by about
    η(Δ_v − E_p[Δ]); so the expected change under ADS sampling (λ > 0) exceeds plain sampling's, and λ < 0
    lowers it."""
    rows = [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in traces.load_traces(grads_run)]
    base = _holdout_loss(proxy, rows, tok.pad_token_id)
    r = _rollout(teacher, tok, seed=1)
    eta, checked = 1e-4, 0
    for b, cut in ((2, 5), (4, 9)):
        T = r.prompt_len + cut
        ids, mask = r.input_ids_BT[b : b + 1, :T], r.attention_mask_BT[b : b + 1, :T]
        pos = sampling.position_ids_from_mask(mask)
        delta = JVP(proxy, g).full(ids, mask)[0, -1]
        change = torch.empty(len(tok))
        for v in range(len(tok)):  # the whole vocabulary: the expectations below are exact, not sampled
            model = copy.deepcopy(proxy)
            logp = (
                model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[0, -1].log_softmax(-1)[v]
            )
            step = torch.autograd.grad(logp, list(model.parameters()))
            with torch.no_grad():
                for p, s in zip(model.parameters(), step):
                    p.add_(s, alpha=eta)  # θ' = θ + η∇log p(v): a step on the distillation loss −log p(v)
            change[v] = (_holdout_loss(model, rows, tok.pad_token_id) - base) / eta
        with torch.no_grad():
            p_proxy = proxy(input_ids=ids, attention_mask=mask, position_ids=pos).logits[0, -1].softmax(-1)
            z = teacher(input_ids=ids, attention_mask=mask, position_ids=pos).logits[0, -1]
        predicted = delta - (p_proxy * delta).sum()
        assert torch.corrcoef(torch.stack([change, predicted]))[0, 1] > 0.9
        expected = {lam: float(((z + lam * delta).softmax(-1) * change).sum()) for lam in (-0.1, 0.0, 0.1)}
        assert expected[0.1] > expected[0.0] > expected[-0.1]
        checked += 1
    assert checked == 2


def test_sweeps_parse_and_points_run_once():
    cfg = load_config(
        AntidistillConfig,
        "tiny",
        {
            "lams": "0, 0.05,0.1",
            "answer_lams": [0, 0.02],
            "ads_temperatures": [1.0],
            "temperatures": [1.0, 1.5],
        },
    )
    assert cfg.lams == [0.0, 0.05, 0.1]
    points = ad_sweep.sweep_points(cfg)
    assert [p.name for p in points] == [
        "temperature-lam0-tau1",
        "ads-lam0.05-tau1",
        "ads-lam0.1-tau1",
        "ads-answer-lam0.02-tau1",
        "temperature-lam0-tau1.5",
    ]
    assert [p.gradient for p in points] == [None, "completion", "completion", "answer", None]
    with pytest.raises(ConfigError, match="list of numbers"):
        load_config(AntidistillConfig, "tiny", {"lams": "a,b"})
    with pytest.raises(ConfigError, match="all empty"):
        AntidistillConfig(lams=[], answer_lams=[], temperatures=[])


def test_shared_vocab_check(tok, qwen3_tokenizer):
    models.check_shared_vocab(tok, tok)
    with pytest.raises(ConfigError, match="shares the teacher's tokenizer"):
        models.check_shared_vocab(tok, qwen3_tokenizer)


def test_batch_order_covers_every_trace_each_epoch():
    order = students.batch_order(10, 4, 5, seed=0)
    flat = [i for step in order for i in step]
    assert len(order) == 5 and all(len(s) == 4 for s in order)
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))


SMALL_SWEEP = {
    "subset_size": 24,
    "eval_size": 16,
    "sft_max_steps": 3,
    "sft_batch_size": 8,
    "sft_micro_batch_size": 3,
    "lams": [0.0, 0.2],
    "answer_lams": [0.1],
    "temperatures": [1.5],
    "repeats": 2,
}


@pytest.fixture(scope="module")
def small_run(grads_run, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tradeoff") / "run"
    over = {
        "run_dir": str(run_dir),
        "grads_run": str(grads_run),
        **SMALL_SWEEP,
    }
    return antidistill.run("tiny", over)


def test_small_tradeoff_run_writes_every_point(small_run):
    summary = small_run.read_summary()
    points = summary["points"]
    assert [(p["method"], p["lam"], p["temperature"]) for p in points] == [
        ("temperature", 0.0, 1.0),
        ("ads", 0.2, 1.0),
        ("ads-answer", 0.1, 1.0),
        ("temperature", 0.0, 1.5),
    ]
    for p in points:
        assert set(p) >= {"method", "lam", "temperature", "teacher_accuracy", "student_accuracy", "runs"}
        assert [r["seed"] for r in p["runs"]] == [42, 43]
        assert p["student_accuracy"] == pytest.approx(sum(r["student_accuracy"] for r in p["runs"]) / 2)
        forced = [r["student_accuracy_forced"] for r in p["runs"]]  # raw and forced, as the reference
        assert all(0 <= f <= 1 for f in forced) and p["student_accuracy_forced"] == pytest.approx(
            sum(forced) / 2
        )
        for r in p["runs"]:
            traces = (small_run.path / "points" / p["name"] / f"seed{r['seed']}" / "traces.jsonl").read_text()
            records = [json.loads(line) for line in traces.splitlines()]
            assert len(records) == 24
            assert r["teacher_accuracy"] == sum(x["correct"] for x in records) / 24
    assert (
        0 <= summary["student_accuracy_before"] <= 1 and 0 <= summary["student_accuracy_before_forced"] <= 1
    )
    assert "<th>student_accuracy_forced</th>" in report.summary_table_html(summary)
    # the student before distillation is the proxy: its held-out loss is the one 01_save_grad reported
    assert summary["student_holdout_loss_before"] == pytest.approx(
        gradfile.read_meta(summary["grads_run"])["loss"], rel=1e-5
    )
    assert all(r["student_holdout_loss"] > 0 for p in points for r in p["runs"])
    report.figures(small_run)  # the job computes; its report draws
    assert (small_run.path / "figures" / "tradeoff_holdout_loss.png").stat().st_size > 1000
    assert (small_run.path / "figures" / "tradeoff.png").stat().st_size > 1000
    assert (small_run.path / "grads").exists() is False  # grads_run given: nothing recomputed


def test_teacher_accuracy_is_checked_against_the_answer(small_run):
    traces = small_run.path / "points" / "temperature-lam0-tau1" / "seed42" / "traces.jsonl"
    for rec in map(json.loads, traces.read_text().splitlines()):
        a, b = map(int, rec["messages"][-1]["content"].split("+"))
        assert rec["correct"] == (task.extract_answer(rec["completion"]) == str(a + b))


def test_resume_reuses_finished_points(small_run, grads_run):
    before = small_run.read_summary()["points"]
    over = {
        "run_dir": str(small_run.path),
        "grads_run": str(grads_run),
        **SMALL_SWEEP,
        "resume": True,
    }
    again = antidistill.run("tiny", over).read_summary()["points"]
    assert [p["runs"] for p in again] == [p["runs"] for p in before]


def test_resume_reuses_a_points_complete_traces(small_run, grads_run, monkeypatch):
    """A point killed after its traces were written: resume distils its student on those traces (the teacher
    writes nothing) to the result an unbroken run had; traces that do not fit the run are written again."""
    entry = small_run.read_summary()["points"][1]
    folder = small_run.path / "points" / entry["name"]
    run_folder = folder / "seed43"
    old = json.loads((run_folder / "result.json").read_text())
    (run_folder / "result.json").unlink()
    (folder / "point.json").unlink()

    def no_teacher(*args, **kwargs):
        raise AssertionError("resume wrote the traces again")

    monkeypatch.setattr(ad_points, "write_traces", no_teacher)
    over = {"run_dir": str(small_run.path), "grads_run": str(grads_run), **SMALL_SWEEP, "resume": True}
    again = antidistill.run("tiny", over).read_summary()["points"][1]["runs"][1]
    assert {k: v for k, v in again.items() if k != "seconds"} == {
        k: v for k, v in old.items() if k != "seconds"
    }
    prep = antidistill.prepare("tiny", over)
    assert ad_points.saved_traces(run_folder / ad_points.TRACES_FILE, prep) is not None
    prep.train_messages = prep.train_messages[:-1]
    assert ad_points.saved_traces(run_folder / ad_points.TRACES_FILE, prep) is None


def test_token_lens_marks_exactly_the_tokens_ads_moved(small_run):
    lens = TokenLens(small_run, num_prompts=3)
    same = lens.compare(0, 0.0, seed=1)
    assert not any(t["changed"] for t in same["tokens"])
    assert same["completion"] == same["plain_completion"]
    moved = lens.compare(0, 0.5, seed=1)
    assert lens.compare(0, 0.1, seed=1, method="ads-answer")["method"] == "ads-answer"
    first = next(i for i, t in enumerate(moved["tokens"]) if t["changed"])
    # up to the first change the two traces are the same tokens, drawn with the same noise
    assert moved["completion"].startswith("".join(t["text"] for t in moved["tokens"][:first]))
    assert moved["plain_completion"].startswith("".join(t["text"] for t in moved["tokens"][:first]))
    html = figures.token_changes_html(moved)
    assert "plain sampling drew" in html
    fig = figures.token_changes_figure([same, moved])
    assert fig.axes


def test_coupled_sampling_at_lambda_zero_is_a_sample_of_the_teacher(teacher, tok):
    """Gumbel-max with shared noise: at λ 0 both draws agree, and the trace is a valid completion."""
    ids = sampling.encode_prompts(tok, [[{"role": "user", "content": "123+456"}]])[0][0].tolist()
    steps = sampler.coupled_sample(
        teacher,
        None,
        ids,
        lam=0.0,
        temperature=1.0,
        top_p=1.0,
        eos_token_id=tok.eos_token_id,
        max_new_tokens=40,
        seed=0,
    )
    assert all(s["token"] == s["plain_token"] for s in steps)
    assert steps[-1]["token"] == tok.eos_token_id
    assert task.extract_answer(tok.decode([s["token"] for s in steps], skip_special_tokens=True)) is not None


def test_processor_chain_is_empty_for_plain_greedy():
    assert len(ads_processors(None, 0.0, torch.ones(1, 3), temperature=0.0, top_p=0.5)) == 0
    assert isinstance(ads_processors(None, 0.0, torch.ones(1, 3), 1.0, 1.0), LogitsProcessorList)
    with pytest.raises(ValueError, match="needs a direction"):
        ads_processors(None, 0.1, torch.ones(1, 3), 1.0, 1.0)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_notebook_runs_headless(tmp_path, monkeypatch, grads_run):
    import papermill

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    run_dir = tmp_path / "run"
    params = {
        "run_dir": str(run_dir),
        "grads_run": str(grads_run),
        "subset_size": 64,
        "eval_size": 40,
        "sft_max_steps": 20,
        "lams": [0.0, 0.1],
        "answer_lams": [0.03],
        "temperatures": [1.4],
    }
    papermill.execute_notebook(
        str(REPO / "notebooks" / "04_antidistill.ipynb"),
        str(tmp_path / "out.ipynb"),
        parameters=params,
        kernel_name="python3",
        cwd=str(REPO / "notebooks"),
        progress_bar=False,
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [(p["method"], p["lam"], p["temperature"]) for p in summary["points"]] == [
        ("temperature", 0.0, 1.0),
        ("ads", 0.1, 1.0),
        ("ads-answer", 0.03, 1.0),
        ("temperature", 0.0, 1.4),
    ]
    for fig in ("tradeoff", "tradeoff_holdout_loss", "ads_tokens"):
        assert (run_dir / "figures" / f"{fig}.png").stat().st_size > 1000, fig


def test_gap_compares_ads_with_temperature_at_equal_teacher_accuracy():
    pts = [
        {
            "name": "t1",
            "method": "temperature",
            "lam": 0.0,
            "temperature": 1.0,
            "teacher_accuracy": 0.9,
            "student_accuracy": 0.8,
        },
        {
            "name": "t2",
            "method": "temperature",
            "lam": 0.0,
            "temperature": 1.5,
            "teacher_accuracy": 0.5,
            "student_accuracy": 0.4,
        },
        {
            "name": "a1",
            "method": "ads",
            "lam": 0.1,
            "temperature": 1.0,
            "teacher_accuracy": 0.7,
            "student_accuracy": 0.5,
        },
        {
            "name": "a2",
            "method": "ads",
            "lam": 0.2,
            "temperature": 1.0,
            "teacher_accuracy": 0.3,
            "student_accuracy": 0.1,
        },
    ]
    summary = {"points": pts, "student_accuracy_before": 0.2}
    got = {g["name"]: g for g in report.gaps(summary)}
    assert got["a1"]["temperature_student_accuracy"] == pytest.approx(0.6)
    assert got["a1"]["gap"] == pytest.approx(-0.1)
    assert got["a2"]["gap"] is None  # below the temperature sweep's range: no extrapolation
    text = report.explain(summary)
    assert "10.0 points lower" in text and "no comparison" in text and "mean gap -10.0 points" in text
    assert [c["temperature"] for c in figures.tradeoff_curves(summary)["temperature"]] == [1.0, 1.5]
    assert [c["lam"] for c in figures.tradeoff_curves(summary)["ADS (τ=1)"]] == [0.0, 0.1, 0.2]


@pytest.mark.parametrize("method", ["fd", "jvp"])
def test_directions_move_between_devices_unchanged(proxy, g, tok, method):
    ids, mask = _prompts(tok, 2)
    direction = make_direction(method, proxy, g, 1e-2)
    before = direction.start(ids, mask)
    torch.testing.assert_close(direction.to("cpu").start(ids, mask), before)


def test_holdout_loss_is_skipped_without_the_gradients_traces(tmp_path, tok):
    cfg = load_config(AntidistillConfig, "tiny")
    assert students.holdout_rows(tmp_path, tok, cfg) == []
    assert students.holdout_loss(_model("tiny:student"), [], tok.pad_token_id, 8) is None


def test_answer_labels_keep_exactly_the_answer(tok):
    cfg = load_config(AntidistillConfig, "tiny")
    text = "8+7=15,5+6+1=12,3+4+1=8;825"
    messages = [{"role": "user", "content": "358+467"}, {"role": "assistant", "content": text}]
    ids, labels = completion_labels(tok, messages)
    kept = steering.answer_labels(tok, ids, labels, tasks.for_dataset(cfg.dataset_path).answer_start(text))
    assert tok.decode([t for t in kept if t != IGNORE]) == "825" + tok.eos_token
    assert tasks.for_dataset(cfg.dataset_path).answer_start("no answer here") is None
    other = load_config(
        AntidistillConfig, "tiny", {"dataset_path": "x.parquet", "eval_dataset_path": "y.parquet"}
    )
    assert tasks.for_dataset(other.dataset_path).answer_start("so \\boxed{12}.") == 3


def test_answer_gradient_is_saved_and_differs_from_the_completion_gradient(small_run, g, tok, proxy):
    answer = gradfile.load_grads(small_run.path / "grads_answer", proxy, tok)
    meta = gradfile.read_meta(small_run.path / "grads_answer")
    assert meta["tokens"] == "answer" and meta["normalization"] == "trace"
    cos = sum((answer[k] * g[k]).sum() for k in g) / (gradient.global_norm(answer) * gradient.global_norm(g))
    assert 0.1 < float(cos) < 0.95  # related (the answer is part of the completion), not the same
    assert set(small_run.read_summary()["grad_norms"]) == {"completion", "answer"}


def test_error_kinds_tell_a_slip_from_a_contradiction():
    assert task.implied_answer("8+7=15,5+6+1=12,3+4+1=8;825") == "825"
    assert task.implied_answer("9+9=18,9+1+1=11,5+5+1=11;1118") == "1118"
    assert task.implied_answer("8+7=1x;825") is None
    recs = [
        {"completion": "8+7=15,5+6+1=12,3+4+1=8;825", "correct": True},  # right
        {"completion": "8+7=15,5+6+1=13,3+4+1=8;835", "correct": False},  # a slip carried through
        {"completion": "8+7=15,5+6+1=12,3+4+1=8;826", "correct": False},  # answer contradicts the working
        {"completion": "8+7=15;", "correct": False},
    ]
    assert tasks.get_task("tiny").error_kinds(recs) == {"slip": 0.25, "contradiction": 0.5}
