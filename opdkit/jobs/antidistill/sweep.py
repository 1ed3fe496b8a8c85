"""antidistill's sweep: the points of the trade-off, and everything they run on: the prompts, the gradients
(the completion gradient of a savegrad run; the answer-token gradient and the gradient without the teacher's
hesitations, derived here from that run's traces) and the steering they load.

    points = sweep_points(cfg)                                  # every (method, λ, τ), in sweep order
    messages, answers = training_prompts(cfg, task)             # what the teacher answers at every point
    grads_dir = ensure_grads(cfg, run, n)        # grads_run, or a savegrad run on these prompts in grads/
    steering, holdout = load_steering(cfg, proxy_tok, student_tok, grads_dir, device, run)

Checked before anything is written (`check_grads_run`, `check_apart_from_gradient`): a given gradient must
belong to the proxy (names, shapes, tokenizer), and no training prompt may be in the holdout it was computed
on.
"""

from __future__ import annotations

import copy
import importlib.util
import multiprocessing
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from opdkit import tasks
from opdkit.ads import gradfile, tokenkinds
from opdkit.ads.gradient import mean_completion_grad
from opdkit.ads.steering import Steering
from opdkit.config import ConfigError, load_config
from opdkit.data import prompts, traces
from opdkit.jobs import savegrad
from opdkit.jobs.antidistill.config import AntidistillConfig
from opdkit.models import check_shared_vocab, load_model, load_tokenizer, model_skeleton
from opdkit.run.folders import RunDir, print0
from opdkit.sft.student import sft_rows

JOB = AntidistillConfig.job
GRADS_DIR = "grads"  # where a run without grads_run keeps the savegrad run it made
# which gradient each ADS method steers by, and the setting that holds its λ values
GRADIENTS = {"ads": "completion", "ads-answer": "answer", "ads-confident": "confident"}
SWEEPS = {"ads": "lams", "ads-answer": "answer_lams", "ads-confident": "confident_lams"}
DERIVED = ("answer", "confident")  # the gradients derived here from the gradient run's traces
HOLDOUT_LOSS_TRACES = 256  # the first traces of the gradient's holdout, enough for a steady mean


@dataclass(frozen=True)
class Point:
    """One point of the trade-off: how the teacher samples its traces."""

    method: str  # "ads", "ads-answer", "ads-confident" (their gradients: GRADIENTS), "temperature" (λ = 0)
    lam: float
    temperature: float

    @property
    def name(self) -> str:
        return f"{self.method}-lam{self.lam:g}-tau{self.temperature:g}"

    @property
    def gradient(self) -> str | None:
        return GRADIENTS.get(self.method)


@dataclass
class Prepared:
    """Everything the sweep runs on that can be checked before anything is written."""

    cfg: AntidistillConfig
    mode: str
    task: tasks.Task
    teacher_tokenizer: PreTrainedTokenizerBase
    proxy_tokenizer: PreTrainedTokenizerBase
    student_tokenizer: PreTrainedTokenizerBase
    train_messages: list[list[dict]]  # the prompts the teacher answers at every point
    train_answers: list[str]
    eval_messages: list[list[dict]]
    eval_answers: list[str]
    dropped: int
    first_example: str
    removed: dict[str, int] = field(default_factory=prompts.removed)  # evaluation rows passed over (overlap)
    gradient_holdout: str = ""  # what `check_apart_from_gradient` found
    started: float = field(default_factory=time.time)
    num_processes: int = 1  # the sweep's processes, once launched


