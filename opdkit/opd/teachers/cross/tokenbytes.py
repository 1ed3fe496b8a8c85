"""The bytes each token stands for (`TokenBytes`), a completion as one tokenizer cut it (`Tokens`), and the
vocabulary two tokenizers share (`VocabMatch`).

Byte offsets come from the tokens themselves, not from the fast tokenizer's character offsets: a multi-byte
character split over two byte-level tokens has one character span but two byte ends.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from opdkit.config import ConfigError


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


@dataclass
class VocabMatch:
    """Token ids both tokenizers spell the same (exact token string, as GOLD matches them, or the same bytes:
    `crosstok_match`), by teacher id."""

    student_ids_S: torch.Tensor
    teacher_ids_S: torch.Tensor

    @classmethod
    def of(
        cls, student_tokenizer, teacher_tokenizer, by_bytes: tuple[TokenBytes, TokenBytes] | None = None
    ) -> VocabMatch:
        """Pairs of the same token string; with `by_bytes` (the student's and the teacher's `TokenBytes`),
        of the same bytes instead (special tokens, which spell none, still by string; the lowest id of a side
        where several spell alike)."""
        student = student_tokenizer.get_vocab()
        if by_bytes is None:
            pairs = sorted(
                (t_id, student[tok]) for tok, t_id in teacher_tokenizer.get_vocab().items() if tok in student
            )
        else:
            s_bytes, t_bytes = by_bytes
            s_of: dict[bytes, int] = {}
            for i in sorted(student.values()):
                if s_bytes.pieces[i]:
                    s_of.setdefault(s_bytes.pieces[i], i)
            t_seen: set[bytes] = set()
            pairs = []
            for tok, t_id in sorted(teacher_tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
                piece = t_bytes.pieces[t_id]
                if piece and piece in s_of and piece not in t_seen:
                    t_seen.add(piece)
                    pairs.append((t_id, s_of[piece]))
                elif not piece and tok in student and not s_bytes.pieces[student[tok]]:
                    pairs.append((t_id, student[tok]))
            pairs.sort()
        teacher_ids, student_ids = zip(*pairs) if pairs else ((), ())
        return cls(torch.tensor(student_ids, dtype=torch.long), torch.tensor(teacher_ids, dtype=torch.long))

    def __len__(self) -> int:
        return len(self.teacher_ids_S)
