"""savegrad's traces: holdout prompts and the teacher's answers to them (or supplied traces), with the
proxy's tokens and labels, kept in the run's `traces/` folder (`opdkit.data.traces`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from pathlib import Path
from types import SimpleNamespace

import datasets
import torch
import torch.distributed as dist
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from opdkit import tasks, tiny
from opdkit.ads import gradient
from opdkit.config import ConfigError
from opdkit.data import labels, prompts, traces
from opdkit.data.labels import completion_labels
from opdkit.data.traces import format_trace
from opdkit.jobs.savegrad.config import SaveGradConfig
from opdkit.models import check_shared_vocab, eos_ids, load_model, load_tokenizer
from opdkit.rollout import engines, sampling
from opdkit.run.folders import RunDir, print0


def holdout_prompts(cfg: SaveGradConfig) -> datasets.Dataset:
    """The holdout prompts, with the system prompt: the task's own holdout stream where it has one (the tiny
    world's), else `tail_holdout`."""
    task = tasks.for_dataset(cfg.dataset_path)
    ds = task.reserved_holdout(cfg.subset_size, cfg.seed)
    if ds is None:
        ds = tail_holdout(task, cfg)
    if len(ds) == 0:
        raise ConfigError(
            f"the holdout of {cfg.dataset_path!r} is empty (holdout_fraction={cfg.holdout_fraction}); "
            "raise holdout_fraction so that it keeps at least one prompt. A file that repeats its prompts "
            "(raw DAPO-Math-17k) may keep none apart from the training part: use one row per prompt "
            "(python -m opdkit.data.prepare writes data/dapo-math-17k-unique.parquet)."
        )
    if not cfg.system_prompt:
        return ds
    system = {"role": "system", "content": cfg.system_prompt}
    return ds.map(lambda row: {"messages": [system, *row["messages"]]}, desc="system prompt")


def tail_holdout(task: tasks.Task, cfg: SaveGradConfig) -> datasets.Dataset:
    """The tail `holdout_fraction` of the seed-shuffled dataset (the other jobs train on its head) without the
    prompts the head holds too, first `subset_size` of it."""
    ds = task.load_prompts(cfg.dataset_path, cfg.dataset_split, -1, cfg.seed)
    start = len(ds) - round(len(ds) * cfg.holdout_fraction)
    msgs = prompts.column(ds, "messages")
    tail = prompts.apart_from(msgs[start:], prompts.prompt_keys(msgs[:start]), cfg.subset_size)
    if tail.overlap:
        print0(f"holdout: {tail.overlap} rows left out, their prompts are in the training part too")
    return ds.select([start + i for i in tail.kept])


def holdout_messages(cfg: SaveGradConfig) -> list[list[dict]]:
    """The prompt conversations a run of `cfg` computes its gradient on: its holdout prompts, or the prompts
    of its supplied traces. What the other jobs keep their training prompts apart from."""
    if cfg.traces_path:
        return [t["messages"][:-1] for t in supplied_traces(cfg)]
    return prompts.column(holdout_prompts(cfg), "messages")


def run_holdout(run_dir: str | Path) -> list[list[dict]] | None:
    """`holdout_messages` of the savegrad run in `run_dir`, rebuilt from its config.yaml (a folder without
    one: the prompts of its traces/; neither, as a bare gradient file: None, unknown)."""
    run = RunDir.attach(run_dir)
    if not (run.path / "config.yaml").is_file():
        if not (run.path / traces.TRACES_DIR).is_dir():
            return None
        return [m[:-1] for m in traces.load_traces(run.path)["messages"]]
    saved = run.read_config(SaveGradConfig.job)
    names = {f.name for f in fields(SaveGradConfig)}
    return holdout_messages(SaveGradConfig(**{k: v for k, v in saved.items() if k in names}))


