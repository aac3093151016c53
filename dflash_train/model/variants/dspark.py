"""DSpark's heads on the DFlash backbone (arXiv 2607.05147; speculators `models/dspark/`).

The backbone drafts every block slot independently; DSpark adds a **Markov logit bias** so that
slot k depends on the token at slot k-1, and a **confidence head** that predicts each slot's
acceptance rate. With h_k the backbone's final hidden state of slot k and x_{k-1} the token at
slot k-1 (for slot 1: the bonus token; slot 0 is the bonus token itself and its own previous
token is taken to be the bonus token too, as speculators does with `sample_from_anchor: false`):

    logits_k = lm_head(h_k) + W2 u_k                 W1 [V, r] embedding, W2 [N, r] (Linear r -> N)
    vanilla: u_k = W1[x_{k-1}]
    gated:   u_k = sigmoid(G [h_k ; W1[x_{k-1}]] + g) * W1[x_{k-1}]
    rnn:     [a ; c ; o] = J [s_{k-1} ; W1[x_{k-1}] ; h_k] + j      s_{-1} = 0, the state runs from slot 0
             s_k = sigmoid(a) * s_{k-1} + (1 - sigmoid(a)) * tanh(c),   u_k = tanh(o)
    confidence_k = sigmoid(P [h_k ; W1[x_{k-1}]] + p)   (or P h_k + p without the Markov input)

W1 reads target ids (the verifier's vocabulary V); W2 and the logits span the drafter's draft vocabulary
(N = draft_vocab_size, speculators' layout) or the whole vocabulary (N = V).

Training feeds the true previous tokens (teacher forcing); decoding feeds back the drafted ones
(`markov_chain`, as vLLM's DSpark runtime drafts), and the draft tree feeds each node's own path
(`MarkovScorer`, used by `ddtree.build_tree`). Parameter names are speculators' DSpark names:
markov_head.{markov_w1, markov_w2, gate_proj, joint_proj}.*, confidence_head.proj.*.
"""

import json
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, Field
from torch import nn

from dflash_train.core.errors import UserError
from dflash_train.model.loss import exp_weights
from dflash_train.core.schema import Index
from dflash_train.model.variants.base import ChainDraft, Variant, cpu_copy, kept_ids, w2_rows
from dflash_train.model.variants.markov_embed import SharedW1

HEAD_TYPES = ("vanilla", "gated", "rnn")
# Candidate tokens per depth that the draft tree applies the Markov bias to (see MarkovScorer).
TREE_CANDIDATES = 256


