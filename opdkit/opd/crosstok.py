"""Distilling from a teacher with another tokenizer: GOLD's cross-tokenizer divergence, vectorised and exact.

    s_bytes, t_bytes = TokenBytes.of(student_tok), TokenBytes.of(teacher_tok)       # once per tokenizer
    match = VocabMatch.of(student_tok, teacher_tok)                             # once per pair (hybrid)
    student = [Tokens(ids, s_bytes.ends(ids)) for ids in completions]                 # the sampled ids
    teacher = [t_bytes.tokenize(teacher_tok, s_bytes.text(ids), eos_id) for ids in completions]
    plan = align(student, teacher, settings, student_eos=..., teacher_eos=...)
    out = cross_tokenizer_divergence(s_hidden_NH, s_head_VH, t_hidden_MH, t_head_WH, plan, settings,
                                     match=match)
    (out.sum / plan.num_groups).backward()      # or plan.row_mean_weights() for TRL's mean of per-row means

The teacher reads the student's completion as text, re-tokenized its own way. Each completion's tokens
are grouped where the two tokenizations' byte end-offsets coincide (a two-pointer walk, `align_ends`); a
group of several tokens is merged by the chain rule into one distribution per side: "bayesian", the last
token's distribution (conditioned on the actual earlier tokens) times the probabilities of the actual
earlier tokens; "observed", the first token's distribution times the probabilities of the actual later
tokens. Each group's loss is ULD's sorted-probability L1 between the two merged distributions (the
vocabularies differ, so probabilities are compared rank by rank), or the hybrid: generalized JSD on the
vocabulary both tokenizers share (matched by exact token string) plus the sorted L1 on the rest, weighted
fixed or by the share of the teacher's vocabulary that matched. This follows TRL's GOLD (`ULDLoss`,
trl/experimental/gold) to 1e-6 in float64 (tests/test_opd_crosstok.py), with the exceptions below.

Tensor names: N student completion tokens (flattened over the batch), V the student's vocabulary, M the
teacher's completion tokens, W the teacher's vocabulary, G groups, Q the scalar (non-base) tokens of
multi-token groups, R the groups of one chunk, H hidden sizes, S the shared vocabulary, B rows.

Rows: row n of `student_hidden_NH` is the hidden state whose logits give token n's probability (position
P-1+k for completion token k after a P-token prompt), completions in batch order, every token including a
trailing EOS even when it is skipped; the same for the teacher's M rows. `prediction_positions` says which.

Pitfalls this module exists for:
- TRL's "observed" strategy (its default) reads each answer token's row one position late: the logits at
  the token's own position, which predict the next token. Single-token groups then compare the two
  models' next-token distributions after the same text, which is consistent, but a multi-token group
  multiplies the probability of token k under the distribution that predicts token k+1. "observed" here
  is the chain rule done right (the row that predicts each token); "observed-trl" reproduces TRL's rows
  (`prediction_positions` moves them), for comparisons only. "bayesian" is TRL's PR #5905 and agrees.
- byte offsets come from the tokens themselves, not from the fast tokenizer's character offsets: a
  multi-byte character split over two byte-level tokens has one character span but two byte ends, and
  an emoji or CJK character is 3-4 bytes. `TokenBytes` decodes each token through the byte-level
  alphabet (or, for a character tokenizer like the tiny world's, encodes each token's characters), and
  checks that the teacher's tokens spell the text byte for byte; where a normalizer changed the text it
  falls back to the character offsets, with the tokens inside one character closing no group.
- special tokens (the EOS) are zero-width, so both sides' EOS tokens close a group at the text's end;
  with skip-EOS (GOLD's default) a trailing EOS is dropped on that side. A truncated completion (no EOS)
  keeps its last token: TRL drops the last token whatever it is.
- ULD sorts every merged distribution over the whole vocabulary (~50 ms per row of 151k on a CPU core).
  `sorted_l1` gets the same value without sorting: it buckets the values by their float32 exponent and
  top mantissa bits (one pass), counts each bucket on both sides, and reads from the counts which of
  two rank-matched values is larger wherever the two values sit in different buckets; only buckets where
  the two sides' ranks meet are sorted, a few percent of the values when the two distributions differ
  in shape (a row where they hold over a quarter, two distributions of one shape, is sorted in full).
  The result is exact: the same terms as the full sort, summed in another order (float rounding only),
  and the same subgradient; tests/test_opd_crosstok.py checks it against the sort with ties, zeros and
  values equal to 1e-4.
- nothing is materialised over the whole batch's vocabulary: scalar tokens need only their own
  probability, base rows are processed `chunk_size` groups at a time, and the student's side is one
  autograd node (`_StudentLoss`) whose backward pass recomputes each chunk's merged probabilities and
  writes their gradient in closed form (the student's signs of the sorted L1 are kept compactly, per
  bucket, for it), so memory is a few chunk x vocabulary buffers, reused from chunk to chunk (GOLD keeps
  full B x T x V logits, ~10 GB per model at 64 x 256 tokens and Qwen3's vocabulary in float32).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from functools import lru_cache

import torch
import torch.nn.functional as F

from opdkit.config import ConfigError, check_ranges, setting

EPS = 1e-8  # GOLD's floor on a merged token's probability and on the hybrid's matched probabilities


@dataclass
class CrossTokenizerSettings:
    """GOLD's knobs for a teacher with another tokenizer (mixed into a job's config like `OPDSettings`)."""

    crosstok_align: str = setting(
        "bytes",
        "how the two tokenizations are paired: bytes (groups close where both sides' byte ends coincide; "
        "byte-level BPE or character tokenizers) or positional (token k with token k, ULD's fallback)",
        choices=("bytes", "positional"),
    )
    crosstok_merge: str = setting(
        "bayesian",
        "how a group of several tokens becomes one distribution: bayesian (the last token's distribution "
        "times the actual earlier tokens' probabilities), observed (the first token's distribution times "
        "the actual later tokens' probabilities), observed-trl (TRL's observed, one position late)",
        choices=("bayesian", "observed", "observed-trl"),
    )
    crosstok_hybrid: bool = setting(
        False,
        "generalized JSD (the kit's beta) on the vocabulary both tokenizers share, sorted L1 on the rest; "
        "off: sorted L1 (ULD) on the whole vocabularies",
    )
    crosstok_hybrid_weights: str = setting(
        "adaptive",
        "hybrid: adaptive (matched part weighted by the share of the teacher's vocabulary that matched, "
        "the rest by one minus it) or fixed (crosstok_matched_weight, crosstok_unmatched_weight)",
        choices=("adaptive", "fixed"),
    )
    crosstok_matched_weight: float = setting(
        0.5, "hybrid, fixed weights: weight of the matched part", min=0.0
    )
    crosstok_unmatched_weight: float = setting(
        0.5, "hybrid, fixed weights: weight of the unmatched part", min=0.0
    )
    crosstok_student_temperature: float = setting(
        1.0, "temperature of the student's distributions in the cross-tokenizer loss", min=1e-3
    )
    crosstok_teacher_temperature: float = setting(
        1.0, "temperature of the teacher's distributions in the cross-tokenizer loss", min=1e-3
    )
    crosstok_skip_student_eos: bool = setting(True, "leave the student's trailing EOS out of the loss")
    crosstok_skip_teacher_eos: bool = setting(True, "leave the teacher's trailing EOS out of the loss")


def _check(settings: CrossTokenizerSettings) -> None:
    check_ranges(settings, fields(CrossTokenizerSettings))


def prediction_positions(prompt_len: int, completion_len: int, settings: CrossTokenizerSettings) -> range:
    """The positions whose hidden states are a completion's rows: P-1+k for token k, one later for
    `crosstok_merge=observed-trl` (TRL's rows)."""
    shift = 0 if settings.crosstok_merge == "observed-trl" else -1
    return range(prompt_len + shift, prompt_len + shift + completion_len)


# Token bytes -----------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): printable bytes stand for themselves, the others for the
    code points from 256 on, in order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


@dataclass(frozen=True)
class Tokens:
    """One completion as one tokenizer cut it: token ids and each token's end in the completion's UTF-8
    bytes (non-decreasing; odd values mark a token that ends inside a character, see `TokenBytes`)."""

    ids: list[int]
    byte_ends: list[int]


@dataclass
class TokenBytes:
    """The bytes each token id stands for, for one tokenizer (`TokenBytes.of(tokenizer)`, once).

    Byte ends are kept doubled (byte e is 2e), so the character-offset fallback can place a token that
    ends inside a character at 2e-1, where no token of the other side ends."""

    pieces: list[bytes]
    kind: str  # "byte-level" or "characters"

    @classmethod
    def of(cls, tokenizer) -> TokenBytes:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ConfigError(
                f"{type(tokenizer).__name__} is not a fast tokenizer; byte alignment needs one "
                "(AutoTokenizer.from_pretrained(..., use_fast=True)) or crosstok_align=positional."
            )
        kind = _tokenizer_kind(json.loads(backend.to_str()))
        added = backend.get_added_tokens_decoder()
        vocab = backend.get_vocab(with_added_tokens=True)
        pieces = [b""] * (max(vocab.values()) + 1)
        decoder = _byte_level_decoder()
        for token, i in vocab.items():
            if i in added:  # added tokens are stored as text; special ones are not part of it
                pieces[i] = b"" if added[i].special else added[i].content.encode()
            elif kind == "characters":
                pieces[i] = token.encode()
            else:
                try:
                    pieces[i] = bytes(decoder[c] for c in token)
                except KeyError:
                    raise ConfigError(
                        f"token {token!r} (id {i}) is not in the byte-level alphabet; the tokenizer's "
                        "pieces are not bytes, so use crosstok_align=positional."
                    ) from None
        return cls(pieces, kind)

    def ends(self, ids: Sequence[int]) -> list[int]:
        """Doubled byte end of each token in the text the ids spell."""
        out, total = [], 0
        for i in ids:
            total += len(self.pieces[i])
            out.append(2 * total)
        return out

    def text(self, ids: Sequence[int]) -> str:
        """The text the ids spell, special tokens left out; cut before the first byte that is not valid
        UTF-8 (a character the completion left unfinished), so the text's bytes are a prefix of the ids'."""
        data = b"".join(self.pieces[i] for i in ids)
        try:
            return data.decode()
        except UnicodeDecodeError as err:
            return data[: err.start].decode()

    def tokenize(self, tokenizer, text: str, eos_id: int | None = None) -> Tokens:
        """`text` in this tokenizer's tokens (no special tokens added), then `eos_id` (zero width)."""
        enc = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)
        ids = list(enc.ids)
        ends = self.ends(ids)
        if b"".join(self.pieces[i] for i in ids) != text.encode():
            ends = _ends_from_offsets(text, enc.offsets)  # a normalizer changed the text
        if eos_id is not None:
            ids.append(eos_id)
            ends.append(ends[-1] if ends else 0)
        return Tokens(ids, ends)


