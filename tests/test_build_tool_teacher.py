"""opdkit.build.tool_teacher: the tool teacher's SFT rows (loss on the assistant's turns only) and the shipped
`tiny:teacher-tools`, which solves held-out problems when its calls are answered. (Its rebuild takes minutes:
`python -m opdkit.build.tool_teacher --out ...`; not run here.)"""

from __future__ import annotations

import json

import pytest

from opdkit import models, tiny
from opdkit.build import tool_teacher
from opdkit.data.labels import IGNORE
from opdkit.tasks import tinytools as task
from opdkit.tiny.tokenizer import IM_END


def test_a_row_labels_the_call_and_the_answer_never_the_tool_result(tiny_tokenizer):
    p = task.Problem((100, 200, 300, 999))
    row = tool_teacher.transcript_row(tiny_tokenizer, task.teacher_messages(p))
    ids, labels = row["input_ids"], row["labels"]
    labelled = [i for i, lab in zip(ids, labels) if lab != IGNORE]
    assert all(lab in (IGNORE, i) for i, lab in zip(ids, labels))
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "100+200+300+999"}}\n</tool_call>'
    assert tiny_tokenizer.decode(labelled) == f"{call}{IM_END};1599{IM_END}"
    context = tiny_tokenizer.decode([i for i, lab in zip(ids, labels) if lab == IGNORE])
    assert "<tool_response>\n1599\n</tool_response>" in context and "calculator(expression)" in context


@pytest.fixture(scope="module")
def teacher():
    return models.load_tokenizer("tiny:teacher-tools"), models.load_model("tiny:teacher-tools")


def test_the_shipped_teacher_solves_held_out_sums_with_the_tool(teacher):
    tok, model = teacher
    messages, answers = task.TinyToolsTask().heldout(64)
    acc = tool_teacher.tool_accuracy(model, tok, messages, answers)
    assert acc["called_tool"] == 1.0 and acc["tool_call_share"] == 1.0 and acc["correct"] >= 0.95
    recorded = json.loads((tiny.ASSETS / "teacher-tools" / "recipe.json").read_text())
    assert recorded["teacher_heldout_with_tool"]["n"] == 500
    assert recorded["teacher_heldout_with_tool"]["accuracy"] >= 0.95
    assert recorded["student_heldout_without_tool"]["called_tool"] == 0.0


def test_the_teacher_shares_the_students_tokenizer_and_copies_the_tools_result(teacher):
    tok, model = teacher
    models.check_tokenizers(models.load_tokenizer("tiny:student"), tok)
    assert model.config.vocab_size == len(tok) and model.config.model_type == "qwen3"
    # it answers what the tool said, not the sum: given a result off by 137, it copies that result
    probs = task.heldout_problems(16)
    told = [
        [*task.teacher_messages(p)[:2], {"role": "tool", "content": str(int(p.answer) + 137)}] for p in probs
    ]
    finals = tool_teacher.greedy_turn(model, tok, told, task.MAX_TURN_TOKENS)
    assert sum(task.extract_answer(f) == str(int(p.answer) + 137) for f, p in zip(finals, probs)) >= 15


def test_the_bpe_tool_teacher_reads_another_tokenizer_and_solves_held_out_sums_with_the_tool():
    """`tiny:teacher-bpe-tools` (`--tokenizer bpe`): teacher-bpe's tokenizer, not the student's; with the tool
    it solves held-out sums, greedy episodes through its own tokenizer and template."""
    from opdkit.opd.teachers.cross.retokenize import differ

    tok, model = models.load_tokenizer("tiny:teacher-bpe-tools"), models.load_model("tiny:teacher-bpe-tools")
    assert tok.get_vocab() == models.load_tokenizer("tiny:teacher-bpe").get_vocab()
    assert differ(models.load_tokenizer("tiny:student"), tok) and model.config.vocab_size == len(tok)
    messages, answers = task.TinyToolsTask().heldout(64)
    acc = tool_teacher.tool_accuracy(model, tok, messages, answers)
    assert acc["called_tool"] == 1.0 and acc["tool_call_share"] == 1.0 and acc["correct"] >= 0.95
    recorded = json.loads((tiny.ASSETS / "teacher-bpe-tools" / "recipe.json").read_text())
    assert recorded["teacher_heldout_with_tool"]["accuracy"] >= 0.95
    assert recorded["tokenizer"].startswith("byte-level BPE")