def sweep_points(cfg: AntidistillConfig) -> list[Point]:
    """ADS points (every λ at every ADS temperature), the answer-gradient's and the confident gradient's ADS
    points, then the temperature sweep; λ = 0 is temperature sampling whatever the sweep, and each (method,
    λ, τ) runs once."""
    triples = [
        (method, lam, tau)
        for method, sweep in SWEEPS.items()
        for tau in cfg.ads_temperatures
        for lam in getattr(cfg, sweep)
    ]
    triples += [("temperature", 0.0, tau) for tau in cfg.temperatures]
    out: dict[tuple, Point] = {}
    for method, lam, tau in triples:
        key = (method if lam != 0 else "temperature", lam, tau)
        out.setdefault(key, Point(*key))
    by_name: dict[str, list[Point]] = {}
    for p in out.values():
        by_name.setdefault(p.name, []).append(p)
    shared = {name: ps for name, ps in by_name.items() if len(ps) > 1}
    if shared:
        listed = "; ".join(
            f"{name}: " + ", ".join(f"λ={p.lam!r} τ={p.temperature!r}" for p in ps)
            for name, ps in shared.items()
        )
        raise ConfigError(
            f"points would share a folder: their names write λ and τ to six significant digits ({listed}); "
            "make the values differ within six digits or drop all but one of each group."
        )
    return list(out.values())


def with_system(messages: list[list[dict]], system_prompt: str) -> list[list[dict]]:
    if not system_prompt:
        return messages
    return [[{"role": "system", "content": system_prompt}, *m] for m in messages]


def training_prompts(cfg: AntidistillConfig, task: tasks.Task) -> tuple[list[list[dict]], list[str]]:
    """The head of the seed-shuffled dataset (savegrad's holdout is its tail); tiny: 02's training
    stream."""
    ds = task.load_prompts(cfg.dataset_path, cfg.dataset_split, cfg.subset_size, cfg.seed)
    return with_system(prompts.column(ds, "messages"), cfg.system_prompt), prompts.column(ds, "answer")


def eval_prompts(
    cfg: AntidistillConfig, task: tasks.Task, train_messages: list[list[dict]]
) -> tuple[list[list[dict]], list[str], dict[str, int]]:
    """Held-out problems for the students, none of them a training prompt (by `prompts.prompt_key`), so one
    file may serve both: `eval_dataset_path` (the first `eval_size` distinct prompts of its seed shuffle
    that are not trained on), else the task's own held-out problems. Also the rows passed over."""
    taken = prompts.prompt_keys(train_messages)
    if not cfg.eval_dataset_path:
        if not task.has_heldout:
            raise ConfigError(
                f"eval_dataset_path is empty but dataset_path is {cfg.dataset_path!r}; give the evaluation "
                "prompts (e.g. the GSM8K test split as a parquet file)."
            )
        messages, answers = task.heldout(300 if cfg.eval_size == -1 else cfg.eval_size)
        kept = prompts.apart_from(messages, taken)
        held = [messages[i] for i in kept.kept], [answers[i] for i in kept.kept]
    else:
        ds, kept = tasks.for_dataset(cfg.eval_dataset_path).load_apart(
            cfg.eval_dataset_path, cfg.eval_dataset_split, cfg.eval_size, cfg.seed, taken
        )
        held = with_system(prompts.column(ds, "messages"), cfg.system_prompt), prompts.column(ds, "answer")
    if not held[0]:
        raise ConfigError(
            f"every evaluation prompt of {cfg.eval_dataset_path or 'the held-out problems'} is a training "
            f"prompt ({kept.overlap} passed over); give evaluation prompts apart from dataset_path's first "
            f"subset_size={cfg.subset_size}, or lower subset_size."
        )
    return *held, prompts.removed(eval_in_train=kept.overlap, eval_repeats=kept.repeats)


# What defines the prompts a gradient's holdout is cut from, and how they are rendered: a savegrad run this
# run starts (grads_run empty) takes them from this run, so its holdout is the tail of the shuffle whose head
# the teacher answers here. `subset_size` is not among them: savegrad's counts the holdout, this run's its
# training prompts.
HOLDOUT_FIELDS = (
    "dataset_path",
    "dataset_split",
    "seed",
    "max_prompt_length",
    "system_prompt",
    "enable_thinking",
)