def _tokenizer_kind(spec: dict) -> str:
    """ "byte-level" (a ByteLevel pre-tokenizer or decoder), "characters" (pieces are literal text: no
    normalizer, pre-tokenizer, prefixes or byte fallback), or a ConfigError saying what to use instead."""
    if "ByteLevel" in json.dumps(spec.get("pre_tokenizer")) or "ByteLevel" in json.dumps(spec.get("decoder")):
        return "byte-level"
    model = spec.get("model") or {}
    literal = (
        spec.get("normalizer") is None
        and spec.get("pre_tokenizer") is None
        and (spec.get("decoder") or {}).get("type") in (None, "Fuse")
        and model.get("type") in ("BPE", "WordLevel")
        and not model.get("continuing_subword_prefix")
        and not model.get("end_of_word_suffix")
        and not model.get("byte_fallback")
    )
    if literal:
        return "characters"
    raise ConfigError(
        f"the tokenizer ({model.get('type')} model, decoder {(spec.get('decoder') or {}).get('type')}) is "
        "neither byte-level BPE nor a character tokenizer, so its byte offsets are not exact; use "
        "crosstok_align=positional (ULD's token-by-position pairing)."
    )


def _ends_from_offsets(text: str, offsets: Sequence[tuple[int, int]]) -> list[int]:
    """Doubled byte ends from character offsets: a token ends at its character's end, except that all but
    the last of the tokens ending in one character end inside it (2e-1) and so close no group."""
    char_end = [0]
    for ch in text:
        char_end.append(char_end[-1] + len(ch.encode()))
    ends = [2 * char_end[e] for _, e in offsets]
    for k in range(len(ends) - 1):
        if ends[k] == ends[k + 1]:
            ends[k] -= 1
    return ends


