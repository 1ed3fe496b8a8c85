"""Proxy-student gradient for antidistillation sampling, the job behind notebooks/01_save_grad.ipynb.

    python -m opdkit.savegrad --mode tiny                                          # CPU, seconds
    python -m opdkit.savegrad --mode full --set num_processes=4                    # one node, 4 GPUs
    torchrun --nproc_per_node 8 -m opdkit.savegrad --mode ads-paper --set run_dir=runs/ads

The teacher writes completions for holdout prompts (or `traces_path` supplies them); the proxy
student's mean completion-only gradient on them is saved in the run directory:

    traces/             datasets folder, one row per trace: messages, input_ids, labels (exactly what the
                        gradient was computed on; -100 outside the completion), answer, correct, truncated
    grads.safetensors   fp32 gradient; keys are the proxy's named_parameters() names (tied weights once)
    grads.json          proxy, tokenizer fingerprint, counts, normalization, world size, norms, version, time

`prepare` does everything that can fail cheaply before anything is written; `run` creates the run
directory and launches `process` in every process. The antidistillation notebook reads the gradient
with `opdkit.grads.load_grads(run_dir, proxy, tokenizer)`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import datasets
import torch
import torch.distributed as dist
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

import opdkit
from opdkit import data, evaluate, grads, rollout, sft, tiny
from opdkit.config import ConfigError, SaveGradConfig, load_config, parse_cli
from opdkit.launch import default_num_processes, launch, under_external_launcher
from opdkit.plots import plt
from opdkit.runs import RunDir, print0
from opdkit.tiny import task

JOB = "01_save_grad"
TRACES_DIR = "traces"
# The tiny holdout is its own problem stream, apart from the training prompts 02_whitebox draws with
# the same run seed (and from the evaluation seed): overlap is only by chance.
TINY_HOLDOUT_SEED_OFFSET = 7_919


@dataclass
class Prepared:
    cfg: SaveGradConfig
    mode: str
    proxy_tokenizer: PreTrainedTokenizerBase
    teacher_tokenizer: PreTrainedTokenizerBase | None  # None when traces_path supplies the traces
    prompts: datasets.Dataset | None  # holdout prompts (messages, answer) for the teacher
    traces: list[dict] | None  # supplied traces: messages ending with the answer, answer
    dropped: int  # holdout prompts dropped as longer than max_prompt_length
    first_example: str  # the first prompt (or supplied trace) as the model sees it


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """A tokenizer padding on the left; without a pad token, its EOS pads (generation masks it anyway)."""
    tok = AutoTokenizer.from_pretrained(tiny.resolve(name), padding_side="left")
    if tok.eos_token is None:
        raise ValueError(f"the tokenizer of {name} has no EOS token, so completions cannot end; set tokenizer.eos_token.")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def is_tiny(cfg: SaveGradConfig) -> bool:
    return cfg.dataset_path == data.TINY


def holdout_prompts(cfg: SaveGradConfig) -> datasets.Dataset:
    """The holdout prompts: the tail `holdout_fraction` of the dataset after a shuffle by seed, first
    `subset_size` of them; the tiny task draws its holdout from its own problem stream instead."""
    if is_tiny(cfg):
        ds = data.load_prompts(data.TINY, subset_size=cfg.subset_size, seed=cfg.seed + TINY_HOLDOUT_SEED_OFFSET)
    else:
        ds = data.load_prompts(cfg.dataset_path, cfg.dataset_split, -1, cfg.seed)
        start = len(ds) - round(len(ds) * cfg.holdout_fraction)
        stop = len(ds) if cfg.subset_size == -1 else min(len(ds), start + cfg.subset_size)
        ds = ds.select(range(start, stop)) if stop > start else ds.select([])
    if len(ds) == 0:
        raise ConfigError(
            f"the holdout of {cfg.dataset_path!r} is empty (holdout_fraction={cfg.holdout_fraction}); "
            "raise holdout_fraction so that it keeps at least one prompt."
        )
    if not cfg.system_prompt:
        return ds
    system = {"role": "system", "content": cfg.system_prompt}
    return ds.map(lambda row: {"messages": [system, *row["messages"]]}, desc="system prompt")


def supplied_traces(cfg: SaveGradConfig) -> list[dict]:
    """Traces from `traces_path`: {messages ending with the assistant's answer, answer} per row."""
    raw = data._load_raw(cfg.traces_path, cfg.dataset_split)
    if cfg.trace_column not in raw.column_names:
        raise ConfigError(
            f"{cfg.traces_path!r} has no column {cfg.trace_column!r}; it has {raw.column_names}, so pass one of "
            "them as trace_column."
        )
    if len(raw) == 0:
        raise ConfigError(f"{cfg.traces_path!r} holds no traces; expected at least one row.")
    if cfg.subset_size != -1:
        raw = raw.select(range(min(cfg.subset_size, len(raw))))
    return [
        {"messages": _trace_messages(row, cfg.trace_column, i), "answer": data._answer(row, None)}
        for i, row in enumerate(raw)
    ]


def _trace_messages(row: dict, column: str, i: int) -> list[dict]:
    """A row's conversation: the column's messages, or its answer text after the row's prompt."""
    value = row[column]
    if isinstance(value, str):
        prompt_col = next((c for c in data.PROMPT_COLUMNS if c != column and c in row), None)
        if prompt_col is None:
            raise ConfigError(
                f"row {i}: trace_column {column!r} holds text but the row has no prompt column "
                f"({list(data.PROMPT_COLUMNS)}); store the conversation as chat messages instead."
            )
        prompt = data._as_messages(row[prompt_col], i, prompt_col)
        if _rendered(value, prompt[-1]["content"]):
            raise ConfigError(
                f"row {i}: the text in {column!r} contains its own prompt (a fully rendered conversation, as the "
                "ADS gentraces.py writes); its completion cannot be found without a hard-coded marker, so store "
                "the teacher's answer alone, or chat messages."
            )
        return [*prompt, {"role": "assistant", "content": value}]
    messages = data._as_messages(value, i, column)
    if messages[-1]["role"] != "assistant":
        raise ConfigError(f"row {i} of {column!r} does not end with an assistant turn; a trace needs the answer.")
    return messages


def _rendered(text: str, prompt: str) -> bool:
    """Does `text` hold a whole rendered conversation: the prompt after a chat template's role markup?"""
    at = text.find(prompt.strip()) if prompt.strip() else -1
    return at > 0 and re.search(r"<\||<｜|\[INST\]|user", text[:at], re.IGNORECASE) is not None


def answer_check(cfg: SaveGradConfig) -> Callable[[str, str], bool]:
    """Is a completion right? The tiny task's exact match, else a boxed-answer match."""
    if is_tiny(cfg):
        return lambda completion, answer: task.extract_answer(completion) == answer
    return evaluate.boxed_match


def prepare(mode: str = "tiny", overrides: dict | None = None) -> Prepared:
    """Resolve the config, load tokenizers and prompts (or supplied traces): every cheap failure happens here."""
    cfg = load_config(JOB, mode, overrides)
    if cfg.max_length and cfg.max_length <= cfg.max_prompt_length:
        raise ConfigError(
            f"max_length={cfg.max_length} leaves no room for a completion after prompts of up to "
            f"max_prompt_length={cfg.max_prompt_length} tokens; raise max_length or set it to 0."
        )
    proxy_tok = load_tokenizer(cfg.proxy_model)
    if cfg.traces_path:
        traces = supplied_traces(cfg)
        ids, labels = _completion_labels(proxy_tok, traces[0]["messages"], cfg.enable_thinking, 0)
        return Prepared(cfg, mode, proxy_tok, None, None, traces, 0, format_trace(proxy_tok, ids, labels))
    teacher_tok = load_tokenizer(cfg.teacher_model)
    prompts = holdout_prompts(cfg)
    prompts, dropped = data.filter_long_prompts(prompts, teacher_tok, cfg.max_prompt_length, cfg.enable_thinking)
    collator = data.PromptCollator(teacher_tok, cfg.max_prompt_length, cfg.enable_thinking)
    first = data.format_first_prompt(prompts, collator, teacher_tok)
    return Prepared(cfg, mode, proxy_tok, teacher_tok, prompts, None, dropped, first)


def load_model(name: str, dtype: torch.dtype, device: torch.device | str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny.resolve(name), dtype=dtype).to(device)


def proxy_skeleton(name: str) -> torch.nn.Module:
    """The model's architecture without weights (meta device): enough to check a gradient's names and shapes."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny.resolve(name))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def eos_ids(tokenizer: PreTrainedTokenizerBase, model: torch.nn.Module) -> list[int]:
    """The tokenizer's EOS and whatever the model's generation config also stops at."""
    extra = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    extra = [] if extra is None else [extra] if isinstance(extra, int) else list(extra)
    return sorted({tokenizer.eos_token_id, *extra})


def generate_batch(
    teacher: torch.nn.Module, tok: PreTrainedTokenizerBase, prompt_ids: list[list[int]], cfg: SaveGradConfig
) -> list[tuple[str, bool]]:
    """(completion text, truncated) per prompt; with max_length, each prompt + completion fits in it."""
    device = next(teacher.parameters()).device
    prompts_BP, mask_BP = rollout.left_pad(prompt_ids, tok.pad_token_id, device)
    budget = cfg.max_new_tokens
    if cfg.max_length:
        budget = min(budget, cfg.max_length - min(len(x) for x in prompt_ids))
    eos = eos_ids(tok, teacher)
    r = rollout.sample(
        teacher, prompts_BP, mask_BP, eos_token_id=eos, pad_token_id=tok.pad_token_id, max_new_tokens=budget,
        temperature=cfg.gen_temperature or 1.0, top_p=cfg.gen_top_p, do_sample=cfg.gen_temperature > 0,
    )  # fmt: skip
    out = []
    for b, ids in enumerate(prompt_ids):
        keep = int(r.completion_mask_BC[b].sum())
        if cfg.max_length:
            keep = min(keep, cfg.max_length - len(ids))
        completion = r.completion_ids_BC[b, :keep].tolist()
        ended = bool(completion) and completion[-1] in eos
        out.append((tok.decode(completion, skip_special_tokens=True), not ended))
    return out


@torch.no_grad()
def teacher_traces(cfg: SaveGradConfig, prep: Prepared, rank: int, world: int, device: torch.device) -> list[dict]:
    """The teacher answers this process's share of the holdout prompts; every process gets all traces."""
    tok = prep.teacher_tokenizer
    teacher = load_model(cfg.teacher_model, torch.bfloat16 if cfg.bf16 else torch.float32, device).eval()
    messages = list(prep.prompts["messages"])
    ids = [data.prompt_ids(tok, m, cfg.enable_thinking) for m in messages]
    mine = grads.shard_by_length([len(x) for x in ids], rank, world)
    torch.manual_seed(cfg.seed + rank)
    local: list[tuple[int, str, bool]] = []
    for s in tqdm(range(0, len(mine), cfg.gen_batch_size), desc="teacher traces", disable=rank != 0):
        batch = mine[s : s + cfg.gen_batch_size]
        local += [(i, *done) for i, done in zip(batch, generate_batch(teacher, tok, [ids[i] for i in batch], cfg))]
    del teacher
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    check, answers = answer_check(cfg), list(prep.prompts["answer"])
    return [
        {"messages": [*messages[i], {"role": "assistant", "content": text}], "answer": answers[i],
         "correct": check(text, answers[i]) if answers[i] else None, "truncated": truncated}
        for i, text, truncated in sorted(_gather(local, world))
    ]  # fmt: skip


def _gather(local: list, world: int) -> list:
    if world == 1:
        return local
    parts: list[list] = [[] for _ in range(world)]
    dist.all_gather_object(parts, local)
    return [x for part in parts for x in part]


def _completion_labels(tok: PreTrainedTokenizerBase, messages: list[dict], enable_thinking: bool, i: int):
    try:
        return sft.completion_labels(tok, messages, enable_thinking)
    except ValueError as exc:
        raise ValueError(f"trace {i}: {exc}") from exc


def with_proxy_tokens(records: list[dict], tok: PreTrainedTokenizerBase, enable_thinking: bool) -> list[dict]:
    """Each trace with the proxy's `input_ids` and `labels` (-100 outside the completion) added."""
    out = []
    for i, rec in enumerate(tqdm(records, desc="tokenizing traces", leave=False, disable=len(records) < 1000)):
        ids, labels = _completion_labels(tok, rec["messages"], enable_thinking, i)
        out.append({**rec, "input_ids": ids, "labels": labels})
    return out


def supplied_records(cfg: SaveGradConfig, prep: Prepared) -> list[dict]:
    check = answer_check(cfg)
    return [
        {**t, "correct": check(t["messages"][-1]["content"], t["answer"]) if t["answer"] else None, "truncated": None}
        for t in prep.traces
    ]


def save_traces(path: Path, records: list[dict]) -> None:
    """Write the traces folder atomically: a complete `traces/` or none."""
    columns = ("messages", "input_ids", "labels", "answer", "correct", "truncated")
    ds = datasets.Dataset.from_dict({c: [r[c] for r in records] for c in columns})
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        ds.save_to_disk(str(tmp))
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_traces(run: RunDir | str | Path) -> datasets.Dataset:
    path = Path(run.path if isinstance(run, RunDir) else run) / TRACES_DIR
    if not path.is_dir():
        raise FileNotFoundError(f"no traces at {path}; expected the folder 01_save_grad writes in its run directory.")
    return datasets.load_from_disk(str(path))


def traces_for(
    cfg: SaveGradConfig, prep: Prepared, run: RunDir, rank: int, world: int, device: torch.device
) -> list[dict]:
    """All traces with proxy tokens, in every process: resumed from the run, supplied, or written now."""
    saved = run.path / TRACES_DIR
    if cfg.resume and saved.is_dir():
        print0(f"resume: reusing the traces in {saved}")
        return list(datasets.load_from_disk(str(saved)))
    records = supplied_records(cfg, prep) if prep.traces is not None else teacher_traces(cfg, prep, rank, world, device)
    records = with_proxy_tokens(records, prep.proxy_tokenizer, cfg.enable_thinking)
    if rank == 0:
        save_traces(saved, records)
    return records


def teacher_accuracy(records: list[dict]) -> float | None:
    """Fraction of checkable traces (those with a reference answer) whose answer is right."""
    checked = [r["correct"] for r in records if r.get("correct") is not None]
    return sum(checked) / len(checked) if checked else None


def grad_meta(cfg: SaveGradConfig, prep: Prepared, named: dict, stats: dict, world: int) -> dict:
    norms = grads.tensor_norms(named)
    return {
        "proxy_model": cfg.proxy_model,
        "proxy_path": tiny.resolve(cfg.proxy_model),
        "teacher_model": None if cfg.traces_path else cfg.teacher_model,
        "traces": cfg.traces_path or TRACES_DIR,
        "tokenizer_fingerprint": grads.tokenizer_fingerprint(prep.proxy_tokenizer),
        "num_traces": stats["num_traces"],
        "completion_tokens": stats["completion_tokens"],
        "normalization": cfg.normalization,
        "loss": stats["loss"],
        "grad_norm": stats["grad_norm"],
        "world_size": world,
        "batch_size": cfg.batch_size,
        "dtype": "float32",
        "num_tensors": len(named),
        "num_parameters": sum(g.numel() for g in named.values()),
        "opdkit_version": opdkit.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "tensor_norms": norms,
        "tensor_shapes": {k: list(g.shape) for k, g in named.items()},
    }


def summarize(records: list[dict], stats: dict, prep: Prepared, world: int, seconds: float) -> dict:
    lengths = [grads.completion_token_count(r["labels"]) for r in records]
    truncated = [r["truncated"] for r in records if r.get("truncated") is not None]
    return {
        "status": "done",
        "num_traces": len(records),
        "completion_tokens": sum(lengths),
        "mean_completion_tokens": sum(lengths) / len(lengths),
        "teacher_accuracy": teacher_accuracy(records),
        "truncated_fraction": sum(truncated) / len(truncated) if truncated else None,
        "prompts_dropped": prep.dropped,
        "normalization": prep.cfg.normalization,
        "proxy_loss": stats["loss"],
        "grad_norm": stats["grad_norm"],
        "world_size": world,
        "batch_size": prep.cfg.batch_size,
        "wall_time_s": round(seconds, 1),
    }


def _share_cpu(world: int, device: torch.device) -> None:
    """Processes sharing one CPU split its cores instead of each spinning up a thread per core."""
    if device.type == "cpu" and world > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))