def grads_overrides(cfg: AntidistillConfig, run_dir: str = "") -> dict:
    """savegrad's overrides when this run computes its own gradient (grads_run empty): this run's teacher and
    proxy, its prompts (`HOLDOUT_FIELDS`) and the gradient variant (`grad_tokens`, `grad_entropy`), over
    `grads_mode`'s preset."""
    return {
        "teacher_model": cfg.teacher_model,
        "proxy_model": cfg.proxy_model,
        "grad_tokens": cfg.grad_tokens,
        "grad_entropy": cfg.grad_entropy,
        **{name: getattr(cfg, name) for name in HOLDOUT_FIELDS},
        **({"run_dir": run_dir} if run_dir else {}),
    }


def grads_config(cfg: AntidistillConfig, run_dir: str = "") -> savegrad.SaveGradConfig:
    """The config of the savegrad run this run starts when grads_run is empty (`grads_overrides` over
    `grads_mode`'s preset); a ConfigError when that preset cannot cut a holdout from this run's prompts."""
    saved = load_config(savegrad.SaveGradConfig, cfg.grads_mode, grads_overrides(cfg, run_dir))
    own_stream = tasks.for_dataset(cfg.dataset_path).reserved_holdout(1, cfg.seed) is not None
    if not own_stream and not saved.traces_path and saved.holdout_fraction >= 1.0:
        raise ConfigError(
            f"grads_mode={cfg.grads_mode!r} holds out the whole of dataset_path (holdout_fraction="
            f"{saved.holdout_fraction:g}, meant for the tiny task's own problem stream), so its gradient "
            f"would be computed on the very prompts the teacher answers here; with a file "
            f"({cfg.dataset_path!r}) choose a grads_mode that holds out its tail (full, ads-paper) or give "
            "grads_run."
        )
    return saved


def check_apart_from_gradient(cfg: AntidistillConfig, train_messages: list[list[dict]]) -> str:
    """The teacher's prompts must stay off the holdout the gradient was computed on (ADS steers away from
    what helps a student there, and `student_holdout_loss` is measured on it): `grads_run`'s, rebuilt from its
    config.yaml, or the one `grads_mode` will compute. Any shared prompt is a ConfigError that counts them;
    returns what was checked (for the summary), or that a bare gradient file left nothing to check."""
    if cfg.grads_run:
        holdout, source = savegrad.run_holdout(cfg.grads_run), f"grads_run {cfg.grads_run}"
        if holdout is None:
            print0(
                f"grads_run {cfg.grads_run} has neither config.yaml nor traces/: its holdout is unknown, so "
                "the training prompts are not checked against it"
            )
            return f"not checked: {cfg.grads_run} has neither config.yaml nor traces/"
    else:
        holdout = savegrad.holdout_messages(grads_config(cfg))
        source = f"savegrad --mode {cfg.grads_mode} on {cfg.dataset_path}"
    shared = prompts.overlap_count(train_messages, prompts.prompt_keys(holdout))
    if shared:
        raise ConfigError(
            f"{shared} of the {len(train_messages)} training prompts are in the holdout of {source} "
            f"({len(holdout)} prompts), which the gradient is computed on; antidistillation needs them "
            "apart. Use a gradient computed on the same dataset_path with the same seed (its holdout is the "
            "tail of the shuffle, the training prompts its head) and a holdout_fraction that leaves "
            "subset_size rows before it, or lower subset_size."
        )
    return f"checked: none of the training prompts is among the {len(holdout)} of {source}"