# Vocabulary matching ----------------------------------------------------------------------------------


@dataclass
class VocabMatch:
    """Token ids both tokenizers spell the same (exact token string, as GOLD matches them), by teacher id."""

    student_ids_S: torch.Tensor
    teacher_ids_S: torch.Tensor

    @classmethod
    def of(cls, student_tokenizer, teacher_tokenizer) -> VocabMatch:
        student = student_tokenizer.get_vocab()
        pairs = sorted(
            (t_id, student[tok]) for tok, t_id in teacher_tokenizer.get_vocab().items() if tok in student
        )
        teacher_ids, student_ids = zip(*pairs) if pairs else ((), ())
        return cls(torch.tensor(student_ids, dtype=torch.long), torch.tensor(teacher_ids, dtype=torch.long))

    def __len__(self) -> int:
        return len(self.teacher_ids_S)


# Alignment --------------------------------------------------------------------------------------------


def align_ends(s_ends: Sequence[int], t_ends: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Groups of token indices (student, teacher) closing where both sides' byte ends coincide: advance the
    side whose token ends first (GOLD's `_align_by_byte_offsets`). Tokens after the last common end (a
    completion cut inside a character) take no part: GOLD pairs them as one last group, though the two
    sides then spell different bytes. A group may be empty on one side (zero-width tokens)."""
    groups, s0, t0, s, t = [], 0, 0, 0, 0
    while s < len(s_ends) and t < len(t_ends):
        if s_ends[s] < t_ends[t]:
            s += 1
        elif s_ends[s] > t_ends[t]:
            t += 1
        else:
            s, t = s + 1, t + 1
            groups.append((list(range(s0, s)), list(range(t0, t))))
            s0, t0 = s, t
    return groups


@dataclass
class Alignment:
    """Which rows make each group's merged distribution, for a whole batch (`align` builds it).

    A group g has one base row per side (`s_base_G`, `t_base_G`) whose full distribution is used, and
    scalar rows (`s_scalar_Q` in group `s_scalar_group_Q`, predicting `s_scalar_token_Q`) whose actual
    token's probability multiplies it."""

    s_base_G: torch.Tensor
    t_base_G: torch.Tensor
    s_scalar_Q: torch.Tensor
    s_scalar_group_Q: torch.Tensor
    s_scalar_token_Q: torch.Tensor
    t_scalar_Q: torch.Tensor
    t_scalar_group_Q: torch.Tensor
    t_scalar_token_Q: torch.Tensor
    row_G: torch.Tensor  # the batch row of each group
    num_rows: int
    num_student_tokens: int  # N: rows the student's hidden states must have
    num_teacher_tokens: int  # M

    @property
    def num_groups(self) -> int:
        return len(self.s_base_G)

    def groups_per_row(self) -> torch.Tensor:
        return torch.bincount(self.row_G, minlength=self.num_rows)

    def row_mean_weights(self) -> torch.Tensor:
        """Per group, 1 / (rows x groups in its row): weighting the groups' losses by it gives TRL's loss, the
        mean over rows of each row's mean over its groups (a row without groups counts as 0)."""
        per_row = self.groups_per_row().clamp(min=1)
        return 1.0 / (self.num_rows * per_row[self.row_G].double())

    def to(self, device: torch.device | str) -> Alignment:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return Alignment(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moved.items()})


def align(
    student: Sequence[Tokens],
    teacher: Sequence[Tokens],
    settings: CrossTokenizerSettings,
    *,
    student_eos: int | None = None,
    teacher_eos: int | None = None,
) -> Alignment:
    """Groups over a batch of completions: row b's student tokens are rows [sum of earlier lengths, + its
    length) of the student's hidden states, the same for the teacher. O(tokens) integer work per row."""
    _check(settings)
    if len(student) != len(teacher):
        raise ValueError(
            f"{len(student)} student completions but {len(teacher)} teacher ones; pass one per row"
        )
    lists: dict[str, list[int]] = {k: [] for k in ("sb", "tb", "sq", "sg", "st", "tq", "tg", "tt", "row")}
    bayesian = settings.crosstok_merge == "bayesian"
    s_off = t_off = 0
    for b, (s, t) in enumerate(zip(student, teacher)):
        s_n = _kept(s.ids, settings.crosstok_skip_student_eos, student_eos)
        t_n = _kept(t.ids, settings.crosstok_skip_teacher_eos, teacher_eos)
        if settings.crosstok_align == "positional":
            groups = [([k], [k]) for k in range(min(s_n, t_n))]
        else:
            groups = [g for g in align_ends(s.byte_ends[:s_n], t.byte_ends[:t_n]) if g[0] and g[1]]
        for s_idx, t_idx in groups:
            g = len(lists["row"])
            lists["row"].append(b)
            for idx, off, tokens, (base, q, qg, qt) in (
                (s_idx, s_off, s.ids, ("sb", "sq", "sg", "st")),
                (t_idx, t_off, t.ids, ("tb", "tq", "tg", "tt")),
            ):
                base_k = idx[-1] if bayesian else idx[0]
                lists[base].append(off + base_k)
                for k in idx:
                    if k != base_k:
                        lists[q].append(off + k)
                        lists[qg].append(g)
                        lists[qt].append(tokens[k])
        s_off, t_off = s_off + len(s.ids), t_off + len(t.ids)
    as_t = {k: torch.tensor(v, dtype=torch.long) for k, v in lists.items()}
    return Alignment(
        as_t["sb"], as_t["tb"], as_t["sq"], as_t["sg"], as_t["st"], as_t["tq"], as_t["tg"], as_t["tt"],
        as_t["row"], len(student), s_off, t_off,
    )  # fmt: skip


def _kept(ids: Sequence[int], skip_eos: bool, eos: int | None) -> int:
    """How many leading tokens take part: all, or all but a trailing EOS when skipping it."""
    return len(ids) - 1 if skip_eos and ids and eos is not None and ids[-1] == eos else len(ids)


# The loss ---------------------------------------------------------------------------------------------


@dataclass
class CrossTokenizerOutput:
    """What `cross_tokenizer_divergence` returns for G groups."""

    sum: torch.Tensor  # scalar, differentiable: sum over groups of weight x group loss
    per_group_G: torch.Tensor  # detached loss of each group (its matched and unmatched parts weighted)
    matched_G: torch.Tensor | None = None  # hybrid: detached generalized JSD on the shared vocabulary
    unmatched_G: torch.Tensor | None = None  # hybrid: detached sorted L1 on the rest


