"""opdkit.rollout.multiturn: episodes played against an environment, one record per micro-batch. With one turn
and no tools the records are EngineRollouts' own; tool-result tokens carry exactly zero loss and gradient and
the loss is a direct reverse-KL sum over the student's tokens; malformed calls are counted and the episodes go
on; rows ending at different turns keep batching, each transcript the chat template's rendering of its
conversation; the same episodes at any process count.

The tiny tokenizer's shipped template renders no tools yet (issue 38's tool world brings one): these tests set
a test-local template that renders tools, tool calls and role tool in Qwen3's format (`TOOL_TEMPLATE`)."""

from __future__ import annotations

import torch
from helpers import call, play, settings, tiny_model

from opdkit.data.prompts import PromptCollator
from opdkit.jobs.whitebox import tooluse
from opdkit.notebook import figures
from opdkit.opd.arguments import OPDArguments
from opdkit.opd.trainer import DistillTrainer
from opdkit.rollout import engines, sampling
from opdkit.rollout.episodes import (
    CALLED_TOOL,
    CALLS,
    CORRECT,
    EPISODES,
    MALFORMED,
    TOOL_CORRECT,
    TRUNCATED,
    TURNS,
    Environment,
    StepResult,
)
from opdkit.rollout.multiturn import MultiTurnRollouts
from opdkit.rollout.source import EngineRollouts
from opdkit.tasks import tiny as task
from opdkit.tasks.calculator import CalculatorEnvironment
from opdkit.tasks.environment import NoTools
from opdkit.tiny.tokenizer import build_tokenizer

# Qwen3's rendering, shortened: the tools in a system turn, a tool result as a user turn with <tool_response>.
TOOL_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n# Tools\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools><|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{% generation %}{{- message['content'] -}}"
    "{%- for call in message.get('tool_calls', []) -%}"
    "{{- '<tool_call>\\n' + ({'name': call['function']['name'], 'arguments': call['function']['arguments']}"
    " | tojson) + '\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>' -}}{% endgeneration %}"
    "{{- '\\n' -}}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] -}}"
    "{{- '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def tool_tokenizer():
    tok = build_tokenizer()
    tok.chat_template = TOOL_TEMPLATE
    return tok


def batches(tok, sizes, tools, seed=5) -> list[dict]:
    collate = PromptCollator(tok, 512, tools=tools)
    probs = task.problems(sum(sizes), seed)
    out, at = [], 0
    for n in sizes:
        rows = [
            {"messages": [{"role": "user", "content": p.prompt}], "answer": p.answer}
            for p in probs[at : at + n]
        ]
        out.append(collate(rows))
        at += n
    return out


def test_one_turn_without_tools_gives_the_engine_sources_records():
    """max_turns 1 and an environment without tools: ids, masks, log-probabilities, truncation, sampling
    places and answers equal EngineRollouts' for the same seed, step and prompts."""
    tok = tool_tokenizer()
    student = tiny_model("tiny:student")
    s = settings(tok, max_new_tokens=27)  # short enough that some rows are truncated
    bs = batches(tok, [3, 3], tools=[])
    make = lambda: engines.HFEngine(logprobs=True)  # noqa: E731
    single = EngineRollouts(make, s, seed=7, rank=0, world=1, batch_size=3).next_step(student, bs, step=4)
    multi = MultiTurnRollouts(
        make, s, 7, 0, 1, 3, environment=NoTools(), tokenizer=tok, max_turns=1
    ).next_step(student, bs, step=4)
    assert len(single) == len(multi) == 2
    assert any(r.truncated_B.any() for r in single) and any((~r.truncated_B).any() for r in single)
    for a, b in zip(single, multi):
        for name in (
            "input_ids_BT",
            "attention_mask_BT",
            "loss_mask_BT",
            "truncated_B",
            "sampling_logprobs_BT",
        ):
            x, y = getattr(a, name), getattr(b, name)
            assert x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y), name
        assert a.sampled_as == b.sampled_as and a.answers == b.answers and b.teacher_ids is None


