"""Antidistillation sampling and its trade-off, the job behind notebooks/04_antidistill.ipynb: a recipe over
`ads` (steering, sampler, teacher), `sft.student`, `opd` (the on-policy attackers) and the run lifecycle.

    python -m opdkit.antidistill --mode tiny                                  # CPU, about 3 to 5 minutes
    python -m opdkit.antidistill --mode ads-paper --set grads_run=runs/savegrad/ads    # every GPU of a node

The ADS paper's headline experiment in miniature. For every point of the sweeps (`sweep.py`)

    ADS:          λ in `lams`, at each temperature in `ads_temperatures`          method "ads"
    ADS, answer:  λ in `answer_lams`, same temperatures, answer-token gradient    method "ads-answer"
    temperature:  λ = 0, at each temperature in `temperatures`                    method "temperature"

the teacher writes one trace per training prompt (`ads.sampler`: z_teacher + λΔ, then temperature, then
top-p), the traces' answers are checked (teacher accuracy), a fresh student is distilled on them by
completion-only SFT, and its greedy accuracy on held-out problems is measured (student accuracy); `attackers`
adds on-policy students (`points.py`). ADS works if, at equal teacher accuracy, its students are worse. The
gradient comes from `grads_run` (a savegrad run, checked with `load_grads`), or savegrad runs in `grads/`
inside this run. Layout:

    grads/, grads_answer/                 the two gradients (when computed here)
    points/<name>/point.json              the point's summary entry (done, or failed with its traceback)
    points/<name>/error.txt               the traceback of a point that failed (the other points go on)
    points/<name>/seed<seed>/             traces.jsonl, result.json, metrics.jsonl (SFT log), student/, sft/
                                          (checkpoints), opd/ (the ADS-scored on-policy student)
    plain/tau<τ>-seed<seed>/              the plain-scored on-policy student of that τ, shared by the points
    baseline.json, metrics.jsonl          the student before distillation; one record per point and SFT losses
    summary.json                          {"points": [{method, lam, temperature, teacher_accuracy,
                                          student_accuracy, student_accuracy_forced, student_holdout_loss,
                                          errors, runs}], "failed_points": [...], "status": "done" |
                                          "incomplete"}
    figures/                              tradeoff.png, tradeoff_holdout_loss.png, attackers.png

The points are spread over `num_processes` processes (0: one per visible GPU, 1 on a CPU), round-robin in
sweep order (`run.spread`); each holds its own teacher and proxies on its own GPU and runs its points one
after another. A point's seeds are its own, so the summary does not depend on the number of processes.
`resume=True` runs only the points not finished, reusing complete traces and each student's newest complete
checkpoint (refused when that checkpoint trained on other traces).
"""

from __future__ import annotations

import importlib.util
import json
import time

from tqdm.auto import tqdm

from opdkit import memory, tasks
from opdkit.config import ConfigError, to_dict
from opdkit.data import prompts
from opdkit.jobs.antidistill import points as pt
from opdkit.jobs.antidistill import sweep
from opdkit.jobs.antidistill.config import AntidistillConfig
from opdkit.jobs.antidistill.sweep import Prepared, sweep_points
from opdkit.models import check_shared_vocab, load_tokenizer
from opdkit.run import spread, tracking
from opdkit.run.cli import run_from_cli
from opdkit.run.files import atomic_write_text
from opdkit.run.folders import RunDir, print0
from opdkit.run.launch import default_num_processes
from opdkit.run.lifecycle import Job, fit_gen_batch, prepare_job, run_job


def prepared(cfg: AntidistillConfig, mode: str) -> Prepared:
    """The prompts, then the tokenizers, then the gradient's fit to the proxy, in the original's order (data
    files in milliseconds, before any download): every cheap failure happens here."""
    sweep_points(cfg)  # two points sharing a folder name are a ConfigError
    task = tasks.for_dataset(cfg.dataset_path)
    messages, answers = sweep.training_prompts(cfg, task)
    eval_messages, eval_answers, removed = sweep.eval_prompts(cfg, task, messages)
    teacher_tok, proxy_tok = load_tokenizer(cfg.teacher_model), load_tokenizer(cfg.proxy_model)
    student_tok = load_tokenizer(cfg.student_tokenizer or cfg.student_model)
    check_shared_vocab(teacher_tok, proxy_tok)
    sweep.check_grads_run(cfg, proxy_tok)
    holdout_check = sweep.check_apart_from_gradient(cfg, messages)
    if cfg.student_lora_r and importlib.util.find_spec("peft") is None:
        raise ConfigError(
            "student_lora_r > 0 needs peft; install it with pip install 'opdkit[lora]' (or pip install peft)."
        )
    keep = prompts.short_prompts(messages, teacher_tok, cfg.max_prompt_length, cfg.enable_thinking)
    dropped = len(messages) - len(keep)
    messages, answers = [messages[i] for i in keep], [answers[i] for i in keep]
    first = teacher_tok.decode(prompts.prompt_ids(teacher_tok, messages[0], cfg.enable_thinking))
    return Prepared(
        cfg,
        mode,
        task,
        teacher_tok,
        proxy_tok,
        student_tok,
        messages,
        answers,
        eval_messages,
        eval_answers,
        dropped,
        first,
        removed,
        holdout_check,
    )