def check_grads_run(cfg: AntidistillConfig, proxy_tok: PreTrainedTokenizerBase) -> None:
    """A given grads_run must hold a gradient of this proxy (names, shapes, tokenizer), checked without
    weights."""
    if cfg.grads_run:
        meta = gradfile.check_grads(cfg.grads_run, model_skeleton(cfg.proxy_model), proxy_tok)
        check_variant(cfg, meta)
        for kind in derived_gradients(cfg):
            if not (Path(cfg.grads_run) / traces.TRACES_DIR).is_dir():
                raise ConfigError(
                    f"{DERIVED_SWEEP[kind]} needs the traces the gradient was computed on, but "
                    f"{cfg.grads_run} has no {traces.TRACES_DIR}/; use a savegrad run directory or set "
                    f"{DERIVED_SWEEP[kind]} to []."
                )
    else:
        # An unknown preset, or one that cannot take this run's prompts, fails here, not after the run dir
        # exists.
        grads_config(cfg)


def check_variant(cfg: AntidistillConfig, meta: dict) -> None:
    """A given grads_run must hold the gradient variant this run asks for (`grad_tokens`, and `grad_entropy`
    for confident); a file that does not say is the whole completion gradient (all)."""
    saved = meta.get("grad_tokens", "all")
    entropy = meta.get("grad_entropy")
    if saved != cfg.grad_tokens or (saved == "confident" and entropy != cfg.grad_entropy):
        held = f"grad_tokens {saved}" + (f", grad_entropy {entropy:g}" if saved == "confident" else "")
        asked = f"grad_tokens {cfg.grad_tokens}" + (
            f", grad_entropy {cfg.grad_entropy:g}" if cfg.grad_tokens == "confident" else ""
        )
        raise ConfigError(
            f"grads_run {cfg.grads_run} holds the gradient of {held}, but this run asks for {asked}; set "
            "them to the run's, or leave grads_run empty to compute the variant asked for here."
        )


def load_run_config(run: RunDir | str | Path) -> tuple[AntidistillConfig, str]:
    """The resolved config an antidistill run was made with, and its mode."""
    saved = (run if isinstance(run, RunDir) else RunDir.attach(run)).read_config(JOB)
    names = {f.name for f in fields(AntidistillConfig)}
    return AntidistillConfig(**{k: v for k, v in saved.items() if k in names}), saved.get("mode", "?")


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def grads_path(cfg: AntidistillConfig, run: RunDir) -> Path:
    """Where the gradient is: grads_run, or grads/ in this run."""
    return Path(cfg.grads_run) if cfg.grads_run else run.path / GRADS_DIR


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
        **grads_overrides(cfg, str(path)),
        "overwrite": path.exists(),
        "num_processes": procs,
        "plan_gpu_memory_gb": cfg.plan_gpu_memory_gb,
    }
    print0(f"no grads_run: computing the proxy gradient with savegrad --mode {cfg.grads_mode} in {path}")
    return savegrad.run(cfg.grads_mode, over).path


DERIVED_SWEEP = {GRADIENTS[m]: sweep for m, sweep in SWEEPS.items() if GRADIENTS[m] in DERIVED}


def derived_gradients(cfg: AntidistillConfig) -> list[str]:
    """The derived gradients (`DERIVED`) the sweep's points steer by, in `DERIVED` order."""
    used = {p.gradient for p in sweep_points(cfg)}
    return [kind for kind in DERIVED if kind in used]


def derived_dir(run: RunDir, kind: str) -> Path:
    """Where a run keeps a derived gradient: grads_answer/, grads_confident/."""
    return run.path / f"{GRADS_DIR}_{kind}"


def derived_rows(
    cfg: AntidistillConfig, kind: str, teacher: torch.nn.Module, tok: PreTrainedTokenizerBase, held: list
) -> tuple[list[dict], dict]:
    """The gradient run's traces with the loss kept on `kind`'s tokens (`ads.tokenkinds`), and the kinds'
    counts: answer, each trace's final answer; confident, every completion token but those the teacher
    hesitates on (entropy above `grad_entropy`), scored here by the teacher."""
    answer_start = tasks.for_dataset(cfg.dataset_path).answer_start
    if kind == "answer":
        return tokenkinds.answer_rows(held, tok, answer_start), {}
    entropies = tokenkinds.teacher_entropies(teacher, held, 8, tok.pad_token_id)
    kinds = tokenkinds.token_kinds(held, entropies, tok, answer_start, cfg.grad_entropy)
    return tokenkinds.keep_kinds(held, kinds, tokenkinds.GRAD_TOKENS[kind]), tokenkinds.kind_counts(kinds)


