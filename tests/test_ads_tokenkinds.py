"""opdkit.ads.tokenkinds and savegrad's gradient variants (`grad_tokens`): the kinds of a hand-made example,
the teacher's entropies against its own unpadded forward, and each variant's saved gradient against plain
autograd on the tiny proxy, with the kept tokens found here without the module (the answer from the
character after the last ';', the entropies from one forward per trace)."""

from __future__ import annotations

import random

import datasets
import pytest
import torch

from opdkit import settings, tasks
from opdkit.ads import gradfile, gradient, tokenkinds
from opdkit.config import ConfigError, load_config
from opdkit.data import traces
from opdkit.data.labels import IGNORE, completion_labels
from opdkit.jobs import savegrad
from opdkit.jobs.savegrad import report as savegrad_report
from opdkit.models import load_model
from opdkit.tasks import tiny as tiny_task

ANSWER_START = tasks.for_dataset("tiny").answer_start


def test_answer_labels_keep_exactly_the_answer(tok):
    text = "8+7=15,5+6+1=12,3+4+1=8;825"
    messages = [{"role": "user", "content": "358+467"}, {"role": "assistant", "content": text}]
    ids, labels = completion_labels(tok, messages)
    kept = tokenkinds.answer_labels(tok, ids, labels, ANSWER_START(text))
    assert tok.decode([t for t in kept if t != IGNORE]) == "825" + tok.eos_token
    assert ANSWER_START("no answer here") is None
    assert tasks.for_dataset("x.parquet").answer_start("so \\boxed{12}.") == 3


def test_answer_rows_keep_the_traces_with_an_answer(tok):
    """A trace without a final answer is left out; no trace with one gives no rows (the caller says what to
    do)."""
    held = []
    for text in ("8+7=15,5+6+1=12,3+4+1=8;825", "8+7=15,5+6"):
        messages = [{"role": "user", "content": "358+467"}, {"role": "assistant", "content": text}]
        ids, labels = completion_labels(tok, messages)
        held.append({"messages": messages, "input_ids": ids, "labels": labels})
    [row] = tokenkinds.answer_rows(held, tok, ANSWER_START)
    assert row == {
        "input_ids": held[0]["input_ids"],
        "labels": tokenkinds.answer_labels(
            tok, held[0]["input_ids"], held[0]["labels"], ANSWER_START(held[0]["messages"][-1]["content"])
        ),
    }
    assert tokenkinds.answer_rows(held[1:], tok, ANSWER_START) == []


def test_kinds_of_a_hand_made_example(tok):
    """'1+2=3;3' (one token a character, then the end of turn) with entropies chosen by hand: the answer
    tokens are 'answer' whatever their entropy, the others split at the threshold (strictly above it is
    uncertain), prompt tokens have no kind."""
    messages = [{"role": "user", "content": "1+2"}, {"role": "assistant", "content": "1+2=3;3"}]
    ids, labels = completion_labels(tok, messages)
    pos = [i for i, lab in enumerate(labels) if lab != IGNORE]
    assert tok.decode([ids[i] for i in pos]) == "1+2=3;3" + tok.eos_token  # 8 tokens
    chosen = [0.1, 0.9, 0.3, 0.31, 2.0, 0.0, 5.0, 1.0]  # '1' '+' '2' '=' '3' ';' '3' eos
    entropies = [None] * len(ids)
    for i, h in zip(pos, chosen):
        entropies[i] = h
    row = {"messages": messages, "input_ids": ids, "labels": labels}
    [kinds] = tokenkinds.token_kinds([row], [entropies], tok, ANSWER_START, 0.3)
    c, u, a = "confident", "uncertain", "answer"
    assert [kinds[i] for i in pos] == [c, u, c, u, u, c, a, a]
    assert all(kinds[i] is None for i in range(len(ids)) if i not in pos)
    assert tokenkinds.kind_counts([kinds]) == {"answer": 2, "uncertain": 3, "confident": 3}
    [kept] = tokenkinds.keep_kinds([row], [kinds], tokenkinds.GRAD_TOKENS["confident"])
    assert [i for i, lab in enumerate(kept["labels"]) if lab != IGNORE] == [pos[i] for i in (0, 2, 5, 6, 7)]
    assert tokenkinds.keep_kinds([row], [kinds], frozenset({"nothing"})) == []  # a row with none drops out


