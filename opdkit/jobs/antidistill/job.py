"""Antidistillation sampling and its trade-off, the job behind notebooks/04_antidistill.ipynb.

    python -m opdkit.antidistill --mode tiny                                  # CPU, about 3 to 5 minutes
    # every GPU of a node:
    python -m opdkit.antidistill --mode ads-paper --set grads_run=runs/savegrad/ads

The ADS paper's headline experiment in miniature. For every point of the sweeps

    ADS:          λ in `lams`, at each temperature in `ads_temperatures`          method "ads"
    ADS, answer:  λ in `answer_lams`, same temperatures, answer-token gradient    method "ads-answer"
    temperature:  λ = 0, at each temperature in `temperatures`                    method "temperature"

(λ = 0 is temperature sampling whatever the sweep), the teacher writes one trace per training prompt
(`opdkit.ads.ads_sample`: z_teacher + λΔ, then temperature, then top-p), the traces' answers are checked
(teacher accuracy), a fresh copy of the student is distilled on them by completion-only SFT, and its greedy
accuracy on held-out problems is measured (student accuracy). ADS works if, at equal teacher accuracy, its
students are worse. `attackers` adds on-policy students beside that SFT one (`attackers.py`): `opd`, distilled
by 02's trainer with the teacher scoring by the ADS distribution of the point, and `opd-plain`, its control
scored by the plain teacher.

The proxy gradient comes from `grads_run` (a savegrad run, checked with `load_grads`), or, when that
is empty, savegrad runs in `grads/` inside this run with the preset `grads_mode`. The answer-token
gradient is the proxy's NLL gradient on the same traces with the loss kept on their final answer only
(tiny: after ';'; else from the last \\boxed), computed here. Layout:

    grads/, grads_answer/                 the two gradients (when computed here)
    points/<name>/point.json              the point's summary entry (status done, or failed with its
                                          traceback)
    points/<name>/error.txt               the traceback of a point that failed (the other points go on)
    points/<name>/seed<seed>/traces.jsonl prompt, completion, answer, correct, truncated per training prompt
                                          (reused by resume=True when it has every training prompt's)
    points/<name>/seed<seed>/result.json  that run's accuracies, losses, error kinds (reused by resume=True)
    points/<name>/seed<seed>/metrics.jsonl the student's SFT log: step, loss, grad_norm, learning_rate
    points/<name>/seed<seed>/student/     the distilled student (`student_save`: LoRA adapter, or model)
    points/<name>/seed<seed>/sft/         the Trainer's checkpoints (`sft_save_steps`), each with the hash of
                                          the rows it trained on, and tracker logs
    points/<name>/seed<seed>/opd/         the ADS-scored on-policy student's metrics.jsonl (attackers opd)
    plain/tau<τ>-seed<seed>/              the plain-scored on-policy student of that τ, shared by the points
    baseline.json                         the student before distillation, the gradients' norms
    metrics.jsonl                         one record per point, plus the students' SFT losses (`sft_loss`)
    summary.json                          {"points": [{method, lam, temperature, teacher_accuracy,
                                          student_accuracy (raw), student_accuracy_forced (its final
                                          answer forced), student_holdout_loss, errors, runs}],
                                          "failed_points": [{name, error}], "status": "done" | "incomplete"}
    figures/tradeoff.png                  teacher accuracy (x) against distilled-student accuracy (y)
    figures/tradeoff_holdout_loss.png     teacher accuracy against the students' NLL on held-out traces
    figures/attackers.png                 teacher accuracy against each attacker's student accuracy (with
                                          opd_student_accuracy, opd_plain_student_accuracy in summary.json)

The points are spread over `num_processes` processes (0: one per visible GPU, 1 on a CPU), round-robin in
sweep order (`spread.py`); each holds its own teacher and proxies on its own GPU and runs its points one after
another, the teacher and proxies waiting in CPU memory while each student trains. A point's seeds are its own,
so the summary does not depend on the number of processes. `resume=True` runs only the points not finished;
an unfinished point reuses its complete traces and continues its student from the newest complete checkpoint
(refused when that checkpoint trained on other traces).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from opdkit import memory
from opdkit.ads import gradfile
from opdkit.config import ConfigError, load_config, to_dict
from opdkit import tasks
from opdkit.data import prompts
from opdkit.jobs import savegrad
from opdkit.jobs.antidistill import spread, sweep
from opdkit.jobs.antidistill.config import AntidistillConfig
from opdkit.jobs.antidistill.points import baseline
from opdkit.jobs.antidistill.spread import BASELINE_FILE, assign, finished, gather
from opdkit.jobs.antidistill.steering import ensure_answer_gradient, load_models
from opdkit.jobs.antidistill.sweep import GRADS_DIR, Prepared, sweep_points
from opdkit.models import check_shared_vocab, load_tokenizer
from opdkit.notebook.live import stop_after_plan
from opdkit.run import tracking
from opdkit.run.cli import run_from_cli
from opdkit.run.files import atomic_write_text
from opdkit.run.folders import RunDir, print0
from opdkit.run.launch import RankFailed, default_num_processes, launch, under_external_launcher

JOB = AntidistillConfig.job


def prepare(mode: str = "tiny", overrides: dict | None = None) -> Prepared:
    """Resolve the config, then the prompts, then the tokenizers, then the gradient's fit to the proxy, in the
    original's order (data files in milliseconds, before any download): every cheap failure happens here."""
    cfg = load_config(AntidistillConfig, mode, overrides)
    tracking.check_report_to(cfg.report_to)
    sweep_points(cfg)  # two points sharing a folder name are a ConfigError
    task = tasks.for_dataset(cfg.dataset_path)
    messages, answers = sweep.training_prompts(cfg)
    eval_messages, eval_answers, removed = sweep.eval_prompts(cfg, task, messages)
    teacher_tok = load_tokenizer(cfg.teacher_model)
    proxy_tok = load_tokenizer(cfg.proxy_model)
    student_tok = load_tokenizer(cfg.student_tokenizer or cfg.student_model)
    check_shared_vocab(teacher_tok, proxy_tok)
    sweep.check_grads_run(cfg, proxy_tok)
    holdout_check = sweep.check_apart_from_gradient(cfg, messages)
    if cfg.student_lora_r and importlib.util.find_spec("peft") is None:
        raise ConfigError(
            "student_lora_r > 0 needs peft; install it with pip install 'opdkit[lora]' (or pip install peft)."
        )
    keep = prompts.short_prompts(messages, teacher_tok, cfg.max_prompt_length, cfg.enable_thinking)
    messages, answers, dropped = (
        [messages[i] for i in keep],
        [answers[i] for i in keep],
        len(messages) - len(keep),
    )
    first = teacher_tok.decode(prompts.prompt_ids(teacher_tok, messages[0], cfg.enable_thinking))
    cfg, plan = planned(cfg)
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
        plan,
    )


