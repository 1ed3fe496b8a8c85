"""A micro-batch re-tokenized for a teacher with another tokenizer (`Retokenizer`), and aligned with the
student's tokens for GOLD's cross-tokenizer divergence (`cross.divergence`); the kind that reads it is
`cross.teacher.CrossTokenizerTeacher`.

    retok = Retokenizer.of(student_tok, teacher_tok, args)           # a ConfigError where they cannot align
    own = retok.prepare(ids_BT, attn_BT, loss_mask_BT, stop_ids)     # per micro-batch, at rollout time

What the teacher reads, as GOLD builds it (`build_teacher_inputs_from_texts`): the student's chat-templated
prompt decoded with its special tokens and tokenized by the teacher's tokenizer (its own BOS added, a trailing
EOS removed), then the completion's text in the teacher's tokens, then the teacher's EOS where the student's
completion ended with a stop token (GOLD appends it to truncated completions too). The teacher's rows are the
positions that predict each of its completion tokens (`cross.prediction_positions`).

The loss of a step is the mean over the step's groups (all micro-batches and processes: the trainer counts the
groups when it counts tokens), so batch size, accumulation and processes never change the gradient, as in the
same-tokenizer path; TRL's `ULDLoss` takes the mean over a batch's rows of each row's mean over its groups,
the same when every row has as many groups. `crosstok_merge=observed-trl` (TRL's rows one position late) is
for comparisons only and refused here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

import torch
from transformers import PreTrainedTokenizerBase

from opdkit.config import ConfigError
from opdkit.opd.teachers.cross.alignment import align
from opdkit.opd.teachers.cross.settings import CrossTokenizerSettings, prediction_positions
from opdkit.opd.teachers.cross.tokenbytes import TokenBytes, Tokens, VocabMatch
from opdkit.rollout import sampling
from opdkit.rollout.multiturn import TURN_MARK
from opdkit.rollout.source import Conversations


def differ(student: PreTrainedTokenizerBase, teacher: PreTrainedTokenizerBase | None) -> bool:
    """Whether the teacher's tokenizer is another vocabulary than the student's (the cross-tokenizer path)."""
    return teacher is not None and teacher is not student and teacher.get_vocab() != student.get_vocab()


@dataclass
class Retokenizer:
    """Both tokenizers, their token bytes and shared vocabulary, and the cross-tokenizer settings: what
    re-tokenizes a micro-batch into the teacher's tokens and aligns the two (`prepare`,
    `prepare_transcripts`)."""

    student_tokenizer: PreTrainedTokenizerBase
    teacher_tokenizer: PreTrainedTokenizerBase
    settings: CrossTokenizerSettings
    student_bytes: TokenBytes | None  # None with crosstok_align=positional
    teacher_bytes: TokenBytes | None
    match: VocabMatch

    @classmethod
    def of(cls, student: PreTrainedTokenizerBase, teacher: PreTrainedTokenizerBase, settings) -> Retokenizer:
        """From the two tokenizers and any object with the `crosstok_*` fields (`OPDArguments`, a job's
        config); a ConfigError of one line when the two cannot be aligned."""
        own = CrossTokenizerSettings(
            **{f.name: getattr(settings, f.name) for f in fields(CrossTokenizerSettings)}
        )
        if own.crosstok_merge == "observed-trl":
            raise ConfigError(
                "crosstok_merge=observed-trl reads TRL's rows one position late and is for comparisons only; "
                "train with bayesian or observed."
            )
        by_bytes = own.crosstok_align == "bytes" or own.crosstok_match == "bytes"
        try:
            s_bytes = TokenBytes.of(student) if by_bytes else None
            t_bytes = TokenBytes.of(teacher) if by_bytes else None
        except ConfigError as err:
            raise ConfigError(f"the teacher's tokenizer differs from the student's and {err}") from None
        match = VocabMatch.of(student, teacher, (s_bytes, t_bytes) if own.crosstok_match == "bytes" else None)
        if own.crosstok_align != "bytes":
            s_bytes = t_bytes = None  # positional pairing reads no byte ends
        return cls(student, teacher, own, s_bytes, t_bytes, match)

    @property
    def teacher_eos(self) -> int | None:
        return self.teacher_tokenizer.eos_token_id

    def overlap(self) -> tuple[int, int]:
        """(tokens both tokenizers spell alike, the teacher's vocabulary)."""
        return len(self.match), len(self.teacher_tokenizer)

    def describe(self, teacher_path: str) -> str:
        shared, vocab = self.overlap()
        s = self.settings
        loss = (
            "hybrid (generalized JSD on the shared tokens, sorted L1 on the rest)"
            if s.crosstok_hybrid
            else "ULD"
        )
        return (
            f"teacher tokenizer {teacher_path} differs from the student's: cross-tokenizer loss ({loss}, "
            f"{s.crosstok_align} alignment, {s.crosstok_merge} merge); vocabulary overlap {shared:,} of the "
            f"teacher's {vocab:,} tokens ({shared / max(vocab, 1):.1%}); the student's has "
            f"{len(self.student_tokenizer):,}"
        )

    def _text(self, ids: list[int]) -> str:
        if self.student_bytes is not None:
            return self.student_bytes.text(ids)
        return self.student_tokenizer.decode(
            ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )

    def _teacher_tokens(self, text: str, eos: int | None) -> Tokens:
        if self.teacher_bytes is not None:
            return self.teacher_bytes.tokenize(self.teacher_tokenizer, text, eos)
        ids = self.teacher_tokenizer.encode(text, add_special_tokens=False) + (
            [eos] if eos is not None else []
        )
        return Tokens(ids, [0] * len(ids))

    def teacher_prompt(self, prompt_ids: list[int]) -> list[int]:
        """The student's prompt as the teacher reads it (as GOLD: decoded with specials, re-tokenized)."""
        text = self.student_tokenizer.decode(
            prompt_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        ids = list(self.teacher_tokenizer(text, add_special_tokens=True)["input_ids"])
        if ids and self.teacher_eos is not None and ids[-1] == self.teacher_eos:
            ids = ids[:-1]
        return ids

    def prepare(
        self, ids_BT: torch.Tensor, attn_BT: torch.Tensor, loss_mask_BT: torch.Tensor, stop_ids: list[int]
    ) -> dict:
        """A micro-batch's teacher inputs and alignment (host work, O(tokens)): `teacher_input_ids`,
        `teacher_attention_mask`, `teacher_pred_BT` (the rows of the teacher's completion tokens),
        `crosstok_alignment` and `crosstok_groups` (a 0-d tensor, for the step's count). Each row's completion
        is its loss tokens (`loss_mask_BT`: one segment, as a single-turn rollout has), its prompt the
        attended tokens before the first of them."""
        ids, attn, loss = ids_BT.cpu(), attn_BT.cpu().bool(), loss_mask_BT.cpu().bool()
        eos = self.student_tokenizer.eos_token_id
        skip = self.settings.crosstok_skip_student_eos
        students, teachers, sequences, spans = [], [], [], []
        for b in range(ids.shape[0]):
            where = loss[b].nonzero()
            first = int(where[0]) if where.numel() else ids.shape[1]
            prompt = ids[b, :first][attn[b, :first]].tolist()
            completion = ids[b][loss[b]].tolist()
            stopped = bool(completion) and completion[-1] in stop_ids
            text = self._text(completion[:-1] if stopped else completion)
            s_ids = list(completion)
            if stopped and skip and eos is not None:
                s_ids[-1] = eos  # any stop token is the EOS that skip-EOS leaves out
            s_ends = self.student_bytes.ends(s_ids) if self.student_bytes else [0] * len(s_ids)
            students.append(Tokens(s_ids, s_ends))
            t = self._teacher_tokens(text, self.teacher_eos if stopped else None)
            teachers.append(t)
            t_prompt = self.teacher_prompt(prompt)
            sequences.append(t_prompt + t.ids)
            spans.append(prediction_positions(len(t_prompt), len(t.ids), self.settings))
        plan = align(students, teachers, self.settings, student_eos=eos, teacher_eos=self.teacher_eos)
        return self.teacher_inputs(sequences, [[span] for span in spans], plan, ids_BT.device)

    def teacher_inputs(self, sequences: list[list[int]], spans: list[list[range]], plan, device) -> dict:
        """The teacher's rows left-padded, the positions in them that predict the aligned tokens (each row's
        `spans`), and the alignment `plan`: what the loss reads of a cross-tokenizer batch."""
        t_ids_BT, t_attn_BT = sampling.left_pad(sequences, _pad_id(self.teacher_tokenizer))
        t_pred_BT = torch.zeros_like(t_attn_BT, dtype=torch.bool)
        for b, (seq, row_spans) in enumerate(zip(sequences, spans)):
            shift = t_ids_BT.shape[1] - len(seq)
            for span in row_spans:
                t_pred_BT[b, shift + span.start : shift + span.stop] = True
        return {
            "teacher_input_ids": t_ids_BT.to(device),
            "teacher_attention_mask": t_attn_BT.to(device),
            "teacher_pred_BT": t_pred_BT.to(device),
            "crosstok_alignment": plan,
            "crosstok_groups": torch.tensor(float(plan.num_groups), device=device),
        }

    def prepare_transcripts(
        self,
        ids_BT: torch.Tensor,
        attn_BT: torch.Tensor,
        loss_mask_BT: torch.Tensor,
        stop_ids: list[int],
        conversations: Conversations,
    ) -> dict:
        """`prepare` for multi-turn records (several runs of loss tokens per row, the student's turns): the
        teacher reads each row's conversation rendered by its own chat template (`turn_contexts`), each
        student turn's text in its tokens (then its EOS where the turn ended at a stop token, the template's
        own EOS text after the turn left out), the rest of the rendering between them tokenized as context.
        Groups are aligned inside each turn, never across; its rows are the positions predicting each turn's
        tokens. A row of `crosstok_alignment` is a batch row (all its turns' groups)."""
        ids, loss = ids_BT.cpu(), loss_mask_BT.cpu().bool()
        eos = self.student_tokenizer.eos_token_id
        eos_text = self.teacher_tokenizer.decode([self.teacher_eos]) if self.teacher_eos is not None else ""
        bos = self.teacher_tokenizer.bos_token
        skip = self.settings.crosstok_skip_student_eos
        students, teachers, turn_row, sequences, spans = [], [], [], [], []
        for b in range(ids.shape[0]):
            texts, stops, seq, row_spans = [], [], [], []
            for start, stop in _runs(loss[b]):
                turn = ids[b, start:stop].tolist()
                stopped = turn[-1] in stop_ids
                texts.append(self._text(turn[:-1] if stopped else turn))
                stops.append(stopped)
                s_ids = list(turn)
                if stopped and skip and eos is not None:
                    s_ids[-1] = eos
                s_ends = self.student_bytes.ends(s_ids) if self.student_bytes else [0] * len(s_ids)
                students.append(Tokens(s_ids, s_ends))
                turn_row.append(b)
            contexts = self.turn_contexts(conversations.messages[b], texts, conversations)
            for k, (context, text, stopped) in enumerate(zip(contexts, texts, stops)):
                if k and stops[k - 1] and eos_text and context.startswith(eos_text):
                    context = context[len(eos_text) :]  # the EOS ending the turn before is the teacher's own
                specials = k == 0 and not (bos and context.startswith(bos))
                seq += self.teacher_tokenizer(context, add_special_tokens=specials)["input_ids"]
                if not seq:
                    raise ValueError("a student turn with nothing before it: the teacher has no row to read")
                t = self._teacher_tokens(text, self.teacher_eos if stopped else None)
                teachers.append(t)
                row_spans.append(prediction_positions(len(seq), len(t.ids), self.settings))
                seq += t.ids
            sequences.append(seq)
            spans.append(row_spans)
        plan = align(students, teachers, self.settings, student_eos=eos, teacher_eos=self.teacher_eos)
        plan = dataclasses.replace(
            plan, row_G=torch.tensor(turn_row, dtype=torch.long)[plan.row_G], num_rows=ids.shape[0]
        )
        return self.teacher_inputs(sequences, spans, plan, ids_BT.device)

    def turn_contexts(
        self, messages: list[dict], texts: list[str], conversations: Conversations
    ) -> list[str]:
        """The teacher's rendering of a conversation cut at its student turns: the text before turn k (after
        turn k-1), for each of `texts` (the student's turns, the conversation's last assistant messages).
        Rendered twice, each student turn's content once a marker and once its text: the two must agree
        (the template writes each turn's text as it is), else a ConfigError of one line names the teacher and
        the turn."""
        turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        if len(turns) < len(texts):
            raise ValueError(
                f"a conversation with {len(turns)} assistant messages for {len(texts)} student turns"
            )
        mine = turns[len(turns) - len(texts) :]
        marks = [f"{TURN_MARK}{k}@@" for k in range(len(texts))]

        def render(contents: list[str]) -> str:
            msgs = [dict(m) for m in messages]
            for i, content in zip(mine, contents):
                msgs[i]["content"] = content
            return self.teacher_tokenizer.apply_chat_template(
                msgs,
                tools=conversations.tools or None,
                tokenize=False,
                add_generation_prompt=False,
                enable_thinking=conversations.enable_thinking,
            )

        marked, real = render(marks), render(texts)
        name = self.teacher_tokenizer.name_or_path or "the teacher"
        contexts, at, want = [], 0, ""
        for k, (mark, text) in enumerate(zip(marks, texts)):
            where = marked.find(mark, at)
            if where < 0:
                raise ConfigError(
                    f"the chat template of teacher {name} does not render the student's turn {k + 1} of "
                    f"{len(texts)} as its content; a teacher of another tokenizer needs a template that does."
                )
            contexts.append(marked[at:where])
            at = where + len(mark)
            want += contexts[-1] + text
            if not real.startswith(want):
                raise ConfigError(
                    f"the chat template of teacher {name} does not reproduce the student's turn {k + 1} of "
                    f"{len(texts)} ({_short(text)}) as it was sampled: the teacher cannot score that "
                    "transcript; use a teacher whose template writes assistant turns unchanged."
                )
        return contexts


def _runs(mask_T: torch.Tensor) -> list[tuple[int, int]]:
    """(start, stop) columns of each run of True."""
    edges = torch.diff(mask_T.int(), prepend=mask_T.new_zeros(1).int(), append=mask_T.new_zeros(1).int())
    starts, stops = (edges == 1).nonzero().flatten().tolist(), (edges == -1).nonzero().flatten().tolist()
    return list(zip(starts, stops))


def _short(text: str, n: int = 40) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")


def _pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return 0 if pad is None else pad


def teacher_forward_inputs(sample: dict) -> tuple[dict, torch.Tensor]:
    """The teacher's forward arguments (positions as under left padding) and its rows."""
    attn = sample["teacher_attention_mask"]
    fwd = dict(
        input_ids=sample["teacher_input_ids"],
        attention_mask=attn,
        position_ids=sampling.position_ids_from_mask(attn),
        use_cache=False,
    )
    return fwd, sample["teacher_pred_BT"]
