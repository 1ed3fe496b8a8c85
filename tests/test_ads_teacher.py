"""`ADSTeacher`, the teacher serving the ADS distribution for scoring: on the prefixes `ads_sample` walks
through, its next-token distribution at every position is the one sampling drew from at that step (recorded
inside `ads_sample`, after the ADS term and the warpers), both from its logits and along the trainer's path
(stacked hidden states and heads); only the shared ids get the ADS term; a `DistillTrainer` step with it
differs from the plain teacher's for λ ≠ 0, equals it at λ = 0, and its loss is the divergence from the ADS
logits computed directly."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from opdkit import models, tiny
from opdkit.ads import sampler
from opdkit.ads.direction import FiniteDifference, make_direction
from opdkit.ads.teacher import ADSTeacher
from opdkit.opd.arguments import OPDArguments
from opdkit.opd.loss import per_token_divergence
from opdkit.opd.trainer import DistillTrainer
from opdkit.rollout import sampling, source
from opdkit.tasks import tiny as task


def _model(name: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny.resolve(name), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tok():
    return models.load_tokenizer("tiny:teacher")


@pytest.fixture(scope="module")
def teacher() -> torch.nn.Module:
    return _model("tiny:teacher")


@pytest.fixture(scope="module")
def proxy() -> torch.nn.Module:
    return _model("tiny:student")


@pytest.fixture(scope="module")
def g(proxy) -> dict[str, torch.Tensor]:
    """A random direction with the proxy's parameter names, about the size of savegrad's gradient."""
    gen = torch.Generator().manual_seed(0)
    return {n: 0.05 * torch.randn(p.shape, generator=gen) for n, p in proxy.named_parameters()}


def _prompts(tok, n: int = 5, seed: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of 1- to 3-digit problems, so rows have different padding."""
    probs = [task.problems(1, seed + i, n_digits=1 + i % 3)[0] for i in range(n)]
    return sampling.encode_prompts(tok, [[{"role": "user", "content": p.prompt}] for p in probs])


class _Last(LogitsProcessor):
    """Appended after ADS's chain: records the scores sampling draws from at each step."""

    def __init__(self) -> None:
        self.scores: list[torch.Tensor] = []

    def __call__(self, input_ids, scores):
        self.scores.append(scores.clone())
        return scores


def _sample_and_record(monkeypatch, teacher, tok, direction, lam, temperature, top_p):
    """`ads_sample` itself, with a recorder after the last processor it builds."""
    rec = _Last()
    chain = sampler.ads_processors
    monkeypatch.setattr(
        sampler, "ads_processors", lambda *a, **k: LogitsProcessorList([*chain(*a, **k), rec])
    )
    ids, mask = _prompts(tok)
    torch.manual_seed(1)
    r = sampler.ads_sample(
        teacher,
        ids,
        mask,
        direction=direction,
        lam=lam,
        temperature=temperature,
        top_p=top_p,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_new_tokens=task.MAX_COMPLETION_TOKENS,
    )
    return r, rec.scores


def _step_rows(r: sampling.Rollout, k: int) -> torch.Tensor:
    """Rows still writing at step k (rows past their EOS are fed padding and belong to no trace)."""
    return (
        torch.ones(r.input_ids_BT.shape[0], dtype=torch.bool)
        if k == 0
        else r.completion_mask_BC[:, k - 1].bool()
    )


def _in(dtype: torch.dtype, teacher: torch.nn.Module, direction):
    """Teacher and direction with their weights in `dtype` (the direction's copies are fp32 by design)."""
    teacher = copy.deepcopy(teacher).to(dtype)
    if isinstance(direction, FiniteDifference):
        for m in (direction.plus, direction.minus):
            m.model.to(dtype)
    elif dtype != torch.float32:
        raise ValueError("the JVP direction is checked in its own fp32")
    return teacher, direction


FP64, FP32 = torch.float64, torch.float32
# float64: the KV-cached steps of sampling and the one forward give the same logits to fp32 rounding, so any
# difference is the wrapper's. float32: the same comparison under the float noise of a KV cache against a full
# forward (the plain teacher's logits alone differ by ~1e-5, and the finite difference multiplies its proxies'
# by λ/2ε).
TOLERANCE = {FP64: 1e-5, FP32: 2e-4}


