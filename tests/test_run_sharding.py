"""FSDP2 for white-box OPD, run as on GPUs but with 2 gloo processes on CPU: the first update against
one unsharded process and against a direct computation with TRL's loss, the lm_head weight the loss
sees, clipping, checkpoints, the saved model, resume; and the redirection helper on its own."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import FIXED, assert_grads_close, direct_gradient, run_tiny
from transformers import AutoModelForCausalLM, TrainerCallback

from opdkit import memory
from opdkit.config import ConfigError, available_modes, load_config
from opdkit.jobs.whitebox.config import WhiteboxConfig
from opdkit.opd.callbacks import GradientDump
from opdkit.run import sharding

TESTS = Path(__file__).resolve().parent
# Clipping on (the tiny step-1 norm is ~13), two steps, a checkpoint after each.
CLIPPED = {**FIXED, "max_grad_norm": 1.0, "max_steps": 2, "checkpoint_every": 1}


class ReshardAfterEveryForward(TrainerCallback):
    """accelerate keeps the embedding/final-norm/lm_head group unsharded after forward, so a loss that
    reads `lm_head.weight` after the model's forward happens to see the full weight there. FSDP2 can
    reshard every group after every forward; then any read outside the forward sees a shard."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        model.set_reshard_after_forward(True, recurse=True)


class ShardingProbe(TrainerCallback):
    """Writes `<path>.rank<k>.json`: what was sharded, and the student head weight as the loss saw it
    (recorded by `spy_on_head_weight`) and as it is between steps, outside any forward."""

    seen_in_loss: list = []
    teacher_seen_in_loss: list = []
    teachers: list = []  # what `shard_frozen` sharded (recorded by `spy_on_head_weight`)

    def __init__(self, path: str):
        self.path, self.between_steps = path, []

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        self.wrapped = sorted({type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule)})
        self.all_dtensor = all(isinstance(p, DTensor) for p in model.parameters())
        self.checkpointing = bool(getattr(model, "is_gradient_checkpointing", False))
        self.teacher = {}
        for teacher in ShardingProbe.teachers:
            optimized = {id(p) for g in optimizer.param_groups for p in g["params"]}
            self.teacher = dict(
                wrapped=sorted({type(m).__name__ for m in teacher.modules() if isinstance(m, FSDPModule)}),
                all_dtensor=all(isinstance(p, DTensor) for p in teacher.parameters()),
                frozen=not any(p.requires_grad for p in teacher.parameters()),
                optimized=any(id(p) in optimized for p in teacher.parameters()),
                head=_describe(teacher.get_output_embeddings().weight),
            )

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.between_steps.append(_describe(model.get_output_embeddings().weight))

    def on_train_end(self, args, state, control, **kwargs):
        record = dict(
            wrapped=self.wrapped,
            all_dtensor=self.all_dtensor,
            checkpointing=self.checkpointing,
            between_steps=self.between_steps,
            in_loss=ShardingProbe.seen_in_loss,
            teacher=self.teacher,
            teacher_in_loss=ShardingProbe.teacher_seen_in_loss,
        )
        Path(f"{self.path}.rank{args.process_index}.json").write_text(json.dumps(record))


def _describe(weight: torch.Tensor) -> dict:
    from torch.distributed.tensor import DTensor

    local = weight.to_local() if isinstance(weight, DTensor) else weight
    return {"dtensor": isinstance(weight, DTensor), "local_rows": local.shape[0]}


def spy_on_head_weight() -> None:
    """Record both head weights every call of the trainer's divergence receives, and what the trainer
    shards with `shard_frozen` (the teacher)."""
    import opdkit.opd.teachers.local

    real, real_shard = opdkit.opd.teachers.local.chunked_divergence, sharding.shard_frozen

    def spy(s_hidden_NH, s_head_VH, t_hidden_NH, t_head_VH, **kwargs):
        ShardingProbe.seen_in_loss.append(_describe(s_head_VH))
        ShardingProbe.teacher_seen_in_loss.append(_describe(t_head_VH))
        return real(s_hidden_NH, s_head_VH, t_hidden_NH, t_head_VH, **kwargs)

    def shard_spy(model):
        ShardingProbe.teachers.append(model)
        return real_shard(model)

    opdkit.opd.teachers.local.chunked_divergence = spy
    sharding.shard_frozen = shard_spy


