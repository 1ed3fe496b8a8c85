"""Antidistillation sampling and its trade-off, the job behind notebooks/04_antidistill.ipynb.

    python -m opdkit.antidistill --mode tiny                                  # CPU, about 3 to 5 minutes
    python -m opdkit.antidistill --mode ads-paper --set grads_run=runs/01_save_grad/ads   # one GPU

The ADS paper's headline experiment in miniature. For every point of the sweeps

    ADS:          λ in `lams`, at each temperature in `ads_temperatures`          method "ads"
    ADS, answer:  λ in `answer_lams`, same temperatures, answer-token gradient    method "ads-answer"
    temperature:  λ = 0, at each temperature in `temperatures`                    method "temperature"

(λ = 0 is temperature sampling whatever the sweep), the teacher writes one trace per training prompt
(`opdkit.ads.ads_sample`: z_teacher + λΔ, then temperature, then top-p), the traces' answers are checked
(teacher accuracy), a fresh copy of the student is distilled on them by completion-only SFT, and its greedy
accuracy on held-out problems is measured (student accuracy). ADS works if, at equal teacher accuracy, its
students are worse.

The proxy gradient comes from `grads_run` (a 01_save_grad run, checked with `load_grads`), or, when that
is empty, 01_save_grad runs in `grads/` inside this run with the preset `grads_mode`. The answer-token
gradient is the proxy's NLL gradient on the same traces with the loss kept on their final answer only
(tiny: after ';'; else from the last \\boxed), computed here. Layout:

    grads/, grads_answer/                 the two gradients (when computed here)
    points/<name>/seed<seed>/traces.jsonl prompt, completion, answer, correct, truncated per training prompt
    points/<name>/seed<seed>/result.json  that run's accuracies, losses, error kinds (reused by resume=True)
    metrics.jsonl                         one record per point, plus the students' SFT losses (`sft_loss`)
    summary.json                          {"points": [{method, lam, temperature, teacher_accuracy,
                                          student_accuracy, student_holdout_loss, errors, runs}], ...}
    figures/tradeoff.png                  teacher accuracy (x) against distilled-student accuracy (y)
    figures/tradeoff_holdout_loss.png     teacher accuracy against the students' NLL on held-out traces

Everything runs in one process on one device (the first GPU, else the CPU); on a GPU the teacher and the
proxies wait in CPU memory while each student trains.
"""

from __future__ import annotations

import copy
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    PreTrainedTokenizerBase,
    get_cosine_schedule_with_warmup,
)

from opdkit import ads, data, evaluate, grads, plots, rollout, savegrad, sft, tiny
from opdkit.config import AntidistillationConfig, ConfigError, load_config, parse_cli
from opdkit.runs import RunDir, atomic_write_text, print0
from opdkit.tiny import task

JOB = "04_antidistill"
GRADS_DIR = "grads"
ANSWER_GRADS_DIR = "grads_answer"
POINTS_DIR = "points"


GRADIENTS = {"ads": "completion", "ads-answer": "answer"}  # which gradient each ADS method steers by


@dataclass(frozen=True)
class Point:
    """One point of the trade-off: how the teacher samples its traces."""

    method: str  # "ads" (completion gradient), "ads-answer" (answer-token gradient), "temperature" (λ = 0)
    lam: float
    temperature: float

    @property
    def name(self) -> str:
        return f"{self.method}-lam{self.lam:g}-tau{self.temperature:g}"

    @property
    def gradient(self) -> str | None:
        return GRADIENTS.get(self.method)


def sweep_points(cfg: AntidistillationConfig) -> list[Point]:
    """ADS points (every λ at every ADS temperature), the answer-gradient ADS points, then the temperature
    sweep; λ = 0 is temperature sampling whatever the sweep, and each (method, λ, τ) runs once."""
    triples = [("ads", lam, tau) for tau in cfg.ads_temperatures for lam in cfg.lams]
    triples += [("ads-answer", lam, tau) for tau in cfg.ads_temperatures for lam in cfg.answer_lams]
    triples += [("temperature", 0.0, tau) for tau in cfg.temperatures]
    out: dict[tuple, Point] = {}
    for method, lam, tau in triples:
        key = (method if lam != 0 else "temperature", lam, tau)
        out.setdefault(key, Point(*key))
    return list(out.values())


@dataclass
class Prepared:
    cfg: AntidistillationConfig
    mode: str
    teacher_tokenizer: PreTrainedTokenizerBase
    proxy_tokenizer: PreTrainedTokenizerBase
    student_tokenizer: PreTrainedTokenizerBase
    messages: list[list[dict]]  # training prompts
    answers: list[str]
    eval_messages: list[list[dict]]
    eval_answers: list[str]
    dropped: int
    first_prompt: str


def is_tiny(cfg: AntidistillationConfig) -> bool:
    return cfg.dataset_path == data.TINY


def answer_check(cfg: AntidistillationConfig) -> Callable[[str, str], bool]:
    """Is a completion right? The tiny task's exact match, else a boxed-answer match."""
    if is_tiny(cfg):
        return lambda completion, answer: task.extract_answer(completion) == answer
    return evaluate.boxed_match