def proxy_gradient(cfg: SaveGradConfig, prep: Prepared, records: list[dict], run: RunDir, rank: int, world: int,
                   device: torch.device) -> tuple[dict[str, torch.Tensor], dict]:  # fmt: skip
    """The fp32 proxy's mean gradient over all traces; a non-finite one marks the run failed, then raises."""
    proxy = load_model(cfg.proxy_model, torch.float32, device)
    pad = prep.proxy_tokenizer.pad_token_id
    try:
        return grads.mean_completion_grad(proxy, records, cfg.normalization, cfg.batch_size, pad, rank, world, rank == 0)
    except grads.NonFiniteGradient as exc:
        run.write_summary({"status": f"failed: {exc}", "num_traces": len(records)})
        raise


def process(cfg_dict: dict, mode: str, run_path: str, prepared: Prepared | None = None) -> None:
    """What every process runs: traces, the proxy's mean gradient over all of them, files on rank 0."""
    from accelerate import PartialState  # here, not at import: nothing may touch CUDA before the fork

    t0 = time.time()
    cfg = SaveGradConfig(**cfg_dict)
    state = PartialState(cpu=not torch.cuda.is_available())
    world, rank, device = state.num_processes, state.process_index, state.device
    _share_cpu(world, device)
    prep = prepared or prepare(mode, {k: v for k, v in cfg_dict.items() if k not in ("overwrite", "resume")})
    run = RunDir.attach(run_path)
    run.write_env(world_size=world)
    records = traces_for(cfg, prep, run, rank, world, device)
    print0(f"{len(records)} traces; teacher accuracy {teacher_accuracy(records)}; {world} process(es) on {device}")
    named, stats = proxy_gradient(cfg, prep, records, run, rank, world, device)
    if rank == 0:
        grads.save_grads(run.path, named, grad_meta(cfg, prep, named, stats, world))
    run.write_summary(summarize(records, stats, prep, world, time.time() - t0))
    print0(f"gradient norm {stats['grad_norm']:.4g} over {stats['completion_tokens']} completion tokens; {run.path}")
    state.wait_for_everyone()


