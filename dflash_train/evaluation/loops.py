"""Repetition loops in a reply: small targets (SmolLM2-135M) loop at greedy decoding, and a loop is
trivially predictable from its own context, so a drafter scores a high tau on it whatever it learned.
dflash-eval counts the looping replies per suite and reports tau with and without them.

    find_loop(token_ids) -> Loop(start, period, length) | None

Definition: a reply loops when some span of it is periodic, i.e. a block of `period` tokens
followed by exact copies of itself (the last copy may be partial), with at least MIN_REPEATS
full copies and at least MIN_LOOP_TOKENS tokens in the span. Why these:
- exact, consecutive copies: a greedy loop repeats token for token; lists and parallel sentences
  ("1. The ...", "2. The ...") share prefixes but differ in between, so they are not periodic;
- anywhere in the reply, not only at its tail: a reply that loops for a while and then stops (or,
  at temperature > 0, is sampled out of it) still hands the drafter the same easy stretch;
- three copies: a sentence said twice is sometimes a restatement, three times in a row is not;
- 32 tokens: short exact runs occur in good text (a table's `|---|---|` row, "!!!"), and a run
  this short moves tau little; a loop that lasts to --max-new-tokens is far longer. A zero-filled
  array or a long run of one character of 32 tokens or more does count: known false positives.
"""

from dataclasses import dataclass

import numpy as np

MIN_REPEATS = 3  # full copies of the block in the span
MIN_LOOP_TOKENS = 32  # tokens in the periodic span


@dataclass(frozen=True)
class Loop:
    start: int  # index of the span's first token in the reply
    period: int  # tokens in the repeated block
    length: int  # tokens in the periodic span (the block and its copies)

    @property
    def repeats(self) -> float:
        return self.length / self.period


def find_loop(tokens) -> Loop | None:
    """The longest periodic span that makes `tokens` (a reply's token ids) a loop, or None.
    Among spans of equal length the smallest period is returned."""
    a = np.asarray(tokens)
    best = None
    for p in range(1, len(a) // MIN_REPEATS + 1):
        same = np.concatenate([[False], a[p:] == a[:-p], [False]])  # same[i + 1]: token i + p repeats token i
        edges = np.flatnonzero(np.diff(same.astype(np.int8)))  # run starts and ends, alternating
        starts, ends = edges[0::2], edges[1::2]
        if not len(starts):
            continue
        k = int(np.argmax(ends - starts))
        # a run of r repeats from i: tokens i .. i + p + r - 1 have period p
        length = int(ends[k] - starts[k]) + p
        if length >= max(MIN_REPEATS * p, MIN_LOOP_TOKENS) and (best is None or length > best.length):
            best = Loop(int(starts[k]), p, length)
    return best