def check_shared_vocab(teacher: PreTrainedTokenizerBase, proxy: PreTrainedTokenizerBase) -> None:
    """ADS adds the proxy's logits to the teacher's by token id: every ordinary token must have one id in both.

    Special and other added tokens may differ (DeepSeek-R1-Distill-Qwen renames Qwen2.5's), as the ADS
    reference allows.
    """
    special = {*teacher.all_special_tokens, *proxy.all_special_tokens, *teacher.get_added_vocab(), *proxy.get_added_vocab()}
    t, p = teacher.get_vocab(), proxy.get_vocab()
    wrong = sorted(k for k in set(t) & set(p) if k not in special and t[k] != p[k])
    only = sorted(k for k in set(t) ^ set(p) if k not in special)
    if wrong or only:
        raise ConfigError(
            f"the teacher's and proxy's tokenizers disagree on {len(wrong)} token ids (e.g. {wrong[:3]}) and "
            f"{len(only)} tokens exist in one only (e.g. {only[:3]}); ADS adds the proxy's logits to the teacher's "
            "by id, so choose a proxy that shares the teacher's tokenizer."
        )


def with_system(messages: list[list[dict]], system_prompt: str) -> list[list[dict]]:
    if not system_prompt:
        return messages
    return [[{"role": "system", "content": system_prompt}, *m] for m in messages]


def training_prompts(cfg: AntidistillationConfig) -> tuple[list[list[dict]], list[str]]:
    """The head of the seed-shuffled dataset (01_save_grad's holdout is its tail); tiny: 02's training stream."""
    ds = data.load_prompts(cfg.dataset_path, cfg.dataset_split, cfg.subset_size, cfg.seed)
    return with_system(list(ds["messages"]), cfg.system_prompt), list(ds["answer"])


def eval_prompts(cfg: AntidistillationConfig) -> tuple[list[list[dict]], list[str]]:
    """Held-out problems for the students: the tiny held-out seed, else `eval_dataset_path`."""
    if not cfg.eval_dataset_path:
        if not is_tiny(cfg):
            raise ConfigError(
                f"eval_dataset_path is empty but dataset_path is {cfg.dataset_path!r}; give the evaluation "
                "prompts (e.g. the GSM8K test split as a parquet file)."
            )
        probs = task.heldout_problems(300 if cfg.eval_size == -1 else cfg.eval_size)
        return [[{"role": "user", "content": p.prompt}] for p in probs], [p.answer for p in probs]
    ds = data.load_prompts(cfg.eval_dataset_path, cfg.eval_dataset_split, cfg.eval_size, cfg.seed)
    return with_system(list(ds["messages"]), cfg.system_prompt), list(ds["answer"])


def _drop_long(messages: list, answers: list, tok: PreTrainedTokenizerBase, cfg: AntidistillationConfig):
    keep = [i for i, m in enumerate(messages) if len(data.prompt_ids(tok, m, cfg.enable_thinking)) <= cfg.max_prompt_length]
    return [messages[i] for i in keep], [answers[i] for i in keep], len(messages) - len(keep)


def check_grads_run(cfg: AntidistillationConfig, proxy_tok: PreTrainedTokenizerBase) -> None:
    """A given grads_run must hold a gradient of this proxy (names, shapes, tokenizer), checked without weights."""
    if cfg.grads_run:
        grads.check_grads(cfg.grads_run, savegrad.proxy_skeleton(cfg.proxy_model), proxy_tok)
        needs_traces = any(lam != 0 for lam in cfg.answer_lams)
        if needs_traces and not (Path(cfg.grads_run) / savegrad.TRACES_DIR).is_dir():
            raise ConfigError(f"answer_lams needs the traces the gradient was computed on, but {cfg.grads_run} has "
                              f"no {savegrad.TRACES_DIR}/; use a 01_save_grad run directory or set answer_lams to [].")  # fmt: skip
    else:
        load_config(savegrad.JOB, cfg.grads_mode)  # an unknown preset fails here, not after the run dir exists


def prepare(mode: str = "tiny", overrides: dict | None = None) -> Prepared:
    """Resolve the config, tokenizers, prompts and the gradient's fit: every cheap failure happens here."""
    cfg = load_config(JOB, mode, overrides)
    teacher_tok = savegrad.load_tokenizer(cfg.teacher_model)
    proxy_tok = savegrad.load_tokenizer(cfg.proxy_model)
    student_tok = savegrad.load_tokenizer(cfg.student_tokenizer or cfg.student_model)
    check_shared_vocab(teacher_tok, proxy_tok)
    check_grads_run(cfg, proxy_tok)
    messages, answers = training_prompts(cfg)
    messages, answers, dropped = _drop_long(messages, answers, teacher_tok, cfg)
    if not messages:
        raise ConfigError(f"every training prompt is longer than max_prompt_length={cfg.max_prompt_length}; raise it.")
    eval_messages, eval_answers = eval_prompts(cfg)
    first = teacher_tok.decode(data.prompt_ids(teacher_tok, messages[0], cfg.enable_thinking))
    return Prepared(cfg, mode, teacher_tok, proxy_tok, student_tok, messages, answers, eval_messages, eval_answers,
                    dropped, first)  # fmt: skip


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def ensure_grads(cfg: AntidistillationConfig, run: RunDir) -> Path:
    """The gradient's run directory: grads_run, or a 01_save_grad run made now in grads/ (reused on resume)."""
    if cfg.grads_run:
        return Path(cfg.grads_run)
    path = run.path / GRADS_DIR
    if (path / grads.GRADS_FILE).is_file():
        print0(f"reusing the gradient in {path}")
        return path
    over = {"teacher_model": cfg.teacher_model, "proxy_model": cfg.proxy_model, "seed": cfg.seed,
            "run_dir": str(path), "overwrite": path.exists(), "num_processes": 1}  # fmt: skip
    print0(f"no grads_run: computing the proxy gradient with 01_save_grad --mode {cfg.grads_mode} in {path}")
    return savegrad.run(cfg.grads_mode, over).path