def supplied_traces(cfg: SaveGradConfig) -> list[dict]:
    """Traces from `traces_path`: {messages ending with the assistant's answer, answer} per row."""
    raw = prompts.load_raw(cfg.traces_path, cfg.dataset_split)
    if cfg.trace_column not in raw.column_names:
        raise ConfigError(
            f"{cfg.traces_path!r} has no column {cfg.trace_column!r}; it has {raw.column_names}, so pass "
            "one of them as trace_column."
        )
    if len(raw) == 0:
        raise ConfigError(f"{cfg.traces_path!r} holds no traces; expected at least one row.")
    if cfg.subset_size != -1:
        raw = raw.select(range(min(cfg.subset_size, len(raw))))
    task = tasks.for_dataset(cfg.dataset_path)
    return [
        {"messages": _trace_messages(row, cfg.trace_column, i), "answer": task.reference_answer(row, None)}
        for i, row in enumerate(raw)
    ]


def _trace_messages(row: dict, column: str, i: int) -> list[dict]:
    """A row's conversation: the column's messages, or its answer text after the row's prompt."""
    value = row[column]
    if isinstance(value, str):
        prompt_col = next((c for c in prompts.PROMPT_COLUMNS if c != column and c in row), None)
        if prompt_col is None:
            raise ConfigError(
                f"row {i}: trace_column {column!r} holds text but the row has no prompt column "
                f"({list(prompts.PROMPT_COLUMNS)}); store the conversation as chat messages instead."
            )
        prompt = prompts.as_messages(row[prompt_col], i, prompt_col)
        if _rendered(value, prompt[-1]["content"]):
            raise ConfigError(
                f"row {i}: the text in {column!r} contains its own prompt (a fully rendered conversation, "
                "as the ADS gentraces.py writes); its completion cannot be found without a hard-coded "
                "marker, so store the teacher's answer alone, or chat messages."
            )
        return [*prompt, {"role": "assistant", "content": value}]
    messages = prompts.as_messages(value, i, column)
    if messages[-1]["role"] != "assistant":
        raise ConfigError(
            f"row {i} of {column!r} does not end with an assistant turn; a trace needs the answer."
        )
    return messages


def _rendered(text: str, prompt: str) -> bool:
    """Does `text` hold a whole rendered conversation: the prompt after a chat template's role markup?"""
    at = text.find(prompt.strip()) if prompt.strip() else -1
    return at > 0 and re.search(r"<\||<｜|\[INST\]|user", text[:at], re.IGNORECASE) is not None


class TeacherSampler:
    """The teacher's sampler for the configured `rollout_engine`: the kit's loop on the HF teacher, or a vLLM
    engine that loads the teacher itself (no HF copy is loaded then). `stop_ids` are the tokenizer's EOS plus
    the teacher's generation_config list."""

    def __init__(self, cfg: SaveGradConfig, tok: PreTrainedTokenizerBase, device, world: int):
        self.cfg, self.tok, self.engine, self.teacher = cfg, tok, None, None
        dtype = torch.bfloat16 if cfg.bf16 else torch.float32
        if cfg.rollout_engine == "vllm":
            path = tiny.resolve(cfg.teacher_model)
            self.engine = engines.make_engine(
                "vllm",
                model_path=path,
                dtype=str(dtype).removeprefix("torch."),
                gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                distributed=world > 1,
            )
            self.stop_ids = teacher_stop_ids(tok, path)
        else:
            self.teacher = load_model(cfg.teacher_model, dtype, device).eval()
            self.stop_ids = eos_ids(tok, self.teacher)

    def close(self) -> None:
        """Give the teacher's memory back before the gradient pass: the vLLM engine shut down (its reserved
        share with it), or the HF teacher dropped."""
        if self.engine is not None:
            self.engine.close()
        self.engine = self.teacher = None
        engines.free_memory()

    def sample(self, prompts_BP, mask_BP, budget: int, seed: int) -> sampling.Rollout:
        cfg = self.cfg
        if self.engine is not None:  # temperature 0 is vLLM's greedy
            settings = engines.SamplingSettings(
                budget, cfg.trace_temperature, cfg.trace_top_p, self.stop_ids, self.tok.pad_token_id
            )
            return self.engine.sample(None, prompts_BP, mask_BP, settings, seed)
        return sampling.sample(
            self.teacher.to(prompts_BP.device),
            prompts_BP,
            mask_BP,
            eos_token_id=self.stop_ids,
            pad_token_id=self.tok.pad_token_id,
            max_new_tokens=budget,
            temperature=cfg.trace_temperature or 1.0,
            top_p=cfg.trace_top_p,
            do_sample=cfg.trace_temperature > 0,
        )


