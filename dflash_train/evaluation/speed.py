"""How fast, and how sure: paired speedups over plain decoding with intervals, advice that admits
ties, and the predicted speedup when several requests share one verify forward.

Intervals are 90% percentile-bootstrap intervals from a two-level bootstrap: prompts are
resampled with replacement, then each drawn prompt's repeats (so both the spread between
prompts and the timing noise between repeats count), RESAMPLES times with a fixed seed, and
every statistic is recomputed on each resample. All methods share the same resamples, so
comparing two methods on one resample is a paired comparison. Row 0 of every resampled array
is the data itself (the identity resample): it gives the point estimate through the same code.

    draws = resample(n_prompts, repeats)                      # indices, 1 + RESAMPLES rows
    speedup = median_over(ar_tpot / tpot, draws)              # [1 + RESAMPLES]
    speedup[0], interval(speedup)
"""

from dataclasses import dataclass, field

import numpy as np

RESAMPLES = 1000
QUANTILES = (5.0, 95.0)  # a 90% interval


# --- resampling -----------------------------------------------------------------------------------

def resample(n: int, repeats: int = 1, resamples: int = RESAMPLES,
             seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Two-level draws: prompts [S, n] and, for each drawn prompt, its repeats [S, n, R], with
    S = 1 + resamples; row 0 is the data (0..n-1 and 0..R-1), the others draws with replacement."""
    rng = np.random.default_rng(seed)
    prompts = np.concatenate([np.arange(n)[None], rng.integers(0, n, size=(resamples, n))])
    reps = np.concatenate([np.broadcast_to(np.arange(repeats), (1, n, repeats)),
                           rng.integers(0, repeats, size=(resamples, n, repeats))])
    return prompts, reps


def _pooled(values: np.ndarray, draws: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """values [n, R] (prompt x repeat) -> [S, n*R]: each resample's samples."""
    prompts, reps = draws
    return values[prompts[:, :, None], reps].reshape(prompts.shape[0], -1)


def median_over(values: np.ndarray, draws: tuple) -> np.ndarray:
    """Median of per-sample values [n, R] on each resample (NaN = no sample) -> [S]."""
    pooled = _pooled(values, draws)
    out = np.full(pooled.shape[0], np.nan)
    ok = ~np.isnan(pooled).all(axis=1)
    out[ok] = np.nanmedian(pooled[ok], axis=1)
    return out


def interval(resampled: np.ndarray) -> list[float] | None:
    """The 90% interval of a resampled statistic (row 0, the point estimate, left out)."""
    rest = resampled[1:]
    rest = rest[~np.isnan(rest)]
    if rest.size == 0:
        return None
    lo, hi = np.percentile(rest, QUANTILES)
    return [round(float(lo), 3), round(float(hi), 3)]


def paired_speedup(ar_tpot: np.ndarray, tpot: np.ndarray, draws: tuple) -> np.ndarray:
    """Speedup over AR = median over prompts (and repeats) of AR's time per token / the method's,
    each ratio taken on the same prompt and repeat. ar_tpot, tpot [n, R] (NaN: nothing decoded)."""
    return median_over(ar_tpot / tpot, draws)


# --- advice ------------------------------------------------------------------------------------------

def verdict(values: dict[tuple[str, int], np.ndarray]) -> dict:
    """Which method to use, or which ones cannot be told apart.

    values: (method, budget) -> resampled speedup over AR [S] (AR itself: all ones). The best is
    the highest point estimate; another method is indistinguishable from it when the best does not
    beat it on at least 95% of the paired resamples (the lower end of the 90% interval of
    best / other is <= 1). A method is recommended only when nothing is indistinguishable from it.
    """
    point = {k: float(v[0]) for k, v in values.items() if not np.isnan(v[0])}
    best = max(point, key=point.get)
    tied = []
    for k in point:
        if k != best:
            ratio = values[best][1:] / values[k][1:]
            ratio = ratio[~np.isnan(ratio)]
            if ratio.size == 0 or np.percentile(ratio, QUANTILES[0]) <= 1.0:
                tied.append(k)
    tied.sort(key=point.get, reverse=True)
    return {"best": _key(best), "speedup": round(point[best], 3), "interval": interval(values[best]),
            "recommended": None if tied else _key(best),
            "indistinguishable": [_key(k) for k in [best, *tied]] if tied else []}


def _key(k: tuple[str, int]) -> dict:
    return {"method": k[0], "budget": k[1]}


def label(m: dict) -> str:
    return {"ar": "plain decoding", "dflash": "the DFlash chain"}.get(m["method"], f"budget {m['budget']}")


def verdict_text(v: dict) -> str:
    """One sentence for report.md and the model card."""
    iv = v["interval"]
    spread = f" (90% interval {iv[0]:.2f}-{iv[1]:.2f}x)" if iv and iv[0] != iv[1] else ""
    best = v["best"]
    if v["recommended"]:
        if best["method"] == "ar":
            return "**plain decoding**: no speculative method is faster here."
        name = f"DDTree budget **{best['budget']}**" if best["method"] == "ddtree" else "**the DFlash chain**"
        return (f"{name}: {v['speedup']:.2f}x over plain decoding{spread}, ahead of every other method "
                "by more than the spread.")
    names = [label(m) for m in v["indistinguishable"]]
    listed = ", ".join(names[:-1]) + f" and {names[-1]}"
    return (f"no single best: {listed} are indistinguishable here (highest: {label(best)} at "
            f"{v['speedup']:.2f}x{spread.replace(' (', ', ').rstrip(')')}).")


# --- cost model: several requests share one verify forward --------------------------------------

def at_width(widths: list[int], table: np.ndarray, width: float) -> np.ndarray:
    """Cost at `width` from costs measured at `widths` (ascending): table [..., W] -> [...].
    Linear in width between measured widths (exact where cost = fixed + per-token); beyond the
    widest along the last segment's slope (the caller flags those as extrapolated); from a single
    measured width, proportional to the width."""
    w = np.asarray(widths, dtype=float)
    if len(w) == 1:
        return table[..., 0] * width / w[0]
    if width <= w[0]:
        return table[..., 0]
    j = min(int(np.searchsorted(w, width)), len(w) - 1)  # first measured width >= width, or the last
    f = (width - w[j - 1]) / (w[j] - w[j - 1])
    return table[..., j - 1] + f * (table[..., j] - table[..., j - 1])


@dataclass
class Curves:
    """How a round's costs grow on one device: verify ms by width [S, W] after `context` cached
    tokens and drafter ms by batch [S, C], either resampled over measurement rounds (S = 1 +
    RESAMPLES, row 0 the medians of all rounds) or fixed (S = 1). The context axis, when measured:
    verify ms [S, K, D] of one request at each of `contexts` (K longer totals) and
    `context_widths` (D widths); without it the verify cost does not grow with context.

    N requests of width w after P tokens each cost one request's forward of width W = N w after
    T = N P tokens (the KV of N contexts is read and copied per forward), less the attention
    pairs a single wide request would compute that N separate ones do not: the single one
    attends W (T + W) pairs (W (P + W) as read off the width curve), the N requests N w (P + w). The single
    request's cost is the width
    curve plus the measured extra cost of a longer context, which is linear in width
    (per context token: a fixed part and a per-query part), so a few widths per context suffice;
    the per-pair cost is that per-query part, fitted from the same points."""
    widths: list[int]
    verify_ms: np.ndarray
    batches: list[int]
    draft_ms: np.ndarray
    context: int | None = None
    contexts: list[int] = field(default_factory=list)
    context_widths: list[int] = field(default_factory=list)
    context_ms: np.ndarray | None = None  # [S, K, D]

    @classmethod
    def from_rounds(cls, costs: dict, resamples: int = RESAMPLES, seed: int = 1) -> "Curves":
        """costs: costs.measure_costs() output (per round: ms per width and per batch)."""
        rounds, _ = resample(len(costs["verify_ms"]), 1, resamples, seed)  # [S, rounds]
        med = lambda key: np.median(np.asarray(costs[key])[rounds], axis=1)  # noqa: E731
        extra = {}
        if costs.get("contexts"):
            extra = {"context": costs["context"], "contexts": list(costs["contexts"]),
                     "context_widths": list(costs["context_widths"]), "context_ms": med("context_verify_ms")}
        return cls(costs["widths"], med("verify_ms"), costs["batches"], med("draft_ms"), **extra)

    def _extra_context_ms(self, width: float) -> tuple[list[int], np.ndarray]:
        """Measured extra verify cost of a longer context at `width`: totals [P, *contexts] and
        ms [S, 1 + K] (0 at P), linear in width between and beyond the measured context widths."""
        base = np.stack([at_width(self.widths, self.verify_ms, w) for w in self.context_widths],
                        axis=-1)  # [S, D]
        extra = self.context_ms - base[:, None, :]  # [S, K, D]
        at = at_width(self.context_widths, extra, width)  # [S, K]
        return [self.context, *self.contexts], np.concatenate([np.zeros_like(at[:, :1]), at], axis=1)

    def per_pair_ms(self) -> np.ndarray:
        """ms per attended (query, key) pair -> [S]: the slope in width of the extra cost per
        extra context token, least squares over the measured (context, width) points, >= 0."""
        if not self.contexts or len(set(self.context_widths)) < 2:
            return np.zeros(self.verify_ms.shape[0])
        base = np.stack([at_width(self.widths, self.verify_ms, w) for w in self.context_widths], axis=-1)
        extra = ((self.context_ms - base[:, None, :])
                 / (np.asarray(self.contexts, float) - self.context)[None, :, None])
        w = np.broadcast_to(np.asarray(self.context_widths, float), extra.shape[1:]).ravel()  # [K*D]
        y = extra.reshape(extra.shape[0], -1)  # [S, K*D]
        slope = (((w - w.mean()) * (y - y.mean(axis=1, keepdims=True))).sum(axis=1)
                 / ((w - w.mean()) ** 2).sum())
        return np.maximum(slope, 0.0)

    def verify_at(self, requests: int, width: int, context: int | None = None) -> np.ndarray:
        """ms of one verify forward for `requests` requests of `width` tokens after `context`
        tokens each (default: the measured one) -> [S]."""
        W = requests * width
        single = at_width(self.widths, self.verify_ms, W)
        if not self.contexts:
            return single  # no context axis: cost by width only
        P = self.context if context is None else context
        T = requests * P
        totals, extra = self._extra_context_ms(W)
        single = single + at_width(totals, extra, T)
        # Pairs one wide request attends and N requests do not: W (T + W) against N w (P + w), the
        # single request's read off the width curve as its cost is (interpolated, or beyond the
        # widest along the last segment), its longer context linear in W as the extra cost is.
        pairs_at_P = at_width(self.widths, np.array([[w * (self.context + w) for w in self.widths]], float),
                              W)
        unshared = pairs_at_P[0] + W * (T - self.context) - requests * width * (P + width)
        return np.maximum(single - self.per_pair_ms() * unshared,
                          at_width(self.widths, self.verify_ms, width))

    def extrapolated(self, requests: int, width: int, context: int | None = None) -> list[str]:
        """Which axes the prediction for `requests` x `width` reads beyond the measured grid."""
        W = requests * width
        out = ["width"] if W > max(self.widths) else []
        if self.contexts:  # else the context is no axis of this model: nothing read beyond it
            T = requests * (self.context if context is None else context)
            if T > max(self.contexts):
                out.append("context")
            if T > self.context and W > max(self.context_widths):
                out.append("width at context")
        return out

    def verify_factor(self, requests: int, width: int) -> np.ndarray:
        """Verify cost of `requests` requests of `width` tokens / of one such request -> [S]."""
        return self.verify_at(requests, width) / self.verify_at(1, width)

    def draft_factor(self, requests: int) -> np.ndarray:
        """Drafter pass for `requests` requests at once / for one -> [S]."""
        return at_width(self.batches, self.draft_ms, requests) / at_width(self.batches, self.draft_ms, 1)


def predicted_speedup(tau: np.ndarray, stages: dict, ar_stages: dict, method: str, budget: int, requests: int,
                      curves: Curves, draws: tuple) -> np.ndarray:
    """Speedup over AR when `requests` requests share each verify forward (width requests x
    (budget + 1)), the median over prompts of a per-prompt prediction -> resampled [S].

    tau [n, R]; stages and ar_stages: "draft", "host" (tree build + commit), "verify" -> [n, R], ms
    per round of one request, this method's and AR's on the same prompt and repeat. A round of
    `requests` requests costs: the drafter pass for all of them (draft x draft_factor), every
    request's host work (host x requests, the tree build included: plain, path-conditioned or
    selector-scored, as decoded) and one verify forward (verify x verify_factor: `requests`
    requests of budget + 1 tokens, each after its own context, against one); AR's the same with
    width 1 and no drafter. At one
    request this is the measured per-prompt ratio again; the curves only say how costs grow."""
    pooled = lambda a: _pooled(a, draws)  # noqa: E731  [S, n*R]
    width = budget + 1
    grow_verify = curves.verify_factor(requests, width)[:, None]  # [S, 1]
    t = pooled(stages["host"]) * requests + pooled(stages["verify"]) * grow_verify
    if method != "ar":
        t = t + pooled(stages["draft"]) * curves.draft_factor(requests)[:, None]
    grow_ar = curves.verify_factor(requests, 1)[:, None]
    t_ar = pooled(ar_stages["host"]) * requests + pooled(ar_stages["verify"]) * grow_ar
    per_prompt = pooled(tau) * t_ar / t
    out = np.full(per_prompt.shape[0], np.nan)
    ok = ~np.isnan(per_prompt).all(axis=1)
    out[ok] = np.nanmedian(per_prompt[ok], axis=1)
    return out