def test_the_variants_are_the_settings_choices():
    assert tuple(tokenkinds.GRAD_TOKENS) == settings.GRAD_TOKENS


def _records(tok, n: int = 7) -> list[dict]:
    """Tiny-world traces of varied length, the last one cut before its answer."""
    rng, out = random.Random(3), []
    for i in range(n):
        p = tiny_task.problems(1, 500 + i, n_digits=1 + i % 3)[0]
        text = tiny_task.scratchpad(p, rng)
        messages = [{"role": "user", "content": p.prompt}, {"role": "assistant", "content": text}]
        out.append({"messages": messages})
    out[-1]["messages"][-1]["content"] = out[-1]["messages"][-1]["content"].split(";")[0]
    return [{**r, **dict(zip(("input_ids", "labels"), completion_labels(tok, r["messages"])))} for r in out]


def _entropy_by_forward(teacher, row) -> list[float | None]:
    """Per token: the teacher's entropy at the position before it (one unpadded forward), None off the
    completion."""
    with torch.no_grad():
        logp = torch.log_softmax(teacher(input_ids=torch.tensor([row["input_ids"]])).logits[0].float(), -1)
    h = -(logp.exp() * logp).sum(-1)
    return [None if lab == IGNORE else float(h[i - 1]) for i, lab in enumerate(row["labels"])]


def test_teacher_entropies_match_one_unpadded_forward_per_trace(tok, teacher):
    records = _records(tok)
    got = tokenkinds.teacher_entropies(teacher, records, 3, tok.pad_token_id)  # padded batches of 3
    for row, h in zip(records, got):
        want = _entropy_by_forward(teacher, row)
        assert [x is None for x in h] == [x is None for x in want]
        assert [x for x in h if x is not None] == pytest.approx([x for x in want if x is not None], abs=1e-5)


def _kept_positions(teacher, row, grad_tokens: str, threshold: float = 0.3) -> list[int]:
    """The tokens a variant keeps, found here: the answer is every completion token after the last ';' (one
    token a character, so from that character on, with the end of turn); the rest by the teacher's entropy."""
    pos = [i for i, lab in enumerate(row["labels"]) if lab != IGNORE]
    text = row["messages"][-1]["content"]
    first = len(pos) if ";" not in text else text.rfind(";") + 1
    answer = pos[first:]
    if grad_tokens == "answer":
        return answer
    h = _entropy_by_forward(teacher, row)
    return [i for i in pos[:first] if h[i] <= threshold] + answer


def _direct_grad(proxy, rows_keep) -> dict[str, torch.Tensor]:
    """The mean over traces of each trace's mean NLL on its kept tokens (traces keeping none left out), by
    autograd on one unpadded forward per trace."""
    proxy.zero_grad(set_to_none=True)
    means = []
    for row, keep in rows_keep:
        if keep:
            logp = torch.log_softmax(proxy(input_ids=torch.tensor([row["input_ids"]])).logits[0].float(), -1)
            means.append(torch.stack([-logp[i - 1, row["input_ids"][i]] for i in keep]).mean())
    (sum(means) / len(means)).backward()
    return {k: p.grad.detach().clone() for k, p in proxy.named_parameters()}


def _rel(a: dict, b: dict) -> float:
    diff = sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in b)
    return (diff / sum(float((b[k].double() ** 2).sum()) for k in b)) ** 0.5


@pytest.fixture(scope="module")
def supplied(tmp_path_factory, tok) -> str:
    path = tmp_path_factory.mktemp("kinds") / "traces"
    rows = [{"messages": r["messages"], "answer": ""} for r in _records(tok)]
    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return str(path)


def _variant_run(tmp_path, supplied, grad_tokens: str):
    over = {"run_dir": str(tmp_path / grad_tokens), "traces_path": supplied, "grad_tokens": grad_tokens}
    return savegrad.run("tiny", {**over, "batch_size": 3})