def derived_gradient(
    cfg: AntidistillConfig,
    kind: str,
    proxy: torch.nn.Module,
    teacher: torch.nn.Module,
    tok: PreTrainedTokenizerBase,
    grads_dir: Path,
    run: RunDir | None,
) -> dict[str, torch.Tensor]:
    """The proxy's mean NLL gradient on `kind`'s tokens of the gradient run's traces (`derived_rows`; same
    normalisation as savegrad), on the proxy's device, saved in the run's `derived_dir`; loaded from there
    when it exists (a sweep's processes always find it: `ensure_derived_gradients` writes it before they
    start)."""
    sweep = DERIVED_SWEEP[kind]
    saved = derived_dir(run, kind) if run is not None else None
    if saved is not None and (saved / gradfile.GRADS_FILE).is_file():
        return gradfile.load_grads(saved, proxy, tok)
    if not (Path(grads_dir) / traces.TRACES_DIR).is_dir():
        raise ConfigError(
            f"{sweep} needs the traces the gradient was computed on, but {grads_dir} has no "
            f"{traces.TRACES_DIR}/; use a savegrad run directory or leave {sweep} empty."
        )
    meta = gradfile.read_meta(grads_dir)
    rows, counts = derived_rows(cfg, kind, teacher, tok, list(traces.load_traces(grads_dir)))
    if not rows:
        raise ConfigError(
            f"no trace of the gradient run keeps a token of kind {kind} (no final answer, or every token "
            f"uncertain) to take the gradient of {sweep} on; leave {sweep} empty."
        )
    work = copy.deepcopy(proxy)
    named, stats = mean_completion_grad(
        work, rows, meta.get("normalization", "trace"), 8, tok.pad_token_id, progress=True
    )
    named = {k: v.detach().to("cpu", torch.float32).clone() for k, v in named.items()}
    if saved is not None and run.writer:
        saved.mkdir(exist_ok=True)
        extra = {"grad_entropy": cfg.grad_entropy, "kind_counts": counts} if kind == "confident" else {}
        gradfile.save_grads(
            saved, named, {**meta, **stats, **extra, "tokens": kind, "derived_from": str(grads_dir)}
        )
    return named


def compute_derived_gradients(cfg_dict: dict, grads_dir: str, run_path: str, device: str) -> None:
    """A run's derived gradients, computed on `device` and saved in its `derived_dir`s."""
    cfg = AntidistillConfig(**cfg_dict)
    proxy = load_model(cfg.proxy_model, torch.float32, device).eval()
    teacher = None
    if "confident" in derived_gradients(cfg):
        teacher = load_model(cfg.teacher_model, teacher_dtype(cfg, torch.device(device)), device).eval()
    tok, run = load_tokenizer(cfg.proxy_model), RunDir.attach(run_path)
    for kind in derived_gradients(cfg):
        derived_gradient(cfg, kind, proxy, teacher, tok, Path(grads_dir), run)


def ensure_derived_gradients(
    cfg: AntidistillConfig, grads_dir: Path, run: RunDir, num_processes: int
) -> None:
    """Compute the derived gradients once, before the sweep's processes start, so that each of them loads
    them from the run instead of computing them again: on the first GPU when there is one (in a process of
    its own when the sweep forks several, which must find CUDA untouched here), else on the CPU."""
    todo = [k for k in derived_gradients(cfg) if not (derived_dir(run, k) / gradfile.GRADS_FILE).is_file()]
    if not todo:
        return
    args = (asdict(cfg), str(grads_dir), str(run.path))
    if torch.cuda.device_count() == 0:  # NVML's count: safe before a fork
        compute_derived_gradients(*args, "cpu")
    elif num_processes == 1:
        compute_derived_gradients(*args, "cuda")
    else:
        worker = multiprocessing.get_context("spawn").Process(
            target=compute_derived_gradients, args=(*args, "cuda")
        )
        worker.start()
        worker.join()
        if worker.exitcode != 0:
            raise RuntimeError(
                f"computing the derived gradients {todo} failed (exit code {worker.exitcode}; its traceback "
                f"is above); the gradient in {grads_dir} and its traces/ are their inputs."
            )


