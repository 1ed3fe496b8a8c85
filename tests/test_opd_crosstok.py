"""Tests for opdkit.opd.crosstok: byte offsets of real tokenizers (Qwen3, DeepSeek, the tiny world's character
tokenizer) on emoji, CJK and multi-byte text; the two-pointer alignment; the sorted L1 without sorting against
a plain sort; the loss and its gradient against TRL's `ULDLoss` (GOLD) in float64 and against a brute-force
chain rule."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from bench import common
from opdkit.config import ConfigError
from opdkit.opd import crosstok
from opdkit.opd.crosstok import (
    CrossTokenizerSettings,
    TokenBytes,
    Tokens,
    VocabMatch,
    align,
    align_ends,
    cross_tokenizer_divergence,
    prediction_positions,
    sorted_l1,
)

TEXTS = [
    "Héllo 世界! 🤖👍🏽 naïve café — 東京タワー 123456 Ω≈ç√ ∫ x² 🇯🇵 done.",
    "Step 1: 12 + 30 = 42.\n答案是 42。 Ünïcödé ✓ 😀😀",
    "ok",
]
PROMPTS = ["Solve: 🤖 + 世界?", "Add twelve and thirty.", "Say ok."]


@pytest.fixture(scope="module")
def qwen3(qwen3_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)
    return tok, TokenBytes.of(tok)


@pytest.fixture(scope="module")
def deepseek():
    try:
        path = common.deepseek_tokenizer_dir()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    tok = AutoTokenizer.from_pretrained(path)
    return tok, TokenBytes.of(tok)


# Byte offsets and alignment on real tokenizers ---------------------------------------------------------


@pytest.mark.parametrize("which", ["qwen3", "deepseek"])
@pytest.mark.parametrize("text", TEXTS)
def test_byte_ends_spell_the_text(request, which, text):
    tok, table = request.getfixturevalue(which)
    assert table.kind == "byte-level"
    ids = tok(text, add_special_tokens=False).input_ids
    pieces = [table.pieces[i] for i in ids]
    assert b"".join(pieces) == text.encode() and table.text(ids) == text
    ends = table.ends(ids)
    assert ends[-1] == 2 * len(text.encode()) and all(e % 2 == 0 for e in ends)
    # A multi-byte character split over tokens: some token ends inside it (its bytes are not valid UTF-8).
    if "🤖" in text:
        assert any(not _valid_utf8(p) for p in pieces)
    t = table.tokenize(tok, text, tok.eos_token_id)
    assert t.ids == [*ids, tok.eos_token_id] and t.byte_ends == [*ends, ends[-1]]


def _valid_utf8(data: bytes) -> bool:
    try:
        data.decode()
        return True
    except UnicodeDecodeError:
        return False


@pytest.mark.parametrize("text", TEXTS)
def test_groups_hold_the_same_bytes_on_both_sides(qwen3, deepseek, text):
    (q, qb), (d, db) = qwen3, deepseek
    s, t = qb.tokenize(q, text), db.tokenize(d, text)
    groups = align_ends(s.byte_ends, t.byte_ends)
    assert [k for g, _ in groups for k in g] == list(range(len(s.ids)))
    assert [k for _, g in groups for k in g] == list(range(len(t.ids)))
    for s_idx, t_idx in groups:
        s_bytes = b"".join(qb.pieces[s.ids[k]] for k in s_idx)
        t_bytes = b"".join(db.pieces[t.ids[k]] for k in t_idx)
        assert s_bytes == t_bytes and s_bytes
    if len(text) > 10:  # the two tokenizers cut differently somewhere: some group has several tokens
        assert any(len(a) > 1 or len(b) > 1 for a, b in groups)


def test_a_completion_cut_inside_a_character(qwen3, deepseek):
    """The student's last token ends inside an emoji: the teacher reads the text up to the last whole
    character; tokens after the last byte end both sides share take no part (GOLD would pair them)."""
    (q, qb), (d, db) = qwen3, deepseek
    ids = q("ok 🤖", add_special_tokens=False).input_ids
    cut = ids[:-1]  # ends inside the emoji
    assert not _valid_utf8(b"".join(qb.pieces[i] for i in cut)) and qb.text(cut) == "ok "
    t = db.tokenize(d, qb.text(cut), d.eos_token_id)
    s = Tokens(cut, qb.ends(cut))
    groups = align_ends(s.byte_ends, t.byte_ends)
    assert groups == [([0], [0])]  # "ok"; the student's " \xf0\x9f" ends past the teacher's " "
    plan = align([s], [t], CrossTokenizerSettings(), teacher_eos=d.eos_token_id)
    assert plan.num_groups == 1


def test_a_normalized_text_falls_back_to_character_offsets(qwen3):
    """Qwen3's tokenizer applies NFC: a decomposed é comes back as one precomposed character, so its tokens do
    not spell the text; the ends then come from the character offsets, still non-decreasing."""
    q, qb = qwen3
    text = "cafe\u0301 ok"
    t = qb.tokenize(q, text)
    assert b"".join(qb.pieces[i] for i in t.ids) != text.encode()
    assert t.byte_ends == sorted(t.byte_ends) and t.byte_ends[-1] == 2 * len(text.encode())


def test_inside_ends_close_no_group():
    # Two teacher tokens inside one 4-byte character (2e-1 for the first): the student's token ending at the
    # character's end pairs with both.
    groups = align_ends([8, 10], [7, 8, 10])
    assert groups == [([0], [0, 1]), ([1], [2])]


def test_the_tiny_character_tokenizer_is_exact(tiny_tokenizer, qwen3):
    table = TokenBytes.of(tiny_tokenizer)
    assert table.kind == "characters"
    text = "12+345=357\n<think>"
    ids = tiny_tokenizer(text, add_special_tokens=False).input_ids
    assert table.text(ids) == "12+345=357\n"  # <think> is a special token of the tiny world: zero width
    q, qb = qwen3
    t = qb.tokenize(q, table.text(ids))
    groups = align_ends(table.ends(ids), t.byte_ends)
    assert all(len(s) >= 1 and len(g) == 1 for s, g in groups)  # Qwen3 merges, characters never split


def test_other_tokenizers_are_refused():
    core = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(ConfigError, match="positional"):
        TokenBytes.of(PreTrainedTokenizerFast(tokenizer_object=core))


def test_vocab_match_is_by_exact_string(qwen3, deepseek):
    (q, _), (d, _) = qwen3, deepseek
    match = VocabMatch.of(q, d)
    assert 50_000 < len(match) < min(len(q), len(d))
    q_vocab = {i: s for s, i in q.get_vocab().items()}
    d_vocab = {i: s for s, i in d.get_vocab().items()}
    for s_id, t_id in list(zip(match.student_ids_S.tolist(), match.teacher_ids_S.tolist()))[::5000]:
        assert q_vocab[s_id] == d_vocab[t_id]
    assert match.teacher_ids_S.tolist() == sorted(match.teacher_ids_S.tolist())


# Sorted L1 without sorting -----------------------------------------------------------------------------


def _sorted_l1_reference(a_RV: torch.Tensor, b_RW: torch.Tensor) -> torch.Tensor:
    width = max(a_RV.shape[1], b_RW.shape[1])
    sa = F.pad(a_RV.sort(-1, descending=True).values, (0, width - a_RV.shape[1]))
    sb = F.pad(b_RW.sort(-1, descending=True).values, (0, width - b_RW.shape[1]))
    return (sa - sb).abs().sum(-1)


def _cases(seed: int):
    gen = torch.Generator().manual_seed(seed)
    for trial in range(40):
        v, w = (int(x) for x in torch.randint(1, 400, (2,), generator=gen))
        kind = trial % 5
        if kind == 0:  # softmaxes of different sharpness
            a = torch.softmax(3 * torch.randn(4, v, generator=gen, dtype=torch.float64), -1)
            b = torch.softmax(torch.randn(4, w, generator=gen, dtype=torch.float64), -1)
        elif kind == 1:  # ties and zeros
            a = torch.randint(0, 4, (4, v), generator=gen).double() / 4
            b = torch.randint(0, 4, (4, w), generator=gen).double() / 4
        elif kind == 2:  # the same values up to 1e-4: every rank's pair in one bucket
            base = torch.rand(4, max(v, w), generator=gen, dtype=torch.float64)
            a = base[:, :v] * (1 + 1e-4 * torch.rand(4, v, generator=gen, dtype=torch.float64))
            b = base[:, :w]
        elif kind == 3:  # one shape on both sides
            a = torch.softmax(2 * torch.randn(4, v, generator=gen), -1)
            b = torch.softmax(2 * torch.randn(4, w, generator=gen), -1)
        else:  # float32, scaled (merged groups)
            a = torch.rand(4, v, generator=gen) * 1e-3
            b = torch.rand(4, w, generator=gen) ** 4
        yield kind, a, b


@pytest.mark.parametrize(
    "dense, sort_all",
    [(4, 10**9), (10**9, 10**9), (4, 1)],
    ids=["dense-rows-sorted", "buckets-only", "small-vocabularies-sorted"],
)
def test_sorted_l1_equals_the_sort(monkeypatch, dense, sort_all):
    monkeypatch.setattr(crosstok, "_DENSE", dense)
    monkeypatch.setattr(crosstok, "_SORT_ALL", sort_all)
    for kind, a, b in _cases(0):
        a = a.clone().requires_grad_()
        got = sorted_l1(a, b)
        torch.testing.assert_close(got, _sorted_l1_reference(a.detach(), b), rtol=1e-6, atol=1e-12)
        (grad,) = torch.autograd.grad(got.sum(), a)
        a_ref = a.detach().clone().requires_grad_()
        (grad_ref,) = torch.autograd.grad(_sorted_l1_reference(a_ref, b).sum(), a_ref)
        if kind != 1:  # with ties the sort's order among equal values, and so its subgradient, is arbitrary
            torch.testing.assert_close(grad, grad_ref)


def test_sorted_l1_at_qwen3_size_sorts_few_values():
    gen = torch.Generator().manual_seed(1)
    a = torch.softmax(3 * torch.randn(3, 151_669, generator=gen), -1)
    b = torch.softmax(torch.randn(3, 129_280, generator=gen), -1)
    torch.testing.assert_close(sorted_l1(a, b), _sorted_l1_reference(a, b), rtol=1e-5, atol=1e-7)
    keys_a, keys_b = crosstok._float_keys(a), crosstok._float_keys(b)
    top, low = int(max(keys_a.max(), keys_b.max())), int(min(keys_a.min(), keys_b.min()))
    ranked_a = crosstok._Ranked.of(a, keys_a, top, top - low + 1)
    ranked_b = crosstok._Ranked.of(b, keys_b, top, top - low + 1)
    first = ranked_a.cum_RK - ranked_a.count_RK + 1
    bucket = torch.arange(top - low + 1)
    met = (ranked_a.count_RK > 0) & (ranked_b.bucket_of_rank(first) <= bucket)
    met &= ranked_b.bucket_of_rank(ranked_a.cum_RK) >= bucket
    assert (met * ranked_a.count_RK).sum() < 0.05 * a.numel()  # a few percent of the values are sorted


# The loss against TRL's ULDLoss and against the chain rule ---------------------------------------------


@pytest.fixture(scope="module")
def uld_loss_class():
    gold = pytest.importorskip("trl.experimental.gold.gold_trainer")
    return gold.ULDLoss


@pytest.fixture(scope="module")
def batch(qwen3, deepseek):
    """Qwen3 student and DeepSeek teacher tokenizations of the same completions, random float64 hidden states
    and heads (vocabularies at the tokenizers' sizes), and the full logits TRL reads."""
    (q, qb), (d, db) = qwen3, deepseek
    gen = torch.Generator().manual_seed(0)
    rows = []
    for prompt, text in zip(PROMPTS, TEXTS):
        s_ids = [*q(text, add_special_tokens=False).input_ids, q.eos_token_id]
        t = db.tokenize(d, qb.text(s_ids), d.eos_token_id)
        rows.append(
            dict(
                s_prompt=q(prompt, add_special_tokens=False).input_ids,
                t_prompt=d(prompt, add_special_tokens=False).input_ids,
                s=Tokens(s_ids, qb.ends(s_ids)),
                t=t,
            )
        )
    s_len = max(len(r["s_prompt"]) + len(r["s"].ids) for r in rows)
    t_len = max(len(r["t_prompt"]) + len(r["t"].ids) for r in rows)
    s_hidden = torch.randn(len(rows), s_len, 8, generator=gen, dtype=torch.float64)
    t_hidden = torch.randn(len(rows), t_len, 6, generator=gen, dtype=torch.float64)
    s_head = 2.0 * torch.randn(len(q), 8, generator=gen, dtype=torch.float64)
    t_head = 2.0 * torch.randn(len(d), 6, generator=gen, dtype=torch.float64)
    return SimpleNamespace(
        rows=rows, q=q, d=d, s_hidden=s_hidden, t_hidden=t_hidden, s_head=s_head, t_head=t_head,
        match=VocabMatch.of(q, d),
    )  # fmt: skip


def _trl_inputs(batch, side: str):
    """(input_ids, labels, byte offsets) padded on the right, as GOLD's collators make them."""
    length = (batch.s_hidden if side == "s" else batch.t_hidden).shape[1]
    ids = torch.zeros(len(batch.rows), length, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    offsets = torch.zeros(len(batch.rows), length, 2, dtype=torch.long)
    for b, r in enumerate(batch.rows):
        prompt, tokens = r[f"{side}_prompt"], r[side]
        p, c = len(prompt), len(tokens.ids)
        ids[b, : p + c] = torch.tensor(prompt + tokens.ids)
        labels[b, p : p + c] = torch.tensor(tokens.ids)
        offsets[b, p : p + c, 1] = torch.tensor(tokens.byte_ends) // 2
    return ids, labels, offsets


def _settings(merge, hybrid, weights, skip_eos, temps) -> CrossTokenizerSettings:
    return CrossTokenizerSettings(
        crosstok_merge=merge,
        crosstok_hybrid=hybrid,
        crosstok_hybrid_weights=weights,
        crosstok_matched_weight=0.7,
        crosstok_unmatched_weight=0.4,
        crosstok_student_temperature=temps[0],
        crosstok_teacher_temperature=temps[1],
        crosstok_skip_student_eos=skip_eos,
        crosstok_skip_teacher_eos=skip_eos,
    )


def _ours(batch, settings, beta, head=True):
    """The loss with TRL's reduction, and the gradients of the student's hidden states and head."""
    s_hidden, s_head = batch.s_hidden.clone().requires_grad_(), batch.s_head.clone().requires_grad_()
    s_rows, t_rows = [], []
    for b, r in enumerate(batch.rows):
        s_rows += [
            s_hidden[b, k] for k in prediction_positions(len(r["s_prompt"]), len(r["s"].ids), settings)
        ]
        t_rows += [
            batch.t_hidden[b, k] for k in prediction_positions(len(r["t_prompt"]), len(r["t"].ids), settings)
        ]
    plan = align(
        [r["s"] for r in batch.rows],
        [r["t"] for r in batch.rows],
        settings,
        student_eos=batch.q.eos_token_id,
        teacher_eos=batch.d.eos_token_id,
    )
    s_NH, t_MH = torch.stack(s_rows), torch.stack(t_rows)
    if head:
        args = (s_NH, s_head, t_MH, batch.t_head)
    else:  # logits rows
        args = (s_NH @ s_head.T, None, t_MH @ batch.t_head.T, None)
    out = cross_tokenizer_divergence(
        *args,
        plan,
        settings,
        match=batch.match,
        beta=beta,
        group_weights_G=plan.row_mean_weights(),
        chunk_size=5,
    )
    out.sum.backward()
    return out.sum.detach(), s_hidden.grad, s_head.grad, out


def _trl(batch, uld_loss_class, merge, hybrid, weights, skip_eos, temps, beta):
    config = SimpleNamespace(
        uld_crossentropy_weight=0.0,
        uld_distillation_weight=1.0,
        uld_student_temperature=temps[0],
        uld_teacher_temperature=temps[1],
        uld_skip_student_eos=skip_eos,
        uld_skip_teacher_eos=skip_eos,
        use_extended_uld=True,
        uld_token_merge_strategy=merge,
        uld_use_hybrid_loss=hybrid,
        uld_hybrid_matched_weight=0.7 if weights == "fixed" else None,
        uld_hybrid_unmatched_weight=0.4 if weights == "fixed" else None,
        beta=beta,
    )
    loss_fn = uld_loss_class(config, student_tokenizer=batch.q, teacher_tokenizer=batch.d)
    s_hidden, s_head = batch.s_hidden.clone().requires_grad_(), batch.s_head.clone().requires_grad_()
    s_ids, s_labels, s_off = _trl_inputs(batch, "s")
    t_ids, t_labels, t_off = _trl_inputs(batch, "t")
    loss = loss_fn(
        s_hidden @ s_head.T,
        batch.t_hidden @ batch.t_head.T,
        s_labels,
        t_labels,
        s_ids,
        t_ids,
        student_byte_offsets=s_off,
        teacher_byte_offsets=t_off,
    )
    loss.backward()
    return loss.detach(), s_hidden.grad, s_head.grad


CASES = [  # (TRL's merge, hybrid, weights, skip EOS, (student, teacher) temperatures, beta)
    ("observed", False, "adaptive", True, (1.0, 1.0), 0.5),
    ("bayesian", False, "adaptive", True, (1.0, 1.0), 0.5),
    ("bayesian", False, "adaptive", False, (0.7, 1.3), 0.5),
    ("observed", True, "adaptive", True, (1.0, 1.0), 0.5),
    ("bayesian", True, "adaptive", True, (1.3, 0.8), 0.5),
    ("bayesian", True, "fixed", False, (1.0, 1.0), 0.0),
    ("observed", True, "fixed", True, (0.9, 1.0), 1.0),
    ("bayesian", True, "fixed", True, (1.0, 1.0), 1.0),
]


@pytest.mark.parametrize(("merge", "hybrid", "weights", "skip_eos", "temps", "beta"), CASES)
def test_matches_trl_uld_loss(batch, uld_loss_class, merge, hybrid, weights, skip_eos, temps, beta):
    """Loss and gradients (student hidden states and head) to 1e-6 relative in float64; TRL's "observed" is
    our "observed-trl"."""
    ours_merge = "observed-trl" if merge == "observed" else merge
    settings = _settings(ours_merge, hybrid, weights, skip_eos, temps)
    loss, grad_h, grad_w, out = _ours(batch, settings, beta)
    ref_loss, ref_h, ref_w = _trl(batch, uld_loss_class, merge, hybrid, weights, skip_eos, temps, beta)
    assert loss.item() > 0.01
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad_h, ref_h, rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(grad_w, ref_w, rtol=1e-6, atol=1e-12)
    if hybrid:
        assert out.matched_G.abs().sum() > 0 and out.unmatched_G.sum() > 0  # unnormalised: JSD may be < 0


def test_logit_rows_give_the_same_loss(batch):
    settings = _settings("bayesian", True, "adaptive", True, (1.0, 1.0))
    loss, grad_h, grad_w, _ = _ours(batch, settings, 0.5)
    loss_l, grad_h_l, grad_w_l, _ = _ours(batch, settings, 0.5, head=False)
    torch.testing.assert_close(loss_l, loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad_h_l, grad_h)
    torch.testing.assert_close(grad_w_l, grad_w)


def _chain_rule_reference(batch, merge: str) -> torch.Tensor:
    """Loops over rows and groups, the chain rule by hand from full logits at the predicting positions
    (P-1+k for token k), and ULD's sorted L1 by plain sorting; TRL's reduction."""
    s_logits = torch.log_softmax(batch.s_hidden @ batch.s_head.T, -1)
    t_logits = torch.log_softmax(batch.t_hidden @ batch.t_head.T, -1)
    per_row = []
    for b, r in enumerate(batch.rows):
        s, t = r["s"], r["t"]
        groups = [g for g in align_ends(s.byte_ends[:-1], t.byte_ends[:-1]) if g[0] and g[1]]
        losses = []
        for s_idx, t_idx in groups:
            merged = []
            for idx, logp, prompt, ids in (
                (s_idx, s_logits, r["s_prompt"], s.ids),
                (t_idx, t_logits, r["t_prompt"], t.ids),
            ):
                rows = [logp[b, len(prompt) - 1 + k] for k in idx]
                base = rows[-1] if merge == "bayesian" else rows[0]
                others = idx[:-1] if merge == "bayesian" else idx[1:]
                scale = sum(rows[idx.index(k)][ids[k]] for k in others) if others else 0.0
                merged.append((base + scale).exp())
            losses.append(_sorted_l1_reference(merged[0][None], merged[1][None])[0])
        per_row.append(torch.stack(losses).mean())
    return torch.stack(per_row).mean()


@pytest.mark.parametrize("merge", ["observed", "bayesian"])
def test_the_chain_rule_by_hand(batch, merge):
    settings = _settings(merge, False, "adaptive", True, (1.0, 1.0))
    loss, *_ = _ours(batch, settings, 0.5)
    # GOLD floors a merged token's probability at 1e-8 (EPS); the chain rule by hand does not.
    torch.testing.assert_close(loss, _chain_rule_reference(batch, merge), rtol=1e-6, atol=0)


def test_trl_observed_reads_the_next_row(batch):
    """TRL's "observed" is not the chain rule: it differs from ours on this batch (multi-token groups), while
    "observed-trl" is TRL's (test_matches_trl_uld_loss)."""
    right, *_ = _ours(batch, _settings("observed", False, "adaptive", True, (1.0, 1.0)), 0.5)
    trl_like, *_ = _ours(batch, _settings("observed-trl", False, "adaptive", True, (1.0, 1.0)), 0.5)
    assert abs(right.item() - trl_like.item()) > 1e-3 * right.item()
    assert list(prediction_positions(5, 3, _settings("observed", False, "adaptive", True, (1, 1)))) == [
        4,
        5,
        6,
    ]
    assert list(prediction_positions(5, 3, _settings("observed-trl", False, "adaptive", True, (1, 1)))) == [
        5,
        6,
        7,
    ]


def test_positional_alignment_pairs_by_index(batch):
    settings = CrossTokenizerSettings(crosstok_align="positional")
    plan = align(
        [r["s"] for r in batch.rows],
        [r["t"] for r in batch.rows],
        settings,
        student_eos=batch.q.eos_token_id,
        teacher_eos=batch.d.eos_token_id,
    )
    expected = sum(min(len(r["s"].ids), len(r["t"].ids)) - 1 for r in batch.rows)
    assert plan.num_groups == expected and len(plan.s_scalar_Q) == len(plan.t_scalar_Q) == 0


def test_group_chunks_and_errors(batch):
    settings = _settings("bayesian", False, "adaptive", True, (1.0, 1.0))
    plan = align(
        [r["s"] for r in batch.rows],
        [r["t"] for r in batch.rows],
        settings,
        student_eos=batch.q.eos_token_id,
        teacher_eos=batch.d.eos_token_id,
    )
    s_NH = torch.randn(plan.num_student_tokens, 8, dtype=torch.float64)
    t_MH = torch.randn(plan.num_teacher_tokens, 6, dtype=torch.float64)
    sums = {
        c: cross_tokenizer_divergence(
            s_NH, batch.s_head, t_MH, batch.t_head, plan, settings, chunk_size=c
        ).sum
        for c in (1, 7, 1000)
    }
    torch.testing.assert_close(sums[1], sums[1000])
    torch.testing.assert_close(sums[7], sums[1000])
    with pytest.raises(ValueError, match="one row per completion token"):
        cross_tokenizer_divergence(s_NH[1:], batch.s_head, t_MH, batch.t_head, plan, settings)
    with pytest.raises(ValueError, match="VocabMatch"):
        cross_tokenizer_divergence(
            s_NH,
            batch.s_head,
            t_MH,
            batch.t_head,
            plan,
            _settings("bayesian", True, "adaptive", True, (1, 1)),
        )
    with pytest.raises(ConfigError, match="crosstok_merge"):
        align([], [], CrossTokenizerSettings(crosstok_merge="first"))


def test_identical_tokenizers_and_models_give_zero(qwen3):
    q, qb = qwen3
    ids = [*q(TEXTS[0], add_special_tokens=False).input_ids, q.eos_token_id]
    tokens = Tokens(ids, qb.ends(ids))
    settings = CrossTokenizerSettings()
    plan = align([tokens], [tokens], settings, student_eos=q.eos_token_id, teacher_eos=q.eos_token_id)
    assert plan.num_groups == len(ids) - 1 and len(plan.s_scalar_Q) == 0
    logits_NV = torch.randn(len(ids), 1000, dtype=torch.float64)
    out = cross_tokenizer_divergence(logits_NV, None, logits_NV.clone(), None, plan, settings)
    assert out.sum.item() == pytest.approx(0.0, abs=1e-12)


def test_every_setting_is_declared_once():
    names = [f for f in CrossTokenizerSettings.__dataclass_fields__]
    assert all(n.startswith("crosstok_") for n in names)
    assert len(list(itertools.chain(names))) == len(set(names))


# The closed-form backward (`_StudentLoss`) ---------------------------------------------------------------


def _plan(batch, settings):
    return align(
        [r["s"] for r in batch.rows],
        [r["t"] for r in batch.rows],
        settings,
        student_eos=batch.q.eos_token_id,
        teacher_eos=batch.d.eos_token_id,
    )


def _direct(s_logits_NV, t_logits_MW, plan, settings) -> torch.Tensor:
    """Each group's ULD loss by plain autograd: log-softmax at the temperature, the chain rule's scalar
    factors floored at EPS, and a full sort."""
    s_lp = torch.log_softmax(s_logits_NV / settings.crosstok_student_temperature, -1)
    t_lp = torch.log_softmax(t_logits_MW / settings.crosstok_teacher_temperature, -1)
    merged = []
    for lp, base, rows, groups, tokens in (
        (s_lp, plan.s_base_G, plan.s_scalar_Q, plan.s_scalar_group_Q, plan.s_scalar_token_Q),
        (t_lp, plan.t_base_G, plan.t_scalar_Q, plan.t_scalar_group_Q, plan.t_scalar_token_Q),
    ):
        factor = lp[rows, tokens].exp().clamp_min(crosstok.EPS).log()
        log_c = torch.zeros(plan.num_groups, dtype=lp.dtype).index_add(0, groups, factor)
        merged.append((lp[base] + log_c.unsqueeze(1)).exp())
    return _sorted_l1_reference(*merged)


@pytest.mark.parametrize("temps", [(1.0, 1.0), (0.7, 1.3)])
def test_uld_on_logit_rows_matches_plain_autograd(batch, temps):
    """The bench's path (ULD on logits rows, no head) against autograd through a full sort, float64."""
    settings = _settings("bayesian", False, "adaptive", True, temps)
    plan = _plan(batch, settings)
    s_hidden, t_hidden = _completion_rows(batch, plan, settings)
    s_logits = (s_hidden @ batch.s_head.T).requires_grad_()
    t_logits = t_hidden @ batch.t_head.T
    weights = torch.rand(plan.num_groups, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    out = cross_tokenizer_divergence(s_logits, None, t_logits, None, plan, settings, group_weights_G=weights)
    (grad,) = torch.autograd.grad(out.sum, s_logits)
    ref_logits = s_logits.detach().clone().requires_grad_()
    ref = _direct(ref_logits, t_logits, plan, settings)
    (ref_grad,) = torch.autograd.grad((weights * ref).sum(), ref_logits)
    torch.testing.assert_close(out.per_group_G, ref.detach(), rtol=1e-9, atol=1e-15)
    # atol: entries m (s - A e^-c) where s and A e^-c nearly cancel carry rounding of the gradient's scale.
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-11 * ref_grad.abs().max().item())


def _completion_rows(batch, plan, cfg):
    rows = []
    for side, hidden in (("s", batch.s_hidden), ("t", batch.t_hidden)):
        rows.append(
            torch.cat(
                [
                    hidden[b, list(prediction_positions(len(r[f"{side}_prompt"]), len(r[side].ids), cfg))]
                    for b, r in enumerate(batch.rows)
                ]
            )
        )
    return rows


def test_only_the_head_or_only_the_rows_get_gradient(batch):
    settings = _settings("observed", False, "adaptive", True, (1.2, 1.0))
    plan = _plan(batch, settings)
    s_NH, t_MH = _completion_rows(batch, plan, settings)
    both_h, both_w = s_NH.clone().requires_grad_(), batch.s_head.clone().requires_grad_()
    args = (t_MH, batch.t_head, plan, settings)
    cross_tokenizer_divergence(both_h, both_w, *args, chunk_size=4).sum.backward()
    head = batch.s_head.clone().requires_grad_()
    (grad_w,) = torch.autograd.grad(cross_tokenizer_divergence(s_NH, head, *args).sum, head)
    rows = s_NH.clone().requires_grad_()
    (grad_h,) = torch.autograd.grad(cross_tokenizer_divergence(rows, batch.s_head, *args).sum, rows)
    torch.testing.assert_close(grad_w, both_w.grad)
    torch.testing.assert_close(grad_h, both_h.grad)


def test_no_groups_gives_a_zero_attached_to_the_graph():
    plan = align([Tokens([5], [2])], [Tokens([7], [4])], CrossTokenizerSettings())  # ends never meet
    assert plan.num_groups == 0
    s = torch.randn(1, 300, requires_grad=True)
    out = cross_tokenizer_divergence(s, None, torch.randn(1, 200), None, plan, CrossTokenizerSettings())
    out.sum.backward()
    assert out.sum.item() == 0.0 and out.per_group_G.shape == (0,) and not s.grad.any()


def test_merged_probabilities_keep_their_precision_far_below_one():
    """Groups whose scalar tokens multiply to e^-60 and e^-80 (near float32's smallest normal, e^-87) keep
    float32's relative precision: softmax(z) exp(c) against float64 (exp(log_softmax + c) in float32 is
    off by ~|log_softmax + c| ulps, 5e-6 here)."""
    gen = torch.Generator().manual_seed(4)
    z = 2 * torch.randn(3, 5000, generator=gen)
    log_c = torch.tensor([0.0, -60.0, -80.0])
    got = crosstok._merge_(z.clone(), log_c).double()
    ref = (torch.log_softmax(z.double(), -1) + log_c.double().unsqueeze(1)).exp()
    normal = ref > torch.finfo(torch.float32).tiny
    assert normal[2].sum() > 100
    torch.testing.assert_close(got[normal], ref[normal], rtol=2e-6, atol=0)


def test_float32_agrees_with_float64(batch):
    """Loss and gradient in float32 against the same in float64, ULD at the kit's default chunk size."""
    settings = _settings("bayesian", False, "adaptive", True, (1.0, 1.0))
    plan = _plan(batch, settings)
    s_hidden, t_hidden = _completion_rows(batch, plan, settings)
    s_logits, t_logits = s_hidden @ batch.s_head.T, t_hidden @ batch.t_head.T
    results = []
    for dtype in (torch.float32, torch.float64):
        logits = s_logits.to(dtype).requires_grad_()
        out = cross_tokenizer_divergence(logits, None, t_logits.to(dtype), None, plan, settings)
        (grad,) = torch.autograd.grad(out.sum, logits)
        results.append((out.per_group_G.double(), grad.double()))
    (loss32, grad32), (loss64, grad64) = results
    torch.testing.assert_close(loss32, loss64, rtol=1e-5, atol=1e-9)
    assert (grad32 - grad64).norm() < 1e-5 * grad64.norm()