def rows_of(records):
    """Each row's (prompt text, full transcript ids, loss mask) by prompt."""
    tok = tool_tokenizer()
    out = {}
    for r in records:
        for b in range(r.input_ids_BT.shape[0]):
            keep = r.attention_mask_BT[b].bool()
            ids, loss = r.input_ids_BT[b][keep], r.loss_mask_BT[b][keep]
            text = tok.decode(ids, skip_special_tokens=False)
            prompt = text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
            out[prompt] = (ids, loss, r.truncated_B[b].item())
    return out


def spans(ids, loss):
    """The runs of mask-1 tokens, as lists."""
    runs, cur = [], []
    for i, m in zip(ids.tolist(), loss.tolist()):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


def test_rows_ending_at_different_turns_keep_batching_and_each_transcript_is_its_conversation():
    """Three episodes ending at turns 1, 2 and 3: each engine call samples only the rows still playing; a
    row's mask-1 runs are exactly its turns (each ending at <|im_end|>); its whole transcript is the chat
    template's rendering of its conversation (an independent render of the full message list)."""
    tok = tool_tokenizer()
    scripts = {
        "111+222": [";333"],
        "345+678": [call("345+678"), ";1023"],
        "999+999": [call("999+999"), call("1998+0"), ";1998"],
    }
    env = CalculatorEnvironment(task.TinyTask())
    records, source, engine = play(tok, scripts, env, [3])
    assert engine.calls == [3, 2, 1]
    assert source.counts[TURNS] == 6 and source.counts[CALLS] == 3 and source.counts[MALFORMED] == 0
    results = {"345+678": ["1023"], "999+999": ["1998", "1998"], "111+222": []}
    for prompt, (ids, loss, truncated) in rows_of(records).items():
        turns = scripts[prompt]
        im_end = tok.eos_token_id
        want = [tok(t, add_special_tokens=False)["input_ids"] + [im_end] for t in turns]
        assert spans(ids, loss) == want and not truncated
        conversation = [{"role": "user", "content": prompt}]
        for t, turn in enumerate(turns):
            conversation.append({"role": "assistant", "content": turn})
            if t < len(results[prompt]):
                conversation.append({"role": "tool", "content": results[prompt][t]})
        rendered = tok.apply_chat_template(conversation, tools=env.tools, tokenize=False)
        assert tok.decode(ids, skip_special_tokens=False) == rendered.removesuffix("\n")


def test_malformed_calls_are_counted_and_the_episodes_go_on():
    tok = tool_tokenizer()
    scripts = {
        "1+1": [call("1+1"), ";2"],
        "2+2": ['<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"\n</tool_call>', ";4"],
        "3+3": ['<tool_call>\n{"name": "abacus", "arguments": {"expression": "3+3"}}\n</tool_call>', ";6"],
        "4+4": [call("4**2"), ";8"],
        "5+5": ['<tool_call>\n{"name": "calculator", "arguments": {}}\n</tool_call>', ";10"],
        "6+6": [";12"],
    }
    env = CalculatorEnvironment(task.TinyTask())
    records, source, engine = play(tok, scripts, env, [3, 3])
    assert engine.calls == [6, 5]
    c = source.counts
    assert (c[EPISODES], c[CALLED_TOOL], c[CALLS], c[MALFORMED], c[TURNS]) == (6, 5, 5, 4, 11)
    assert (c[TOOL_CORRECT], c[CORRECT], c[TRUNCATED]) == (0, 0, 0)  # answer "x" for every prompt
    m = source.step_metrics(lambda t: t)  # one process: the sum is the step's own
    assert m == {
        "tool/episodes": 6.0,
        "tool/called_share": 5 / 6,
        "tool/call_correct_share": 0.0,
        "tool/calls_per_episode": 5 / 6,
        "tool/malformed": 4.0,
        "tool/malformed_share": 4 / 5,
        "tool/turns_mean": 11 / 6,
        "tool/accuracy": 0.0,
    }
    # two processes with the same counts: the totals double, the shares stay
    doubled = source.step_metrics(lambda t: 2 * t)
    assert doubled == {**m, "tool/episodes": 12.0, "tool/malformed": 8.0}
    rows = rows_of(records)
    for prompt in ("2+2", "3+3", "4+4", "5+5"):
        ids, loss, _ = rows[prompt]
        tool_text = tok.decode(ids[(loss == 0)], skip_special_tokens=False)
        assert "<tool_response>\nerror: " in tool_text, prompt
    assert "<tool_response>\n2\n</tool_response>" in tok.decode(rows["1+1"][0], skip_special_tokens=False)


