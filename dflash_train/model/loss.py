"""DFlash objectives: per-slot divergence terms, slot weights, accept-until-fail (AUF), and the
block loss over the full vocabulary computed in chunks. Pure functions: tensors in, (loss, metrics) out.

Block slot k = 1..K (K = B-1) predicts the token k places after the anchor. p is the target's
distribution for that token, q the drafter's, and alpha = sum_v min(p_v, q_v) the probability
that speculative sampling accepts the drafter's token there (alpha per slot is reported).

Terms, per slot (`loss.terms` weighs and sums them; formulas as in speculators' losses/eager.py):
  ce         -log q(label); label = the target's greedy token or the data's (`loss.ce_labels`)
  kl         KL(p || q)
  rkl        KL(q || p)
  jsd        (KL(p || m) + KL(q || m)) / 2 with m = (p + q) / 2
  tv         1 - alpha (total variation distance)
  nla        -log max(alpha, 1e-5): gradient (1/alpha) grad tv; equals ce for a one-hot p
  lk_hybrid  lam kl + (1 - lam) tv with lam = exp(-eta sg[alpha]) (LK losses, arXiv 2602.23881)

Slot weights w (`loss.position_weight`):
  exp      exp(-(k-1)/gamma), DFlash's decay
  uniform  1
  dpace    D-PACE (arXiv 2605.18810; speculators' `dpace_loss_decay`): confidence
           c_i = exp(-ce_i) (detached), smoothed s_i = (1 - a) c_i + a (1 on invalid slots),
           w_j = sum_{m >= j, m valid} prod_{i <= m} s_i: the gradient of the expected
           accepted length with respect to log q_j. ce_i is always the CE to the labels,
           whatever terms are trained.
AUF (`loss.until_first_failure`, arXiv 2607.01893) then zeroes the weights of every slot after
the block's first valid slot whose argmax misses its label (that slot is still supervised).

Normalisation: loss = sum over slots of w * sum_t c_t term_t, divided by D = the sum of the
*static* slot weights over the valid slots (exp weights for exp, 1 per slot for uniform and
dpace, as speculators divides D-PACE by the slot count). D-PACE and AUF weights are only known
after the drafter's forward, D before it: training passes the D of the whole optimizer step
(every micro-batch, every process), so a step's loss and gradient are the same whatever the
split; a block's weights depend only on that block.

Memory: the terms need [slots, V] softmaxes (512 anchors x 15 slots x 151,936 vocab is 4.7 GB
per fp32 tensor). The loss therefore takes hidden states and the LM head and works through
chunks of whole blocks (`loss.chunk_slots`): each chunk's logits, terms and the gradient of its
share of the loss with respect to its hidden rows are computed together in the forward
(`ChunkedBlockLoss`), so no [slots, V] tensor outlives its chunk and backward only scales the
stored [slots, H] gradient. chunk_slots = 0 computes everything at once with plain autograd.
"""

import math

import torch
import torch.nn.functional as F

TERMS = ("ce", "kl", "rkl", "jsd", "tv", "nla", "lk_hybrid")
NLA_EPS = 1e-5  # alpha floor inside -log alpha (speculators' value)


# --- per-slot terms ----------------------------------------------------------------------------

