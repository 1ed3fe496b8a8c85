"""ULD's sorted-probability L1 without a full sort (`sorted_l1`, `l1_signs`): values bucketed by their float32
exponent and top mantissa bits, each value's sign read from the two sides' bucket counts, only the buckets
where the two sides' ranks meet sorted (see `opdkit.opd.teachers.cross`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


class Buffers:
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


def buffer(buffers: Buffers | None, name: str, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    shape = tuple(like.shape)
    if buffers is None:
        return torch.empty(shape, dtype=dtype, device=like.device)
    return buffers(name, shape, dtype, like.device)


_SHIFT = 16  # float32 bits >> 16: exponent and 7 mantissa bits, buckets 0.8 % wide
_DENSE = 4  # a row whose met buckets hold over 1/_DENSE of its values is sorted in full
_SORT_ALL = 1  # more than _SORT_ALL buckets per value of a row pair: every row is sorted in full


def sorted_l1(a_RV: torch.Tensor, b_RW: torch.Tensor) -> torch.Tensor:
    """Per row, sum_i |a_(i) - b_(i)| over both rows sorted in descending order, the shorter padded with
    zeros (ULD's loss), for non-negative values; differentiable in `a` like the sort (the sign of the
    difference at each value's rank), `b` taken as constant.

    Computed as sum_v sign_v a_v - sum_u sign_u b_u, with each value's sign read from bucket counts
    (`l1_signs`); exact, no full sort (but for vocabularies smaller than the bucket range, where one sort is
    cheaper)."""
    with torch.no_grad():
        signs, _, part_b_R = l1_signs(a_RV.detach(), b_RW.detach())
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
        buffers: Buffers | None = None,
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
        keys = _float_keys(values_RV, buffer(buffers, "keys_a", values_RV, torch.int32))
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
    """One side of `l1_signs`: values, their flat bucket index (row x buckets + bucket; bucket 0 the largest
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


def l1_signs(
    a_RV: torch.Tensor, b_RW: torch.Tensor, buffers: Buffers | None = None
) -> tuple[_Signs, torch.Tensor, torch.Tensor]:
    """sign(a_(i) - b_(i)) at each value's rank i for every value of a (compactly), and per row
    sum_v sign_v a_v and sum_u sign_u b_u (the sorted L1 is their difference)."""
    keys_a = _float_keys(a_RV, buffer(buffers, "keys_a", a_RV, torch.int32))
    keys_b = _float_keys(b_RW, buffer(buffers, "keys_b", b_RW, torch.int32))
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
    sign_a = a.lookup(uniform[0], buffer(buffers, "sign_a", a_RV, a_RV.dtype))
    sign_b = b.lookup(uniform[1], buffer(buffers, "sign_b", b_RW, b_RW.dtype))
    met_a = torch.eq(sign_a, 0, out=buffer(buffers, "met_a", a_RV, torch.bool))
    sorted_a = _sort_met(a, met_a)
    sorted_b = _sort_met(b, torch.eq(sign_b, 0, out=buffer(buffers, "met_b", b_RW, torch.bool)))
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
    """`l1_signs` by sorting both rows in full (int8 signs of every value)."""
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