@dataclass
class Models:
    """What every point shares: the teacher, the fp32 proxy (in CPU memory) with its gradients, and the ADS
    direction of the gradient in use (one pair of perturbed copies at a time, built when first needed)."""

    teacher: torch.nn.Module
    proxy: torch.nn.Module
    grads: dict[str, dict[str, torch.Tensor]]  # "completion" (01_save_grad's), "answer" (answer tokens only)
    method: str
    eps: float
    device: torch.device
    holdout: list[dict]  # the gradient's holdout traces in the student's tokens (for `holdout_loss`)
    directions: dict[str, ads.Direction] = field(default_factory=dict)

    def direction(self, gradient: str) -> ads.Direction:
        if gradient not in self.directions:
            self.directions.clear()  # free the other gradient's copies first
            built = ads.make_direction(self.method, self.proxy, self.grads[gradient], self.eps)
            self.directions[gradient] = built.to(self.device)
        return self.directions[gradient]

    def grad_norms(self) -> dict[str, float]:
        return {k: grads.global_norm(g) for k, g in self.grads.items()}


def load_models(cfg: AntidistillationConfig, prep: Prepared, grads_dir: Path, dev: torch.device,
                run: RunDir | None = None) -> Models:  # fmt: skip
    """Teacher on `dev`; proxy and gradients in CPU memory (the perturbed copies go to `dev` when built)."""
    dtype = torch.bfloat16 if cfg.bf16 and dev.type == "cuda" else torch.float32
    teacher = savegrad.load_model(cfg.teacher_model, dtype, dev).eval()
    proxy = savegrad.load_model(cfg.proxy_model, torch.float32, "cpu").eval()
    named = {"completion": grads.load_grads(grads_dir, proxy, prep.proxy_tokenizer)}
    if any(p.gradient == "answer" for p in sweep_points(cfg)):
        named["answer"] = answer_gradient(cfg, proxy, prep.proxy_tokenizer, grads_dir, run)
    holdout = holdout_rows(grads_dir, prep.student_tokenizer, cfg)
    return Models(teacher, proxy, named, cfg.ads_method, cfg.eps, dev, holdout)


def answer_start(text: str, cfg: AntidistillationConfig) -> int | None:
    """Where a completion's final answer begins: after the tiny task's ';', else at the last \\boxed."""
    if is_tiny(cfg):
        at = text.rfind(task.ANSWER_SEP)
        return None if at < 0 else at + 1
    at = text.rfind("\\boxed")
    return None if at < 0 else at


def answer_labels(tok: PreTrainedTokenizerBase, input_ids: list[int], labels: list[int], start: int) -> list[int]:
    """`labels` with everything before the answer (character `start` of the completion) set to -100: the first
    completion token whose decoded prefix reaches past `start`, found by bisection, and all after it."""
    pos = [i for i, t in enumerate(labels) if t != sft.IGNORE]
    lo, hi = 0, len(pos) - 1
    while lo < hi:  # smallest j with len(decode(completion[: j + 1])) > start
        mid = (lo + hi) // 2
        if len(tok.decode(input_ids[pos[0] : pos[mid] + 1], skip_special_tokens=True)) > start:
            hi = mid
        else:
            lo = mid + 1
    return [t if i >= pos[lo] else sft.IGNORE for i, t in enumerate(labels)]


def answer_rows(traces: list[dict], tok: PreTrainedTokenizerBase, cfg: AntidistillationConfig) -> list[dict]:
    """The gradient run's traces with the loss on their answer tokens only; traces without an answer are left out."""
    rows = []
    for t in traces:
        start = answer_start(t["messages"][-1]["content"], cfg)
        if start is not None and any(x != sft.IGNORE for x in t["labels"]):
            rows.append({"input_ids": t["input_ids"], "labels": answer_labels(tok, t["input_ids"], t["labels"], start)})
    if not rows:
        raise ConfigError("no trace of the gradient run has a final answer to take the answer-token gradient on; "
                          "leave answer_lams empty.")  # fmt: skip
    return rows


