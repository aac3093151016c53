"""DSpark's heads on the DFlash backbone (arXiv 2607.05147; speculators `models/dspark/`).

The backbone drafts every block slot independently; DSpark adds a **Markov logit bias** so that
slot k depends on the token at slot k-1, and a **confidence head** that predicts each slot's
acceptance rate. With h_k the backbone's final hidden state of slot k and x_{k-1} the token at
slot k-1 (for slot 1: the bonus token; slot 0 is the bonus token itself and its own previous
token is taken to be the bonus token too, as speculators does with `sample_from_anchor: false`):

    logits_k = lm_head(h_k) + W2 u_k                 W1 [V, r] embedding, W2 [V, r] (Linear r -> V)
    vanilla: u_k = W1[x_{k-1}]
    gated:   u_k = sigmoid(G [h_k ; W1[x_{k-1}]] + g) * W1[x_{k-1}]
    rnn:     [a ; c ; o] = J [s_{k-1} ; W1[x_{k-1}] ; h_k] + j      s_{-1} = 0, the state runs from slot 0
             s_k = sigmoid(a) * s_{k-1} + (1 - sigmoid(a)) * tanh(c),   u_k = tanh(o)
    confidence_k = sigmoid(P [h_k ; W1[x_{k-1}]] + p)   (or P h_k + p without the Markov input)

Training feeds the true previous tokens (teacher forcing); decoding feeds back the drafted ones
(`markov_chain`, as vLLM's DSpark runtime drafts), and the draft tree feeds each node's own path
(`MarkovScorer`, used by `ddtree.build_tree`). Parameter names are speculators' DSpark names:
markov_head.{markov_w1, markov_w2, gate_proj, joint_proj}.*, confidence_head.proj.*.
"""

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

HEAD_TYPES = ("vanilla", "gated", "rnn")
# Candidate tokens per depth that the draft tree applies the Markov bias to (see MarkovScorer).
TREE_CANDIDATES = 256


class MarkovHead(nn.Module):
    def __init__(self, vocab_size: int, rank: int, hidden_size: int, head_type: str):
        super().__init__()
        if rank <= 0 or head_type not in HEAD_TYPES:
            raise ValueError(f"MarkovHead needs rank > 0 and a type in {HEAD_TYPES}, got {rank}, {head_type!r}")
        self.head_type, self.rank = head_type, rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
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
        """Teacher-forced bias: prev_tokens [N, B] (slot k's previous token), hidden [N, B, H] ->
        (bias of the drafted slots 1..B-1 [N, B-1, V], prev_emb [N, B, r] for the confidence head).
        A module forward, so FSDP / ZeRO-3 hooks gather the head's weights around it."""
        prev_emb = self.markov_w1(prev_tokens)
        u = self.vectors(prev_emb, hidden.to(prev_emb.dtype))
        return self.markov_w2(u[:, 1:]), prev_emb


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
    """The heads a DrafterConfig asks for: none for variant dflash."""
    if config.variant != "dspark":
        return None, None
    markov = None
    if config.markov_rank > 0:
        markov = MarkovHead(config.vocab_size, config.markov_rank, config.hidden_size, config.markov_head_type)
    if config.confidence_head_with_markov and markov is None:
        raise ValueError("confidence_head_with_markov needs markov_rank > 0")
    confidence = None
    if config.confidence_head:
        confidence = ConfidenceHead(config.hidden_size, config.markov_rank if config.confidence_head_with_markov else 0)
    return markov, confidence


def previous_tokens(block_tokens: torch.Tensor) -> torch.Tensor:
    """[.., B] tokens at slots 0..B-1 -> [.., B] the token before each slot (slot 0: itself)."""
    return torch.cat([block_tokens[..., :1], block_tokens[..., :-1]], dim=-1)


