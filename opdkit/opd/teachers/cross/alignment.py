"""Groups of tokens closing where two tokenizations' byte ends coincide (`align_ends`), and the rows that make
each group's merged distribution over a batch (`align` -> `Alignment`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from opdkit.opd.teachers.cross.settings import CrossTokenizerSettings, check_settings
from opdkit.opd.teachers.cross.tokenbytes import Tokens


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
    check_settings(settings)
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