def answer_gradient(cfg: AntidistillationConfig, proxy: torch.nn.Module, tok: PreTrainedTokenizerBase,
                    grads_dir: Path, run: RunDir | None) -> dict[str, torch.Tensor]:  # fmt: skip
    """The proxy's mean NLL gradient on the answer tokens of the gradient run's traces (same normalisation as
    01_save_grad), saved in grads_answer/ of this run; reused from there when it exists."""
    saved = run.path / ANSWER_GRADS_DIR if run is not None else None
    if saved is not None and (saved / grads.GRADS_FILE).is_file():
        return grads.load_grads(saved, proxy, tok)
    if not (Path(grads_dir) / savegrad.TRACES_DIR).is_dir():
        raise ConfigError(f"answer_lams needs the traces the gradient was computed on, but {grads_dir} has no "
                          f"{savegrad.TRACES_DIR}/; use a 01_save_grad run directory or leave answer_lams empty.")  # fmt: skip
    meta = grads.read_meta(grads_dir)
    rows = answer_rows(list(savegrad.load_traces(grads_dir)), tok, cfg)
    work = copy.deepcopy(proxy)
    named, stats = grads.mean_completion_grad(work, rows, meta.get("normalization", "trace"), 8, tok.pad_token_id,
                                              progress=True)  # fmt: skip
    named = {k: v.detach().clone() for k, v in named.items()}
    if saved is not None:
        saved.mkdir(exist_ok=True)
        grads.save_grads(saved, named, {**meta, **stats, "tokens": "answer", "derived_from": str(grads_dir)})
    return named


def write_traces(
    cfg: AntidistillationConfig, prep: Prepared, models: Models, point: Point, seed: int, dev: torch.device
) -> list[dict]:
    """The teacher answers every training prompt at this point; each record says whether its answer is right."""
    tok, check = prep.teacher_tokenizer, answer_check(cfg)
    eos = savegrad.eos_ids(tok, models.teacher)
    ids = [data.prompt_ids(tok, m, cfg.enable_thinking) for m in prep.messages]
    order = sorted(range(len(ids)), key=lambda i: (len(ids[i]), i))  # similar lengths share a batch
    direction = models.direction(point.gradient) if point.gradient else None
    torch.manual_seed(seed)  # the same noise at every point of a repeat: the sweeps differ only by λ and τ
    texts: dict[int, tuple[str, bool]] = {}
    batches = range(0, len(order), cfg.gen_batch_size)
    for s in tqdm(batches, desc=f"traces {point.name}", leave=False):
        batch = order[s : s + cfg.gen_batch_size]
        prompts_BP, mask_BP = rollout.left_pad([ids[i] for i in batch], tok.pad_token_id, dev)
        r = ads.ads_sample(
            models.teacher, prompts_BP, mask_BP, direction=direction, lam=point.lam,
            temperature=point.temperature, top_p=cfg.top_p, eos_token_id=eos, pad_token_id=tok.pad_token_id,
            max_new_tokens=cfg.max_new_tokens,
        )  # fmt: skip
        done = ~r.truncated_B(eos)
        for b, (i, text) in enumerate(zip(batch, rollout.decode_completions(tok, r))):
            texts[i] = (text, not bool(done[b]))
    return [
        {"messages": prep.messages[i], "completion": texts[i][0], "answer": prep.answers[i],
         "correct": check(texts[i][0], prep.answers[i]) if prep.answers[i] else None, "truncated": texts[i][1]}
        for i in range(len(ids))
    ]  # fmt: skip


def scratchpad_answer(completion: str) -> str | None:
    """The answer a tiny-task scratchpad implies (its column sums' last digits read back, then the final carry);
    None when the working is malformed."""
    if task.ANSWER_SEP not in completion:
        return None
    sums = []
    for step in completion.rsplit(task.ANSWER_SEP, 1)[0].split(","):
        total = step.partition("=")[2]
        if not total.isdigit():
            return None
        sums.append(int(total))
    carry = str(sums[-1] // 10) if sums[-1] >= 10 else ""
    return carry + "".join(str(v % 10) for v in reversed(sums))


def error_kinds(records: list[dict]) -> dict[str, float] | None:
    """Tiny task: the fraction of traces with a wrong answer that follows from their own (mistaken) working,
    `slip`, and with a wrong answer that contradicts it (or malformed working), `contradiction`."""
    checked = [r for r in records if r["correct"] is not None]
    if not checked:
        return None
    wrong = [r for r in checked if not r["correct"]]
    slips = sum(task.extract_answer(r["completion"]) == scratchpad_answer(r["completion"]) for r in wrong)
    return {"slip": slips / len(checked), "contradiction": (len(wrong) - slips) / len(checked)}


def teacher_accuracy(records: list[dict]) -> float | None:
    checked = [r["correct"] for r in records if r["correct"] is not None]
    return sum(checked) / len(checked) if checked else None


def fresh_student(cfg: AntidistillationConfig, dev: torch.device, seed: int) -> torch.nn.Module:
    """The student as loaded, or (student_init=scratch) its architecture with weights drawn from `seed`."""
    name = tiny.resolve(cfg.student_model)
    torch.manual_seed(seed)
    if cfg.student_init == "scratch":
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(name))
    else:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    return model.to(dev)


