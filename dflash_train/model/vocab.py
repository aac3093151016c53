"""A draft vocabulary: the drafter predicts over N of the target's V tokens (EAGLE-3 / speculators style).

On a CPU with a 135M target, the drafter's 49,152-wide head and the losses over it are most of a step;
a draft vocabulary of the N most frequent supervised tokens covers nearly all of them at a fraction of
the width. The target still verifies, so output stays exactly the target's: a token outside the draft
vocabulary is never proposed, only never drafted.

Speculators' layout, which vLLM reads (reference/speculators.md):
    d2t  int64 [N]   OFFSETS: target id = draft index + d2t[index]; the kept ids sorted ascending
    t2d  bool  [V]   True for kept target ids (t2d.sum() == N)
Building (speculators' train/vocab_mapping.py, SpecForge alike): count supervised tokens, take the top N
by count (ties by id), pad with ids 0.. when fewer are seen, sort. Ours also always keeps the stop tokens
(end-of-turn, EOS): a drafter that can never propose the end of an answer loses the last block of each.
"""

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from dflash_train.core.errors import UserError


@dataclass(frozen=True)
class DraftVocab:
    kept: torch.Tensor  # int64 [N], target ids, ascending
    vocab_size: int  # V, the target's

    @property
    def size(self) -> int:
        return len(self.kept)

    @property
    def d2t(self) -> torch.Tensor:  # int64 [N] offsets
        return self.kept - torch.arange(self.size)

    @property
    def t2d(self) -> torch.Tensor:  # bool [V]
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[self.kept] = True
        return mask

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.kept.to(draft_ids.device)[draft_ids]

    def to_draft(self, target_ids: torch.Tensor, missing: int = -100) -> torch.Tensor:
        """Target ids -> draft indices (on their device); ids outside the draft vocabulary, and -1 (an
        absent label), -> `missing` (the loss's ignore index)."""
        index = torch.full((self.vocab_size + 1,), missing, dtype=torch.long, device=target_ids.device)
        index[self.kept.to(target_ids.device)] = torch.arange(self.size, device=target_ids.device)
        return index[target_ids.long().clamp(min=-1)]  # -1 reads the extra last entry: `missing`

    def coverage(self, counts: Counter) -> float:
        """Share of the counted (supervised) tokens inside the draft vocabulary."""
        total = sum(counts.values())
        inside = set(self.kept.tolist())
        return sum(c for t, c in counts.items() if t in inside) / total if total else 0.0


def check_size(size: int, vocab_size: int) -> None:
    if not 2 <= size < vocab_size:  # N = V is the full vocabulary: no d2t / t2d (vLLM would not load them)
        raise UserError(f"model.draft_vocab_size {size} must be in 2..{vocab_size - 1}, below the target's "
                        f"vocabulary of {vocab_size} (null: the whole vocabulary)")


def count_supervised(rows: Iterable[tuple[list[int], list[int]]]) -> Counter:
    """(input_ids, loss_mask) rows -> how often each token id is supervised (mask 1)."""
    counts = Counter()
    for ids, mask in rows:
        counts.update(t for t, m in zip(ids, mask) if m)
    return counts


def build_draft_vocab(counts: Counter, size: int, vocab_size: int, always: Iterable[int] = ()) -> DraftVocab:
    """The `size` most supervised tokens (ties by id), the `always` ids among them (they take the places
    of the least frequent), padded with ids 0.. when fewer tokens were seen."""
    check_size(size, vocab_size)
    always = sorted(set(always))
    if len(always) > size or any(not 0 <= t < vocab_size for t in always):
        raise UserError(f"a draft vocabulary of {size} cannot hold the stop tokens {always}")
    ranked = [t for t in sorted(counts, key=lambda t: (-counts[t], t)) if 0 <= t < vocab_size]
    kept = always + [t for t in ranked if t not in set(always)][:size - len(always)]
    pad = (t for t in range(vocab_size) if t not in set(kept))
    while len(kept) < size:
        kept.append(next(pad))
    return DraftVocab(torch.tensor(sorted(kept), dtype=torch.long), vocab_size)


def draft_vocab_from_tensors(d2t: torch.Tensor, t2d: torch.Tensor, where: str) -> DraftVocab:
    """A checkpoint's d2t/t2d pair, checked to describe one draft vocabulary (else one line)."""
    if d2t.dtype != torch.int64 or d2t.dim() != 1 or t2d.dtype != torch.bool or t2d.dim() != 1:
        raise UserError(f"{where}: d2t must be int64 [N] and t2d bool [V], got {d2t.dtype} {list(d2t.shape)} "
                        f"and {t2d.dtype} {list(t2d.shape)}")
    kept = d2t + torch.arange(len(d2t))
    vocab = DraftVocab(kept, len(t2d))
    if len(kept) < 2 or bool((kept[1:] <= kept[:-1]).any()) or int(kept[0]) < 0 or int(kept[-1]) >= len(t2d):
        raise UserError(f"{where}: d2t does not map draft indices to ascending target ids inside the "
                        f"vocabulary of {len(t2d)}")
    if not torch.equal(vocab.t2d, t2d):
        raise UserError(f"{where}: d2t and t2d disagree ({int(t2d.sum())} target ids marked in t2d, "
                        f"{len(d2t)} in d2t, {int((vocab.t2d != t2d).sum())} ids differ)")
    return vocab