def run_two_fsdp_processes(
    tmp_path: Path, name: str, overrides: dict, reshard_everything: bool = True
) -> Path:
    """A 2-process gloo run with parallelism fsdp in a fresh interpreter, with a gradient dump at
    step 1 (`<name>.pt`) and the sharding probe (`<name>.rank<k>.json`)."""
    out = tmp_path / name
    over = {**overrides, "run_dir": str(out), "num_processes": 2, "parallelism": "fsdp"}
    script = textwrap.dedent(f"""
        import sys, torch; torch.set_num_threads(1)
        sys.path.insert(0, {str(TESTS)!r})
        from test_run_sharding import ReshardAfterEveryForward, ShardingProbe, spy_on_head_weight
        from opdkit.jobs import whitebox
        from opdkit.opd.callbacks import GradientDump
        spy_on_head_weight()
        callbacks = [GradientDump({str(out) + ".pt"!r}), GradientDump({str(out) + ".2.pt"!r}, at_step=2),
                     ShardingProbe({str(out)!r})]
        if {reshard_everything!r}:
            callbacks.append(ReshardAfterEveryForward())
        whitebox.run("tiny", {over!r}, callbacks=callbacks)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def probes(run_path: Path) -> list[dict]:
    return [json.loads(Path(f"{run_path}.rank{r}.json").read_text()) for r in (0, 1)]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> tuple[Path, dict]:
    """The unsharded reference: one process, the same global batch of 4 prompts, plain (ddp) mode."""
    tmp = tmp_path_factory.mktemp("one")
    dump = tmp / "one.pt"
    dump2 = tmp / "one.2.pt"
    callbacks = [GradientDump(str(dump)), GradientDump(str(dump2), at_step=2)]
    run = run_tiny(tmp, "one", callbacks, per_device_train_batch_size=4, **CLIPPED)
    return run.path, torch.load(dump)


def well_conditioned(dumps: list[dict[str, torch.Tensor]], floor: float = 1e-3) -> dict[str, torch.Tensor]:
    """Where AdamW's steps follow the gradient smoothly: every step's |g| above `floor` x its tensor's
    largest.

    AdamW's first steps are about lr * g / (|g| + eps): for an element whose gradient is below the rounding
    noise of its tensor (~1e-7 x the tensor's largest entry when one process sums 4 sequences and two
    processes sum 2 + 2), that is lr times a noisy sign, so the same update computed two ways can differ by
    up to 2 lr there, whatever the tolerance. Elsewhere the two must agree tightly."""
    out = {}
    for name in dumps[0]:
        steady = torch.stack([d[name].abs() > floor * d[name].abs().max() for d in dumps]).all(dim=0)
        untouched = torch.stack([d[name] == 0 for d in dumps]).all(dim=0)  # e.g. embeddings of unseen tokens
        out[name] = steady | untouched
    return out


def assert_adamw_weights_close(two: dict, one: dict, mask: dict, steps: int, lr: float) -> None:
    for name, w_one in one.items():
        # A tied head is one tensor with the embedding, dumped under one of the two names.
        m = (
            mask[name]
            if name in mask
            else mask["model.embed_tokens.weight" if name == "lm_head.weight" else "lm_head.weight"]
        )
        torch.testing.assert_close(
            two[name][m], w_one[m], rtol=1e-4, atol=1e-6, msg=lambda s, n=name: f"{n}: {s}"
        )
        assert (two[name] - w_one).abs().max() <= 2 * lr * steps * 1.01, name


def test_fsdp_first_update_equals_one_process_and_trl(tmp_path, one_process):
    one_path, one_grads = one_process
    two = run_two_fsdp_processes(tmp_path, "two", {**CLIPPED, "per_device_train_batch_size": 2})
    assert len(list((two / "rollouts").glob("step000001-rank*.pt"))) == 2
    two_grads = torch.load(f"{two}.pt")

    # What was sharded, and which head weight the loss multiplied by.
    vocab = AutoModelForCausalLM.from_pretrained(one_path / "model").get_output_embeddings().weight.shape[0]
    for probe in probes(two):
        assert {"FSDPQwen3DecoderLayer", "FSDPQwen3ForCausalLM"} <= set(probe["wrapped"])
        assert probe["all_dtensor"]
        # Between steps, outside any forward, lm_head.weight is this rank's shard: used there, it breaks.
        assert all(w["dtensor"] and w["local_rows"] < vocab for w in probe["between_steps"])
        # Inside the redirected forward the loss saw the whole, unsharded weight.
        assert probe["in_loss"] and all(
            not w["dtensor"] and w["local_rows"] == vocab for w in probe["in_loss"]
        )

    # Pre-clip gradient norm: a plain float, the same as one process's; clipping applied on both.
    m_two, m_one = (
        json.loads(x)
        for x in (
            (two / "metrics.jsonl").read_text().splitlines()[0],
            (one_path / "metrics.jsonl").read_text().splitlines()[0],
        )
    )
    assert isinstance(m_two["grad_norm"], float) and m_two["clipped"] and m_one["clipped"]
    assert m_two["grad_norm"] == pytest.approx(m_one["grad_norm"], rel=1e-4)
    assert m_two["loss"] == pytest.approx(m_one["loss"], rel=1e-4)

    # The dump is the gradient the optimizer applies (clipped); undo the clip to get the pre-clip one.
    unclip = (m_two["grad_norm"] + 1e-6) / CLIPPED["max_grad_norm"]
    pre_clip = {n: g * unclip for n, g in two_grads.items()}
    assert_grads_close(two_grads, one_grads, rtol=1e-4)
    assert_grads_close(pre_clip, {n: g * unclip for n, g in one_grads.items()}, rtol=1e-4)
    assert_grads_close(pre_clip, direct_gradient(two))

    # Weights after step 1 (checkpoint) and after step 2 (model/): ordinary HF folders, the same weights
    # wherever AdamW's step is well conditioned, within AdamW's bound 2 lr per step elsewhere.
    lr = load_config(WhiteboxConfig, "tiny").learning_rate
    one_dumps = [one_grads, torch.load(one_path.parent / "one.2.pt")]
    for steps, folder in ((1, "checkpoints/checkpoint-1"), (2, "model")):
        sd_two = AutoModelForCausalLM.from_pretrained(two / folder).state_dict()
        sd_one = AutoModelForCausalLM.from_pretrained(one_path / folder).state_dict()
        assert sd_two.keys() == sd_one.keys()
        assert_adamw_weights_close(sd_two, sd_one, well_conditioned(one_dumps[:steps]), steps, lr)
    summary = json.loads((two / "summary.json").read_text())
    assert (summary["steps"], summary["world_size"], summary["status"]) == (2, 2, "done")


@pytest.mark.slow
def test_sharded_teacher_gives_the_replicated_teachers_loss_first_update_and_accuracy(tmp_path, one_process):
    """Under fsdp the teacher is sharded too (weights only, frozen, outside the optimizer); the loss, the
    first update and the teacher's accuracy (decoded in step, 5 prompts over 2 ranks: one repeated) are
    the replicated teacher's in one process."""
    from opdkit.jobs import whitebox
    from opdkit.jobs.whitebox.job import sharded_accuracies
    from opdkit.models import load_model

    one_path, one_grads = one_process
    over = {**CLIPPED, "max_steps": 1, "per_device_train_batch_size": 2, "eval_size": 5}
    two = run_two_fsdp_processes(tmp_path, "teacher", over)
    vocab = AutoModelForCausalLM.from_pretrained(one_path / "model").get_output_embeddings().weight.shape[0]
    for probe in probes(two):
        t = probe["teacher"]
        assert {"FSDPQwen3DecoderLayer", "FSDPQwen3ForCausalLM"} <= set(t["wrapped"]), t
        assert t["all_dtensor"] and t["frozen"] and not t["optimized"]
        assert t["head"]["dtensor"] and t["head"]["local_rows"] < vocab  # a shard outside its forward
        # The divergence got the whole head (a copy taken inside the teacher's forward).
        assert probe["teacher_in_loss"] and all(
            not w["dtensor"] and w["local_rows"] == vocab for w in probe["teacher_in_loss"]
        )

    # Each rank's own record of what it holds (issue 28), from its tensors: half of each model, so the
    # shards add up to the whole and a sharding that silently failed would show.
    held = [json.loads((two / "held" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [h["rank"] for h in held] == [0, 1] and {h["world_size"] for h in held} == {2}
    for role in ("student", "teacher"):
        parts = [h["models"][role] for h in held]
        whole = parts[0]["of_params"]
        assert all(0 < p["params"] < whole for p in parts), parts
        assert sum(p["params"] for p in parts) == whole
        assert sum(p["bytes"] for p in parts) == 4 * whole  # fp32 on CPU
    print("held:", [memory.held_line(h) for h in held])

    m_two, m_one = (json.loads((p / "metrics.jsonl").read_text().splitlines()[0]) for p in (two, one_path))
    grads = torch.load(f"{two}.pt")
    errors = {
        "loss_rel": abs(m_two["loss"] - m_one["loss"]) / abs(m_one["loss"]),
        "grad_max_abs": max((grads[n] - g).abs().max().item() for n, g in one_grads.items()),
        "grad_max_rel": max(
            ((grads[n] - g).abs().max() / g.abs().max()).item() for n, g in one_grads.items() if g.any()
        ),
    }
    sd_two = AutoModelForCausalLM.from_pretrained(two / "model").state_dict()
    sd_one = AutoModelForCausalLM.from_pretrained(one_path / "checkpoints/checkpoint-1").state_dict()
    sd_zero = load_model("tiny:student", torch.float32, "cpu").state_dict()
    errors["update_max_abs"] = max((sd_two[k] - v).abs().max().item() for k, v in sd_one.items())
    errors["update_max_rel"] = errors["update_max_abs"] / max(
        (v - sd_zero[k]).abs().max().item() for k, v in sd_one.items()
    )
    print("sharded teacher vs one process:", errors)
    assert m_two["loss"] == pytest.approx(m_one["loss"], rel=1e-4)
    assert m_two["grad_norm"] == pytest.approx(m_one["grad_norm"], rel=1e-4)
    assert_grads_close(grads, one_grads, rtol=1e-4)
    lr = load_config(WhiteboxConfig, "tiny").learning_rate
    assert_adamw_weights_close(sd_two, sd_one, well_conditioned([one_grads]), 1, lr)

    # The teacher's accuracy decoded in step by the sharded teacher, against the whole teacher here.
    prep = whitebox.prepare("tiny", over)
    teacher = load_model(prep.cfg.teacher_model, torch.float32, "cpu")
    summary = json.loads((two / "summary.json").read_text())
    assert summary["teacher_accuracy"] == sharded_accuracies(teacher, prep, 1, 0, forced=False).raw


@pytest.mark.slow
def test_fsdp_with_accelerates_own_wrapping_gives_the_trl_gradient_and_a_plain_model(tmp_path):
    from safetensors import safe_open

    two = run_two_fsdp_processes(
        tmp_path, "plain", {**FIXED, "per_device_train_batch_size": 2}, reshard_everything=False
    )
    assert_grads_close(torch.load(f"{two}.pt"), direct_gradient(two))
    # model/ is an ordinary, tied Hugging Face folder: no wrapper prefixes, every tensor as trained.
    with safe_open(str(two / "model" / "model.safetensors"), "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    assert not [k for k in saved if "module." in k or "fsdp" in k.lower()], sorted(saved)
    model = AutoModelForCausalLM.from_pretrained(two / "model")
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    for k, v in model.state_dict().items():
        # A tied head may be left out of the file; it is the embedding.
        expected = saved[k] if k in saved else saved["model.embed_tokens.weight"]
        torch.testing.assert_close(v, expected, rtol=0, atol=0)
    if "lm_head.weight" in saved:
        torch.testing.assert_close(
            saved["lm_head.weight"], saved["model.embed_tokens.weight"], rtol=0, atol=0
        )


@pytest.mark.slow
def test_fsdp_gradient_checkpointing_gives_the_same_first_update(tmp_path, one_process):
    _, one_grads = one_process
    over = {
        **CLIPPED,
        "max_steps": 1,
        "checkpoint_every": 0,
        "per_device_train_batch_size": 2,
        "gradient_checkpointing": True,
        "eval_size": 8,
    }
    two = run_two_fsdp_processes(tmp_path, "gc", over)
    assert all(p["checkpointing"] for p in probes(two))
    assert_grads_close(torch.load(f"{two}.pt"), one_grads, rtol=1e-4)
    summary = json.loads((two / "summary.json").read_text())
    assert 0.0 <= summary["student_accuracy_after"] <= 1.0  # evaluated from the saved full model


def test_fsdp_with_a_teacher_of_another_tokenizer_gives_the_one_process_loss_and_first_update(tmp_path):
    """tiny-crosstok's teacher (byte-level BPE) sharded with the student over 2 gloo processes: the step's
    loss is the mean over all its groups (counted across processes), so loss and first gradient are one
    process's with the same global batch of 4 prompts."""
    over = {**FIXED, "teacher_model": "tiny:teacher-bpe", "crosstok_hybrid": True}
    dump = tmp_path / "one.pt"
    one = run_tiny(tmp_path, "one", [GradientDump(str(dump))], per_device_train_batch_size=4, **over)
    two = run_two_fsdp_processes(tmp_path, "two", {**over, "per_device_train_batch_size": 2})
    assert all(p["teacher"]["all_dtensor"] for p in probes(two))  # the BPE teacher is sharded too
    m_one, m_two = (json.loads((p / "metrics.jsonl").read_text().splitlines()[0]) for p in (one.path, two))
    assert m_two["loss"] == pytest.approx(m_one["loss"], rel=1e-4)
    assert m_two["grad_norm"] == pytest.approx(m_one["grad_norm"], rel=1e-4)
    assert_grads_close(torch.load(f"{two}.pt"), torch.load(dump), rtol=1e-4)


@pytest.mark.slow
def test_fsdp_bf16_mixed_precision_stays_close_to_one_process_bf16(tmp_path):
    """bf16 under FSDP also rounds the parameters and the gradient reduction to bf16, so this is a
    closeness check (cosine), not equality: the mixed-precision path runs and stays on course."""
    over = {**FIXED, "bf16": True}
    dump = tmp_path / "one.pt"
    run_tiny(tmp_path, "one", [GradientDump(str(dump))], per_device_train_batch_size=4, **over)
    two = run_two_fsdp_processes(tmp_path, "two", {**over, "per_device_train_batch_size": 2})
    a, b = torch.load(f"{two}.pt"), torch.load(dump)
    assert all(g.dtype == torch.float32 for g in a.values())  # fp32 master weights and gradients
    flat_a, flat_b = (torch.cat([g[n].float().flatten() for n in sorted(g)]) for g in (a, b))
    assert torch.nn.functional.cosine_similarity(flat_a, flat_b, dim=0) > 0.99


@pytest.mark.slow
def test_fsdp_resume_ends_with_the_same_metrics_as_an_unbroken_run(tmp_path):
    over = {
        **FIXED,
        "max_steps": 4,
        "checkpoint_every": 2,
        "max_grad_norm": 1.0,
        "rollout_temperature": 1.0,
        "save_rollouts": False,
        "per_device_train_batch_size": 2,
        "num_processes": 2,
        "parallelism": "fsdp",
    }
    script = textwrap.dedent(f"""
        import sys, torch; torch.set_num_threads(1)
        from transformers import TrainerCallback
        from opdkit.jobs import whitebox
        from opdkit.run.launch import RankFailed
        from opdkit.run.lifecycle import RunFailed

        class InterruptAt3(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == 3:
                    raise RuntimeError("killed after step 3")

        over = {over!r}
        whitebox.run("tiny", {{**over, "run_dir": {str(tmp_path / "unbroken")!r}}})
        try:
            whitebox.run(
                "tiny", {{**over, "run_dir": {str(tmp_path / "broken")!r}}}, callbacks=[InterruptAt3()]
            )
            sys.exit("the interrupted run did not stop")
        except RunFailed as stop:  # one line, the ranks' failure behind it
            assert isinstance(stop.__cause__, RankFailed), repr(stop.__cause__)
        whitebox.run("tiny", {{**over, "run_dir": {str(tmp_path / "broken")!r}, "resume": True}})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    read = lambda name: [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    a, b = read("unbroken"), read("broken")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        for key in ("loss", "grad_norm", "completion_length", "entropy"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-5), (ra["step"], key)
    sd_a = AutoModelForCausalLM.from_pretrained(tmp_path / "unbroken" / "model").state_dict()
    sd_b = AutoModelForCausalLM.from_pretrained(tmp_path / "broken" / "model").state_dict()
    for k in sd_a:
        torch.testing.assert_close(sd_a[k], sd_b[k])


def _plain_fsdp2_rank(rank: int, port: int, out: str) -> None:
    """One rank of `test_the_loss_must_run_inside_the_root_forward_of_a_plain_fsdp2_student`."""
    import os

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from opdkit import tiny
    from opdkit.opd.loss import chunked_divergence
    from opdkit.opd.teachers.local import student_divergence

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    load = lambda name: AutoModelForCausalLM.from_pretrained(tiny.resolve(name))  # noqa: E731
    teacher, reference = load("tiny:teacher").eval(), load("tiny:student")
    gen = torch.Generator().manual_seed(0)
    ids_BT = torch.randint(3, 101, (4, 10), generator=gen)  # the same global batch on both ranks
    pred_BT = torch.zeros_like(ids_BT, dtype=torch.bool)
    pred_BT[:, 4:9] = True
    kw = dict(vocab_size=101, chunk_size=3)

    def batch(rows):
        fwd = dict(input_ids=ids_BT[rows], attention_mask=torch.ones_like(ids_BT[rows]), use_cache=False)
        with torch.no_grad():
            t_hidden_NH = teacher.base_model(**fwd).last_hidden_state[pred_BT[rows]]
        return fwd, pred_BT[rows], t_hidden_NH, teacher.get_output_embeddings().weight

    n_all = pred_BT.sum()
    full = student_divergence(reference, *batch(slice(None)), **kw)[0] / n_all
    full.backward()

    def sharded():  # the usual FSDP2 recipe: each decoder layer, then the root, resharded after forward
        student = load("tiny:student")
        for layer in student.model.layers:
            fully_shard(layer)
        return fully_shard(student, reshard_after_forward=True)

    mine = batch(slice(rank, None, 2))
    report = {}
    student = sharded()
    with torch.no_grad():
        student(**mine[0])  # the head weight after the root's forward has returned
    report["after_forward"] = _describe(student.get_output_embeddings().weight)

    def head_read_after_forward():  # hidden states from the wrapped forward, the head weight after it
        fwd, pred_BT, t_hidden_NH, t_head_VH = mine
        s_hidden_NH = student(**fwd, output_hidden_states=True).hidden_states[-1][pred_BT]
        s_head_VH = student.get_output_embeddings().weight
        return chunked_divergence(s_hidden_NH, s_head_VH, t_hidden_NH, t_head_VH, **kw)

    for name, attempt in (
        ("head_read_after_forward", head_read_after_forward),
        ("root_hooks_bypassed", lambda: student_divergence(sharded(), *mine, **kw)),
    ):
        try:
            attempt()
            report[name] = "ran"
        except RuntimeError as exc:
            report[name] = str(exc)
    student = sharded()
    part = lambda **fwd: student_divergence(student, fwd, *mine[1:], **kw)  # noqa: E731
    loss = sharding.call_inside_forward(student, student, part, **mine[0])[0] / n_all * 2  # as the trainer
    loss.backward()
    total = loss.detach() / 2
    dist.all_reduce(total)
    ref_grads = dict(reference.named_parameters())
    errs = {}
    for name, p in student.named_parameters():
        g, ref = sharding.full_tensor(p.grad), ref_grads[name].grad
        errs[name] = ((g - ref).abs().max() / ref.abs().max()).item()
    report.update(loss=total.item(), reference_loss=full.item(), relative_errors=errs)
    if rank == 0:
        Path(out).write_text(json.dumps(report))
    dist.destroy_process_group()


def test_the_loss_must_run_inside_the_root_forward_of_a_plain_fsdp2_student(tmp_path):
    """The standard FSDP2 recipe (no accelerate grouping) on the trainer's own `student_divergence`:
    after the forward the head weight is a shard and the loss fails, and so it does when the root's
    hooks are bypassed; run inside the root's forward it gives the unsharded loss and gradient."""

    out = tmp_path / "report.json"
    script = textwrap.dedent(f"""
        import sys, socket, torch
        sys.path.insert(0, {str(TESTS)!r})
        from torch.multiprocessing import start_processes
        from test_run_sharding import _plain_fsdp2_rank
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        start_processes(_plain_fsdp2_rank, args=(port, {str(out)!r}), nprocs=2, start_method="fork")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["after_forward"]["dtensor"] and report["after_forward"]["local_rows"] in (50, 51)
    assert "DTensor" in report["head_read_after_forward"], report["head_read_after_forward"]
    assert "DTensor" in report["root_hooks_bypassed"], report["root_hooks_bypassed"]
    assert report["loss"] == pytest.approx(report["reference_loss"], rel=1e-6)
    assert len(report["relative_errors"]) == 24 and max(report["relative_errors"].values()) < 1e-5


# ---- the pieces on their own ----------------------------------------------------------------------


def test_parallelism_is_opt_in_and_checked():
    for mode in available_modes(WhiteboxConfig):
        assert load_config(WhiteboxConfig, mode).parallelism == "ddp", mode
    assert load_config(WhiteboxConfig, "full", {"parallelism": "fsdp"}).parallelism == "fsdp"
    with pytest.raises(ConfigError, match="parallelism='zero3'"):
        load_config(WhiteboxConfig, "tiny", {"parallelism": "zero3"})


def test_fsdp_arguments_only_when_there_is_something_to_shard():
    assert sharding.fsdp_arguments("ddp", 8) == {} and sharding.fsdp_arguments("fsdp", 1) == {}
    args = sharding.fsdp_arguments("fsdp", 2)
    cfg = args["fsdp_config"]
    assert args["fsdp"] is True
    assert (
        cfg["version"] == 2 and cfg["state_dict_type"] == "FULL_STATE_DICT" and cfg["reshard_after_forward"]
    )


class _Counted(torch.nn.Module):
    """A module whose forward hooks count, standing in for a DDP/FSDP wrapper's hooks."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(3, 2, bias=False)
        self.events: list[str] = []
        self.register_forward_pre_hook(lambda *a: self.events.append("pre"))
        self.register_forward_hook(lambda *a: self.events.append("post"))

    def forward(self, x):
        return self.head(x)


def test_call_inside_forward_runs_the_function_between_the_hooks_and_restores_forward():
    m = _Counted()
    x = torch.ones(1, 3)

    def loss(x):
        m.events.append("fn")
        return (x @ m.head.weight.T).sum()  # reads the weight directly, as the divergence does

    out = sharding.call_inside_forward(m, m, loss, x)
    assert m.events == ["pre", "fn", "post"]
    torch.testing.assert_close(out, m.head(x).sum())
    assert "forward" not in m.__dict__  # the class's forward is back
    m.events.clear()
    m(x)
    assert m.events == ["pre", "post"]

    patched = m.forward  # an instance-level forward (as accelerate's autocast wrapper) is kept
    m.forward = patched
    with pytest.raises(ZeroDivisionError):
        sharding.call_inside_forward(m, m, lambda x: 1 / 0, x)
    assert m.__dict__["forward"] is patched


# accelerate's bf16 policy casts outputs to bf16 up to 1.15 and leaves them alone from 1.16: either way the
# kit's outputs stay float32.
@pytest.mark.parametrize("accelerate_output_dtype", [torch.bfloat16, None])
def test_fsdp_outputs_stay_float32_under_bf16_mixed_precision(accelerate_output_dtype):
    import dataclasses

    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True)
    plugin.set_mixed_precision("bf16")
    plugin.mixed_precision_policy = dataclasses.replace(
        plugin.mixed_precision_policy, output_dtype=accelerate_output_dtype
    )
    sharding.keep_fp32_outputs(plugin)
    policy = plugin.mixed_precision_policy
    assert policy.param_dtype == policy.reduce_dtype == torch.bfloat16 and policy.output_dtype is None