def slot_terms(draft_logits: torch.Tensor, target_logits: torch.Tensor, labels: torch.Tensor, names,
               lk_eta: float = 3.0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """draft_logits, target_logits [..., V]; labels [...] long -> ({name: [...]}, alpha [...]).
    Computed in float32 (float64 for float64 inputs); alpha keeps its graph (tv, nla use it).
    target_logits None: ce only, alpha 0 (a step with the target's labels given and nothing else)."""
    dtype = torch.promote_types(draft_logits.dtype, torch.float32)
    logq = F.log_softmax(draft_logits.to(dtype), dim=-1)
    if target_logits is None:  # labels only (ce): no p, no alpha (reported as 0)
        if set(names) - {"ce"}:
            raise ValueError(f"terms {sorted(set(names) - {'ce'})} need the target's logits")
        return {"ce": -logq.gather(-1, labels.unsqueeze(-1)).squeeze(-1)}, logq.new_zeros(logq.shape[:-1])
    logp = F.log_softmax(target_logits.to(dtype), dim=-1)
    q, p = logq.exp(), logp.exp()
    alpha = torch.minimum(p, q).sum(-1)
    kl = (p * (logp - logq)).sum(-1) if {"kl", "lk_hybrid"} & set(names) else None
    out = {}
    for name in names:
        if name == "ce":
            out[name] = -logq.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        elif name == "kl":
            out[name] = kl
        elif name == "rkl":
            out[name] = (q * (logq - logp)).sum(-1)
        elif name == "jsd":
            logm = torch.logaddexp(logp, logq) - math.log(2.0)
            out[name] = 0.5 * ((p * (logp - logm)).sum(-1) + (q * (logq - logm)).sum(-1))
        elif name == "tv":
            out[name] = 1.0 - alpha
        elif name == "nla":
            out[name] = -torch.log(alpha.clamp_min(NLA_EPS))
        elif name == "lk_hybrid":
            lam = torch.exp(-lk_eta * alpha.detach())
            out[name] = lam * kl + (1.0 - lam) * (1.0 - alpha)
        else:
            raise ValueError(f"unknown loss term {name!r} (known: {', '.join(TERMS)})")
    return out, alpha


def acceptance_rate(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """[..., V] x 2 -> alpha [...] = sum_v min(p_v, q_v), float32 (float64 for float64 inputs)."""
    dtype = torch.promote_types(draft_logits.dtype, torch.float32)
    return torch.minimum(F.softmax(draft_logits.to(dtype), -1),
                         F.softmax(target_logits.to(dtype), -1)).sum(-1)


# --- slot weights ------------------------------------------------------------------------------

def exp_weights(num_slots: int, gamma: float, device=None, dtype=torch.float32) -> torch.Tensor:
    """[K] weights exp(-(k-1)/gamma) for slots k = 1..K."""
    k = torch.arange(1, num_slots + 1, device=device, dtype=dtype)
    return torch.exp(-(k - 1) / gamma)


def dpace_weights(ce: torch.Tensor, valid: torch.Tensor, dpace_alpha: float) -> torch.Tensor:
    """ce, valid [..., K] (ce detached) -> D-PACE weights [..., K], 0 where invalid."""
    c = torch.exp(-ce)
    s = torch.where(valid, (1.0 - dpace_alpha) * c + dpace_alpha, torch.ones_like(c))
    prefix = torch.cumprod(s, dim=-1) * valid  # prod_{i <= m} s_i, kept where m is valid
    return prefix.flip(-1).cumsum(-1).flip(-1) * valid  # sum over m >= j


def until_first_failure(correct: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """correct, valid [..., K] bool -> keep [..., K] bool: valid slots up to and including the
    first valid slot whose argmax misses its label (invalid slots are passed over)."""
    ok = (correct | ~valid).long()
    before = torch.cat([torch.ones_like(ok[..., :1]), ok[..., :-1]], dim=-1).cumprod(-1)  # all earlier ok
    return valid & before.bool()


def slot_weights(valid: torch.Tensor, ce: torch.Tensor | None, cfg, dtype=torch.float32) -> torch.Tensor:
    """valid [..., K] bool (and ce [..., K] detached, read by dpace) -> w [..., K] (0 where invalid)."""
    if cfg.position_weight == "dpace":
        return dpace_weights(ce, valid, cfg.dpace_alpha).to(dtype)
    if cfg.position_weight == "exp":
        return exp_weights(valid.shape[-1], cfg.gamma, valid.device, dtype) * valid
    return valid.to(dtype)


def loss_divisor(valid: torch.Tensor, cfg, dtype=torch.float32) -> torch.Tensor:
    """The share of these slots in the loss's divisor D (see the module docstring): known from
    `valid` alone, so a training step can sum it over micro-batches and processes first."""
    if cfg.position_weight == "exp":
        return (exp_weights(valid.shape[-1], cfg.gamma, valid.device, dtype) * valid).sum()
    return valid.to(dtype).sum()


# --- the block loss ------------------------------------------------------------------------------

def _objective_names(cfg) -> list[str]:
    """The trained/reported terms, plus ce when only D-PACE needs it."""
    extra = ["ce"] if cfg.position_weight == "dpace" and "ce" not in cfg.terms else []
    return [*cfg.terms, *extra]


def block_pieces(draft_logits: torch.Tensor, target_logits: torch.Tensor | None, tokens: torch.Tensor,
                 valid: torch.Tensor, cfg, labels: torch.Tensor | None = None):
    """Whole blocks: draft/target logits [n, K, V], tokens (the data's) [n, K], valid [n, K] ->
    (numerator: sum w * sum_t c_t term_t, term sums [T] = sum w * term_t in cfg.terms order,
    labels [n, K], correct [n, K] bool (argmax == label, valid), alpha [n, K] (0 where invalid),
    pred [n, K] the draft argmax (XPress feeds it to its next consistency round)).
    Only the numerator carries a graph. Sums over chunks of blocks give the whole batch's.
    `labels` [n, K] given (a draft vocabulary's: indices into it, -1 outside it) replace the
    target's argmax / the data's tokens; -1 slots are left out of the loss (not of the divisor)."""
    if labels is None:
        if target_logits is None and cfg.ce_labels == "target":
            raise ValueError("no target logits and no labels: give labels= or target_hidden")
        labels = target_logits.argmax(-1) if cfg.ce_labels == "target" else tokens
    known = labels >= 0  # a label outside the draft vocabulary (-1) is not supervised, and never hit
    pred = draft_logits.argmax(-1)
    correct = (pred == labels) & valid
    values, alpha = slot_terms(draft_logits, target_logits, labels.clamp(min=0), _objective_names(cfg),
                               cfg.lk_eta)
    ce = values["ce"].detach() if "ce" in values else None
    if ce is not None and not bool(known.all()):
        # D-PACE: confidence exp(-ce) 0 where the drafter cannot hit
        ce = ce.masked_fill(~known, float("inf"))
    w = slot_weights(valid, ce, cfg, alpha.dtype)
    if cfg.until_first_failure:
        w = w * until_first_failure(correct, valid)
    w = w * known
    sums = torch.stack([(w * values[name]).sum() for name in cfg.terms])  # [T]
    coefs = torch.tensor(list(cfg.terms.values()), dtype=sums.dtype, device=sums.device)
    return (sums * coefs).sum(), sums.detach(), labels, correct, alpha.detach() * valid, pred


def _draft_logits(head, h: torch.Tensor, bias: tuple | None) -> torch.Tensor:
    """head(h), plus the low-rank bias u . w2^T when given (bias = (u [.., r], w2 [V, r]))."""
    logits = head(h)
    return logits if bias is None else logits + F.linear(bias[0].to(logits.dtype), bias[1].to(logits.dtype))


def _chunked_pieces(h, th, tokens, valid, head, cfg, chunk: int, grad: torch.Tensor | None, bias=None,
                    bias_grads=None, labels=None):
    """block_pieces over chunks of `chunk` blocks, from hidden states h, th [n, K, H] (and the
    draft logits' low-rank bias (u [n, K, r], w2 [V, r])). With `grad` ([n, K, H]), also writes
    there the gradient of the numerator with respect to h, and with the bias into bias_grads
    (the gradient for u [n, K, r]; the one for w2 [V, r], summed over chunks). th None: no
    target logits (labels given, ce only)."""
    numerator, sums, per_slot = 0.0, 0.0, []
    for i in range(0, h.shape[0], chunk):
        rows = slice(i, i + chunk)
        with torch.no_grad():
            t_logits = None if th is None else head(th[rows])
        chunk_bias = None if bias is None else (bias[0][rows], bias[1])
        chunk_labels = None if labels is None else labels[rows]
        if grad is None:
            with torch.no_grad():
                num, s, *slots = block_pieces(_draft_logits(head, h[rows], chunk_bias), t_logits,
                                              tokens[rows], valid[rows], cfg, chunk_labels)
        else:
            with torch.enable_grad():
                leaves = [h[rows].detach().requires_grad_()]
                if chunk_bias is not None:
                    leaves += [t.detach().requires_grad_() for t in chunk_bias]
                num, s, *slots = block_pieces(_draft_logits(head, leaves[0], leaves[1:] or None), t_logits,
                                              tokens[rows], valid[rows], cfg, chunk_labels)
                grads = torch.autograd.grad(num, leaves)
                grad[rows] = grads[0]
                if chunk_bias is not None:
                    bias_grads[0][rows] = grads[1]
                    bias_grads[1].add_(grads[2])
            num = num.detach()
        numerator, sums = numerator + num, sums + s
        per_slot.append(slots)
    labels, correct, alpha, pred = (torch.cat(x) for x in zip(*per_slot))
    return numerator, sums, labels, correct, alpha, pred


class ChunkedBlockLoss(torch.autograd.Function):
    """block_pieces from hidden states through a frozen LM head, chunk by chunk: the forward
    computes each chunk's logits, terms and d numerator / d h together and keeps only the
    [n, K, H] gradient; backward scales it by the incoming gradient. Same value and gradient
    as autograd over the whole batch, peak memory of one chunk's [chunk x K, V] tensors.
    A low-rank logit bias u . w2^T (DSpark's Markov head) is trained the same way: its
    gradients for u and w2 are kept beside the one for h."""

    @staticmethod
    def forward(ctx, h, th, tokens, valid, head, cfg, chunk, u=None, w2=None, given=None):
        grad = torch.empty_like(h)
        bias = None if u is None else (u, w2)
        bias_grads = None if u is None else (torch.empty_like(u), torch.zeros_like(w2))
        numerator, sums, labels, correct, alpha, pred = _chunked_pieces(h, th, tokens, valid, head, cfg,
                                                                        chunk, grad, bias, bias_grads, given)
        ctx.save_for_backward(grad, *(bias_grads or ()))
        ctx.mark_non_differentiable(sums, labels, correct, alpha, pred)
        return numerator, sums, labels, correct, alpha, pred

    @staticmethod
    def backward(ctx, g, *_):
        grad, *bias_grads = ctx.saved_tensors
        scaled = [x * g.to(x.dtype) for x in bias_grads] or [None, None]
        return grad * g.to(grad.dtype), None, None, None, None, None, None, *scaled, None


def dflash_loss(draft_hidden: torch.Tensor, target_hidden: torch.Tensor | None, head: torch.nn.Module,
                tokens: torch.Tensor, valid: torch.Tensor, cfg,
                normalizer: torch.Tensor | float | None = None,
                markov_bias: tuple[torch.Tensor, torch.Tensor] | None = None,
                labels: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """draft_hidden [b, A, K, H] (the drafter's states for slots 1..K); target_hidden [b, A, K, H]
    (the target's final-normed state that predicts each slot's token); head: the frozen LM head
    (the target's, or a draft vocabulary's); tokens [b, A, K] the data's tokens at the slots; valid
    [b, A, K] bool; cfg: the recipe's LossConfig; markov_bias: DSpark's Markov logit bias as
    (u [b, A, K, r], w2 [V, r]), the drafter's logits being head(h) + u . w2^T (both trained);
    labels [b, A, K]: given labels in the head's index space (-1: outside it, see block_pieces),
    and then target_hidden may be None (ce only, alpha reported as 0). Returns loss = numerator /
    normalizer (default: this batch's loss_divisor) and detached metrics: terms [T] (each term's
    share, same divisor, cfg.terms order), labels, correct, valid, alpha, pred (the argmax) [b, A, K]."""
    b, A, K, H = draft_hidden.shape
    h = draft_hidden.reshape(b * A, K, H)
    th = None if target_hidden is None else target_hidden.reshape(b * A, K, H)
    tok, ok = tokens.reshape(b * A, K), valid.reshape(b * A, K)
    given = None if labels is None else labels.reshape(b * A, K)
    u, w2 = (None, None) if markov_bias is None else (markov_bias[0].reshape(b * A, K, -1), markov_bias[1])
    if cfg.chunk_slots == 0:
        with torch.no_grad():
            t_logits = None if th is None else head(th)
        numerator, sums, labels, correct, alpha, pred = block_pieces(
            _draft_logits(head, h, None if u is None else (u, w2)), t_logits, tok, ok, cfg, given)
    else:
        if any(p.requires_grad for p in head.parameters()):
            raise ValueError("the chunked loss takes a frozen LM head (set loss.chunk_slots=0 to train one)")
        chunk = max(1, cfg.chunk_slots // K)  # whole blocks: D-PACE and AUF act along a block
        if torch.is_grad_enabled() and h.requires_grad:
            numerator, sums, labels, correct, alpha, pred = ChunkedBlockLoss.apply(h, th, tok, ok, head, cfg,
                                                                                   chunk, u, w2, given)
        else:
            numerator, sums, labels, correct, alpha, pred = _chunked_pieces(
                h, th, tok, ok, head, cfg, chunk, None, None if u is None else (u, w2), None, given)
    divisor = loss_divisor(valid, cfg, numerator.dtype).clamp(min=1e-8) if normalizer is None else normalizer
    shape = (b, A, K)
    return numerator / divisor, {"terms": sums / divisor, "labels": labels.view(shape),
                                 "correct": correct.view(shape), "valid": valid, "alpha": alpha.view(shape),
                                 "pred": pred.view(shape)}


# --- acceptance metrics --------------------------------------------------------------------------

def acceptance_counts(correct: torch.Tensor, valid: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """correct/valid [..., K] bool and alpha [..., K] over blocks -> summable counts [3K + 2]:
    correct per slot, valid per slot, alpha summed per slot, accepted tokens, blocks. The chain
    accepts slots 1..k while every one matches the target; an invalid slot (past the response)
    ends it. Blocks count when slot 1 is valid. Counts add up across batches and processes."""
    K = correct.shape[-1]
    correct, valid, alpha = correct.reshape(-1, K), valid.reshape(-1, K), alpha.reshape(-1, K)
    blocks = valid[:, 0]
    accepted = torch.cumprod((correct & valid).long(), dim=1).sum(1)
    return torch.cat([(correct & valid).sum(0).double(), valid.sum(0).double(),
                      (alpha * valid).sum(0).double(), accepted[blocks].sum()[None].double(),
                      blocks.sum()[None].double()])


def acceptance_metrics(counts: torch.Tensor) -> dict:
    """Per-position accuracy, per-position acceptance rate alpha (mean over valid slots of
    sum_v min(p_v, q_v)) and the chain's expected acceptance length (EAL, the bonus token
    counted: EAL = 1 + mean accepted drafted tokens per block)."""
    K = (counts.numel() - 2) // 3
    correct, valid, alpha = counts[:K], counts[K : 2 * K], counts[2 * K : 3 * K]
    accepted, blocks = counts[-2], counts[-1]
    return {
        "eal": 1.0 + (accepted / blocks).item() if blocks > 0 else 1.0,
        "acc_per_position": (correct / valid.clamp(min=1)).tolist(),
        "alpha_per_position": (alpha / valid.clamp(min=1)).tolist(),
        "blocks": int(blocks),
    }