def test_max_turns_and_the_episode_budget_end_an_episode():
    tok = tool_tokenizer()
    scripts = {"7+7": [call("7+7"), call("14"), call("14"), ";14"]}
    env = CalculatorEnvironment(task.TinyTask())
    records, source, engine = play(tok, scripts, env, [1], max_turns=2)
    ids, loss, truncated = rows_of(records)["7+7"]
    # two turns sampled; the second's results are not appended (no turn would read them)
    assert engine.calls == [1, 1] and len(spans(ids, loss)) == 2 and loss[-1] == 1 and not truncated
    assert source.counts[CORRECT] == 0
    # a budget the second turn reaches: it is cut at what is left, the episode truncated
    records, source, engine = play(tok, scripts, env, [1], episode_max_tokens=150)
    ids, loss, truncated = rows_of(records)["7+7"]
    after = len(ids) - int(loss.nonzero()[0])  # the tokens after the prompt
    first = len(tok(call("7+7"))["input_ids"]) + 1
    assert truncated and source.counts[TRUNCATED] == 1 and engine.calls == [1, 1]
    assert after == 150 and first < 150 - 1 and [len(x) for x in spans(ids, loss)][0] == first


def test_a_tool_turn_that_fills_the_budget_is_not_appended():
    """A tool result that would bring the episode to `episode_max_tokens` ends it there, truncated, without
    the result (no turn could read it): the record holds the student's turn only, within the budget."""
    tok = tool_tokenizer()
    scripts = {"7+7": [call("7+7"), ";14"]}
    env = CalculatorEnvironment(task.TinyTask())
    first = len(tok(call("7+7"))["input_ids"]) + 1  # the call and its stop token
    records, source, engine = play(tok, scripts, env, [1], episode_max_tokens=first + 5)
    ids, loss, truncated = rows_of(records)["7+7"]
    after = len(ids) - int(loss.nonzero()[0])
    assert truncated and source.counts[TRUNCATED] == 1 and engine.calls == [1]
    assert after == first and int(loss.sum()) == first and source.counts[CALLS] == 1


class Ok(Environment):
    """Every turn answered with a tool message (its length), so every episode plays all its turns."""

    tools = []

    def respond(self, episode, text):
        return StepResult([{"role": "tool", "content": str(len(text))}], done=False, metrics={CALLS: 1})

    def grade(self, episode):
        return {CORRECT: False, CALLED_TOOL: True}