def stages(prep: Prepared, budget: float | None) -> dict[str, memory.Stage]:
    """What one process holds at the stages of every point: the teacher sampling `gen_batch_size` traces
    steered by the proxy's perturbed copies (the proxy and its gradients wait in host memory on a GPU; fd: two
    copies, each with its KV cache), then, with teacher and proxies in host memory, the student's SFT
    (`sft_micro_batch_size` traces) and its greedy evaluation; and the on-policy attackers when asked."""
    cfg, gpu = prep.cfg, budget is not None
    sft_completion = cfg.max_new_tokens
    if cfg.sft_max_length:
        sft_completion = max(1, min(cfg.max_new_tokens, cfg.sft_max_length - cfg.max_prompt_length))
    student = memory.ModelShape.from_config(cfg.student_model)
    device = "cuda" if gpu else "cpu"
    out = {
        "ADS sampling": memory.Stage(
            teacher=memory.ModelShape.from_config(cfg.teacher_model),
            proxy=memory.ModelShape.from_config(cfg.proxy_model),
            teacher_dtype="bfloat16" if cfg.bf16 and gpu else "float32",
            proxy_dtype="float32",
            bf16=False,
            device=device,
            sampler="teacher",
            gen_batch_size=cfg.gen_batch_size,
            prompt_len=cfg.max_prompt_length,
            completion_len=cfg.max_new_tokens,
            ads_copies=2 if cfg.ads_method == "fd" else 0,
            proxy_gradients=2 if cfg.answer_lams else 1,
            proxy_on_host=gpu,
        ),
        "student SFT": memory.Stage(
            student=student,
            student_dtype="float32",
            bf16=cfg.bf16 and gpu,
            device=device,
            optimizer="adamw",
            trainable_params=student.lora_params(cfg.student_lora_r, cfg.student_lora_target_modules),
            gradient_checkpointing=cfg.gradient_checkpointing,
            train_batch_size=cfg.sft_micro_batch(),
            prompt_len=cfg.max_prompt_length,
            completion_len=sft_completion,
            eval_model="student",
            eval_batch_size=cfg.eval_batch_size,
            eval_completion_len=cfg.eval_max_new_tokens or cfg.max_new_tokens,
        ),
    }
    if set(cfg.attackers) - {"sft"}:
        out["on-policy attackers"] = on_policy_stage(cfg, gpu)
    return out


def on_policy_stage(cfg: AntidistillConfig, gpu: bool) -> memory.Stage:
    """The on-policy attackers (`attackers` opd, opd-plain): a fresh student trained by DistillTrainer on its
    own rollouts (`per_device_train_batch_size` prompts, the kit's loop, AdamW), scored by the teacher with
    the proxy's two perturbed fp32 copies beside it (the ADS teacher, with its stacked fp32 head), then
    evaluated."""
    return memory.Stage(
        student=memory.ModelShape.from_config(cfg.student_model),
        teacher=memory.ModelShape.from_config(cfg.teacher_model),
        proxy=memory.ModelShape.from_config(cfg.proxy_model),
        student_dtype="float32",
        teacher_dtype="bfloat16" if cfg.bf16 and gpu else "float32",
        proxy_dtype="float32",
        bf16=cfg.bf16 and gpu,
        device="cuda" if gpu else "cpu",
        optimizer="adamw",
        shard_teacher=False,
        gradient_checkpointing=cfg.gradient_checkpointing,
        prompt_len=cfg.max_prompt_length,
        completion_len=cfg.max_new_tokens,
        train_batch_size=cfg.per_device_train_batch_size,
        sampler="student",
        gen_batch_size=cfg.per_device_train_batch_size,
        ads_copies=2,
        proxy_gradients=2 if cfg.answer_lams else 1,
        proxy_on_host=gpu,
        eval_model="student",
        eval_batch_size=cfg.eval_batch_size,
        eval_completion_len=cfg.eval_max_new_tokens or cfg.max_new_tokens,
    )


def fit(prep: Prepared, budget: float | None) -> Prepared:
    """`gen_batch_size` 0: the largest batch of traces that fits the ADS sampling stage (`fit_gen_batch`)."""
    return fit_gen_batch(prep, budget, {"ADS sampling": stages(prep, budget)["ADS sampling"]})