def sft_rows(records: list[dict], tok: PreTrainedTokenizerBase, cfg: AntidistillationConfig) -> list[dict]:
    """Each trace in the student's own chat template: input_ids, labels (-100 outside the completion)."""
    rows = []
    for rec in records:
        ids, labels = sft.completion_labels(
            tok, [*rec["messages"], {"role": "assistant", "content": rec["completion"]}], cfg.enable_thinking
        )
        if cfg.sft_max_length:
            ids, labels = ids[: cfg.sft_max_length], labels[: cfg.sft_max_length]
        if any(t != sft.IGNORE for t in labels):
            rows.append({"input_ids": ids, "labels": labels})
    return rows


def sft_steps(cfg: AntidistillationConfig, n_rows: int) -> int:
    if cfg.sft_max_steps >= 0:
        return cfg.sft_max_steps
    return max(1, math.ceil(cfg.sft_epochs * n_rows / cfg.sft_batch_size))


def batch_order(n_rows: int, batch_size: int, steps: int, seed: int) -> list[list[int]]:
    """Row indices of every step: epochs of seeded shuffles, cut into batches (an epoch may span two steps)."""
    rng, pool, out = random.Random(seed), [], []
    for _ in range(steps):
        while len(pool) < batch_size:
            epoch = list(range(n_rows))
            rng.shuffle(epoch)
            pool += epoch
        out.append(pool[:batch_size])
        del pool[:batch_size]
    return out


def distill_student(
    model: torch.nn.Module, rows: list[dict], cfg: AntidistillationConfig, pad_token_id: int, seed: int,
    desc: str = "sft",
) -> list[float]:
    """Completion-only SFT: AdamW, linear warmup then cosine, gradient clipping at 1, micro-batches summed so
    that each step's loss is the mean over all of its completion tokens. Returns the loss of every step."""
    steps = sft_steps(cfg, len(rows))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_learning_rate, weight_decay=cfg.sft_weight_decay)
    sched = get_cosine_schedule_with_warmup(opt, round(cfg.sft_warmup_ratio * steps), steps)
    dev, micro = next(model.parameters()).device, cfg.sft_micro_batch_size or cfg.sft_batch_size
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cfg.bf16 and dev.type == "cuda")
    model.train()
    losses = []
    bar = tqdm(batch_order(len(rows), cfg.sft_batch_size, steps, seed), desc=desc, leave=False)
    for idx in bar:
        n_tokens = sum(grads.completion_token_count(rows[i]["labels"]) for i in idx)
        total = 0.0
        for s in range(0, len(idx), micro):
            batch = next(grads.make_batches(rows, idx[s : s + micro], micro, pad_token_id, dev))
            with autocast:
                loss_sum_B, _ = grads.token_losses(model, batch)
            loss = loss_sum_B.sum() / n_tokens
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
        bar.set_postfix(loss=f"{total:.3f}")
    model.eval()
    return losses


def student_accuracy(model: torch.nn.Module, prep: Prepared) -> float:
    cfg = prep.cfg
    return evaluate.accuracy(
        model, prep.student_tokenizer, prep.eval_messages, prep.eval_answers, answer_check(cfg),
        max_new_tokens=cfg.eval_max_new_tokens or cfg.max_new_tokens, batch_size=cfg.gen_batch_size,
        enable_thinking=cfg.enable_thinking,
    )  # fmt: skip


HOLDOUT_LOSS_TRACES = 256  # the first traces of the gradient's holdout, enough for a steady mean


def holdout_rows(grads_dir: Path, tok: PreTrainedTokenizerBase, cfg: AntidistillationConfig) -> list[dict]:
    """The traces the proxy gradient was computed on, in the student's tokens: ADS's own objective is the
    mean completion NLL on them, which `holdout_loss` measures for a distilled student. None without traces/."""
    if not (Path(grads_dir) / savegrad.TRACES_DIR).is_dir():
        print0(f"{grads_dir} keeps no traces/: the students' held-out loss is not measured")
        return []
    traces = savegrad.load_traces(grads_dir)
    traces = traces.select(range(min(len(traces), HOLDOUT_LOSS_TRACES)))
    return sft_rows([{"messages": m[:-1], "completion": m[-1]["content"]} for m in traces["messages"]], tok, cfg)


@torch.no_grad()
def holdout_loss(model: torch.nn.Module, rows: list[dict], pad_token_id: int, batch_size: int) -> float | None:
    """Mean over traces of each trace's mean completion NLL (01_save_grad's `trace` normalisation)."""
    if not rows:
        return None
    dev, total = next(model.parameters()).device, 0.0
    for batch in grads.make_batches(rows, list(range(len(rows))), batch_size, pad_token_id, dev):
        loss_sum_B, n_B = grads.token_losses(model, batch)
        total += float((loss_sum_B / n_B).sum())
    return total / len(rows)


def _write_jsonl(path: Path, records: list[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records))