def run(mode: str = "tiny", overrides: dict | None = None, prepared: Prepared | None = None) -> RunDir:
    """Prepare, create the run directory, launch the processes; returns the run directory."""
    prep = prepared or prepare(mode, overrides)
    cfg = prep.cfg
    if prepared is None:  # a notebook has shown it already
        print0(prep.first_example)
    if under_external_launcher():
        if not cfg.run_dir:
            raise ConfigError(
                "under torchrun / accelerate launch every process must write to one folder: pass --set run_dir=PATH."
            )
        run_dir = RunDir.create(cfg, job=JOB, mode=mode) if int(os.environ["RANK"]) == 0 else RunDir.attach(cfg.run_dir)
    else:
        run_dir = RunDir.create(cfg, job=JOB, mode=mode)
    n = default_num_processes(cfg.num_processes)
    # In-process runs reuse the prepared data; forked processes prepare their own (cheap) copy.
    local = n <= 1 or under_external_launcher()
    launch(process, (dataclasses.asdict(cfg), mode, str(run_dir.path), prep if local else None), n, run_dir.path)
    return run_dir


def format_trace(tok: PreTrainedTokenizerBase, input_ids: list[int], labels: list[int]) -> str:
    """A trace as the proxy reads it, special tokens kept, the completion (where the loss is) in ⟦ ⟧."""
    out, start = [], 0
    for k in range(1, len(input_ids) + 1):
        if k == len(input_ids) or (labels[k] == sft.IGNORE) != (labels[start] == sft.IGNORE):
            text = tok.decode(input_ids[start:k], skip_special_tokens=False)
            out.append(text if labels[start] == sft.IGNORE else f"⟦{text}⟧")
            start = k
    return "".join(out)