def test_the_same_episodes_on_one_process_or_split_over_two():
    """Rows keyed by (seed, step, place, turn): one process's two micro-batches and two ranks' one each sample
    the same three-turn episodes."""
    tok = tool_tokenizer()
    student = tiny_model("tiny:student")
    s = settings(tok, max_new_tokens=40)
    env = Ok()
    bs = batches(tok, [2, 2], tools=[], seed=11)

    def run(parts, rank, world):
        src = MultiTurnRollouts(
            lambda: engines.HFEngine(logprobs=True),
            s,
            3,
            rank,
            world,
            2,
            environment=env,
            tokenizer=tok,
            max_turns=3,
        )
        return src.next_step(student, parts, step=2)

    def by_answer(records):
        out = {}
        for r in records:
            for b in range(r.input_ids_BT.shape[0]):
                keep = r.attention_mask_BT[b].bool()
                out[r.answers[b]] = (
                    r.input_ids_BT[b][keep],
                    r.loss_mask_BT[b][keep],
                    r.sampling_logprobs_BT[b][keep],
                )
        return out

    one = by_answer(run(bs, 0, 1))
    two = {**by_answer(run(bs[:1], 0, 2)), **by_answer(run(bs[1:], 1, 2))}
    assert one.keys() == two.keys() and len(one) == 4
    for k in one:
        assert torch.equal(one[k][0], two[k][0]) and torch.equal(one[k][1], two[k][1])
        # log-probabilities within the float32 floor (other padding, other rounding)
        torch.testing.assert_close(one[k][2], two[k][2], rtol=0, atol=1e-4)
    # episodes of several turns (a turn that hits its limit without a stop token ends its episode)
    assert sum(len(spans(ids, loss)) for ids, loss, _ in one.values()) > len(one)
    # the turns are drawn from different streams: turn keys differ from the episode key
    from opdkit.rollout.multiturn import turn_seeds

    keys = engines.rollout_seeds(3, 2, [0, 1])
    assert turn_seeds(keys, 0) == keys and len({*turn_seeds(keys, 1), *turn_seeds(keys, 2), *keys}) == 6


class _Noisy(torch.nn.Module):
    """The teacher with its final states replaced by noise wherever `where_BT` is True."""

    def __init__(self, teacher, where_BT):
        super().__init__()
        self.teacher, self.where_BT = teacher, where_BT

    @property
    def base_model(self):
        outer = self

        class Backbone(torch.nn.Module):
            def forward(self, **fwd):
                out = outer.teacher.base_model(**fwd)
                h = out.last_hidden_state.clone()
                g = torch.Generator().manual_seed(1)
                h[outer.where_BT] = torch.randn(h[outer.where_BT].shape, generator=g) * 5
                out.last_hidden_state = h
                return out

        return Backbone()

    def get_output_embeddings(self):
        return self.teacher.get_output_embeddings()


def _loss_and_grads(tmp_path, teacher, record, tok):
    args = OPDArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, sample_every=0, save_strategy="no", max_steps=1
    )
    trainer = DistillTrainer(
        model=tiny_model("tiny:student"), args=args, processing_class=tok, teacher_model=teacher
    )
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, trainer.micro_batch(record))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


def test_tool_tokens_carry_no_loss_and_no_gradient_and_the_loss_is_the_direct_reverse_kl(tmp_path):
    tok = tool_tokenizer()
    scripts = {
        "358+467": [call("358+467"), ";825"],
        "12+30": [";42"],
        "5+6": [call("5+6"), call("11"), ";11"],
    }
    env = CalculatorEnvironment(task.TinyTask())
    records, _, _ = play(tok, scripts, env, [3])
    (record,) = records
    assert (record.attention_mask_BT.bool() & ~record.loss_mask_BT.bool())[:, -40:].any()  # tool tokens
    teacher = tiny_model("tiny:teacher")
    pred_BT = record.predicting_BT()
    # every position that predicts no student token: the prompt's, the template's and the tools' (and pads)
    noisy = _Noisy(teacher, ~pred_BT)
    loss, grads = _loss_and_grads(tmp_path / "a", teacher, record, tok)
    loss_n, grads_n = _loss_and_grads(tmp_path / "b", noisy, record, tok)
    assert torch.equal(loss, loss_n) and all(torch.equal(grads[n], grads_n[n]) for n in grads)
    # the same noise where the student's tokens are predicted does move it
    loss_m, _ = _loss_and_grads(tmp_path / "c", _Noisy(teacher, pred_BT), record, tok)
    assert abs(float(loss_m - loss)) > 1e-3 * float(loss)

    # independently: full logits of both models, reverse KL(student || teacher) at each position that
    # predicts a mask-1 token, summed over them and divided by their count
    student = tiny_model("tiny:student")
    fwd = dict(
        input_ids=record.input_ids_BT,
        attention_mask=record.attention_mask_BT,
        position_ids=sampling.position_ids_from_mask(record.attention_mask_BT),
    )
    with torch.no_grad():
        ls = torch.log_softmax(student(**fwd).logits[..., : len(tok)].double(), -1)
        lt = torch.log_softmax(teacher(**fwd).logits[..., : len(tok)].double(), -1)
    kl_BT = (ls.exp() * (ls - lt)).sum(-1)
    total, count = 0.0, 0
    B, T = record.input_ids_BT.shape
    for b in range(B):
        for t in range(T - 1):
            if record.loss_mask_BT[b, t + 1] == 1:
                total += float(kl_BT[b, t])
                count += 1
    assert count == int(record.loss_mask_BT.sum())
    torch.testing.assert_close(float(loss), total / count, rtol=1e-5, atol=0)