def run_once(point: Point, seed: int, prep: Prepared, models: Models, run: RunDir, dev: torch.device) -> dict:
    """Traces at this point, a fresh student distilled on them, both accuracies; in points/<name>/seed<seed>/."""
    cfg, folder = prep.cfg, run.path / POINTS_DIR / point.name / f"seed{seed}"
    if cfg.resume and (folder / "result.json").is_file():
        print0(f"resume: reusing {folder / 'result.json'}")
        return json.loads((folder / "result.json").read_text())
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    records = write_traces(cfg, prep, models, point, seed, dev)
    _write_jsonl(folder / "traces.jsonl", records)
    offload(models, dev, off=True)
    student = fresh_student(cfg, dev, seed)
    rows = sft_rows(records, prep.student_tokenizer, cfg)
    losses = distill_student(student, rows, cfg, prep.student_tokenizer.pad_token_id, seed, desc=f"sft {point.name}")
    result = {
        "seed": seed, "teacher_accuracy": teacher_accuracy(records), "student_accuracy": student_accuracy(student, prep),
        "student_holdout_loss": holdout_loss(student, models.holdout, prep.student_tokenizer.pad_token_id,
                                             cfg.sft_micro_batch_size or cfg.sft_batch_size),
        "truncated_fraction": sum(r["truncated"] for r in records) / len(records), "num_traces": len(records),
        "errors": error_kinds(records) if is_tiny(cfg) else None,
        "sft_steps": len(losses), "final_sft_loss": losses[-1] if losses else None,
        "seconds": round(time.time() - t0, 1),
    }  # fmt: skip
    run.log({"point": point.name, "seed": seed, "sft_loss": losses})
    atomic_write_text(folder / "result.json", json.dumps(result, indent=2))
    del student
    offload(models, dev, off=False)
    return result


def offload(models: Models, dev: torch.device, off: bool) -> None:
    """On a GPU, teacher and proxies wait in CPU memory while a student trains (a 7B teacher, two fp32 3B
    proxies and a 3B student with AdamW states do not fit one 80 GB GPU together); on a CPU, nothing moves."""
    if dev.type != "cuda":
        return
    target = "cpu" if off else dev
    models.teacher.to(target)
    for direction in models.directions.values():
        direction.to(target)
    torch.cuda.empty_cache()


def _mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def _mean_errors(values: list[dict | None]) -> dict[str, float] | None:
    kept = [v for v in values if v]
    return {k: sum(v[k] for v in kept) / len(kept) for k in kept[0]} if kept else None


def run_point(point: Point, prep: Prepared, models: Models, run: RunDir, dev: torch.device) -> dict:
    """The point's `repeats` runs (seeds seed, seed+1, ...) and their mean accuracies: one summary entry."""
    cfg = prep.cfg
    runs = [run_once(point, cfg.seed + k, prep, models, run, dev) for k in range(cfg.repeats)]
    return {
        **asdict(point), "name": point.name,
        "teacher_accuracy": _mean([r["teacher_accuracy"] for r in runs]),
        "student_accuracy": _mean([r["student_accuracy"] for r in runs]),
        "student_holdout_loss": _mean([r.get("student_holdout_loss") for r in runs]),
        "errors": _mean_errors([r.get("errors") for r in runs]),
        "runs": runs, "seconds": round(sum(r["seconds"] for r in runs), 1),
    }  # fmt: skip


def baseline(prep: Prepared, models: Models, dev: torch.device) -> dict:
    """The student before any distillation, where every point starts from: accuracy and held-out loss."""
    cfg, student = prep.cfg, fresh_student(prep.cfg, dev, prep.cfg.seed)
    loss = holdout_loss(student, models.holdout, prep.student_tokenizer.pad_token_id,
                        cfg.sft_micro_batch_size or cfg.sft_batch_size)  # fmt: skip
    return {"student_accuracy_before": student_accuracy(student, prep), "student_holdout_loss_before": loss}


def run(mode: str = "tiny", overrides: dict | None = None, prepared: Prepared | None = None) -> RunDir:
    """Prepare, create the run directory, compute or check the gradient, run every point; returns the run."""
    t0 = time.time()
    prep = prepared or prepare(mode, overrides)
    cfg, dev = prep.cfg, device()
    points = sweep_points(cfg)
    run = RunDir.create(cfg, job=JOB, mode=mode)
    run.write_env(device=str(dev))
    grads_dir = ensure_grads(cfg, run)
    models = load_models(cfg, prep, grads_dir, dev, run)
    before = baseline(prep, models, dev)
    print0(f"{len(points)} points, {len(prep.messages)} traces each; student before distillation: "
           f"{before['student_accuracy_before']:.3f}")  # fmt: skip
    results = []
    for point in tqdm(points, desc="trade-off points"):
        results.append(run_point(point, prep, models, run, dev))
        run.log(results[-1])
        print0(_line(results[-1]))
    summary = summarize(cfg, results, before, grads_dir, models, prep, time.time() - t0)
    run.write_summary(summary)
    plots.tradeoff(summary, path=run.figure("tradeoff"))
    plots.tradeoff_loss(summary, path=run.figure("tradeoff_holdout_loss"))
    return run


def _line(r: dict) -> str:
    acc = r["teacher_accuracy"]
    return (f"{r['name']:28s} teacher {'n/a' if acc is None else f'{acc:.3f}'}  "
            f"student {r['student_accuracy']:.3f}  ({r['seconds']:.0f} s)")  # fmt: skip