def show_traces(run: RunDir, n: int = 4) -> str:
    """The first `n` traces of a run: answer, correctness, completion length and the tokens themselves."""
    ds = load_traces(run)
    tok = load_tokenizer(_config(run)["proxy_model"])
    blocks = []
    for i, row in enumerate(ds.select(range(min(n, len(ds))))):
        head = (f"trace {i} · answer {row['answer']!r} · correct {row['correct']} · "
                f"{grads.completion_token_count(row['labels'])} completion tokens")  # fmt: skip
        blocks.append(f"{head}\n{format_trace(tok, row['input_ids'], row['labels'])}")
    return "\n\n".join(blocks)


def _config(run: RunDir) -> dict:
    import yaml

    return yaml.safe_load((run.path / "config.yaml").read_text())


def completion_lengths(run: RunDir) -> list[int]:
    return [grads.completion_token_count(labels) for labels in load_traces(run)["labels"]]


def length_histogram(run: RunDir):
    """Histogram of the traces' completion lengths in proxy tokens (what each trace's mean runs over)."""
    lengths = completion_lengths(run)
    fig, ax = plt.subplots(figsize=(6, 3))
    lo, hi = min(lengths), max(lengths)
    ax.hist(lengths, bins=range(lo, hi + 2) if hi - lo < 60 else 40, align="left", color="#37a", rwidth=0.9)
    ax.set_xlabel("completion tokens (proxy tokenizer)")
    ax.set_ylabel("traces")
    ax.set_title(f"{len(lengths)} traces, mean {sum(lengths) / len(lengths):.1f} tokens", fontsize=10)
    fig.tight_layout()
    fig.savefig(run.figure("completion_lengths"), dpi=110)
    return fig