def test_the_trainer_plays_episodes_when_given_an_environment_and_logs_their_counts(tmp_path):
    """`environment` set: the trainer's source is MultiTurnRollouts over the environment it was given, and a
    step's tool/ metrics are the episodes' counts; without the object, one line (vLLM plays episodes too:
    tests/test_rollout_multiturn_vllm.py; a producer sampling ahead: tests/test_rollout_ahead_episodes.py)."""
    import pytest

    from opdkit import settings as opd_settings
    from opdkit import tasks
    from opdkit.config import ConfigError
    from opdkit.jobs.whitebox.config import WhiteboxConfig

    assert tuple(tasks.ENVIRONMENTS) == opd_settings.ENVIRONMENTS
    tok = tool_tokenizer()
    env = tasks.get_environment("calculator", task.TinyTask())
    args = OPDArguments(
        output_dir=str(tmp_path),
        report_to=[],
        use_cpu=True,
        sample_every=0,
        save_strategy="no",
        max_steps=1,
        environment="calculator",
        max_turns=2,
        rollout_max_new_tokens=30,
    )
    common = dict(
        model=tiny_model("tiny:student"), processing_class=tok, teacher_model=tiny_model("tiny:teacher")
    )
    trainer = DistillTrainer(
        args=args, data_collator=PromptCollator(tok, 512, tools=env.tools), env=env, **common
    )
    assert isinstance(trainer.rollouts, MultiTurnRollouts) and trainer.rollouts.max_turns == 2
    bs = batches(tok, [4], tools=env.tools)
    records = trainer.rollouts.next_step(trainer.model, bs, step=0)
    assert sum(r.input_ids_BT.shape[0] for r in records) == 4
    m = trainer.rollouts.step_metrics(lambda t: t)
    assert m["tool/episodes"] == 4 and 1 <= m["tool/turns_mean"] <= 2
    assert set(m) >= {"tool/called_share", "tool/calls_per_episode", "tool/malformed", "tool/accuracy"}
    with pytest.raises(ConfigError, match="environment object"):
        DistillTrainer(args=args, **{**common, "model": tiny_model("tiny:student")})
    assert WhiteboxConfig(environment="calculator", rollout_ahead=1).rollout_ahead == 1  # the producer plays
    assert WhiteboxConfig(environment="calculator", rollout_engine="vllm").rollout_engine == "vllm"
    with pytest.raises(ConfigError, match="not one of"):
        WhiteboxConfig(environment="abacus")


def test_single_turn_sources_have_no_step_metrics_for_the_trainer_to_log(tmp_path):
    args = OPDArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, sample_every=0, save_strategy="no", max_steps=1
    )
    trainer = DistillTrainer(
        model=tiny_model("tiny:student"),
        args=args,
        processing_class=tool_tokenizer(),
        teacher_model=tiny_model("tiny:teacher"),
    )
    assert isinstance(trainer.rollouts, EngineRollouts) and trainer.rollouts.step_metrics(lambda t: t) == {}