def summarize(cfg: AntidistillationConfig, results: list[dict], before: dict, grads_dir: Path, models: Models,
              prep: Prepared, seconds: float) -> dict:  # fmt: skip
    return {
        "status": "done",
        "points": results,
        **before,
        "grads_run": str(grads_dir),
        "grad_norms": models.grad_norms(),
        "eps": cfg.eps,
        "ads_method": cfg.ads_method,
        "top_p": cfg.top_p,
        "num_traces": len(prep.messages),
        "prompts_dropped": prep.dropped,
        "eval_size": len(prep.eval_messages),
        "wall_time_s": round(seconds, 1),
    }


def main(argv: list[str] | None = None) -> None:
    mode, overrides = parse_cli(JOB, "Antidistillation sampling trade-off (opdkit 04_antidistill).", argv)
    print(run(mode, overrides).path)


if __name__ == "__main__":
    main()


def load_run_config(run: RunDir | str | Path) -> tuple[AntidistillationConfig, str]:
    """The resolved config a 04_antidistill run was made with, and its mode."""
    import yaml

    path = Path(run.path if isinstance(run, RunDir) else run)
    if not (path / "config.yaml").is_file():
        raise FileNotFoundError(f"no config.yaml in {path}; expected a 04_antidistill run directory.")
    saved = yaml.safe_load((path / "config.yaml").read_text())
    if saved.get("job") != JOB:
        raise ConfigError(f"{path} is a {saved.get('job')!r} run, not a {JOB} run.")
    names = {f.name for f in fields(AntidistillationConfig)}
    return AntidistillationConfig(**{k: v for k, v in saved.items() if k in names}), saved.get("mode", "?")


class TokenLens:
    """Which tokens ADS changes, one training prompt at a time, with a finished run's teacher and gradient.

        lens = TokenLens(run)
        c = lens.compare(0, lam=0.1, seed=0)   # {"tokens": [{"text", "plain_text", "changed", ...}], ...}

    ADS and plain sampling share their random noise at every step (`ads.coupled_sample`), so a token is
    marked changed exactly where the ADS term moved the draw; the trace goes on with the ADS token.
    """

    def __init__(self, run: RunDir | str | Path, num_prompts: int = 8):
        self.cfg, _ = load_run_config(run)
        cfg, self.device = self.cfg, device()
        self.tokenizer = savegrad.load_tokenizer(cfg.teacher_model)
        messages, answers = training_prompts(cfg)
        self.messages, self.answers = messages[:num_prompts], answers[:num_prompts]
        grads_dir = Path(cfg.grads_run) if cfg.grads_run else Path(cfg.run_dir) / GRADS_DIR
        proxy_tok = savegrad.load_tokenizer(cfg.proxy_model)
        student_tok = savegrad.load_tokenizer(cfg.student_tokenizer or cfg.student_model)
        dummy = Prepared(cfg, "", self.tokenizer, proxy_tok, student_tok, [], [], [], [], 0, "")
        self.models = load_models(cfg, dummy, grads_dir, self.device, RunDir.attach(cfg.run_dir))

    @property
    def labels(self) -> list[str]:
        return [m[-1]["content"][:60] for m in self.messages]

    def _trace(self, index: int, lam: float, seed: int, method: str) -> list[dict]:
        cfg = self.cfg
        ids = data.prompt_ids(self.tokenizer, self.messages[index], cfg.enable_thinking)
        tau = cfg.ads_temperatures[0] if cfg.ads_temperatures else 1.0
        direction = self.models.direction(GRADIENTS[method]) if lam else None
        return ads.coupled_sample(
            self.models.teacher, direction, ids, lam=lam, temperature=tau, top_p=cfg.top_p,
            eos_token_id=savegrad.eos_ids(self.tokenizer, self.models.teacher),
            max_new_tokens=cfg.max_new_tokens, seed=seed,
        )  # fmt: skip

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def compare(self, index: int, lam: float, seed: int = 0, method: str = "ads") -> dict:
        """The ADS trace at λ with its changed tokens, and the plain trace drawn with the same noise; `method`
        "ads-answer" steers by the answer-token gradient."""
        if method not in GRADIENTS:
            raise ValueError(f"method={method!r} is not one of {sorted(GRADIENTS)}.")
        steps, plain = self._trace(index, lam, seed, method), self._trace(index, 0.0, seed, method)
        tokens = [{"text": self._text(s["token"]), "plain_text": self._text(s["plain_token"]),
                   "changed": s["token"] != s["plain_token"], "p_ads": s["p_ads"], "p_plain": s["p_plain"],
                   "p_plain_choice": s["p_plain_choice"]} for s in steps]  # fmt: skip
        check, answer = answer_check(self.cfg), self.answers[index]
        text = self.tokenizer.decode([s["token"] for s in steps], skip_special_tokens=True)
        plain_text = self.tokenizer.decode([s["token"] for s in plain], skip_special_tokens=True)
        return {
            "prompt": self.labels[index], "answer": answer, "lam": lam, "seed": seed, "method": method,
            "temperature": self.cfg.ads_temperatures[0] if self.cfg.ads_temperatures else 1.0,
            "tokens": tokens, "completion": text, "plain_completion": plain_text,
            "correct": check(text, answer) if answer else None,
            "plain_correct": check(plain_text, answer) if answer else None,
        }  # fmt: skip