def layer_norm_bars(run: RunDir):
    """The saved gradient's norm per layer (embeddings, each block, final norm, head) as bars."""
    layers = grads.norms_by_layer(grads.read_meta(run.path)["tensor_norms"])
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(layers)), 3.4))
    ax.bar(range(len(layers)), list(layers.values()), color="#3a7")
    ax.set_xticks(range(len(layers)), [k.removeprefix("model.") for k in layers], rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("gradient norm")
    ax.set_yscale("log")
    ax.set_title("proxy gradient norm per layer", fontsize=10)
    fig.tight_layout()
    fig.savefig(run.figure("grad_norm_by_layer"), dpi=110)
    return fig


def largest_tensors(run: RunDir, k: int = 10) -> list[dict]:
    """The `k` tensors with the largest gradient norm: name, shape, norm, share of the squared norm, RMS."""
    meta = grads.read_meta(run.path)
    norms, shapes = meta["tensor_norms"], meta["tensor_shapes"]
    total = sum(v**2 for v in norms.values()) or 1.0
    top = sorted(norms, key=norms.get, reverse=True)[:k]
    return [
        {"tensor": name, "shape": tuple(shapes[name]), "norm": norms[name], "share": norms[name] ** 2 / total,
         "rms": norms[name] / max(1, _numel(shapes[name])) ** 0.5}
        for name in top
    ]  # fmt: skip


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def main(argv: list[str] | None = None) -> None:
    mode, overrides = parse_cli(JOB, "Proxy-student gradient for antidistillation (opdkit 01_save_grad).", argv)
    run(mode, overrides)


if __name__ == "__main__":
    main()