def test_tool_results_in_qwen3s_own_template(qwen3_tokenizer):
    """With Qwen3's real chat template the tokens after a student's turn are Qwen3's tool response (two
    results of one turn in one user turn) and the next generation prompt, with its empty think block when
    thinking is off, as the contract writes them."""
    tok = qwen3_tokenizer
    env = CalculatorEnvironment(task.TinyTask())
    turn = "<think>\nfine\n</think>\n\n" + call("12*34") + call("1/0")
    msgs = [
        {"role": "user", "content": "12*34?"},
        {"role": "assistant", "content": turn},
        {"role": "tool", "content": "408"},
        {"role": "tool", "content": "error: division by zero"},
    ]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    response = (
        "\n<|im_start|>user\n<tool_response>\n408\n</tool_response>\n"
        "<tool_response>\nerror: division by zero\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    for thinking, prompt in ((True, ""), (False, "<think>\n\n</think>\n\n")):
        s = settings(tok)
        src = MultiTurnRollouts(
            lambda: None, s, 0, 0, 1, 1, environment=env, tokenizer=tok, max_turns=3, enable_thinking=thinking
        )
        ids = src.tool_ids(msgs, 2, im_end)
        assert tok.decode(ids) == response + prompt
        assert ids == tok(response + prompt, add_special_tokens=False)["input_ids"]


def test_a_kept_sample_of_an_episode_shows_its_turns_in_order(tmp_path):
    """samples.jsonl's record of a multi-turn row: the student's tokens and their divergences as before, and
    its parts after the prompt in order, the student's turns apart from the tools'."""
    tok = tool_tokenizer()
    scripts = {"5+6": [call("5+6"), ";11"], "1+2": [";3"]}
    records, _, _ = play(tok, scripts, CalculatorEnvironment(task.TinyTask()), [2])
    args = OPDArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, sample_every=1, save_strategy="no", max_steps=1
    )
    trainer = DistillTrainer(
        model=tiny_model("tiny:student"),
        args=args,
        processing_class=tok,
        teacher_model=tiny_model("tiny:teacher"),
    )
    trainer.run = object()  # a run folder to keep samples for
    trainer.compute_loss(trainer.model, trainer.micro_batch(records[0]))
    kept = {r["prompt"].split("user\n")[-1].split("<|im_end|>")[0]: r for r in trainer.samples.rows(tok)}
    one, two = kept["1+2"], kept["5+6"]
    assert "turns" not in one and "".join(one["tokens"]) == ";3<|im_end|>"
    assert [t["sampled"] for t in two["turns"]] == [True, False, True]
    assert two["turns"][0]["text"] == call("5+6") + "<|im_end|>"
    assert two["turns"][1][
        "text"
    ] == "\n<|im_start|>user\n<tool_response>\n11\n</tool_response><|im_end|>\n" + ("<|im_start|>assistant\n")
    assert two["turns"][2]["text"] == ";11<|im_end|>"
    assert len(two["divergence"]) == len(two["tokens"]) == len(tok(call("5+6") + ";11")["input_ids"]) + 2
    # each student turn's token count, which 05's transcript view splits the tokens and divergences by
    assert [t.get("n_tokens") for t in two["turns"]] == [len(tok(call("5+6"))["input_ids"]) + 1, None, 4]
    parts = figures.turn_parts(two)
    assert ["".join(p["tokens"]) if p["sampled"] else p["text"] for p in parts] == [
        t["text"] for t in two["turns"]
    ]
    assert [d for p in parts if p["sampled"] for d in p["divergence"]] == two["divergence"]
    shown = tooluse.transcript_html(two, 1.0)
    assert shown.count("<b>student</b>") == 2 and shown.count("tool / template") == 1
    assert "&lt;tool_response&gt;⏎11⏎&lt;/tool_response&gt;" in shown
    # the static figure (make demo's transcripts.png): the call, the tool's result in grey, the answer
    fig = figures.samples_figure([two], lines_per_sample=6)
    texts = [(t.get_text(), t.get_color()) for t in fig.axes[0].texts][1:]  # after the sample's label
    grey = [i for i, (_, colour) in enumerate(texts) if colour == "#446"]
    assert [texts[i][0] for i in grey][2:7] == ["⏎", "<tool_response>", "⏎", "11", "⏎"]
    student = "".join(text for i, (text, _) in enumerate(texts) if i not in grey)
    assert student == call("5+6").replace("\n", "⏎") + "<|im_end|>;11<|im_end|>"
    answer_at = max(i for i, (text, _) in enumerate(texts) if text == ";")
    assert grey == list(range(grey[0], grey[-1] + 1)) and 0 < grey[0] and grey[-1] < answer_at