def test_grad_tokens_all_is_the_gradient_as_it_always_was(tmp_path, supplied, tok):
    """all: exactly (bit for bit) the mean completion gradient of the run's own traces."""
    run = _variant_run(tmp_path, supplied, "all")
    proxy = load_model("tiny:student", torch.float32, "cpu")
    rows = [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in traces.load_traces(run.path)]
    today, _ = gradient.mean_completion_grad(proxy, rows, "trace", 3, tok.pad_token_id)
    saved = gradfile.load_grads(run.path, proxy, tok)
    assert all(torch.equal(saved[k], today[k]) for k in today)
    assert gradfile.read_meta(run.path)["grad_tokens"] == "all"


@pytest.mark.parametrize("grad_tokens", ["confident", "answer"])
def test_a_variant_is_the_mean_gradient_on_its_kept_tokens(tmp_path, supplied, tok, teacher, grad_tokens):
    run = _variant_run(tmp_path, supplied, grad_tokens)
    proxy = load_model("tiny:student", torch.float32, "cpu")
    records = _records(tok)
    keeps = [_kept_positions(teacher, r, grad_tokens) for r in records]
    assert any(keeps) and not all(keeps) if grad_tokens == "answer" else all(keeps)
    if grad_tokens == "confident":  # some tokens left out, so the variant differs from the whole
        assert sum(map(len, keeps)) < sum(sum(lab != IGNORE for lab in r["labels"]) for r in records)
    want = _direct_grad(proxy, list(zip(records, keeps)))
    assert _rel(gradfile.load_grads(run.path, proxy, tok), want) < 1e-5
    meta = gradfile.read_meta(run.path)
    assert meta["grad_tokens"] == grad_tokens
    assert meta["num_traces"] == sum(1 for k in keeps if k)
    assert meta["completion_tokens"] == sum(map(len, keeps))
    total = sum(sum(lab != IGNORE for lab in r["labels"]) for r in records)
    table = savegrad_report.summary_table_html(run.read_summary())
    kept = sum(map(len, keeps))
    assert f"{grad_tokens}: {kept} of {total} completion tokens, in {meta['num_traces']} traces" in table
    if grad_tokens == "confident":
        assert meta["grad_entropy"] == 0.3
        assert sum(meta["token_kinds"].values()) == sum(
            sum(lab != IGNORE for lab in r["labels"]) for r in records
        )


def test_an_unknown_variant_is_refused_in_one_line(tmp_path, supplied):
    with pytest.raises(ConfigError, match=r"grad_tokens='uncertain' is not one of \['all', 'confident'"):
        savegrad.prepare("tiny", {"traces_path": supplied, "grad_tokens": "uncertain"})
    with pytest.raises(ConfigError, match="grad_entropy=-1"):
        savegrad.prepare("tiny", {"traces_path": supplied, "grad_entropy": -1})


def test_a_variant_that_keeps_no_token_stops_before_writing_a_gradient(tmp_path, tok):
    path = tmp_path / "noanswer"
    rows = [{"messages": r["messages"], "answer": ""} for r in _records(tok)[-1:]]  # no answer
    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match="grad_tokens=answer keeps no completion token"):
        savegrad.run("tiny", {"run_dir": str(run_dir), "traces_path": str(path), "grad_tokens": "answer"})
    assert not (run_dir / gradfile.GRADS_FILE).exists()


@pytest.mark.parametrize("kind", ["confident", "answer"])
def test_antidistill_derives_each_variant_from_a_whole_gradient_run(tmp_path, supplied, tok, teacher, kind):
    """04's third and second ADS lines (confident_lams, answer_lams) steer by variants derived from a plain
    savegrad run's traces: each is the mean gradient on its kept tokens, found here directly."""
    from opdkit.jobs.antidistill import sweep
    from opdkit.jobs.antidistill.config import AntidistillConfig

    run = _variant_run(tmp_path, supplied, "all")
    records = list(traces.load_traces(run.path))
    proxy = load_model("tiny:student", torch.float32, "cpu")
    want = _direct_grad(proxy, [(r, _kept_positions(teacher, r, kind)) for r in records])
    lams = {"answer_lams": [], "confident_lams": [], f"{kind}_lams": [0.1]}
    cfg = load_config(AntidistillConfig, "tiny", {"grads_run": str(run.path), **lams})
    assert sweep.derived_gradients(cfg) == [kind]
    got = sweep.derived_gradient(cfg, kind, proxy, teacher, tok, run.path, None)
    assert _rel(got, want) < 1e-5
