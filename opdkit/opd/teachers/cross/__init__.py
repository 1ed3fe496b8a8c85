"""Distilling from a teacher with another tokenizer: the kind (`CrossTokenizerTeacher`), the micro-batch
re-tokenized and aligned for it (`Retokenizer`), and GOLD's cross-tokenizer divergence, vectorised and exact.

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
trl/experimental/gold) to 1e-6 in float64 (tests/test_opd_teachers_cross_divergence.py), with the exceptions
below.

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
  and the same subgradient; tests/test_opd_teachers_cross_sortedl1.py checks it against the sort with ties,
  zeros and values equal to 1e-4.
- nothing is materialised over the whole batch's vocabulary: scalar tokens need only their own
  probability, base rows are processed `chunk_size` groups at a time, and the student's side is one
  autograd node (`_StudentLoss`) whose backward pass recomputes each chunk's merged probabilities and
  writes their gradient in closed form (the student's signs of the sorted L1 are kept compactly, per
  bucket, for it), so memory is a few chunk x vocabulary buffers, reused from chunk to chunk (GOLD keeps
  full B x T x V logits, ~10 GB per model at 64 x 256 tokens and Qwen3's vocabulary in float32).

One module per idea: `teacher` (the kind, and the student's side of its loss), `retokenize` (a micro-batch in
the teacher's tokens, single- and multi-turn, and `differ`: whether two tokenizers are two vocabularies), and
the pure maths: `settings` (GOLD's knobs, declared in `opdkit.settings`; the rows they read), `tokenbytes`
(token bytes, the shared vocabulary), `alignment` (groups and rows), `divergence` (the loss and its
closed-form backward), `sortedl1` (the sorted L1 without a sort). The names below are the package's
interface.
"""

from opdkit.opd.teachers.cross.alignment import Alignment, align, align_ends
from opdkit.opd.teachers.cross.divergence import EPS, CrossTokenizerOutput, cross_tokenizer_divergence
from opdkit.opd.teachers.cross.retokenize import Retokenizer, differ, teacher_forward_inputs
from opdkit.opd.teachers.cross.settings import CrossTokenizerSettings, prediction_positions
from opdkit.opd.teachers.cross.sortedl1 import sorted_l1
from opdkit.opd.teachers.cross.teacher import CrossTokenizerTeacher, student_cross_divergence
from opdkit.opd.teachers.cross.tokenbytes import TokenBytes, Tokens, VocabMatch

__all__ = [
    "EPS",
    "Alignment",
    "CrossTokenizerOutput",
    "CrossTokenizerSettings",
    "CrossTokenizerTeacher",
    "Retokenizer",
    "TokenBytes",
    "Tokens",
    "VocabMatch",
    "align",
    "align_ends",
    "cross_tokenizer_divergence",
    "differ",
    "prediction_positions",
    "sorted_l1",
    "student_cross_divergence",
    "teacher_forward_inputs",
]