def teacher_stop_ids(tok: PreTrainedTokenizerBase, path: str) -> list[int]:
    """The vLLM path's stop ids for the model at `path`, the same as the HF loop's `eos_ids(tok, teacher)`:
    the tokenizer's EOS plus the generation config transformers gives the loaded model, its
    generation_config.json or, in a folder without one, the config derived from config.json."""
    from transformers import AutoConfig, GenerationConfig

    try:
        gen = GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json: what from_pretrained derives (config.json's eos_token_id)
        gen = GenerationConfig.from_model_config(AutoConfig.from_pretrained(path))
    return eos_ids(tok, SimpleNamespace(generation_config=gen))


def generate_batch(
    sampler: TeacherSampler, prompt_ids: list[list[int]], device, seed: int = 0
) -> list[tuple[str, bool, list[int]]]:
    """(completion text, truncated, completion token ids with the stop token if it ended) per prompt; with
    max_length, each prompt + completion fits in it."""
    cfg, tok = sampler.cfg, sampler.tok
    prompts_BP, mask_BP = sampling.left_pad(prompt_ids, tok.pad_token_id, device)
    budget = cfg.trace_max_new_tokens
    if cfg.max_length:
        budget = min(budget, cfg.max_length - min(len(x) for x in prompt_ids))
    r = sampler.sample(prompts_BP, mask_BP, budget, seed)
    eos = sampler.stop_ids
    out = []
    for b, ids in enumerate(prompt_ids):
        keep = int(r.completion_mask_BC[b].sum())
        if cfg.max_length:
            keep = min(keep, cfg.max_length - len(ids))
        completion = r.completion_ids_BC[b, :keep].tolist()
        ended = bool(completion) and completion[-1] in eos
        out.append((tok.decode(completion, skip_special_tokens=True), not ended, completion))
    return out


@torch.no_grad()
def teacher_traces(cfg: SaveGradConfig, prep, rank: int, world: int, device: torch.device) -> list[dict]:
    """The teacher answers this process's share of the holdout prompts; every process gets all traces."""
    tok = prep.teacher_tokenizer
    sampler = TeacherSampler(cfg, tok, device, world)
    messages = prep.train_messages
    ids = [prompts.prompt_ids(tok, m, cfg.enable_thinking) for m in messages]
    mine = gradient.shard_by_length([len(x) for x in ids], rank, world)
    torch.manual_seed(cfg.seed + rank)
    local: list[tuple[int, str, bool, list[int]]] = []
    try:
        for s in tqdm(range(0, len(mine), cfg.trace_batch_size), desc="teacher traces", disable=rank != 0):
            batch = mine[s : s + cfg.trace_batch_size]
            seed = engines.rollout_seed(cfg.seed, s, rank)  # the vLLM engine's per-request seeds
            done = generate_batch(sampler, [ids[i] for i in batch], device, seed)
            local += [(i, *d) for i, d in zip(batch, done)]
    finally:
        sampler.close()  # before the gradient pass, and also when sampling failed
    check, answers = prep.task.check, prep.train_answers
    return [
        traces.trace(
            messages[i],
            text,
            answer=answers[i],
            correct=check(text, answers[i]) if answers[i] else None,
            truncated=truncated,
            teacher_ids=(ids[i], completion),
        )
        for i, text, truncated, completion in sorted(gather(local, world))
    ]


def teacher_tokens(record: dict) -> dict:
    """A generated trace as the teacher wrote it: its prompt ids (the teacher's chat template) then its
    completion ids, labels on the completion only (its stop token included when it finished, nothing
    invented when not)."""
    prompt, completion = record["teacher_ids"]
    return {
        **record,
        "input_ids": [*prompt, *completion],
        "labels": [labels.IGNORE] * len(prompt) + list(completion),
    }


def gather(local: list, world: int) -> list:
    """Every process's `local` items, in rank order, in every process."""
    if world == 1:
        return local
    parts: list[list] = [[] for _ in range(world)]
    dist.all_gather_object(parts, local)
    return [x for part in parts for x in part]


def supplied_records(cfg: SaveGradConfig, prep) -> list[dict]:
    check = prep.task.check
    return [
        {
            **t,
            "correct": check(t["messages"][-1]["content"], t["answer"]) if t["answer"] else None,
            "truncated": None,
        }
        for t in prep.traces
    ]


def traces_for(
    cfg: SaveGradConfig, prep, run: RunDir, rank: int, world: int, device: torch.device
) -> list[dict]:
    """All traces with proxy tokens, in every process: resumed from the run, supplied, or written now."""
    saved = run.path / traces.TRACES_DIR
    if cfg.resume and saved.is_dir():
        print0(f"resume: reusing the traces in {saved}")
        return list(datasets.load_from_disk(str(saved)))
    records = (
        supplied_records(cfg, prep)
        if prep.traces is not None
        else teacher_traces(cfg, prep, rank, world, device)
    )
    if cfg.proxy_tokens == "teacher":
        records = [teacher_tokens(r) for r in records]
    else:
        records = traces.with_labels(records, prep.proxy_tokenizer, cfg.enable_thinking)
    records = [{k: v for k, v in r.items() if k != "teacher_ids"} for r in records]
    if rank == 0:
        traces.save_traces(saved, records)
    return records


@dataclass
class Prepared:
    cfg: SaveGradConfig
    mode: str
    task: tasks.Task
    proxy_tokenizer: PreTrainedTokenizerBase
    teacher_tokenizer: PreTrainedTokenizerBase | None  # None when traces_path supplies the traces
    # The holdout prompts the teacher answers: the data this job's gradient is computed on (empty when
    # traces_path supplies the traces).
    train_messages: list[list[dict]]
    train_answers: list[str]
    traces: list[dict] | None  # supplied traces: messages ending with the answer, answer
    dropped: int  # holdout prompts dropped as longer than max_prompt_length
    first_example: str  # the first prompt (or supplied trace) as the model sees it


def prepared(cfg: SaveGradConfig, mode: str) -> Prepared:
    """The prompts (or supplied traces), then the tokenizers, in the original's order (data files in
    milliseconds, before any download): every cheap failure happens here."""
    if cfg.max_length and cfg.max_length <= cfg.max_prompt_length:
        raise ConfigError(
            f"max_length={cfg.max_length} leaves no room for a completion after prompts of up to "
            f"max_prompt_length={cfg.max_prompt_length} tokens; raise max_length or set it to 0."
        )
    task = tasks.for_dataset(cfg.dataset_path)
    if cfg.traces_path and cfg.proxy_tokens == "teacher":
        raise ConfigError(
            "proxy_tokens=teacher needs the teacher's own token ids, which only traces generated here have; "
            "with traces_path, set proxy_tokens=proxy (each trace re-rendered in the proxy's chat template)."
        )
    if cfg.traces_path:
        traces = supplied_traces(cfg)
        proxy_tok = load_tokenizer(cfg.proxy_model)
        if cfg.grad_tokens == "confident":  # the teacher scores the proxy's token ids
            check_shared_vocab(load_tokenizer(cfg.teacher_model), proxy_tok)
        ids, labels = completion_labels(proxy_tok, traces[0]["messages"], cfg.enable_thinking)
        return Prepared(
            cfg, mode, task, proxy_tok, None, [], [], traces, 0, format_trace(proxy_tok, ids, labels)
        )
    holdout = holdout_prompts(cfg)
    proxy_tok, teacher_tok = load_tokenizer(cfg.proxy_model), load_tokenizer(cfg.teacher_model)
    if cfg.proxy_tokens == "teacher" or cfg.grad_tokens == "confident":
        # the proxy reads the teacher's token ids, or the teacher scores the proxy's (the token kinds)
        check_shared_vocab(teacher_tok, proxy_tok)
    holdout, dropped = prompts.filter_long_prompts(
        holdout, teacher_tok, cfg.max_prompt_length, cfg.enable_thinking
    )
    collator = prompts.PromptCollator(teacher_tok, cfg.max_prompt_length, cfg.enable_thinking)
    first = prompts.format_first_prompt(holdout, collator, teacher_tok)
    engines.check_available(cfg.rollout_engine, cfg.dry_run)  # an import check, after the data and tokenizers
    messages, answers = prompts.column(holdout, "messages"), prompts.column(holdout, "answer")
    return Prepared(cfg, mode, task, proxy_tok, teacher_tok, messages, answers, None, dropped, first)