class MarkovHead(nn.Module):
    def __init__(self, vocab_size: int, rank: int, hidden_size: int, head_type: str,
                 draft_vocab_size: int | None = None):
        super().__init__()
        if rank <= 0 or head_type not in HEAD_TYPES:
            raise ValueError(f"MarkovHead needs rank > 0 and a type in {HEAD_TYPES}, got {rank}, "
                             f"{head_type!r}")
        self.head_type, self.rank = head_type, rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size or vocab_size, bias=False)  # over draft space
        self.gate_proj = nn.Linear(hidden_size + rank, rank) if head_type == "gated" else None
        self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank) if head_type == "rnn" else None
        nn.init.normal_(self.markov_w1.weight, std=0.01)  # speculators' init: a small bias to start from
        for linear in (self.markov_w2, self.gate_proj, self.joint_proj):
            if linear is not None:
                nn.init.normal_(linear.weight, std=0.02)
                if linear.bias is not None:
                    nn.init.zeros_(linear.bias)

    def step(self, state: torch.Tensor | None, prev_emb: torch.Tensor, hidden: torch.Tensor):
        """One block slot k: state s_{k-1} [.., r] (rnn; None otherwise), prev_emb W1[x_{k-1}] [.., r],
        hidden h_k [.., H] -> (u_k [.., r], s_k). The slot's bias is markov_w2(u_k)."""
        if self.head_type == "vanilla":
            return prev_emb, state
        if self.head_type == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([hidden, prev_emb], -1))) * prev_emb, state
        a, c, o = self.joint_proj(torch.cat([state, prev_emb, hidden], -1)).chunk(3, dim=-1)
        gate = torch.sigmoid(a)
        state = gate * state + (1.0 - gate) * torch.tanh(c)
        return torch.tanh(o), state

    def vectors(self, prev_emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """prev_emb [N, B, r], hidden [N, B, H] -> u [N, B, r] for every slot, teacher-forced."""
        if self.head_type != "rnn":
            return self.step(None, prev_emb, hidden)[0]
        state, out = prev_emb.new_zeros(prev_emb.shape[0], self.rank), []
        for k in range(prev_emb.shape[1]):
            u, state = self.step(state, prev_emb[:, k], hidden[:, k])
            out.append(u)
        return torch.stack(out, dim=1)

    def forward(self, prev_tokens: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced: prev_tokens [N, B] (slot k's previous token), hidden [N, B, H] ->
        (u [N, B, r] of every slot: slot k's bias is markov_w2(u_k); prev_emb [N, B, r] for the
        confidence head). The [.., V] bias is left to the loss, which adds it chunk by chunk."""
        prev_emb = self.markov_w1(prev_tokens)
        return self.vectors(prev_emb, hidden.to(prev_emb.dtype)), prev_emb


class ConfidenceHead(nn.Module):
    def __init__(self, hidden_size: int, markov_rank: int):
        """markov_rank > 0: the input is [h_k ; W1[x_{k-1}]] (speculators' confidence_head_with_markov)."""
        super().__init__()
        self.with_markov = markov_rank > 0
        self.proj = nn.Linear(hidden_size + markov_rank, 1)
        nn.init.normal_(self.proj.weight, std=0.02)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: torch.Tensor, prev_emb: torch.Tensor | None) -> torch.Tensor:
        """hidden [.., H], prev_emb [.., r] -> acceptance logits [..]."""
        features = torch.cat([hidden, prev_emb.to(hidden.dtype)], -1) if self.with_markov else hidden
        return self.proj(features).squeeze(-1)


def dspark_heads(config) -> tuple[MarkovHead | None, ConfidenceHead | None]:
    """The heads a DSpark DrafterConfig asks for (either may be None)."""
    markov = None
    if config.markov_rank > 0:
        markov = MarkovHead(config.vocab_size, config.markov_rank, config.hidden_size,
                            config.markov_head_type, config.draft_vocab_size)
    if config.confidence_head_with_markov and markov is None:
        raise ValueError("confidence_head_with_markov needs markov_rank > 0")
    confidence = None
    if config.confidence_head:
        confidence = ConfidenceHead(config.hidden_size,
                                    config.markov_rank if config.confidence_head_with_markov else 0)
    return markov, confidence


def previous_tokens(block_tokens: torch.Tensor) -> torch.Tensor:
    """[.., B] tokens at slots 0..B-1 -> [.., B] the token before each slot (slot 0: itself)."""
    return torch.cat([block_tokens[..., :1], block_tokens[..., :-1]], dim=-1)


def teacher_forced(drafter, hidden: torch.Tensor, block_tokens: torch.Tensor):
    """Training and validation: the heads on the true previous tokens. hidden [b, A, B, H] (the
    backbone's, every slot), block_tokens [b, A, B] (the true tokens at slots 0..B-1) ->
    (u [b, A, K, r] of the drafted slots 1..B-1, whose logits are lm_head(h) + markov_w2(u), or
    None without a Markov head; confidence logits [b, A, K] or None)."""
    b, A, B, H = hidden.shape
    flat_h, prev = hidden.reshape(b * A, B, H), previous_tokens(block_tokens).reshape(b * A, B)
    u = prev_emb = None
    if drafter.markov_head is not None:
        u, prev_emb = drafter.markov_head(prev, flat_h)  # [bA, B, r] each
        u = u[:, 1:].reshape(b, A, B - 1, -1)
    confidence = None
    if drafter.confidence_head is not None:
        emb = prev_emb[:, 1:] if prev_emb is not None else None
        confidence = drafter.confidence_head(flat_h[:, 1:], emb).view(b, A, B - 1)
    return u, confidence


def markov_logits(lm_head, markov_head: MarkovHead | None, hidden: torch.Tensor, u: torch.Tensor | None):
    """Whole logits of drafted slots: lm_head(hidden) + markov_w2(u) (hidden [.., H], u [.., r])."""
    logits = lm_head(hidden)
    return logits if markov_head is None else logits + markov_head.markov_w2(u.to(logits.dtype))


@torch.no_grad()
def markov_chain(drafter, hidden: torch.Tensor, base_logits: torch.Tensor, bonus: int,
                 kept: torch.Tensor | None = None):
    """The greedy DSpark chain, drafted as vLLM's runtime does: slot k's logits are the backbone's
    plus the Markov bias of the token drafted at slot k-1 (slot 1: the bonus token); its argmax is fed
    to slot k+1. hidden [B, H], base_logits [B-1, N] over the draft vocabulary (kept [N]: the target id
    of each index, which W1 reads) or N = V (kept None) -> (tokens [B-1] long in the logits' indices,
    logits [B-1, N] with the bias, confidence logits [B-1] or None)."""
    head, conf_head = drafter.markov_head, drafter.confidence_head
    B = hidden.shape[0]
    prev = torch.tensor(bonus, device=hidden.device)
    state, logits, tokens, confidence = None, base_logits.clone(), [], []
    if head is not None and head.head_type == "rnn":
        state = hidden.new_zeros(head.rank)
        _, state = head.step(state, head.markov_w1(prev), hidden[0])  # slot 0: the bonus token after itself
    for k in range(1, B):
        emb = None
        if head is not None:
            emb = head.markov_w1(prev)
            u, state = head.step(state, emb, hidden[k])
            logits[k - 1] += head.markov_w2(u)
        drafted = logits[k - 1].argmax()
        tokens.append(drafted)
        prev = drafted if kept is None else kept[drafted]
        if conf_head is not None:
            confidence.append(conf_head(hidden[k], emb))
    return torch.stack(tokens), logits, (torch.stack(confidence) if confidence else None)


class MarkovScorer:
    """Path-conditioned children for `ddtree.build_tree`: the children of a node carrying token x
    at depth d are ranked by the drafter's slot-(d+1) distribution given x (gated: and h_{d+1};
    rnn: given the recurrent state of the node's whole path).

    The scores the tree uses, exactly: per depth d the candidate set C_d is the top-M tokens of the
    backbone's logits b_d (M = min(candidates, V), ties as torch.topk breaks them). Given a node's
    path, the drafter's distribution at depth d is taken with the Markov bias on the candidate
    columns only, normalised over the whole vocabulary:
        z(v) = b_d[v] + W2[v] . u   (v in C_d),     z(v) = b_d[v]   (every other v),
        log p(v) = z(v) - logsumexp_V z,
    and a node's children are the top-K candidates by p (K = min(budget, M); ties: the better
    backbone rank first). So the tree holds the top-`budget` prefixes among those made of each
    depth's candidates, with exact products of these probabilities. The non-candidates' mass
    exp(logsumexp_V b_d) - sum_{C_d} exp(b_d) is computed in float64 from the float32
    log-normaliser, exact to ~1e-6 of the total mass (clamped at 0). With candidates >= V this
    is the drafter's exact conditional distribution; the approximation drops the Markov bias
    outside the backbone's top-M tokens, and it is deterministic.

    Cost: one top-M and one logsumexp over [L, V] (as the plain tree's top-K and normaliser), then
    per expanded node an [M, r] mat-vec and a sort of M values (numpy, float32), with the W1 / W2
    rows of a depth's candidates gathered when a node there is first expanded.

    With a draft vocabulary (V above reads N) either the logits are [L, N] in draft space (`kept`: [N]
    the target id of each column; the nodes carry target ids, so build_tree then takes no token_ids),
    or [L, V] scattered with -inf outside it (`w2_row`: [V] the W2 row of each target id, validation's
    trees).
    """

    def __init__(self, head: MarkovHead, hidden: torch.Tensor, bonus: int, candidates: int = TREE_CANDIDATES,
                 kept: torch.Tensor | None = None, w2_row: torch.Tensor | None = None):
        """hidden [B, H]: the backbone's final hidden states of the block (slot 0 = the bonus token)."""
        self.head, self.hidden, self.bonus, self.candidates = head, hidden, bonus, candidates
        self.kept, self.w2_row = kept, w2_row

    @torch.no_grad()
    def expander(self, draft_logits: torch.Tensor, K: int):
        """draft_logits [L, V] (the backbone's, depth d = row d-1) -> (expand, root token, root carry)
        for `ddtree.best_first`. expand(token, carry, depth) scores the children of a node at
        `depth` carrying `token`: (logp [K'], ids [K'], the carry its children share), K' = min(K, M).
        The [L, V] work runs on draft_logits' device, the per-node work on float32 numpy arrays."""
        head, V = self.head, draft_logits.shape[-1]
        M, K = min(self.candidates, V), min(K, self.candidates, V)
        cands = _Candidates(draft_logits, M, head.markov_w1.weight, head.markov_w2.weight, self.kept,
                            self.w2_row)
        step = _MarkovStep(head, self.hidden)
        bonus_emb = _rows(head.markov_w1.weight.detach(), [self.bonus])[0]  # [r]

        def expand(token: int, carry, depth: int):
            u, child_carry = step(bonus_emb if depth == 0 else cands.w1_of(depth, token), carry, depth + 1)
            z = cands.vals[depth] + cands.w2_of(depth) @ u  # [M] the candidates' logits with the bias
            peak = z.max()
            log_norm = np.logaddexp(cands.rest[depth], peak + np.log(np.exp(z - peak).sum()))
            order = np.argsort(-z, kind="stable")[:K]  # ties: the better backbone rank first
            return (z[order] - log_norm).tolist(), cands.ids[depth, order].tolist(), child_carry

        root_carry = None
        if head.head_type == "rnn":  # slot 0 advances the state (its own prediction is not drafted)
            _, root_carry = step(bonus_emb, np.zeros(head.rank, dtype=np.float32), 0)
        return expand, self.bonus, root_carry


def _rows(w: torch.Tensor, index) -> np.ndarray:
    """Rows of a weight (on its device, any dtype) as float32 numpy."""
    index = torch.as_tensor(index, device=w.device)
    return w.index_select(0, index.reshape(-1)).view(*index.shape, -1).to("cpu", torch.float32).numpy()


class _Candidates:
    """The per-depth candidates of a path-conditioned scorer (MarkovScorer, xpress.XPressScorer): the
    backbone's top-M columns of each depth (best first) and their logits, the non-candidates' log-mass,
    and the rows of a depth's candidates in w1 [V, r] (read by target id) and w2 [N, r] (by column),
    gathered when a node there is first expanded. kept [N]: each column's target id (draft-space
    logits); w2_row [V]: each column's w2 row (logits over V with a draft vocabulary)."""

    def __init__(self, draft_logits: torch.Tensor, M: int, w1: torch.Tensor, w2: torch.Tensor,
                 kept: torch.Tensor | None = None, w2_row: torch.Tensor | None = None):
        logits = draft_logits.float()
        L, V = logits.shape
        vals, cols = torch.topk(logits, M, dim=-1)  # [L, M] each depth's candidates, best first
        lse = torch.logsumexp(logits, dim=-1)  # [L]
        self.vals, self.cols = vals.cpu().numpy(), cols.cpu().numpy()
        lse = lse.cpu().numpy().astype(np.float64)
        # the nodes' tokens (target ids) and the w2 row of each candidate column
        self.ids = self.cols if kept is None else kept.cpu().numpy()[self.cols]
        self.w2_rows = self.cols if w2_row is None else w2_row.cpu().numpy()[self.cols]
        if M < V:  # log-mass of the non-candidates (they keep their backbone logits)
            cand_mass = np.exp(self.vals.astype(np.float64) - lse[:, None]).sum(-1)  # [L]
            with np.errstate(divide="ignore"):
                self.rest = (lse + np.log(np.maximum(1.0 - cand_mass, 0.0))).astype(np.float32)
        else:
            self.rest = np.full(L, -np.inf, dtype=np.float32)
        self.w1_full, self.w2_full = w1.detach(), w2.detach()
        self.w1: dict[int, tuple[np.ndarray, dict]] = {}  # depth -> (its candidates' W1 [M, r], token -> row)
        self.w2: dict[int, np.ndarray] = {}  # depth -> W2 of its candidates [M, r]

    def w1_of(self, depth: int, token: int) -> np.ndarray:
        """W1[token] [r] for a token among depth's candidates (a node at `depth` carries one)."""
        if depth not in self.w1:
            ids = self.ids[depth - 1]
            self.w1[depth] = _rows(self.w1_full, ids), dict(zip(ids.tolist(), range(len(ids))))
        table, column = self.w1[depth]
        return table[column[token]]

    def w2_of(self, depth: int) -> np.ndarray:
        """W2 of the candidates of the children of a node at `depth` [M, r]."""
        if depth not in self.w2:
            self.w2[depth] = _rows(self.w2_full, self.w2_rows[depth])
        return self.w2[depth]


class _MarkovStep:
    """MarkovHead.step in float32 numpy for one block, its slot part precomputed.

    gated: gate = sigmoid(G_h h_k + g + G_e e); rnn: [a; c; o] = J_s s + J_e e + J_h h_k + j.
    The h_k part depends on the slot only: one matmul for all slots (reads G_h / J_h once)."""

    def __init__(self, head: MarkovHead, hidden: torch.Tensor):
        """hidden [B, H]: the block's backbone states."""
        self.head_type = head.head_type
        proj = head.gate_proj if head.head_type == "gated" else head.joint_proj
        if proj is None:  # vanilla: u = e
            return
        r, H, w = head.rank, hidden.shape[-1], proj.weight.detach()
        # gate_proj reads [h ; e], joint_proj [s ; e ; h]
        w_h = w[:, :H] if head.head_type == "gated" else w[:, 2 * r:]
        slot_part = torch.addmm(proj.bias.detach(), hidden.to(w.device, w.dtype), w_h.T)
        self.slot_part = slot_part.to("cpu", torch.float32).numpy()  # [B, r] or [B, 3r]
        # the rest of the weight: G_e [r, r], or [J_s J_e] [3r, 2r] applied to [s ; e] at once
        emb_w = w[:, H:] if head.head_type == "gated" else w[:, :2 * r]
        self.emb_w = emb_w.to("cpu", torch.float32).numpy()

    def __call__(self, e: np.ndarray, carry, slot: int):
        """u of block slot `slot` after a token with W1 row e [r], and the state after it (rnn; else None)."""
        if self.head_type == "vanilla":
            return e, None
        if self.head_type == "gated":
            return e / (1.0 + np.exp(-(self.slot_part[slot] + self.emb_w @ e))), None
        a, c, o = np.split(self.slot_part[slot] + self.emb_w @ np.concatenate([carry, e]), 3)
        gate = 1.0 / (1.0 + np.exp(-a))
        return np.tanh(o), gate * carry + (1.0 - gate) * np.tanh(c)


def confidence_loss(confidence_logits: torch.Tensor, alpha: torch.Tensor, weights: torch.Tensor,
                    normalizer) -> torch.Tensor:
    """BCE of the confidence head toward the detached acceptance rate, slot-weighted and
    normalised like the main loss. confidence_logits, alpha, weights [b, A, K]."""
    bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), alpha.detach().float(),
                                             reduction="none")
    return (bce * weights).sum() / normalizer


def confidence_counts(confidence_logits: torch.Tensor, alpha: torch.Tensor,
                      valid: torch.Tensor) -> torch.Tensor:
    """Calibration of the confidence head, teacher-forced: per slot k the summed predicted
    acceptance sigmoid(c_k), the summed measured rate alpha_k = sum_v min(p_v, q_v) (the loss's),
    and the count of valid slots. Returns summable counts [3K]."""
    v = valid.float()
    predicted = (torch.sigmoid(confidence_logits.float()) * v).flatten(0, -2).sum(0)
    return torch.cat([predicted, (alpha.float() * v).flatten(0, -2).sum(0), v.flatten(0, -2).sum(0)]).double()


def tree_vectors(head: MarkovHead, tokens: torch.Tensor, depths: torch.Tensor, parents: torch.Tensor,
                 hidden: torch.Tensor) -> torch.Tensor:
    """u at m draft-tree nodes: tokens, depths, parents [m] (root first: its bonus token, depth 0,
    parent -1; a node's parent an index among the m), hidden [B, H] -> u [m, r] of the slot after each
    node (slot depth + 1)."""
    emb = head.markov_w1(tokens)  # [m, r]
    h_next = hidden[(depths + 1).clamp(max=hidden.shape[0] - 1)].to(emb.dtype)  # [m, H]
    if head.head_type != "rnn":
        return head.step(None, emb, h_next)[0]
    # rnn: the state runs down each path. Slot 0 advances it with the bonus token (as in
    # teacher forcing and MarkovScorer); a node's step starts from its parent's state.
    _, root_carry = head.step(emb.new_zeros(head.rank), emb[0], hidden[0].to(emb.dtype))
    u, state = [None] * len(tokens), [None] * len(tokens)
    for i in range(len(tokens)):  # parents come before children (pop order)
        carry = root_carry if i == 0 else state[int(parents[i])]
        u[i], state[i] = head.step(carry, emb[i], h_next[i])
    return torch.stack(u)


# --- DSpark's fields (Variant.model_keys, loss_keys, drafter_keys, speculators_keys) ---------------------

class DSparkModelKeys(BaseModel):
    """The recipe's model section: model.variant=dspark = the DFlash backbone + the Markov logit-bias head
    (slot k conditioned on the token at slot k-1) and the confidence head."""
    markov_rank: int = Field(256, ge=0)  # r of the bias W2(W1[x]); 0 = no Markov head (the backbone's logits)
    markov_head_type: Literal[HEAD_TYPES] = "vanilla"  # vLLM 0.33 serves vanilla only
    # Train W1 as table + (target embedding) x P, folded into the table each step, so tokens rarely seen
    # as predecessors (a tree's siblings) learn from tokens like them; served as the plain table
    # (dflash_train/model/variants/markov_embed.py). Single process or DDP.
    markov_w1_embed: bool = False
    confidence_head: bool = True  # predict each slot's acceptance rate (trained with loss.confidence_weight)


class DSparkLossKeys(BaseModel):
    # DSpark's confidence head: BCE toward the detached per-slot acceptance rate sum_v min(p_v, q_v)
    confidence_weight: float = Field(1.0, ge=0)


class DSparkDrafterKeys(BaseModel):
    """DrafterConfig's: the Markov head of rank markov_rank (0: none) and the confidence head, whose input
    includes the Markov embedding when confidence_head_with_markov (off for other variants)."""
    markov_rank: Index = 0
    markov_head_type: Literal[HEAD_TYPES] = "vanilla"
    confidence_head: bool = False
    confidence_head_with_markov: bool = False


class DSparkSpeculatorsKeys(BaseModel):
    markov_rank: Index | None = None
    markov_head_type: Literal[HEAD_TYPES] | None = None
    enable_confidence_head: bool | None = None
    confidence_head_with_markov: bool | None = None


class DSpark(Variant):
    """The variant: the heads after the backbone, the Markov chain and tree, and DSpark's fields."""
    name = "dspark"
    display_name = "DSpark"
    model_keys, loss_keys, drafter_keys = DSparkModelKeys, DSparkLossKeys, DSparkDrafterKeys
    speculators_keys = DSparkSpeculatorsKeys
    grows_from = ("dflash",)
    grown = ("markov_head.", "confidence_head.")
    # a draft vocabulary: W2 is [N, r] over it (speculators'), W1 stays [V, r] (it reads target ids)
    heads_outside_forward = True  # the heads run after the backbone, W2 inside the loss
    native_refusal = ("the native DFlash format has no Markov or confidence head: export a DSpark drafter "
                      "with --format speculators (served by vLLM as method dspark)")

    def chain(self, drafter, hidden, base_logits, bonus, before=None) -> ChainDraft:
        """Each slot biased by the token drafted before it (`markov_chain`), and the confidence logits."""
        tokens, _, confidence = markov_chain(drafter, hidden, base_logits, bonus, kept_ids(drafter))
        return ChainDraft(tokens, confidence)

    def states_confidence(self, drafter) -> bool:
        return drafter.confidence_head is not None

    def scorer(self, drafter, hidden, bonus, before=None):
        if drafter.markov_head is None:
            return None
        return MarkovScorer(drafter.markov_head, hidden, bonus, kept=kept_ids(drafter))

    def cpu_tree_scorer(self, model):
        """MarkovScorer over a CPU float32 copy of the Markov head (validation's logits are [.., V], -inf
        outside a draft vocabulary: w2_row maps a target id to its W2 row)."""
        if model.markov_head is None:
            return None
        c = model.config
        copy = cpu_copy(model.markov_head, MarkovHead(c.vocab_size, c.markov_rank, c.hidden_size,
                                                      c.markov_head_type, c.draft_vocab_size))
        row = w2_rows(model)
        return lambda hidden, bonus, before=None: MarkovScorer(copy, hidden, bonus, w2_row=row)

    def add_modules(self, drafter, config) -> None:
        drafter.markov_head, drafter.confidence_head = dspark_heads(config)

    # --- training and validation -------------------------------------------------------------------

    def teacher_forced(self, drafter, block_hidden, block_tokens, before=None) -> dict:
        """{"u": the Markov vectors [b, A, K, r] or None, "confidence_logits": [b, A, K] or None}."""
        u, confidence = teacher_forced(drafter, block_hidden, block_tokens)
        return {"u": u, "confidence_logits": confidence}

    def logit_bias(self, model, heads):
        """The Markov bias u . W2^T (W2 [N, r] over the head's vocabulary)."""
        return None if heads["u"] is None else (heads["u"], model.markov_head.markov_w2.weight)

    def extra_loss(self, o, model, target, cfg, normalizer, block_loss, loss, m):
        """+ loss.confidence_weight x the confidence head's BCE toward the detached per-slot acceptance
        rate alpha (`confidence_loss`), with DFlash's exp slot weights (as speculators weighs it) and the
        main loss's normaliser (with a draft vocabulary alpha is over it: `needs_alpha`)."""
        confidence = o.heads["confidence_logits"]
        if confidence is None or not cfg.loss.confidence_weight:
            return loss, m
        w = exp_weights(o.valid.shape[-1], cfg.loss.gamma, o.valid.device) * o.valid
        return loss + cfg.loss.confidence_weight * confidence_loss(confidence, m["alpha"], w, normalizer), m

    def needs_alpha(self, model, cfg) -> bool:
        """The confidence head's BCE reads alpha on every step (a draft vocabulary's step then computes the
        target's probabilities over it)."""
        return model.confidence_head is not None and cfg.loss.confidence_weight > 0

    def node_log_probs(self, model, lm_head, hidden, tokens, depths, parents):
        """q = softmax(lm_head(h_{d+1}) + W2 u), u from the node's token x (gated: and h_{d+1}; rnn: the
        state along the node's path; `tree_vectors`). This is the exact distribution (the bias on every
        token), which MarkovScorer's tree (the bias on each depth's top-256 backbone tokens) approximates."""
        logits = lm_head(hidden[depths + 1])  # [m, V]
        if model.markov_head is not None:
            u = tree_vectors(model.markov_head, tokens, depths, parents, hidden)
            logits = logits + model.markov_head.markov_w2(u.to(logits.dtype))
        return None, torch.log_softmax(logits.float(), dim=-1)

    def side_optimizer(self, drafter, cfg, engine, embed_weight, schedule):
        """model.markov_w1_embed: W1 trained through the target's input embedding (markov_embed.SharedW1);
        it reads the Markov table's whole gradient, so one process or DDP only."""
        if not cfg.model.markov_w1_embed:
            return None
        if engine not in ("single", "ddp"):
            raise UserError(f"model.markov_w1_embed runs on one process or under DDP, not under {engine} (it "
                            "reads the Markov table's whole gradient after each step)")
        return SharedW1(drafter.markov_head, embed_weight, cfg.train.lr, cfg.train.betas, schedule)

    def validation_count_size(self, model, cfg) -> int:
        """The confidence head's calibration: predicted, alpha and n per slot."""
        return 0 if model.confidence_head is None else 3 * (cfg.model.block_size - 1)

    def validation_counts(self, o, m):
        confidence = o.heads["confidence_logits"]
        if confidence is None:
            return super().validation_counts(o, m)
        return confidence_counts(confidence, m["alpha"], o.valid).cpu()

    def validation_entries(self, counts, cfg) -> dict:
        """"confidence": the mean predicted acceptance and the measured alpha per slot."""
        if not len(counts):
            return {}
        predicted, alpha, n = counts.view(3, cfg.model.block_size - 1)
        return {"confidence": {"predicted": (predicted / n.clamp(min=1)).tolist(),
                               "alpha": (alpha / n.clamp(min=1)).tolist()}}

    def validation_record(self, val) -> dict:
        if "confidence" not in val:
            return {}
        return {"val_confidence": {k: [round(x, 4) for x in v] for k, v in val["confidence"].items()}}

    def check_recipe(self, cfg) -> None:
        if cfg.model.markov_rank == 0:  # no Markov head: refused as for DFlash
            super().check_recipe(cfg)

    def drafter_fields(self, m, tc) -> dict:
        if m.markov_rank > tc.vocab_size:  # W2(W1[x]) is a V x V bias: its rank is at most V
            raise UserError(f"model.markov_rank {m.markov_rank} exceeds the target's vocabulary "
                            f"({tc.vocab_size}): a rank above {tc.vocab_size} adds nothing")
        return {"variant": "dspark", "markov_rank": m.markov_rank, "markov_head_type": m.markov_head_type,
                "confidence_head": m.confidence_head,
                "confidence_head_with_markov": m.confidence_head and m.markov_rank > 0}

    def from_speculators(self, config: dict) -> dict:
        """speculators' own default is sample_from_anchor true (B drafted tokens, slot 0 predicting the
        token after the anchor); dflash-train drafts B-1 tokens after the bonus token, so only false is
        read."""
        if config.get("sample_from_anchor", True):  # speculators' DSpark default is true
            raise UserError("DSpark config has sample_from_anchor true (or unset, speculators' default): "
                            "dflash-train reads only false (the bonus token at block slot 0, B-1 drafted "
                            "tokens)")
        head_type = config.get("markov_head_type", "vanilla")
        if head_type not in HEAD_TYPES:
            raise UserError(f"DSpark config has an unknown markov_head_type '{head_type}'")
        rank = int(config.get("markov_rank", 256))
        confidence = bool(config.get("enable_confidence_head", True))
        with_markov = confidence and bool(config.get("confidence_head_with_markov", True))
        if with_markov and rank <= 0:
            raise UserError("DSpark config has confidence_head_with_markov true but markov_rank 0")
        return {"variant": "dspark", "markov_rank": rank, "markov_head_type": head_type,
                "confidence_head": confidence, "confidence_head_with_markov": with_markov}

    def speculators_config_class(self):
        from speculators.models.dspark import DSparkSpeculatorConfig
        return DSparkSpeculatorConfig

    def speculators_fields(self, cfg) -> dict:
        return {"markov_rank": cfg.markov_rank, "markov_head_type": cfg.markov_head_type,
                "enable_confidence_head": cfg.confidence_head,
                "confidence_head_with_markov": cfg.confidence_head_with_markov}

    # --- the model card -----------------------------------------------------------------------------

    def card_algorithm(self, cfg) -> str:
        return (f"DSpark: the DFlash block forward, then a {cfg.markov_head_type} Markov logit-bias head "
                f"(rank {cfg.markov_rank}) conditions each slot on the token drafted before it"
                + ("; a confidence head predicts each slot's acceptance" if cfg.confidence_head else ""))

    def card_vllm(self, fmt, cfg, pin, serve_ref) -> str:
        """Speculators only (native_refusal): vLLM reads `speculators_model_type: dspark` as method dspark."""
        spec = json.dumps({"method": "dspark", "model": serve_ref,
                           "num_speculative_tokens": cfg.block_size - 1})
        return (f"vllm serve {serve_ref}   # method dspark, read from config.json\n"
                f"vllm serve {pin['name_or_path']} --speculative-config '{spec}'")

    def card_limitations(self, cfg) -> str:
        head = "" if cfg.markov_head_type == "vanilla" else (
            "\n- vLLM 0.33's DSpark runtime (`Qwen3DSparkModel`) implements the vanilla Markov head "
            f"only: this `{cfg.markov_head_type}` head's weights are not served there (speculators and "
            "dflash-train load them).")
        return head + ("\n- The path-conditioned DDTree (dflash-train's decoder) scores each node's children "
                       f"with the Markov bias on the backbone's top-{TREE_CANDIDATES} tokens per depth; vLLM "
                       "drafts the DSpark chain.")

    def card_training(self, m, loss) -> str | None:
        if not m.get("confidence_head"):
            return None
        return f", plus the confidence head's BCE (weight {loss['confidence_weight']})."

    def card_training_notes(self, m) -> list[str]:
        if not m.get("markov_w1_embed"):
            return []
        return ["The Markov head's W1 was trained as a table plus the verifier's input embedding times "
                "a learned [H, r] map, folded into the table every step (model.markov_w1_embed), so "
                "tokens seldom seen before a slot (a tree's siblings) have trained rows; it is served "
                "as the plain table."]

    def cost_key(self, cfg) -> str | None:
        return f"dspark-{cfg.markov_head_type}" if cfg.markov_rank else None