def stages(cfg: AntidistillConfig, budget: float | None) -> dict[str, memory.Stage]:
    """What one process holds, for the memory plan, at the two stages of every point: the teacher sampling
    `gen_batch_size` traces steered by the proxy's perturbed copies (the proxy and its gradients wait in
    CPU memory on a GPU; fd: two copies, each with its KV cache), then, with teacher and proxies moved
    to CPU memory, the student's SFT (`sft_micro_batch_size` traces) and its greedy evaluation. The SFT
    of a LoRA student is planned without optimizer state but with every weight's gradient, an upper bound."""
    gpu = budget is not None
    completion = cfg.max_new_tokens
    sft_completion = completion
    if cfg.sft_max_length:
        sft_completion = max(1, min(completion, cfg.sft_max_length - cfg.max_prompt_length))
    teacher_dtype = "bfloat16" if cfg.bf16 and gpu else "float32"
    gradients = 2 if cfg.answer_lams else 1
    micro = min(cfg.sft_micro_batch_size or cfg.sft_batch_size, cfg.sft_batch_size)
    student = memory.ModelShape.from_config(cfg.student_model)
    return {
        "ADS sampling": memory.Stage(
            teacher=memory.ModelShape.from_config(cfg.teacher_model),
            proxy=memory.ModelShape.from_config(cfg.proxy_model),
            teacher_dtype=teacher_dtype,
            proxy_dtype="float32",
            bf16=False,
            device="cuda" if gpu else "cpu",
            sampler="teacher",
            gen_batch_size=cfg.gen_batch_size,
            prompt_len=cfg.max_prompt_length,
            completion_len=completion,
            ads_copies=2 if cfg.ads_method == "fd" else 0,
            proxy_gradients=gradients,
            proxy_on_host=gpu,
        ),
        "student SFT": memory.Stage(
            student=student,
            student_dtype="float32",
            bf16=cfg.bf16 and gpu,
            device="cuda" if gpu else "cpu",
            optimizer="adamw",
            trainable_params=student.lora_params(cfg.student_lora_r, cfg.student_lora_target_modules),
            gradient_checkpointing=cfg.gradient_checkpointing,
            train_batch_size=micro,
            prompt_len=cfg.max_prompt_length,
            completion_len=sft_completion,
            eval_model="student",
            eval_batch_size=cfg.gen_batch_size,
            eval_completion_len=cfg.eval_max_new_tokens or cfg.max_new_tokens,
        ),
        **({"on-policy attackers": on_policy_stage(cfg, gpu)} if set(cfg.attackers) - {"sft"} else {}),
    }