def test_one_turn_without_tools_takes_the_single_turn_paths_first_update(tmp_path):
    """A whole optimizer step through the trainer: episodes of one turn without tools, and today's
    single-turn source, give the same loss and the same weights after the update."""
    import datasets

    tok = tool_tokenizer()
    rows = [
        {"messages": [{"role": "user", "content": p.prompt}], "answer": p.answer} for p in task.problems(8, 9)
    ]
    results = []
    for name, env in (("single", None), ("multi", NoTools())):
        args = OPDArguments(
            output_dir=str(tmp_path / name),
            report_to=[],
            use_cpu=True,
            sample_every=0,
            save_strategy="no",
            max_steps=1,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            rollout_max_new_tokens=30,
            learning_rate=1e-3,
            seed=3,
            max_turns=1,
            remove_unused_columns=False,
        )
        trainer = DistillTrainer(
            model=tiny_model("tiny:student"),
            args=args,
            processing_class=tok,
            teacher_model=tiny_model("tiny:teacher"),
            train_dataset=datasets.Dataset.from_list(rows),
            data_collator=PromptCollator(tok, 512, tools=None if env is None else env.tools),
            env=env,
        )
        assert isinstance(trainer.rollouts, EngineRollouts if env is None else MultiTurnRollouts)
        out = trainer.train()
        results.append(
            (out.training_loss, {n: p.detach().clone() for n, p in trainer.model.named_parameters()})
        )
    (loss_a, weights_a), (loss_b, weights_b) = results
    assert loss_a == loss_b and all(torch.equal(weights_a[n], weights_b[n]) for n in weights_a)
    assert any(not torch.equal(weights_a[n], tiny_model("tiny:student").state_dict()[n]) for n in weights_a)


def test_the_sampling_log_probabilities_are_the_students_own_on_the_whole_transcript():
    """Each sampled token's log-probability the engine reported, turn by turn on growing left-padded contexts,
    is the student's log-probability of it in one teacher-forced forward of the record's whole transcript
    (within the float32 floor): the transcript is exactly what the student saw at every turn."""
    tok = tool_tokenizer()
    student = tiny_model("tiny:student")
    s = settings(tok, max_new_tokens=40)
    bs = batches(tok, [3], tools=[], seed=2)
    src = MultiTurnRollouts(
        lambda: engines.HFEngine(logprobs=True), s, 1, 0, 1, 3, environment=Ok(), tokenizer=tok, max_turns=3
    )
    (record,) = src.next_step(student, bs, step=0)
    assert src.counts[TURNS] > 3  # some episodes took several turns
    with torch.no_grad():
        logits = student(
            input_ids=record.input_ids_BT,
            attention_mask=record.attention_mask_BT,
            position_ids=sampling.position_ids_from_mask(record.attention_mask_BT),
        ).logits
    logp_BTV = torch.log_softmax(logits.float(), -1)
    mask = record.loss_mask_BT.bool()
    pred = record.predicting_BT()
    forward_N = logp_BTV[pred].gather(-1, record.input_ids_BT[mask][:, None])[:, 0]
    torch.testing.assert_close(record.sampling_logprobs_BT[mask], forward_N, rtol=0, atol=1e-4)