def teacher_forced(drafter, hidden: torch.Tensor, block_tokens: torch.Tensor, logits: torch.Tensor):
    """Training and validation: the heads on the true previous tokens.
    hidden [b, A, B, H], block_tokens [b, A, B] (the true tokens at slots 0..B-1), logits [b, A, K, V]
    (the backbone's, slots 1..B-1) -> (logits with the Markov bias [b, A, K, V], confidence logits
    [b, A, K] or None)."""
    b, A, B, H = hidden.shape
    flat_h, prev = hidden.reshape(b * A, B, H), previous_tokens(block_tokens).reshape(b * A, B)
    prev_emb = None
    if drafter.markov_head is not None:
        bias, prev_emb = drafter.markov_head(prev, flat_h)  # [bA, K, V], [bA, B, r]
        logits = logits + bias.view(b, A, B - 1, -1).to(logits.dtype)
    confidence = None
    if drafter.confidence_head is not None:
        emb = prev_emb[:, 1:] if prev_emb is not None else None
        confidence = drafter.confidence_head(flat_h[:, 1:], emb).view(b, A, B - 1)
    return logits, confidence


@torch.no_grad()
def markov_chain(drafter, hidden: torch.Tensor, base_logits: torch.Tensor, bonus: int):
    """The greedy DSpark chain, drafted as vLLM's runtime does: slot k's logits are the backbone's
    plus the Markov bias of the token drafted at slot k-1 (slot 1: the bonus token), over the full
    vocabulary; its argmax is fed to slot k+1. hidden [B, H], base_logits [B-1, V] ->
    (tokens [B-1] long, logits [B-1, V] with the bias, confidence logits [B-1] or None)."""
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
        prev = logits[k - 1].argmax()
        tokens.append(prev)
        if conf_head is not None:
            confidence.append(conf_head(hidden[k], emb))
    return torch.stack(tokens), logits, (torch.stack(confidence) if confidence else None)