@pytest.mark.parametrize(
    "method,lam,temperature,top_p,dtype",
    [
        *[
            (m, lam, t, p, d)
            for m, lam, t, p in (
                ("fd", 0.1, 1.0, 1.0),
                ("fd", 0.3, 0.7, 1.0),
                ("fd", 0.1, 1.3, 0.9),
                ("fd", 0.0, 1.0, 1.0),
            )
            for d in (FP64, FP32)
        ],
        ("jvp", 0.1, 1.0, 1.0, FP32),  # exact Δ: no finite difference to amplify the float noise
    ],
)
def test_next_token_distribution_is_the_one_ads_sampling_draws_from(
    monkeypatch, teacher, proxy, g, tok, method, lam, temperature, top_p, dtype
):
    teacher, direction = _in(dtype, teacher, make_direction(method, proxy, g, 1e-2))
    r, steps = _sample_and_record(monkeypatch, teacher, tok, direction, lam, temperature, top_p)
    ads = ADSTeacher(teacher, direction, lam)
    logits_BTV = ads(input_ids=r.input_ids_BT, attention_mask=r.attention_mask_BT).logits
    plain_BTV = teacher(
        input_ids=r.input_ids_BT, attention_mask=r.attention_mask_BT, position_ids=r.position_ids_BT
    ).logits.float()
    served = {"forward": logits_BTV, "plain": plain_BTV}
    if temperature != 1:  # served at τ: its own softmax is sampling's distribution, no warper's temperature
        at_tau = ADSTeacher(teacher, direction, lam, temperature)
        served["at_tau"] = (
            at_tau(input_ids=r.input_ids_BT, attention_mask=r.attention_mask_BT).logits * temperature
        )
    if method == "fd":  # the trainer's path: stacked hidden states through the stacked head
        hidden_BTH = ads.base_model(
            input_ids=r.input_ids_BT, attention_mask=r.attention_mask_BT, position_ids=r.position_ids_BT
        ).last_hidden_state
        served["stacked"] = hidden_BTH @ ads.get_output_embeddings().weight.T
        if temperature != 1:
            hidden_BTH = at_tau.base_model(
                input_ids=r.input_ids_BT, attention_mask=r.attention_mask_BT, position_ids=r.position_ids_BT
            ).last_hidden_state
            served["stacked_at_tau"] = hidden_BTH @ at_tau.get_output_embeddings().weight.T * temperature
    P, gap = r.prompt_len, dict.fromkeys(served, 0.0)
    assert len(steps) >= 10
    for k, scores_BV in enumerate(steps):
        live = _step_rows(r, k)
        drawn_BV = scores_BV[live].softmax(-1)  # what sampling drew token k from
        for name, z_BTV in served.items():
            p_BV = torch.stack([sampler.warp(z, temperature, top_p) for z in z_BTV[live, P - 1 + k]]).softmax(
                -1
            )
            gap[name] = max(gap[name], float((p_BV.to(drawn_BV) - drawn_BV).abs().max()))
    print(f"\n{method} λ={lam} τ={temperature} top_p={top_p} {dtype}: max |p - p_sampled|", gap)
    assert max(v for k, v in gap.items() if k != "plain") <= TOLERANCE[dtype]
    if lam != 0:
        assert gap["plain"] > 0.05  # the ADS term moved the distribution: the comparison is not trivial