def processes(prep: Prepared, run: RunDir) -> tuple[int, tuple]:
    """The points not finished, spread over `num_processes` processes (no more than there are points), after
    the gradients they steer by are on disk (computed once, before the processes start)."""
    cfg, points = prep.cfg, sweep_points(prep.cfg)
    todo = [p for p in points if not (cfg.resume and pt.finished(run, p))]
    n = max(1, min(default_num_processes(cfg.num_processes), len(todo)))
    prep.num_processes = n
    sweep.ensure_answer_gradient(cfg, sweep.ensure_grads(cfg, run, n), run, n)
    print0(
        f"{len(points)} points ({len(points) - len(todo)} finished before), "
        f"{len(prep.train_messages)} traces each, {n} process(es)"
    )
    if not todo and (run.path / pt.BASELINE_FILE).is_file():
        return 0, ()  # nothing left to run
    return n, (spread.assign([p.name for p in todo], n),)


def process(prep: Prepared, run: RunDir, shares: list[list[str]]) -> None:
    """What every sweep process runs: its own teacher and proxies on its own device, then its share of the
    points."""
    rank, world = spread.own_process()
    cfg, dev = prep.cfg, sweep.device()
    if rank == 0:
        run.write_env(world_size=world, device=str(dev))
    mine = [p for p in sweep_points(cfg) if p.name in set(shares[rank])]
    steering, holdout = sweep.load_steering(
        cfg, prep.proxy_tokenizer, prep.student_tokenizer, sweep.grads_path(cfg, run), dev, run
    )
    held = pt.Held(steering, holdout, dev, run)
    if rank == 0 and not (run.path / pt.BASELINE_FILE).is_file():
        before = {**pt.baseline(prep, held), "grad_norms": steering.grad_norms()}
        atomic_write_text(run.path / pt.BASELINE_FILE, json.dumps(before, indent=2))
    tag = f" (process {rank} of {world})" if world > 1 else ""
    for point in tqdm(mine, desc=f"trade-off points{tag}", position=rank if world > 1 else None):
        print0(pt.result_line(pt.point_result(point, prep, held)) + tag)


def summarize(prep: Prepared, run: RunDir, failure: str | None) -> dict:
    """The points gathered from their folders (`points.gather`), the sweep's facts; failed points said."""
    cfg = prep.cfg
    summary = {
        **pt.gather(sweep_points(cfg), run, failure),
        "grads_run": str(sweep.grads_path(cfg, run)),
        "eps": cfg.eps,
        "ads_method": cfg.ads_method,
        "top_p": cfg.trace_top_p,
        "top_k": cfg.trace_top_k,
        "grad_scale": cfg.grad_scale,
        "num_traces": len(prep.train_messages),
        "prompts_dropped": prep.dropped,
        "prompts_removed_for_overlap": prep.removed,
        "gradient_holdout": prep.gradient_holdout,  # any training prompt in it is refused in prepare
        "eval_size": len(prep.eval_messages),
        "num_processes": prep.num_processes,
        "wall_time_s": round(time.time() - prep.started, 1),
    }
    for p in summary["failed_points"]:
        print0(
            f"point {p['name']} failed (traceback in the summary and points/{p['name']}/error.txt):\n"
            f"{p['error']}"
        )
    return summary


TRACKED = ("lam", "temperature", "teacher_accuracy", "student_accuracy", "student_accuracy_forced")
TRACKED += ("student_holdout_loss",)


def track(prep: Prepared, run: RunDir, summary: dict) -> None:
    """Every point (in sweep order, as steps 1, 2, ...) and a table of them to `report_to`."""
    tracker = tracking.Tracker.start(prep.cfg.report_to, run, config=to_dict(prep.cfg))
    before = ("student_accuracy_before", "student_accuracy_before_forced", "student_holdout_loss_before")
    tracker.log({k: summary[k] for k in before if summary.get(k) is not None}, step=0)
    for i, point in enumerate(summary["points"]):
        tracker.log({k: point.get(k) for k in TRACKED}, step=i + 1)
    tracker.table(
        "points", [{"name": p["name"], **{k: p.get(k) for k in TRACKED}} for p in summary["points"]]
    )
    tracker.finish()


JOB = Job(
    "antidistill",
    AntidistillConfig,
    prepare=prepared,
    stages=stages,
    process=process,
    summarize=summarize,
    fit=fit,
    processes=processes,
    track=track,
    own_processes=True,
    keeps_going=True,
)


def prepare(mode: str = "tiny", overrides: dict | None = None) -> Prepared:
    """Everything that can fail cheaply, nothing written (`lifecycle.prepare_job`)."""
    return prepare_job(JOB, mode, overrides)


def run(mode: str = "tiny", overrides: dict | None = None, prepared: Prepared | None = None) -> RunDir | None:
    """The sweep (`lifecycle.run_job`): its folder, or None after a dry run."""
    return run_job(JOB, mode, overrides, prepared)


def main(argv: list[str] | None = None) -> None:
    from opdkit.jobs.antidistill import report

    run_from_cli(
        AntidistillConfig,
        "Antidistillation sampling trade-off (opdkit antidistill).",
        run,
        report.figures,
        argv,
    )


if __name__ == "__main__":
    main()