class MarkovScorer:
    """Path-conditioned children for `ddtree.build_tree`: the children of a node carrying token x
    at depth d are ranked by the drafter's slot-(d+1) distribution given x (gated: and h_{d+1};
    rnn: given the recurrent state of the node's whole path).

    The scores the tree uses, exactly: per depth d the candidate set C_d is the top-M tokens of the
    backbone's logits b_d (M = min(candidates, V), ties as torch.topk breaks them). A node's
    children at depth d get the logits z(v) = b_d[v] + W2[v] . u for v in C_d and z(v) = b_d[v]
    for every other token (the bias is applied to the candidate columns only), normalised over
    the whole vocabulary: log p(v) = z(v) - logsumexp_V z. The node's children are the top-K of
    that distribution (K = min(budget, V)): candidates plus, where they rank, the best
    non-candidates, which are the next tokens of b_d by rank. With candidates >= V this is the
    drafter's exact conditional distribution; the approximation only drops the Markov bias on
    tokens outside the backbone's top-M, and it is deterministic.

    Cost: one top-(M+K) and one masked logsumexp over [L, V] (as the plain tree's top-K and
    normaliser), gathers of the W1 / W2 rows of those tokens, then per expanded node an
    [M, r] mat-vec and a sort of M+K values (ties: the better backbone rank first).
    """

    def __init__(self, head: MarkovHead, hidden: torch.Tensor, bonus: int, candidates: int = TREE_CANDIDATES):
        """hidden [B, H]: the backbone's final hidden states of the block (slot 0 = the bonus token)."""
        self.head, self.hidden, self.bonus, self.candidates = head, hidden, bonus, candidates

    @torch.no_grad()
    def expander(self, draft_logits: torch.Tensor, K: int):
        """draft_logits [L, V] (the backbone's, depth d = row d-1) -> (expand, root token, root carry)
        for `ddtree.best_first`. expand(token, carry, depth) scores the children of a node at
        `depth` carrying `token`: (logp [K], ids [K], the carry its children share). The [L, V]
        work runs on draft_logits' device; the per-node work on small float32 numpy arrays."""
        head = self.head
        logits = draft_logits.float()
        L, V = logits.shape
        M = min(self.candidates, V)
        T = min(K, V - M)  # the best non-candidates a node may still rank among its top-K
        vals, ids = torch.topk(logits, M + T, dim=-1)  # [L, M+T]: every token a depth-d node can carry
        if M < V:  # log-mass of the non-candidates: they keep their backbone logits
            rest = logits.scatter(-1, ids[:, :M], float("-inf")).logsumexp(-1)  # [L]
        else:
            rest = logits.new_full((L,), float("-inf"))
        # W1 / W2 rows of those tokens, gathered once (unless that is more rows than V: tiny vocabularies)
        gathered = L * (M + T) <= V

        def cpu(t: torch.Tensor, rows: torch.Tensor | None = None) -> np.ndarray:
            t = t if rows is None else t[rows.to(t.device)]
            return t.detach().to("cpu", torch.float32).numpy()

        w1_full, w2_full = head.markov_w1.weight, head.markov_w2.weight
        w1 = cpu(w1_full, ids) if gathered else cpu(w1_full)  # [L, M+T, r] or [V, r]
        w2 = cpu(w2_full, ids[:, :M]) if gathered else cpu(w2_full)  # [L, M, r] or [V, r]
        ids_np, vals, rest = ids.cpu().numpy(), cpu(vals), cpu(rest)
        column = [dict(zip(row, range(len(row)))) for row in ids_np.tolist()] if gathered else None
        bonus_emb = cpu(w1_full[self.bonus])  # [r]
        hidden = self.hidden.float()  # [B, H]
        r, H = head.rank, hidden.shape[-1]
        if head.head_type == "gated":  # gate = sigmoid(G_h h_k + g + G_e e): the h part once per slot
            g = head.gate_proj.weight.float()
            slot_part = cpu(hidden @ g[:, :H].T.to(hidden.device) + head.gate_proj.bias.float().to(hidden.device))
            emb_w = cpu(g[:, H:])  # [B, r], [r, r]
        elif head.head_type == "rnn":  # [a; c; o] = J_s s + J_e e + J_h h_k + j: the h part once per slot
            j = head.joint_proj.weight.float()
            slot_part = cpu(hidden @ j[:, 2 * r:].T.to(hidden.device) + head.joint_proj.bias.float().to(hidden.device))
            state_w, emb_w = cpu(j[:, :r]), cpu(j[:, r:2 * r])  # [B, 3r]; [3r, r] each

        def vector(e: np.ndarray, carry, slot: int):
            """u of block slot `slot` after a token with W1 row e, and the state after it (rnn)."""
            if head.head_type == "vanilla":
                return e, None
            if head.head_type == "gated":
                return e / (1.0 + np.exp(-(slot_part[slot] + emb_w @ e))), None
            a, c, o = np.split(slot_part[slot] + state_w @ carry + emb_w @ e, 3)
            gate = 1.0 / (1.0 + np.exp(-a))
            return np.tanh(o), gate * carry + (1.0 - gate) * np.tanh(c)

        def expand(token: int, carry, depth: int):
            if depth == 0:
                e = bonus_emb
            else:
                e = w1[depth - 1, column[depth - 1][token]] if gathered else w1[token]
            u, child_carry = vector(e, carry, depth + 1)
            z = vals[depth].copy()  # [M+T]: candidates, then the best non-candidates
            z[:M] += w2[depth] @ u if gathered else (w2 @ u)[ids_np[depth, :M]]
            peak = z[:M].max()
            log_norm = np.logaddexp(rest[depth], peak + np.log(np.exp(z[:M] - peak).sum()))
            order = np.argsort(-z, kind="stable")[:K]  # ties: the better backbone rank first
            return (z[order] - log_norm).tolist(), ids_np[depth, order].tolist(), child_carry

        root_carry = None
        if head.head_type == "rnn":  # slot 0 advances the state (its own prediction is not drafted)
            _, root_carry = vector(bonus_emb, np.zeros(r, dtype=np.float32), 0)
        return expand, self.bonus, root_carry


def acceptance_rate(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """alpha = sum_v min(p_v, q_v) per slot [...] (p target, q drafter): the probability that
    speculative sampling accepts the slot's draft. Full-vocabulary softmaxes in float32."""
    p = F.softmax(target_logits.float(), dim=-1)
    q = F.softmax(draft_logits.float(), dim=-1)
    return torch.minimum(p, q).sum(-1)


def confidence_loss(confidence_logits: torch.Tensor, alpha: torch.Tensor, weights: torch.Tensor,
                    normalizer) -> torch.Tensor:
    """BCE of the confidence head toward the detached acceptance rate, slot-weighted and
    normalised like the main loss. confidence_logits, alpha, weights [b, A, K]."""
    bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), alpha.detach().float(), reduction="none")
    return (bce * weights).sum() / normalizer