def test_prompts_without_their_conversations_are_refused_in_one_line():
    import pytest

    from opdkit.config import ConfigError

    tok = tool_tokenizer()
    bs = batches(tok, [2], tools=None)  # a single-turn collator keeps no messages
    src = MultiTurnRollouts(
        lambda: engines.HFEngine(),
        settings(tok),
        0,
        0,
        1,
        2,
        environment=NoTools(),
        tokenizer=tok,
        max_turns=2,
    )
    with pytest.raises(ConfigError, match=r"PromptCollator\(\.\.\., tools=environment.tools\)"):
        src.next_step(None, bs, 0)
    with pytest.raises(ConfigError, match="at least one turn"):
        MultiTurnRollouts(
            lambda: None, settings(tok), 0, 0, 1, 2, environment=NoTools(), tokenizer=tok, max_turns=0
        )


class WholeTranscripts:
    """The kit's loop reached as another engine is (vLLM's path): each turn the whole transcript, re-read."""

    name = "whole"

    def __init__(self):
        self.engine = engines.HFEngine(logprobs=True)

    def sync(self, model):
        pass

    def close(self):
        pass

    def sample(self, *args):
        return self.engine.sample(*args)


def test_the_cached_loop_plays_the_episodes_a_whole_re_read_plays():
    """The tiny tool world (`tiny:teacher-tools` calls the calculator, then copies its result), temperature 1,
    three turns: the kit's engine, its KV cache kept between turns (`sampling.Turns`), plays the episodes the
    same loop plays re-reading each whole transcript every turn: the same token ids, masks, turns, counts and
    conversations, and log-probabilities within the float32 floor (the first turn's are the same forwards;
    the later turns' keys and values of earlier tokens come from other forwards: measured, at most 9.5e-7
    here, 5.7e-6 on 32 episodes, where a teacher-forced forward of the transcripts differs from either by
    5.2e-6)."""
    from opdkit.models import load_tokenizer
    from opdkit.tasks.tinytools import MAX_TURN_TOKENS, TinyToolsTask

    tok = load_tokenizer("tiny:teacher-tools")
    student = tiny_model("tiny:teacher-tools")
    env = CalculatorEnvironment(TinyToolsTask())
    messages, answers = TinyToolsTask().heldout(12)
    collate = PromptCollator(tok, 512, tools=env.tools)
    bs = [
        collate([{"messages": m, "answer": a} for m, a in zip(messages[at : at + 6], answers[at : at + 6])])
        for at in (0, 6)
    ]
    s = settings(tok, max_new_tokens=MAX_TURN_TOKENS)
    got = {}
    for name, make in (("cached", lambda: engines.HFEngine(logprobs=True)), ("whole", WholeTranscripts)):
        src = MultiTurnRollouts(
            make, s, 3, 0, 1, 6, environment=env, tokenizer=tok, max_turns=3, episode_max_tokens=200
        )
        got[name] = (src.next_step(student, bs, step=1), dict(src.counts))
    (cached, counts), (whole, whole_counts) = got["cached"], got["whole"]
    assert counts == whole_counts
    assert counts[CALLS] >= 10 and counts[TURNS] >= 22 and counts[CORRECT] > 0  # tool turns happened
    for a, b in zip(cached, whole, strict=True):
        for name in ("input_ids_BT", "attention_mask_BT", "loss_mask_BT", "truncated_B"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert a.sampled_as == b.sampled_as and a.conversations == b.conversations
        torch.testing.assert_close(a.sampling_logprobs_BT, b.sampling_logprobs_BT, rtol=0, atol=1e-5)