def test_shared_ids_only_get_the_ads_term(teacher, proxy, g, tok):
    """A proxy head with fewer rows than the teacher's: the rest keep the teacher's logits, in both paths."""
    cut = proxy.get_output_embeddings().weight.shape[0] - 7
    ads_full = ADSTeacher(teacher, FiniteDifference(proxy, g, 1e-2), 0.2)
    direction = FiniteDifference(proxy, g, 1e-2)
    for m in (direction.plus.model, direction.minus.model):
        m.lm_head.weight = torch.nn.Parameter(m.lm_head.weight[:cut].clone(), requires_grad=False)
    ads = ADSTeacher(teacher, direction, 0.2)
    ids, mask = _prompts(tok, 2)
    pos = sampling.position_ids_from_mask(mask)
    plain = teacher(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    hidden = ads.base_model(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
    stacked = hidden @ ads.get_output_embeddings().weight.T
    torch.testing.assert_close(stacked[..., cut:], plain[..., cut:], rtol=0, atol=1e-5)
    torch.testing.assert_close(
        stacked[..., :cut], ads_full(input_ids=ids, attention_mask=mask).logits[..., :cut], rtol=0, atol=1e-4
    )


def _trainer(tmp_path, teacher_model, tok, kl_temperature: float = 1.0, **kwargs) -> DistillTrainer:
    args = OPDArguments(
        output_dir=str(tmp_path),
        report_to=[],
        rollout_max_new_tokens=task.MAX_COMPLETION_TOKENS,
        kl_temperature=kl_temperature,
        beta=1.0,
        use_cpu=True,
        sample_every=0,
        save_strategy="no",
        remove_unused_columns=False,
        max_steps=1,
        per_device_train_batch_size=4,
    )
    return DistillTrainer(
        model=_model("tiny:student"), args=args, processing_class=tok, teacher_model=teacher_model, **kwargs
    )


@pytest.fixture(scope="module")
def rollout(tok) -> sampling.Rollout:
    student = _model("tiny:student")
    ids, mask = _prompts(tok, 6, seed=21)
    torch.manual_seed(2)
    return sampling.sample(
        student,
        ids,
        mask,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_new_tokens=task.MAX_COMPLETION_TOKENS,
    )


def _loss_and_grads(trainer: DistillTrainer, r: sampling.Rollout) -> tuple[float, dict[str, torch.Tensor]]:
    batch = trainer.micro_batch(source.record_of(r, trainer.stop_ids))
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


def test_a_trainer_step_scores_with_the_ads_distribution(tmp_path, teacher, proxy, g, tok, rollout):
    """λ = 0: the plain teacher's loss and gradient exactly; λ ≠ 0: another loss, equal to the reverse KL
    from the ADS logits (at the trainer's kl_temperature) computed from full logits."""
    tau = 1.3
    plain_loss, plain_grads = _loss_and_grads(_trainer(tmp_path / "p", teacher, tok, tau), rollout)
    zero = ADSTeacher(teacher, FiniteDifference(proxy, g, 1e-2), 0.0)
    zero_loss, zero_grads = _loss_and_grads(_trainer(tmp_path / "z", zero, tok, tau), rollout)
    assert zero_loss == plain_loss
    assert all(torch.equal(plain_grads[n], zero_grads[n]) for n in plain_grads)

    ads = ADSTeacher(teacher, FiniteDifference(proxy, g, 1e-2), 0.2)
    ads_loss, ads_grads = _loss_and_grads(_trainer(tmp_path / "a", ads, tok, tau), rollout)
    assert abs(ads_loss - plain_loss) > 1e-3 * abs(plain_loss)
    assert any(not torch.allclose(plain_grads[n], ads_grads[n]) for n in plain_grads)

    # the same loss from full logits: the student's and the ADS teacher's, at the completion positions
    student = _model("tiny:student")
    r, P = rollout, rollout.prompt_len
    fwd = dict(input_ids=r.input_ids_BT, attention_mask=r.attention_mask_BT, position_ids=r.position_ids_BT)
    sel = r.completion_mask_BC.bool()
    with torch.no_grad():
        s_NV = student(**fwd).logits[:, P - 1 : -1][sel]
        t_NV = ads(**fwd).logits[:, P - 1 : -1][sel]
    direct = float(per_token_divergence(s_NV, t_NV, beta=1.0, temperature=tau).sum() / sel.sum())
    assert ads_loss == pytest.approx(direct, rel=1e-4)


def test_a_training_step_runs_with_the_ads_teacher(tmp_path, teacher, proxy, g, tok):
    """`DistillTrainer.train` with the ADS teacher: rollouts, scoring, clipping, one optimizer step."""
    from datasets import Dataset

    from opdkit.data import prompts

    rows = [
        {"messages": [{"role": "user", "content": p.prompt}], "answer": p.answer} for p in task.problems(8, 5)
    ]
    ads = ADSTeacher(teacher, FiniteDifference(proxy, g, 1e-2), 0.2)
    trainer = _trainer(
        tmp_path,
        ads,
        tok,
        train_dataset=Dataset.from_list(rows),
        data_collator=prompts.PromptCollator(tok, 64),
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.global_step == 1 and trainer.first_nonfinite_step is None
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