@dataclass
class _Side:
    """One model's rows and head, its temperature and vocabulary width."""

    hidden: torch.Tensor
    head: torch.Tensor | None  # None: `hidden` rows are logits already
    temperature: float
    vocab: int

    @property
    def dtype(self) -> torch.dtype:
        return torch.promote_types((self.hidden if self.head is None else self.head).dtype, torch.float32)

    def logits(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The rows' logits at this side's temperature, R x vocab: a new tensor (or `out`, R x vocab), free to
        be changed in place."""
        if self.head is None:
            source = self.hidden[:, : self.vocab]
            if out is not None and source.dtype == out.dtype:
                z = torch.index_select(source, 0, rows, out=out)
            else:
                z = source.index_select(0, rows).to(self.dtype)
        else:
            with torch.autocast(rows.device.type, enabled=False):
                z = F.linear(self.hidden.index_select(0, rows).to(self.head.dtype), self.head[: self.vocab])
            z = z.to(self.dtype)
        if self.temperature != 1.0:
            z.div_(self.temperature)
        return z


def cross_tokenizer_divergence(
    student_hidden_NH: torch.Tensor,
    student_head_VH: torch.Tensor | None,
    teacher_hidden_MH: torch.Tensor,
    teacher_head_WH: torch.Tensor | None,
    alignment: Alignment,
    settings: CrossTokenizerSettings,
    *,
    match: VocabMatch | None = None,
    beta: float = 1.0,
    student_vocab_size: int | None = None,
    teacher_vocab_size: int | None = None,
    group_weights_G: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> CrossTokenizerOutput:
    """Sum over groups of the cross-tokenizer loss, from final hidden states and bias-free heads (or, with a
    head of None, from logits rows: `student_hidden_NH` is then N x V logits).

    Gradient reaches the student's rows and head; the teacher's are detached. `match` (from `VocabMatch.of`)
    is needed with `crosstok_hybrid`; `beta` is the hybrid's generalized JSD weight (0 forward KL, 1 reverse
    KL, GOLD's default 0.5). `*_vocab_size` slices padded heads to their tokenizers; the adaptive hybrid
    weight is |shared| / the teacher's vocabulary so sliced. `group_weights_G` weights each group's loss in
    `sum` (`alignment.row_mean_weights()` gives TRL's reduction); default 1.
    """
    _check(settings)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1] (0 = forward KL, 1 = reverse KL), got {beta}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    for name, hidden, rows in (
        ("student_hidden_NH", student_hidden_NH, alignment.num_student_tokens),
        ("teacher_hidden_MH", teacher_hidden_MH, alignment.num_teacher_tokens),
    ):
        if hidden.dim() != 2 or hidden.shape[0] != rows:
            raise ValueError(
                f"{name} {tuple(hidden.shape)} must have one row per completion token of the alignment "
                f"({rows}); gather the rows of every completion token, trailing EOS included"
            )
    student = _Side(
        student_hidden_NH,
        student_head_VH,
        settings.crosstok_student_temperature,
        _width(student_hidden_NH, student_head_VH, student_vocab_size, "student"),
    )
    teacher = _Side(
        teacher_hidden_MH.detach(),
        None if teacher_head_WH is None else teacher_head_WH.detach(),
        settings.crosstok_teacher_temperature,
        _width(teacher_hidden_MH, teacher_head_WH, teacher_vocab_size, "teacher"),
    )
    hybrid = _hybrid_plan(settings, match, beta, student.vocab, teacher.vocab, student_hidden_NH.device)
    run = _Run(student, teacher, alignment.to(student_hidden_NH.device), hybrid, chunk_size)
    wants_grad = torch.is_grad_enabled() and (
        student.hidden.requires_grad or (student.head is not None and student.head.requires_grad)
    )
    if wants_grad:
        loss_G, matched_G, unmatched_G = _StudentLoss.apply(student.hidden, student.head, run)
    else:
        with torch.no_grad():
            loss_G, matched_G, unmatched_G = run.forward(keep=False)
    weights = torch.ones_like(loss_G) if group_weights_G is None else group_weights_G.to(loss_G)
    out = CrossTokenizerOutput(sum=(weights * loss_G).sum(), per_group_G=loss_G.detach())
    if hybrid is not None and len(loss_G):
        out.matched_G, out.unmatched_G = matched_G, unmatched_G
    return out


def _width(hidden: torch.Tensor, head: torch.Tensor | None, vocab_size: int | None, name: str) -> int:
    rows = hidden.shape[1] if head is None else head.shape[0]
    if vocab_size is None:
        return rows
    if not 1 <= vocab_size <= rows:
        raise ValueError(
            f"{name}_vocab_size={vocab_size} must be between 1 and the {name}'s {rows} logits; use "
            f"len(tokenizer) of the {name}'s tokenizer"
        )
    return vocab_size


@dataclass
class _Hybrid:
    beta: float
    matched_weight: float
    unmatched_weight: float
    s_ids_S: torch.Tensor
    t_ids_S: torch.Tensor
    s_unmatched_V: torch.Tensor  # 1.0 where the student's token has no teacher twin
    t_unmatched_W: torch.Tensor


def _hybrid_plan(settings, match, beta, s_vocab, t_vocab, device) -> _Hybrid | None:
    if not settings.crosstok_hybrid:
        return None
    if match is None:
        raise ValueError("crosstok_hybrid needs match=VocabMatch.of(student_tokenizer, teacher_tokenizer)")
    keep = (match.student_ids_S < s_vocab) & (match.teacher_ids_S < t_vocab)
    s_ids, t_ids = match.student_ids_S[keep].to(device), match.teacher_ids_S[keep].to(device)
    if settings.crosstok_hybrid_weights == "adaptive":
        matched = len(t_ids) / max(1, t_vocab)
        weights = (matched, 1.0 - matched)
    else:
        weights = (settings.crosstok_matched_weight, settings.crosstok_unmatched_weight)
    s_un, t_un = torch.ones(s_vocab, device=device), torch.ones(t_vocab, device=device)
    s_un[s_ids], t_un[t_ids] = 0.0, 0.0
    return _Hybrid(beta, *weights, s_ids, t_ids, s_un, t_un)


class _Buffers:
    """Vocabulary-wide buffers reused from chunk to chunk, by name: on a CPU a fresh one costs as much as a
    pass over it (the allocator returns big blocks to the system, which pages them in again)."""

    def __init__(self) -> None:
        self.store: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        numel = math.prod(shape)
        buffer = self.store.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype or buffer.device != device:
            buffer = self.store[name] = torch.empty(numel, dtype=dtype, device=device)
        return buffer[:numel].view(shape)


def _buffer(buffers: _Buffers | None, name: str, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    shape = tuple(like.shape)
    if buffers is None:
        return torch.empty(shape, dtype=dtype, device=like.device)
    return buffers(name, shape, dtype, like.device)


class _StudentLoss(torch.autograd.Function):
    """The loss of every group as one autograd node of the student's rows and head. The forward pass keeps,
    per chunk of groups, only what the backward pass cannot recompute cheaply (the sorted L1's signs,
    compactly); the backward pass recomputes each chunk's merged probabilities and writes their gradient in
    closed form (`_Run.backward`), so no graph over vocabulary-wide tensors is recorded."""

    @staticmethod
    def forward(ctx, hidden, head, run):
        ctx.run = run
        loss_G, matched_G, unmatched_G = run.forward(keep=True)
        ctx.mark_non_differentiable(matched_G, unmatched_G)
        return loss_G, matched_G, unmatched_G

    @staticmethod
    def backward(ctx, grad_G, _matched, _unmatched):
        want_hidden, want_head = ctx.needs_input_grad[:2]
        return (*ctx.run.backward(grad_G, want_hidden, want_head), None)


@dataclass
class _Run:
    """One call of `cross_tokenizer_divergence`: its forward pass, group chunk by group chunk, and the
    backward pass of the student's side.

    Merged probabilities of a group: m_v = softmax(z / T)_v exp(c), c the log of the scalar tokens' factor.
    For a group loss L with dL/dm_v = G_v (the sorted L1's sign s_v for ULD), with A = sum_v G_v m_v:
        dL/dz_j = (G_j m_j - softmax(z / T)_j A) / T = m_j (G_j - A exp(-c)) / T,    dL/dc = A,
    and c's gradient reaches the scalar rows through log p(token) = z_token / T - logsumexp(z / T)."""

    student: _Side
    teacher: _Side
    al: Alignment
    hybrid: _Hybrid | None
    chunk_size: int
    saved: list = field(default_factory=list)

    def chunks(self) -> list[slice]:
        step = self.chunk_size
        return [slice(s, s + step) for s in range(0, self.al.num_groups, step)]

    def forward(self, keep: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss, matched part, unmatched part) of every group; `keep`: save what the backward pass reads."""
        s, t, al, hybrid = self.student, self.teacher, self.al, self.hybrid
        buffers, device = _Buffers(), s.hidden.device
        log_c_s_G, lp_s_Q, lse_s_Q = _scalar_factors(
            s, al.s_scalar_Q, al.s_scalar_token_Q, al.s_scalar_group_Q, self, buffers, "m_s"
        )
        log_c_t_G, *_ = _scalar_factors(
            t, al.t_scalar_Q, al.t_scalar_token_Q, al.t_scalar_group_Q, self, buffers, "m_t"
        )
        if keep:
            self.log_c_s_G, self.lp_s_Q, self.lse_s_Q = log_c_s_G, lp_s_Q, lse_s_Q
        parts = []
        for chunk in self.chunks():
            rows_s, rows_t = al.s_base_G[chunk], al.t_base_G[chunk]
            m_s = s.logits(rows_s, buffers("m_s", (len(rows_s), s.vocab), s.dtype, device))
            _merge_(m_s, log_c_s_G[chunk])
            m_t = t.logits(rows_t, buffers("m_t", (len(rows_t), t.vocab), t.dtype, device))
            _merge_(m_t, log_c_t_G[chunk])
            if hybrid is None:
                signs, part_s, part_t = _l1_signs(m_s, m_t, buffers)
                loss = part_s - part_t
                parts.append((loss, loss[:0], loss[:0]))
                if keep:
                    self.saved.append((signs, part_s))
                continue
            matched = _matched_jsd(m_s[:, hybrid.s_ids_S], m_t[:, hybrid.t_ids_S], hybrid.beta)
            m_s.mul_(hybrid.s_unmatched_V), m_t.mul_(hybrid.t_unmatched_W)
            signs, part_s, part_t = _l1_signs(m_s, m_t, buffers)
            unmatched = part_s - part_t
            parts.append(
                (hybrid.matched_weight * matched + hybrid.unmatched_weight * unmatched, matched, unmatched)
            )
            if keep:
                self.saved.append((signs, log_c_t_G[chunk]))
        if not parts:
            empty = torch.zeros(0, dtype=s.dtype, device=s.hidden.device)
            return empty, empty.clone(), empty.clone()
        return tuple(torch.cat(p) for p in zip(*parts))

    def backward(self, grad_G: torch.Tensor, want_hidden: bool, want_head: bool):
        s, t, al, hybrid = self.student, self.teacher, self.al, self.hybrid
        grad_hidden = torch.zeros_like(s.hidden) if want_hidden else None
        grad_head = torch.zeros_like(s.head) if want_head else None
        grad_G = grad_G.to(s.dtype)
        dc_G = torch.zeros_like(grad_G)
        buffers, device = _Buffers(), s.hidden.device
        for chunk, saved in zip(self.chunks(), self.saved):
            rows, g_R, log_c_R = al.s_base_G[chunk], grad_G[chunk], self.log_c_s_G[chunk]
            m = _merge_(s.logits(rows, buffers("m_s", (len(rows), s.vocab), s.dtype, device)), log_c_R)
            out = buffers("sign_a", m.shape, m.dtype, device)
            if hybrid is None:
                signs, part_R = saved
                # m (s - A e^-c) g / T: the shift and the scale folded into the sign table.
                shift, scale = _share(part_R, log_c_R), g_R / s.temperature
                grad_z = signs.expand(m, shift, scale, out=out, buffers=buffers).mul_(m)
                dc_G[chunk] = g_R * part_R
            else:
                signs, log_c_t_R = saved
                with torch.no_grad():
                    rows_t = al.t_base_G[chunk]
                    m_t = t.logits(rows_t, buffers("m_t", (len(rows_t), t.vocab), t.dtype, device))
                    _merge_(m_t, log_c_t_R)
                with torch.enable_grad():
                    m_S = m[:, hybrid.s_ids_S].requires_grad_()
                    jsd = _matched_jsd(m_S, m_t[:, hybrid.t_ids_S], hybrid.beta)
                    (grad_S,) = torch.autograd.grad((jsd * g_R).sum() * hybrid.matched_weight, m_S)
                signs.expand(torch.mul(m, hybrid.s_unmatched_V, out=out), out=out, buffers=buffers)
                grad_m = out.mul_(hybrid.s_unmatched_V).mul_(hybrid.unmatched_weight * g_R.unsqueeze(1))
                grad_m.index_add_(1, hybrid.s_ids_S, grad_S)
                part_R = grad_m.mul_(m).sum(1)  # grad_m is now G m
                grad_z = grad_m.sub_(m.mul_(_share(part_R, log_c_R).unsqueeze(1)))
                if s.temperature != 1.0:
                    grad_z.div_(s.temperature)
                dc_G[chunk] = part_R
            _put(s, rows, grad_z, grad_hidden, grad_head)
        # The scalar rows: d log p(token) / dz = (onehot(token) - softmax(z / T)) / T; GOLD's floor at EPS
        # passes no gradient below it.
        d_Q = dc_G[al.s_scalar_group_Q] * (self.lp_s_Q.exp() >= EPS)
        for start in range(0, len(al.s_scalar_Q), self.chunk_size):
            part = slice(start, start + self.chunk_size)
            rows, d_R = al.s_scalar_Q[part], d_Q[part]
            z = s.logits(rows, buffers("m_s", (len(rows), s.vocab), s.dtype, device))
            p = z.sub_(self.lse_s_Q[part].unsqueeze(1)).exp_()
            grad_z = p.mul_(-d_R.unsqueeze(1))
            grad_z.scatter_add_(1, al.s_scalar_token_Q[part].unsqueeze(1), d_R.unsqueeze(1))
            if s.temperature != 1.0:
                grad_z.div_(s.temperature)
            _put(s, rows, grad_z, grad_hidden, grad_head)
        return grad_hidden, grad_head


def _put(side: _Side, rows, grad_z, grad_hidden, grad_head) -> None:
    """Adds the gradient of the rows' logits to the hidden states' and the head's."""
    if side.head is None:
        if grad_hidden is not None:
            grad_hidden[:, : side.vocab].index_add_(0, rows, grad_z.to(grad_hidden.dtype))
        return
    with torch.autocast(grad_z.device.type, enabled=False):
        grad_z = grad_z.to(side.head.dtype)
        if grad_hidden is not None:
            grad_hidden.index_add_(0, rows, (grad_z @ side.head[: side.vocab]).to(grad_hidden.dtype))
        if grad_head is not None:
            grad_head[: side.vocab].addmm_(grad_z.T, side.hidden.index_select(0, rows).to(side.head.dtype))


def _share(part_R: torch.Tensor, log_c_R: torch.Tensor) -> torch.Tensor:
    """part exp(-c) in float64 (|part| <= exp(c)); through logarithms where exp(-c) alone would overflow."""
    part, log_c = part_R.double(), log_c_R.double()
    share = part * torch.exp(-log_c)
    safe = (part.abs().log() - log_c).exp() * part.sign()
    return torch.where(share.isfinite(), share, safe).to(part_R.dtype)


def _scalar_factors(side: _Side, rows_Q, tokens_Q, groups_Q, run: _Run, buffers: _Buffers, name: str):
    """Per group, the sum of log max(p(actual token), EPS) over its scalar rows (GOLD's clamped product); and
    each scalar row's log p(token) and log-normalizer (for the backward pass)."""
    lp, lse = [], []
    for start in range(0, len(rows_Q), run.chunk_size):
        part = slice(start, start + run.chunk_size)
        rows = rows_Q[part]
        z = side.logits(rows, buffers(name, (len(rows), side.vocab), side.dtype, side.hidden.device))
        z_token = z.gather(1, tokens_Q[part].unsqueeze(1)).squeeze(1)
        top = z.amax(1)
        lse.append(top + z.sub_(top.unsqueeze(1)).exp_().sum(1).log())
        lp.append(z_token - lse[-1])
    log_c_G = torch.zeros(run.al.num_groups, dtype=side.dtype, device=side.hidden.device)
    if not lp:
        return log_c_G, log_c_G[:0], log_c_G[:0]
    lp_Q, lse_Q = torch.cat(lp), torch.cat(lse)
    return log_c_G.index_add_(0, groups_Q, lp_Q.exp().clamp_min(EPS).log()), lp_Q, lse_Q


def _merge_(z_RV: torch.Tensor, log_c_R: torch.Tensor) -> torch.Tensor:
    """Turns tempered logits, in place, into merged probabilities softmax(z) exp(c); returns them. The same
    calls give the same values bit for bit (the backward pass recomputes them and reads their buckets).
    exp(z - max) times exp(c) / sum in float64 keeps the dtype's relative precision however small exp(c) is
    (exp(log_softmax + c) loses |log_softmax + c| ulps of it)."""
    top = z_RV.amax(1, keepdim=True)
    total = z_RV.sub_(top).exp_().sum(1, keepdim=True)
    return z_RV.mul_((log_c_R.double().unsqueeze(1) - total.double().log()).exp().to(z_RV.dtype))


def _matched_jsd(p_s_RS: torch.Tensor, p_t_RS: torch.Tensor, beta: float) -> torch.Tensor:
    """GOLD's generalized JSD on (unnormalised) merged probabilities floored at EPS, summed per row."""
    ls, lt = p_s_RS.clamp_min(EPS).log(), p_t_RS.clamp_min(EPS).log()
    if beta == 0:
        return (lt.exp() * (lt - ls)).sum(-1)
    if beta == 1:
        return (ls.exp() * (ls - lt)).sum(-1)
    lm = torch.logaddexp(ls + math.log1p(-beta), lt + math.log(beta))
    return (beta * lt.exp() * (lt - lm) + (1 - beta) * ls.exp() * (ls - lm)).sum(-1)


# Sorted L1 without sorting ----------------------------------------------------------------------------

_SHIFT = 16  # float32 bits >> 16: exponent and 7 mantissa bits, buckets 0.8 % wide
_DENSE = 4  # a row whose met buckets hold over 1/_DENSE of its values is sorted in full
_SORT_ALL = 1  # more than _SORT_ALL buckets per value of a row pair: every row is sorted in full


def sorted_l1(a_RV: torch.Tensor, b_RW: torch.Tensor) -> torch.Tensor:
    """Per row, sum_i |a_(i) - b_(i)| over both rows sorted in descending order, the shorter padded with
    zeros (ULD's loss), for non-negative values; differentiable in `a` like the sort (the sign of the
    difference at each value's rank), `b` taken as constant.

    Computed as sum_v sign_v a_v - sum_u sign_u b_u, with each value's sign read from bucket counts
    (`_l1_signs`); exact, no full sort (but for vocabularies smaller than the bucket range, where one sort is
    cheaper)."""
    with torch.no_grad():
        signs, _, part_b_R = _l1_signs(a_RV.detach(), b_RW.detach())
        sign_a_RV = signs.expand(a_RV.detach())
    return (sign_a_RV * a_RV).sum(-1) - part_b_R


@dataclass
class _Signs:
    """One side's signs, compactly: per (row, bucket) where uniform (0 in met buckets), then the exact ones of
    met buckets and the rows sorted in full."""

    top: int
    low: int  # keys below it (zeros) count as `low`
    buckets: int
    uniform_RK: torch.Tensor | None  # None: every row is a dense row
    rows: torch.Tensor
    cols: torch.Tensor
    exact: torch.Tensor
    dense_rows: torch.Tensor
    dense_RV: torch.Tensor
    zeros: bool = True  # False: no value's key is below `low` (no clamping)

    def expand(
        self,
        values_RV: torch.Tensor,
        shift_R: torch.Tensor | None = None,
        scale_R: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        buffers: _Buffers | None = None,
    ) -> torch.Tensor:
        """Each value's sign (in the values' dtype), or (sign - shift) x scale with a shift and a scale per
        row; into `out` if given (which may be `values_RV` itself)."""

        def fold(sign: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
            sign = sign.to(values_RV.dtype)
            for by, op in ((shift_R, torch.sub), (scale_R, torch.mul)):
                if by is not None:
                    by = by if rows is None else by[rows]
                    sign = op(sign, by.view(-1, *[1] * (sign.dim() - 1)))
            return sign

        if self.uniform_RK is None:  # every row sorted in full
            signs = fold(self.dense_RV, None)
            return signs if out is None else out.copy_(signs)
        keys = _float_keys(values_RV, _buffer(buffers, "keys_a", values_RV, torch.int32))
        if self.zeros:
            keys.clamp_min_(self.low)
        flat = _flat_buckets(keys, self.top, self.buckets)
        out = torch.empty_like(values_RV) if out is None else out
        torch.index_select(fold(self.uniform_RK, None).view(-1), 0, flat.view(-1), out=out.view(-1))
        if len(self.rows):
            out[self.rows, self.cols] = fold(self.exact, self.rows)
        if len(self.dense_rows):
            out[self.dense_rows] = fold(self.dense_RV, self.dense_rows)
        return out


def _float_keys(values: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 bits >> _SHIFT of non-negative values: monotone in the value (float32 rounding is)."""
    return torch.bitwise_right_shift(values.float().view(torch.int32), _SHIFT, out=out)


def _flat_buckets(keys32: torch.Tensor, top: int, buckets: int) -> torch.Tensor:
    """row x buckets + top - key, in place of the keys (int32: no conversion to int64 for bincount and
    index_select)."""
    rows = torch.arange(keys32.shape[0], dtype=torch.int32, device=keys32.device)
    return torch.sub((rows * buckets + top).unsqueeze(1), keys32, out=keys32)


@dataclass
class _Ranked:
    """One side of `_l1_signs`: values, their flat bucket index (row x buckets + bucket; bucket 0 the largest
    values, K - 1 the smallest, over the key range both sides span), per-row bucket counts, and cumulative
    counts from the top."""

    values: torch.Tensor
    index: torch.Tensor
    count_RK: torch.Tensor
    cum_RK: torch.Tensor

    @classmethod
    def of(cls, values: torch.Tensor, keys32: torch.Tensor, top: int, buckets: int) -> _Ranked:
        """From the values' keys (`_float_keys`, none below the range's lowest), which become the index."""
        index = _flat_buckets(keys32, top, buckets)
        count = torch.bincount(index.view(-1), minlength=values.shape[0] * buckets).view(-1, buckets)
        return cls(values, index, count, count.cumsum(1))

    @property
    def buckets(self) -> int:
        return self.count_RK.shape[1]

    def bucket_of_rank(self, rank: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The bucket holding the value of each 1-based rank (per row: `rank` R x K; or of `rows[i]`);
        K past the row's length (padding zeros, below every bucket)."""
        k = self.buckets
        if rows is None:
            return torch.searchsorted(self.cum_RK, rank).clamp(max=k)
        width = self.values.shape[1] + 1
        offset = torch.arange(self.cum_RK.shape[0], device=rank.device) * width
        flat = (self.cum_RK + offset.unsqueeze(1)).flatten()
        found = torch.searchsorted(flat, rank + offset[rows])
        return (found - rows * k).clamp(max=k)

    def lookup(self, table_RK: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Each value's entry of a per (row, bucket) table, in `out` (the values' shape)."""
        table = table_RK.to(out.dtype).view(-1)
        return torch.index_select(table, 0, self.index.view(-1), out=out.view(-1)).view_as(out)


def _l1_signs(
    a_RV: torch.Tensor, b_RW: torch.Tensor, buffers: _Buffers | None = None
) -> tuple[_Signs, torch.Tensor, torch.Tensor]:
    """sign(a_(i) - b_(i)) at each value's rank i for every value of a (compactly), and per row
    sum_v sign_v a_v and sum_u sign_u b_u (the sorted L1 is their difference)."""
    keys_a = _float_keys(a_RV, _buffer(buffers, "keys_a", a_RV, torch.int32))
    keys_b = _float_keys(b_RW, _buffer(buffers, "keys_b", b_RW, torch.int32))
    (low_a, top_a), (low_b, top_b) = torch.aminmax(keys_a), torch.aminmax(keys_b)
    top, low = int(max(top_a, top_b)), int(min(low_a, low_b))
    zeros = low == 0
    if zeros:  # exact zeros (masked or underflowed): one bucket just below the smallest positive value
        low = min(int(torch.where(k > 0, k, top).min()) for k in (keys_a, keys_b)) - 1
        keys_a, keys_b = keys_a.clamp_min_(low), keys_b.clamp_min_(low)
    buckets = top - low + 1
    if buckets > _SORT_ALL * (a_RV.shape[1] + b_RW.shape[1]):
        # Small vocabularies (the tiny world's): more buckets than values, one sort of every row is cheaper.
        sign_a, sign_b = _sorted_signs(a_RV, b_RW)
        none = torch.zeros(0, dtype=torch.long, device=a_RV.device)
        all_rows = torch.arange(a_RV.shape[0], device=a_RV.device)
        signs = _Signs(top, low, buckets, None, none, none, none.to(torch.int8), all_rows, sign_a, zeros)
        return signs, (sign_a.to(a_RV.dtype) * a_RV).sum(-1), (sign_b.to(b_RW.dtype) * b_RW).sum(-1)
    a, b = _Ranked.of(a_RV, keys_a, top, buckets), _Ranked.of(b_RW, keys_b, top, buckets)
    del keys_a, keys_b
    uniform, met = [], []
    for mine, other, flip in ((a, b, 1), (b, a, -1)):
        # This bucket holds ranks (mine's cum - count, mine's cum]. The other side's values at those ranks
        # all lie in lower buckets (this side's are larger) when the other's cum here is at most the first
        # rank's predecessor, all in higher buckets when its cum before this bucket reaches the last rank
        # (`bucket_of_rank` of both ends, without searching).
        above = other.cum_RK <= mine.cum_RK - mine.count_RK
        below = other.cum_RK - other.count_RK >= mine.cum_RK
        sign_RK = torch.where(above, 1, torch.where(below, -1, 0)) * flip
        uniform.append(sign_RK.to(torch.int8))
        met.append((mine.count_RK > 0) & (sign_RK == 0))
    # Where the two count curves run together (distributions of one shape), most values sit in met buckets
    # and one plain sort of those rows is cheaper than sorting them bucket by bucket.
    met_values_R = (met[0] * a.count_RK).sum(1) + (met[1] * b.count_RK).sum(1)
    dense_R = met_values_R * _DENSE > a_RV.shape[1] + b_RW.shape[1]
    dense_rows = dense_R.nonzero().squeeze(1)
    for u in uniform:  # no value of a dense row counts as met (their signs are set below)
        u[dense_rows] = 2
    # Each value's sign from its bucket's; 0 marks the values of met buckets, ranked exactly below.
    sign_a = a.lookup(uniform[0], _buffer(buffers, "sign_a", a_RV, a_RV.dtype))
    sign_b = b.lookup(uniform[1], _buffer(buffers, "sign_b", b_RW, b_RW.dtype))
    met_a = torch.eq(sign_a, 0, out=_buffer(buffers, "met_a", a_RV, torch.bool))
    sorted_a = _sort_met(a, met_a)
    sorted_b = _sort_met(b, torch.eq(sign_b, 0, out=_buffer(buffers, "met_b", b_RW, torch.bool)))
    exact_a = torch.zeros(0, dtype=torch.int8, device=a_RV.device)
    for other, mine_sorted, other_sorted, flip, sign in (
        (b, sorted_a, sorted_b, 1, sign_a),
        (a, sorted_b, sorted_a, -1, sign_b),
    ):
        rows, cols, vals, keys, rank = mine_sorted
        if not len(rows):
            continue
        theirs = other.bucket_of_rank(rank, rows)
        exact = torch.where(theirs > keys, 1, -1) * flip
        same = theirs == keys
        if same.any():
            # Both values of this rank in one bucket: that bucket is met on both sides, so sorted, and the
            # other side's sorted values are in (row, rank) order.
            o_rows, _, o_vals, _, o_rank = other_sorted
            stride = max(a_RV.shape[1], b_RW.shape[1]) + 2
            pos = torch.searchsorted(o_rows * stride + o_rank, rows[same] * stride + rank[same])
            exact[same] = torch.sign(vals[same] - o_vals[pos]).long() * flip
        sign[rows, cols] = exact.to(sign.dtype)
        if flip == 1:
            exact_a = exact.to(torch.int8)
    dense_a, dense_b = _sorted_signs(a_RV[dense_rows], b_RW[dense_rows])
    sign_a[dense_rows], sign_b[dense_rows] = dense_a.to(sign_a.dtype), dense_b.to(sign_b.dtype)
    part_a, part_b = sign_a.mul_(a_RV).sum(-1), sign_b.mul_(b_RW).sum(-1)
    rows, cols = sorted_a[:2]
    signs = _Signs(top, low, buckets, uniform[0], rows, cols, exact_a, dense_rows, dense_a, zeros)
    return signs, part_a, part_b


def _sorted_signs(a_RV: torch.Tensor, b_RW: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`_l1_signs` by sorting both rows in full (int8 signs of every value)."""
    width = max(a_RV.shape[1], b_RW.shape[1])
    sa, ia = a_RV.sort(dim=1, descending=True)
    sb, ib = b_RW.sort(dim=1, descending=True)
    diff = torch.sign(F.pad(sa, (0, width - sa.shape[1])) - F.pad(sb, (0, width - sb.shape[1]))).to(
        torch.int8
    )
    sign_a = torch.empty_like(diff[:, : a_RV.shape[1]]).scatter_(1, ia, diff[:, : a_RV.shape[1]])
    sign_b = torch.empty_like(diff[:, : b_RW.shape[1]]).scatter_(1, ib, diff[:, : b_RW.shape[1]])
    return sign_a, sign_b


def _sort_met(side: _Ranked, met_RV: torch.Tensor):
    """(rows, columns, values, buckets, 1-based ranks) of the values where `met_RV`, ordered by row, bucket,
    then value descending (so ordered by (row, rank))."""
    rows, cols = met_RV.nonzero(as_tuple=True)
    vals, keys = side.values[rows, cols], side.index[rows, cols].long() - rows * side.buckets
    order = torch.argsort(vals, descending=True, stable=True)
    segment = rows[order] * side.buckets + keys[order]
    order = order[torch.argsort(segment, stable=True)]
    rows, cols, vals, keys = rows[order], cols[order], vals[order], keys[order]
    segment = rows * side.buckets + keys
    _, counts = torch.unique_consecutive(segment, return_counts=True)
    starts = torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    within = torch.arange(len(rows), device=rows.device) - starts
    rank = (side.cum_RK - side.count_RK)[rows, keys] + within + 1
    return rows, cols, vals, keys, rank