def teacher_dtype(cfg: AntidistillConfig, dev: torch.device) -> torch.dtype:
    return torch.bfloat16 if cfg.bf16 and dev.type == "cuda" else torch.float32


def load_steering(
    cfg: AntidistillConfig,
    proxy_tok: PreTrainedTokenizerBase,
    student_tok: PreTrainedTokenizerBase,
    grads_dir: Path,
    dev: torch.device,
    run: RunDir | None = None,
) -> tuple[Steering, list[dict]]:
    """The steering (teacher on `dev`; proxy and gradients in host memory, scaled by `grad_scale`) and the
    gradient's holdout traces in the student's tokens (what `student_holdout_loss` measures)."""
    teacher = load_model(cfg.teacher_model, teacher_dtype(cfg, dev), dev).eval()
    proxy = load_model(cfg.proxy_model, torch.float32, "cpu").eval()
    named = {"completion": gradfile.load_grads(grads_dir, proxy, proxy_tok)}
    for kind in derived_gradients(cfg):
        named[kind] = derived_gradient(cfg, kind, proxy, teacher, proxy_tok, grads_dir, run)
    if cfg.grad_scale != 1.0:  # e.g. the ADS reference's 1/W-scaled gradient (W = 8 DDP processes)
        named = {kind: {k: g * cfg.grad_scale for k, g in g_named.items()} for kind, g_named in named.items()}
    steering = Steering(teacher, proxy, named, cfg.ads_method, cfg.eps, dev)
    return steering, holdout_rows(grads_dir, student_tok, cfg)


def holdout_rows(grads_dir: Path, tok: PreTrainedTokenizerBase, cfg: AntidistillConfig) -> list[dict]:
    """The traces the proxy gradient was computed on, in the student's tokens: ADS's own objective is the
    mean completion NLL on them, which `sft.student.holdout_loss` measures for a distilled student. Empty
    without traces/."""
    if not (Path(grads_dir) / traces.TRACES_DIR).is_dir():
        print0(f"{grads_dir} keeps no traces/: the students' held-out loss is not measured")
        return []
    held = traces.load_traces(grads_dir)
    held = held.select(range(min(len(held), HOLDOUT_LOSS_TRACES)))
    return sft_rows([{"messages": m} for m in held["messages"]], tok, cfg)


def prepared(cfg: AntidistillConfig, mode: str) -> Prepared:
    """The prompts, then the tokenizers, then the gradient's fit to the proxy, in the original's order (data
    files in milliseconds, before any download): every cheap failure happens here."""
    sweep_points(cfg)  # two points sharing a folder name are a ConfigError
    if any(a != "sft" for a in cfg.attackers):  # on-policy attackers train in one process each
        cfg.accumulation_steps(1)
    task = tasks.for_dataset(cfg.dataset_path)
    messages, answers = training_prompts(cfg, task)
    eval_messages, eval_answers, removed = eval_prompts(cfg, task, messages)
    teacher_tok, proxy_tok = load_tokenizer(cfg.teacher_model), load_tokenizer(cfg.proxy_model)
    student_tok = load_tokenizer(cfg.student_tokenizer or cfg.student_model)
    check_shared_vocab(teacher_tok, proxy_tok)
    check_grads_run(cfg, proxy_tok)
    holdout_check = check_apart_from_gradient(cfg, messages)
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
