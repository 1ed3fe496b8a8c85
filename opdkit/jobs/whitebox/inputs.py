"""whitebox's inputs, its prepared run: everything that can fail cheaply, before anything is written (the
prompts, then the tokenizers, as the original does: the data file in milliseconds, before any download); above
all the training prompts and the evaluation problems, apart by text (`prompts.prompt_key`).

    prep = prepared(cfg, mode)                 # Prepared: train_dataset, eval_messages, tokenizer, ...
    split = split_prompts(task, cfg, exclude=prompt_keys(holdout))    # split.train, split.eval_messages, ...

A task with held-out problems of its own (the tiny world) trains on its training stream and evaluates on
those; any other cuts both from the dataset: in its seed shuffle, `subset_size` > 0 trains on the head (rows
in `exclude` passed over) and evaluates on the next distinct prompts that are not training prompts; -1
evaluates on the last `eval_size` distinct prompts and trains on every row whose prompt is neither one of them
nor in `exclude`. Apart by text, not by row, since a file may repeat a prompt (raw DAPO-Math-17k holds each
about 100 times).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import datasets
import torch

from opdkit import tasks
from opdkit.config import ConfigError
from opdkit.data import prompts
from opdkit.jobs import savegrad
from opdkit.jobs.whitebox.config import WhiteboxConfig
from opdkit.models import check_chat_template, check_special_tokens, check_tokenizers, load_tokenizer
from opdkit.opd.teachers import cross, served
from opdkit.rollout import ahead, build, engines
from opdkit.run.launch import run_processes
from opdkit.tasks.base import Messages, Task


@dataclass
class Split:
    """The training prompts and evaluation problems, and what was passed over to keep them apart."""

    train: datasets.Dataset
    eval_messages: list[Messages]
    eval_answers: list[str]
    removed: dict[str, int] = field(default_factory=prompts.removed)


def split_prompts(task: Task, cfg, exclude: set[str] | frozenset[str] = frozenset()) -> Split:
    """`subset_size` training prompts of `dataset_path` (-1: all) and `eval_size` evaluation problems, no
    evaluation prompt among the training prompts, no training prompt in `exclude` (`prompt_key`s, e.g. a
    gradient's holdout)."""
    if task.has_heldout:
        return _with_heldout(task, cfg, set(exclude))
    return _from_dataset(task, cfg, set(exclude))


def _with_heldout(task: Task, cfg, exclude: set[str]) -> Split:
    ds = task.load_prompts(cfg.dataset_path, cfg.dataset_split, cfg.subset_size, cfg.seed)
    train = prompts.apart_from(prompts.column(ds, "messages"), exclude)
    ds = ds.select(train.kept)
    messages, answers = task.heldout(cfg.eval_size) if cfg.eval_size else ([], [])
    held = prompts.apart_from(messages, prompts.prompt_keys(prompts.column(ds, "messages")))
    return Split(
        ds,
        [messages[i] for i in held.kept],
        [answers[i] for i in held.kept],
        prompts.removed(train_in_excluded=train.overlap, eval_in_train=held.overlap),
    )


def _from_dataset(task: Task, cfg, exclude: set[str]) -> Split:
    path, subset_size, eval_size = cfg.dataset_path, cfg.subset_size, cfg.eval_size
    if subset_size == -1:
        ds = task.load_prompts(path, cfg.dataset_split, -1, cfg.seed)
        msgs = prompts.column(ds, "messages")
        back = prompts.apart_from(msgs[::-1], set(), eval_size, distinct=True) if eval_size else None
        held = sorted(len(msgs) - 1 - i for i in back.kept) if back else []
        rest = sorted(set(range(len(msgs))) - set(held))
        in_eval = prompts.apart_from([msgs[i] for i in rest], prompts.prompt_keys([msgs[i] for i in held]))
        rest = [rest[j] for j in in_eval.kept]
        excluded = prompts.apart_from([msgs[i] for i in rest], exclude)
        train = [rest[j] for j in excluded.kept]
        counts = prompts.removed(
            train_in_eval=in_eval.overlap,
            train_in_excluded=excluded.overlap,
            eval_repeats=back.repeats if back else 0,
        )
    else:
        want = subset_size + eval_size
        ds = task.load_prompts(path, cfg.dataset_split, want, cfg.seed)
        train, held, counts = _head_split(prompts.column(ds, "messages"), subset_size, eval_size, exclude)
        if (len(train) < subset_size or len(held) < eval_size) and len(ds) == want:
            ds = task.load_prompts(path, cfg.dataset_split, -1, cfg.seed)  # passed-over rows: read further
            train, held, counts = _head_split(prompts.column(ds, "messages"), subset_size, eval_size, exclude)
    if not train or (eval_size > 0 and not held):
        raise ConfigError(
            f"{path!r} holds {len(ds)} prompts: too few for subset_size={subset_size} training prompts "
            f"and eval_size={eval_size} held-out ones apart from them by text (prompts passed over: "
            f"{counts}); lower subset_size or eval_size."
        )
    rows = ds.select(held)
    return Split(ds.select(train), list(rows["messages"]), list(rows["answer"]), counts)


def _head_split(
    msgs: list[Messages], subset_size: int, eval_size: int, exclude: set[str]
) -> tuple[list[int], list[int], dict[str, int]]:
    train = prompts.apart_from(msgs, exclude, subset_size)
    start = train.kept[-1] + 1 if train.kept else len(msgs)
    taken = prompts.prompt_keys([msgs[i] for i in train.kept])
    held = prompts.apart_from(msgs[start:], taken, eval_size, distinct=True)
    counts = prompts.removed(
        train_in_excluded=train.overlap, eval_in_train=held.overlap, eval_repeats=held.repeats
    )
    return train.kept, [start + i for i in held.kept], counts


def with_system(split: Split, system_prompt: str) -> Split:
    """Every training prompt and evaluation problem with the system message first (kept apart by the same
    rule: `prompt_key` ignores system messages)."""
    system = {"role": "system", "content": system_prompt}
    train = split.train.map(lambda row: {"messages": [system, *row["messages"]]}, desc="system prompt")
    held = [[system, *m] for m in split.eval_messages]
    return Split(train, held, split.eval_answers, split.removed)


def excluded_holdout(run_dir: str) -> list[list[dict]]:
    """The holdout prompts of the savegrad run `exclude_run` names."""
    holdout = savegrad.run_holdout(run_dir)
    if holdout is None:
        raise ConfigError(
            f"exclude_run={run_dir!r} has neither config.yaml nor traces/, so its holdout prompts are "
            "unknown; point it to the savegrad run directory itself."
        )
    return holdout


@dataclass
class Prepared:
    cfg: WhiteboxConfig
    mode: str
    task: Task
    tokenizer: object
    train_dataset: object  # datasets.Dataset of prompts: messages, answer
    eval_messages: list
    eval_answers: list
    dropped: int
    first_example: str
    eval_prompt_tokens: int = 0  # the longest evaluation prompt, chat-templated (sizes a vLLM engine)
    removed: dict[str, int] = field(default_factory=prompts.removed)  # rows passed over to keep sets apart
    teacher_tokenizer: object = None  # the teacher's own where it differs from the student's (crosstok)

    @property
    def train_messages(self) -> list[list[dict]]:
        return prompts.column(self.train_dataset, "messages")

    @property
    def teacher_reads(self) -> object:
        """The tokenizer whose ids the teacher reads (a served teacher's server is checked against it)."""
        return self.teacher_tokenizer if self.teacher_tokenizer is not None else self.tokenizer


def check_combination(cfg: WhiteboxConfig, other_vocabulary: bool) -> None:
    """What the run's teacher kind, rollout source, engine and processes need of each other, from the settings
    alone (`other_vocabulary`: the teacher's tokenizer is another one); each refusal one line, before the run
    folder is written. `combinations.table` lists every combination and what this says of it."""
    check_environment(cfg)
    check_ahead(cfg, other_vocabulary)
    if other_vocabulary and cfg.teacher_server and cfg.topk():
        raise ConfigError(
            f"teacher_logprobs {cfg.teacher_logprobs} needs a teacher with the student's tokenizer (the "
            f"served top-K ids are its vocabulary) and {cfg.teacher_model} has another; use "
            "teacher_logprobs exact (its hidden states, the exact cross-tokenizer loss)."
        )


def check_environment(cfg: WhiteboxConfig) -> None:
    """Multi-turn episodes (`environment`) are scored by every teacher kind: each transcript sent whole to a
    served teacher (its states, or its top-K log-probabilities at the positions predicting the student's
    tokens), rendered by its own chat template for a teacher of another tokenizer
    (`cross.Retokenizer.prepare_transcripts`); played in the training process or by a producer sampling
    ahead. What they need of the run: `rollout.build.check_episodes`."""
    if cfg.environment:
        build.check_episodes(cfg, cfg.parallelism == "fsdp" and run_processes(cfg.num_processes) > 1)


def prepared(cfg: WhiteboxConfig, mode: str) -> Prepared:
    """The prompts, then the tokenizers, as the original does (the data file in milliseconds, before any
    download): every cheap failure happens here, before anything is written; first of all a global batch
    that does not split over the run's processes."""
    cfg.accumulation_steps(run_processes(cfg.num_processes))
    task = tasks.for_dataset(cfg.dataset_path)
    exclude = prompts.prompt_keys(excluded_holdout(cfg.exclude_run)) if cfg.exclude_run else set()
    split = split_prompts(task, cfg, exclude)
    if cfg.system_prompt:
        split = with_system(split, cfg.system_prompt)
    tok = load_tokenizer(cfg.student_model)
    check_chat_template(tok, cfg.student_model)
    teacher_tok = load_tokenizer(cfg.teacher_model)
    other_vocabulary = cross.differ(tok, teacher_tok)
    check_combination(cfg, other_vocabulary)
    check_ahead_arms(cfg, other_vocabulary)
    if other_vocabulary:  # the cross-tokenizer loss; refused here if it cannot align
        cross.Retokenizer.of(tok, teacher_tok, cfg)
        check_chat_template(teacher_tok, cfg.teacher_model)  # the teacher reads its own chat
    else:  # one vocabulary (`differ`): the special tokens are what is left to compare
        check_special_tokens(tok, teacher_tok)
    if cfg.teacher_server and cfg.teacher_server != served.LOCAL:  # reachable, the model, its tokenizer
        served.check_job_server(cfg, teacher_tok if other_vocabulary else tok)
    # A multi-turn environment's tools are in every prompt (its system turn): measured with them.
    tools = tasks.get_environment(cfg.environment, task).tools if cfg.environment else None
    train, dropped = prompts.filter_long_prompts(
        split.train, tok, cfg.max_prompt_length, cfg.enable_thinking, tools
    )
    check_teacher_set(cfg, tok, train)
    collator = prompts.PromptCollator(tok, cfg.max_prompt_length, cfg.enable_thinking, tools)
    first = prompts.format_first_prompt(train, collator, tok)
    engines.check_available(cfg.rollout_engine, cfg.dry_run)  # an import check, after the data and tokenizers
    if cfg.rollout_engine == "vllm" and cfg.vllm_sleep and torch.cuda.device_count() == 0:
        raise ConfigError("vllm_sleep needs CUDA GPUs (vLLM has no sleep mode on CPU); set vllm_sleep false.")
    msgs = split.eval_messages
    longest = max((len(prompts.prompt_ids(tok, m, cfg.enable_thinking)) for m in msgs), default=0)
    return Prepared(
        cfg,
        mode,
        task,
        tok,
        train,
        msgs,
        split.eval_answers,
        dropped,
        first,
        longest,
        split.removed,
        teacher_tok if other_vocabulary else None,
    )


def check_ahead(cfg: WhiteboxConfig, other_vocabulary: bool) -> None:
    """Sampling ahead (`rollout_ahead`) beyond what its settings alone say (`OPDSettings.normalise`): what
    it needs of the machine and the run (`rollout.ahead.check_settings`: an unsharded student, a producer GPU
    this machine has), and a corrected run (`async_correction`) a teacher whose divergence takes per-token
    weights (neither one with another tokenizer nor a served top-K one); each failure one line, before the
    run folder is written."""
    world = run_processes(cfg.num_processes)
    ahead.check_settings(cfg, cfg.parallelism == "fsdp" and world > 1, cfg.dry_run)
    if cfg.async_correction != "none" and (other_vocabulary or (cfg.teacher_server and cfg.topk())):
        kind = (
            "the cross-tokenizer loss (a teacher with another tokenizer)"
            if other_vocabulary
            else "a top-K divergence"
        )
        raise ConfigError(
            f"async_correction={cfg.async_correction} weights the exact divergence per token, and {kind} "
            "takes no weights: use async_correction none."
        )


def check_ahead_arms(cfg: WhiteboxConfig, other_vocabulary: bool) -> None:
    """`ahead_arms` beyond what its settings alone say (`WhiteboxConfig.check_ahead_arms`): the comparison
    runs in one training process (each arm beside its producer; several processes sampling ahead are a
    setting of their own, not yet an arm), so this run does too, and a corrected arm needs a teacher whose
    divergence takes per-token weights (not one with another tokenizer); each failure one line."""
    if not cfg.ahead_arms:
        return
    world = run_processes(cfg.num_processes)
    if world > 1:
        raise ConfigError(
            f"ahead_arms={cfg.ahead_arms}: the arms are compared in one training process each, and this "
            f"run has {world}: set num_processes 1 (the synchronous run and its arms "
            "alike), or no ahead_arms."
        )
    corrected = [a.name for a in cfg.arms() if a.correction != "none"]
    if other_vocabulary and corrected:
        raise ConfigError(
            f"ahead_arms: arms {','.join(corrected)} weight the divergence per token, and the "
            "cross-tokenizer loss of a teacher with another tokenizer takes no weights: use arms without t."
        )


def check_teacher_set(cfg: WhiteboxConfig, tok, train) -> None:
    """`teachers`: each one's tokenizer is the student's, and routed rows (no `teacher_weights`) name one of
    them in a `teacher_id` column; each failure one `ConfigError` line, before anything is written."""
    specs = cfg.teacher_specs()
    if not specs:
        return
    if cfg.teacher_logprobs != "exact":
        raise ConfigError("teachers take exact divergences only: set teacher_logprobs exact.")
    for t in specs:
        try:
            check_tokenizers(tok, load_tokenizer(t.model))
        except Exception as e:  # noqa: BLE001 - one line naming the teacher
            raise ConfigError(
                f"teachers: {t.id}={t.model} does not share the student's tokenizer ({e})"
            ) from None
    if cfg.weights():
        return
    ids = {t.id for t in specs}
    if "teacher_id" not in train.column_names:
        raise ConfigError(
            f"teachers {sorted(ids)} without teacher_weights route each prompt by its teacher_id column, and "
            "this data has none: add that column, or set teacher_weights (every prompt scored by all)."
        )
    unknown = sorted(set(train["teacher_id"]) - ids)
    if unknown:
        raise ConfigError(
            f"the data's teacher_id names {unknown[:5]}, which are not among the teachers {sorted(ids)}."
        )


def overlap_facts(cfg: WhiteboxConfig, prep: Prepared) -> dict:
    """The rows passed over to keep evaluation off training and training off savegrad's holdout, and
    whether that holdout was known."""
    return {
        "prompts_removed_for_overlap": prep.removed,
        "exclude_run": cfg.exclude_run
        or "not given: training prompts were not checked against a savegrad run's holdout",
    }