def on_policy_stage(cfg: AntidistillConfig, gpu: bool) -> memory.Stage:
    """The on-policy attackers (`attackers` opd, opd-plain): a fresh student trained by DistillTrainer on its
    own rollouts (`opd_batch_size` prompts, the kit's loop, AdamW), scored by the teacher with the proxy's two
    perturbed fp32 copies beside it (the ADS teacher, with its stacked fp32 head), then evaluated greedily."""
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
        train_batch_size=cfg.opd_batch_size,
        sampler="student",
        gen_batch_size=cfg.opd_batch_size,
        ads_copies=2,
        proxy_gradients=2 if cfg.answer_lams else 1,
        proxy_on_host=gpu,
        eval_model="student",
        eval_batch_size=cfg.gen_batch_size,
        eval_completion_len=cfg.eval_max_new_tokens or cfg.max_new_tokens,
    )


def planned(cfg: AntidistillConfig) -> tuple[AntidistillConfig, memory.JobPlan]:
    """The memory plan per process, against `plan_gpu_memory_gb` or the visible GPU's; `gen_batch_size` 0
    becomes the largest batch that fits both stages (the config returned says which)."""
    budget = memory.budget_gb(cfg.plan_gpu_memory_gb)
    if cfg.gen_batch_size == 0:
        if budget is None:
            raise ConfigError(
                "gen_batch_size=0 means the largest batch that fits the memory plan, which needs a budget: "
                "a GPU, or plan_gpu_memory_gb; or give a batch size."
            )
        largest = min(memory.largest_batch(stage, budget) for stage in stages(cfg, budget).values())
        if not largest:
            raise ConfigError(
                f"not even one trace of {cfg.max_prompt_length} + {cfg.max_new_tokens} tokens fits "
                f"{budget:.1f} GB beside the teacher and the proxy's copies; shorten max_new_tokens or use a "
                "larger GPU."
            )
        print0(f"gen_batch_size 0: {largest}, the largest batch that fits the plan's {budget:.1f} GB")
        cfg = dataclasses.replace(cfg, gen_batch_size=largest)
    return cfg, memory.plan_job(stages(cfg, budget), budget)


def ensure_grads(cfg: AntidistillConfig, run: RunDir, num_processes: int = 1) -> Path:
    """The gradient's run directory: grads_run, or a savegrad run made now in grads/ (reused on resume),
    in `num_processes` processes on a GPU node (its own processes: this one never touches CUDA)."""
    if cfg.grads_run:
        return Path(cfg.grads_run)
    path = run.path / GRADS_DIR
    if (path / gradfile.GRADS_FILE).is_file():
        print0(f"reusing the gradient in {path}")
        return path
    procs = num_processes if torch.cuda.device_count() > 1 else 1  # NVML's count: safe before a fork
    over = {
        **sweep.grads_overrides(cfg, str(path)),
        "overwrite": path.exists(),
        "num_processes": procs,
        "plan_gpu_memory_gb": cfg.plan_gpu_memory_gb,
    }
    print0(f"no grads_run: computing the proxy gradient with savegrad --mode {cfg.grads_mode} in {path}")
    return savegrad.run(cfg.grads_mode, over).path