def temperature_student_at(points: list[dict], teacher_accuracy: float) -> float | None:
    """The temperature sweep's student accuracy at this teacher accuracy, linearly interpolated between its
    two nearest points (by teacher accuracy); None outside the sweep's range or with fewer than 2 points."""
    curve = sorted((p["teacher_accuracy"], p["student_accuracy"]) for p in points
                   if p["lam"] == 0 and p["teacher_accuracy"] is not None)  # fmt: skip
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x0 <= teacher_accuracy <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (teacher_accuracy - x0) / (x1 - x0)
    return None


def gaps(summary: dict) -> list[dict]:
    """Per ADS point: its student accuracy minus the temperature sweep's at the same teacher accuracy.
    Negative: ADS hurt the distilled student more than temperature sampling did, at equal teacher accuracy."""
    out = []
    for p in summary["points"]:
        if p["lam"] == 0 or p["teacher_accuracy"] is None:
            continue
        ref = temperature_student_at(summary["points"], p["teacher_accuracy"])
        out.append({"name": p["name"], "method": p["method"], "lam": p["lam"], "temperature": p["temperature"],
                    "teacher_accuracy": p["teacher_accuracy"], "student_accuracy": p["student_accuracy"],
                    "temperature_student_accuracy": ref, "gap": None if ref is None else p["student_accuracy"] - ref})  # fmt: skip
    return out


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{v:.1%}"


def summary_table_html(summary: dict) -> str:
    """One row per point; `slip` and `contradiction` split the teacher's wrong traces (tiny task): a wrong
    answer that follows from its own working, or one that contradicts it."""
    cols = ["method", "lam", "temperature", "teacher_accuracy", "slip", "contradiction", "student_accuracy",
            "student_holdout_loss", "runs", "seconds"]  # fmt: skip
    head = "".join(f"<th>{c}</th>" for c in cols)
    rows = []
    for p in summary["points"]:
        err, loss = p.get("errors") or {}, p.get("student_holdout_loss")
        cells = [p["method"], f"{p['lam']:g}", f"{p['temperature']:g}", _pct(p["teacher_accuracy"]),
                 _pct(err.get("slip")), _pct(err.get("contradiction")), _pct(p["student_accuracy"]),
                 "–" if loss is None else f"{loss:.3f}", str(len(p.get("runs", [1]))), f"{p['seconds']:.0f}"]  # fmt: skip
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def _error_lines(summary: dict) -> list[str]:
    """Per method, the range of the share of traces whose wrong answer contradicts their own working."""
    out = []
    for method in dict.fromkeys(p["method"] for p in summary["points"]):
        shares = [p["errors"]["contradiction"] for p in summary["points"]
                  if p["method"] == method and p.get("errors")]  # fmt: skip
        if shares:
            label = plots.ADS_LABELS.get(method, method)
            out.append(f"- {label}: {min(shares):.1%} to {max(shares):.1%} of the traces have a wrong answer that "
                       "contradicts their own working (the rest of the wrong ones follow from a slip in it).")  # fmt: skip
    return out


def explain(summary: dict) -> str:
    """What this run measured, in sentences built from summary.json: each ADS point against the temperature
    sweep at the same teacher accuracy."""
    lines = [f"- student before distillation: {_pct(summary.get('student_accuracy_before'))}"]
    for gp in gaps(summary):
        label = plots.ADS_LABELS.get(gp["method"], gp["method"])
        where = (f"{label} λ={gp['lam']:g} (τ={gp['temperature']:g}): teacher {_pct(gp['teacher_accuracy'])}, "
                 f"student {_pct(gp['student_accuracy'])}")  # fmt: skip
        if gp["gap"] is None:
            lines.append(f"- {where}; outside the temperature sweep's range of teacher accuracy, no comparison.")
        else:
            verdict = "lower" if gp["gap"] < 0 else "higher"
            lines.append(f"- {where}; temperature sampling at that teacher accuracy: student "
                         f"{_pct(gp['temperature_student_accuracy'])}, so the ADS student is "
                         f"{abs(gp['gap']) * 100:.1f} points {verdict}.")  # fmt: skip
    lines += _error_lines(summary)
    runs = min(len(p.get("runs", [None])) for p in summary["points"])
    for method in dict.fromkeys(gp["method"] for gp in gaps(summary)):
        known = [gp["gap"] for gp in gaps(summary) if gp["method"] == method and gp["gap"] is not None]
        if known:
            lines.append(f"- {plots.ADS_LABELS.get(method, method)}: mean gap {sum(known) / len(known) * 100:+.1f} points "
                         f"over {len(known)} comparable point(s) (negative favours ADS).")  # fmt: skip
    lines.append(f"- each point is the mean of {runs} run(s); one run's student accuracy moves by several points with "
                 "the sampling noise and the SFT order alone (raise `repeats` to average it).")
    return "\n".join(lines)
