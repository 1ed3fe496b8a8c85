"""opdkit.build.tiny_world, the recipe that built the tiny world: its stream of SFT rows, its
evaluate-and-stop callback, and a few steps of the whole recipe."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM, TrainerControl

from opdkit.build import tiny_world as build
from opdkit.data.labels import IGNORE
from opdkit.tasks import tiny as task


def test_task_rows_are_drawn_from_the_seed_and_the_index(tiny_tokenizer):
    rows = build.TaskRows(tiny_tokenizer, 8, seed=5)
    assert len(rows) == 8
    assert rows[3] == build.TaskRows(tiny_tokenizer, 1000, seed=5)[3]  # not from the stream's length
    assert rows[3] != rows[4] and rows[3] != build.TaskRows(tiny_tokenizer, 8, seed=6)[3]
    for i in range(8):
        rng = random.Random(f"5-{i}")  # the row's own draw, made here again
        problem = task.sample_problem(rng)
        pad = task.scratchpad(problem, rng)
        assert task.is_valid_scratchpad(problem, pad)
        ids, labels = rows[i]["input_ids"], rows[i]["labels"]
        first = next(k for k, t in enumerate(labels) if t != IGNORE)
        prompt = tiny_tokenizer.apply_chat_template(
            [{"role": "user", "content": problem.prompt}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )["input_ids"]
        assert ids[:first] == prompt and set(labels[:first]) == {IGNORE}  # the prompt is not learned
        kept = [t for t in labels if t != IGNORE]
        assert (
            labels[first : first + len(kept)] == kept == ids[first : first + len(kept)]
        )  # one span, the ids
        assert tiny_tokenizer.decode(kept) == pad + tiny_tokenizer.eos_token
        assert set(labels[first + len(kept) :]) <= {IGNORE}


class Model(torch.nn.Linear):
    """A stand-in model that records the mode it was in at each evaluation."""

    def __init__(self) -> None:
        super().__init__(1, 1)
        self.modes: list[bool] = []


def test_evaluate_and_stop_records_every_few_steps_and_stops_when_told():
    model, values = Model(), iter([0.1, 0.5, 0.95, 0.99])
    trainer = SimpleNamespace(step_losses=[])

    def evaluate() -> float:
        model.modes.append(model.training)
        return next(values)

    stopper = build.EvaluateAndStop(trainer, evaluate, every=2, stop_when=lambda acc: acc >= 0.9)
    stops = []
    model.train()
    for step in range(1, 8):
        trainer.step_losses.append(1.0 / step)
        control = stopper.on_step_end(None, SimpleNamespace(global_step=step), TrainerControl(), model=model)
        stops.append(control.should_training_stop)
        assert model.training  # back in training mode after evaluating
    assert stopper.history == [
        {"step": 2, "loss": 1 / 2, "eval": 0.1},
        {"step": 4, "loss": 1 / 4, "eval": 0.5},
        {"step": 6, "loss": 1 / 6, "eval": 0.95},
    ]
    assert stops == [False, False, False, False, False, True, False]
    assert model.modes == [False, False, False]  # evaluated in eval mode


def test_evaluate_and_stop_every_zero_never_evaluates():
    stopper = build.EvaluateAndStop(
        SimpleNamespace(step_losses=[1.0]), lambda: 1 / 0, every=0, stop_when=bool
    )
    control = stopper.on_step_end(None, SimpleNamespace(global_step=4), TrainerControl(), model=Model())
    assert not control.should_training_stop and stopper.history == []


def test_recipe_runs_a_few_steps(tmp_path):
    rec = build.build_tiny_world(tmp_path, teacher_steps=3, student_steps=2, eval_every=2)
    for part in ("tokenizer", "teacher", "student"):
        assert (tmp_path / part).is_dir()
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "teacher").config.model_type == "qwen3"
    assert set(rec) >= {"teacher_heldout_accuracy", "student_heldout_accuracy", "build_seconds"}