def run(mode: str = "tiny", overrides: dict | None = None, prepared: Prepared | None = None) -> RunDir | None:
    """Prepare, show the memory plan, stop there under `dry_run` (None; in a notebook kernel `PlanOnly`) or
    when the plan does not fit (ConfigError, before any weight is loaded); else create the run directory
    (plan.json in it), compute or check the gradient, run the points not yet finished in `num_processes`
    processes, gather the summary; returns the run."""
    t0 = time.time()
    prep = prepared or prepare(mode, overrides)
    cfg = prep.cfg
    print0(prep.plan.table())
    if cfg.dry_run:
        stop_after_plan(JOB)
        return None
    prep.plan.check()
    if under_external_launcher():
        raise ConfigError(
            "antidistill spreads its points over processes itself: start it as one process with "
            "num_processes=N (0: every visible GPU), not under torchrun or accelerate launch."
        )
    points = sweep_points(cfg)
    run = RunDir.create(cfg, job=JOB, mode=mode)
    atomic_write_text(run.path / memory.PLAN_FILE, prep.plan.to_json())
    todo = [p for p in points if not (cfg.resume and finished(run, p))]
    n = max(1, min(default_num_processes(cfg.num_processes), len(todo)))
    grads_dir = ensure_grads(cfg, run, n)
    ensure_answer_gradient(cfg, grads_dir, run, n)
    print0(
        f"{len(points)} points ({len(points) - len(todo)} finished before), "
        f"{len(prep.train_messages)} traces each, {n} process(es)"
    )
    failure = None
    if todo or not (run.path / BASELINE_FILE).is_file():
        args = (asdict(cfg), mode, str(run.path), str(grads_dir), assign(todo, n), prep if n == 1 else None)
        try:
            launch(process, args, n, run.path)
        except RankFailed as exc:  # a whole process died (killed, out of memory): its unfinished points fail
            failure = str(exc)
    summary = {**gather(points, run, failure), **facts(cfg, prep, grads_dir, n, time.time() - t0)}
    run.write_summary(summary)
    for p in summary["failed_points"]:
        print0(
            f"point {p['name']} failed (traceback in the summary and points/{p['name']}/error.txt):\n"
            f"{p['error']}"
        )
    track(cfg, run, summary)
    return run


TRACKED = (
    "lam",
    "temperature",
    "teacher_accuracy",
    "student_accuracy",
    "student_accuracy_forced",
    "student_holdout_loss",
)


def process(
    cfg_dict: dict,
    mode: str,
    run_path: str,
    grads_dir: str,
    shares: list[list[str]],
    prepared: Prepared | None = None,
) -> None:
    """What every process runs: its own teacher and proxies on its own device, then its share of the
    points."""
    rank, world = spread.own_process()
    prep = prepared or prepare(mode, {k: v for k, v in cfg_dict.items() if k != "overwrite"})
    cfg, dev, run = prep.cfg, sweep.device(), RunDir.attach(run_path)
    if rank == 0:
        run.write_env(world_size=world, device=str(dev))
    mine = [p for p in sweep.sweep_points(cfg) if p.name in set(shares[rank])]
    models = load_models(cfg, prep, Path(grads_dir), dev, run)
    if rank == 0 and not (run.path / spread.BASELINE_FILE).is_file():
        before = {**baseline(prep, models, dev), "grad_norms": models.grad_norms()}
        atomic_write_text(run.path / spread.BASELINE_FILE, json.dumps(before, indent=2))
    tag = f" (process {rank} of {world})" if world > 1 else ""
    for point in tqdm(mine, desc=f"trade-off points{tag}", position=rank if world > 1 else None):
        result = spread.run_point_safely(point, prep, models, run, dev)
        print0(spread.result_line(result) + tag)


def track(cfg: AntidistillConfig, run: RunDir, summary: dict) -> None:
    """Every point (in sweep order, as steps 1, 2, ...) and a table of them to `report_to`."""
    tracker = tracking.Tracker.start(cfg.report_to, run, config=to_dict(cfg))
    tracker.log(
        {
            k: summary[k]
            for k in (
                "student_accuracy_before",
                "student_accuracy_before_forced",
                "student_holdout_loss_before",
            )
            if summary.get(k) is not None
        },
        step=0,
    )
    for i, point in enumerate(summary["points"]):
        tracker.log({k: point.get(k) for k in TRACKED}, step=i + 1)
    tracker.table(
        "points", [{"name": p["name"], **{k: p.get(k) for k in TRACKED}} for p in summary["points"]]
    )
    tracker.finish()


def facts(cfg: AntidistillConfig, prep: Prepared, grads_dir: Path, n: int, seconds: float) -> dict:
    return {
        "grads_run": str(grads_dir),
        "eps": cfg.eps,
        "ads_method": cfg.ads_method,
        "top_p": cfg.top_p,
        "top_k": cfg.top_k,
        "grad_scale": cfg.grad_scale,
        "num_traces": len(prep.train_messages),
        "prompts_dropped": prep.dropped,
        "prompts_removed_for_overlap": prep.removed,
        "gradient_holdout": prep.gradient_holdout,  # any training prompt in it is refused in prepare
        "eval_size": len(prep.eval_messages),
        "num_processes": n,
        "wall_time_s": round(seconds, 1),
    }


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
