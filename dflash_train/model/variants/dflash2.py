"""DFlash2: local convolutions and a candidate selector (z-lab/inco; speculators `models/dflash2/`, vLLM 0.33
`qwen3_dflash2.py`).

The backbone (DFlash, dflash_train/model/drafter.py, with each sublayer between the two sides of a
`GroupedDynamicConv`) gives each drafted slot t unary logits U_t = lm_head(h_t). The selector
re-ranks slot t's top-K unary candidates C_t given the token a at slot t-1 (for slot 1: the bonus
token):

    S_t(a, b) = U_t(b) + < P[a] * (W_h h_t), Q[b] >        b in C_t (K = selector_top_k)

P, Q [V, r] are the predecessor and successor codebooks and W_h [r, H] the hidden projection
(rank r = selector_rank; speculators' names: candidate_selector.{predecessor_codebook,
successor_codebook, hidden_projection.weight}); h_t is the backbone's final-normed state.

Training (as speculators trains it; z-lab published no objective): teacher-forced, a = the
data's token at slot t-1, a K-way cross-entropy over C_t toward the slot's label (the target's
greedy token); a label outside the unary top-K replaces the K-th candidate, so every slot has a
target. It is weighted per slot like the base loss (exp, or D-PACE from the selector's own CE)
and added with weight `loss.selector_weight` (`selector_loss`). Its gradient also reaches the
backbone, through U_t(b) and W_h h_t.

Decoding: the greedy chain walks the selector as vLLM does (`selector_chain`: slot t picks
argmax_b S_t(a, b) with a the token it picked at slot t-1), and the draft tree ranks every
node's children by the selector given the node's own token (`SelectorScorer`, for
`ddtree.build_tree`). Both come from one [L, K, K] table of edge scores (`edge_scores`).
"""

import torch
import torch.nn.functional as F
from pydantic import BaseModel, Field
from torch import nn

from dflash_train.core.errors import UserError
from dflash_train.model.loss import slot_weights, until_first_failure
from dflash_train.core.schema import Index, Size
from dflash_train.model.variants.base import ChainDraft, Variant, cpu_copy

# speculators' DFlash2SpeculatorConfig defaults, for configs that omit a field
SPECULATORS_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256,
                        "selector_top_k": 16}


class GroupedDynamicConv(nn.Module):
    """DFlash2's two local convolutions around one sublayer (speculators' GroupedDynamicCausalConv).

    Over the slots s of each block, with G = H / group_size channel groups and k taps:
        conv(x)[s, c] = sum_{j < k, j <= s} (base[j, c] + delta[s, j, group(c)]) * x[s - j, c]
    delta = kernel_projection(sublayer input) [q, 2, k, G]: one projection gives the input-side
    kernel (applied before the sublayer) and the output-side one (applied to its output). Taps
    that would reach before slot 0 read zeros, so a block never sees the previous one. Identity
    initialisation: base[:, 0] = 1, the rest and kernel_projection 0."""

    def __init__(self, hidden_size: int, block_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.block_size, self.kernel_size, self.group_size = block_size, kernel_size, group_size
        self.num_groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))  # [input/output side, k, H]
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.num_groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [b, q, H] (q whole blocks) -> (the input-side convolution of x, the output side's
        dynamic kernel [b, q, k, G], both from x)."""
        delta = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.num_groups)
        return self._convolve(x, delta[..., 0, :, :], 0), delta[..., 1, :, :]

    def finish(self, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """The output-side convolution of the sublayer's output y [b, q, H] with prepare's kernel."""
        return self._convolve(y, delta, 1)

    def _convolve(self, x: torch.Tensor, delta: torch.Tensor, side: int) -> torch.Tensor:
        b, q, H = x.shape
        B, k, G, g = self.block_size, self.kernel_size, self.num_groups, self.group_size
        xs = x.view(b, q // B, B, G, g)  # [b, blocks, slot, group, channel in group]
        coef = self.base_kernel[side].to(x.dtype).view(k, G, g) + delta.reshape(b, q // B, B, k, G, 1)
        out = xs * coef[..., 0, :, :]
        for j in range(1, k):
            # slot s reads slot s - j of the same block; the first j slots read zeros
            shifted = F.pad(xs[:, :, :-j], (0, 0, 0, 0, j, 0))
            out = out + shifted * coef[..., j, :, :]
        return out.view(b, q, H)


class CandidateSelector(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        if not 1 <= top_k <= vocab_size:
            raise ValueError(f"selector_top_k must be in 1..{vocab_size} (the vocabulary), got {top_k}")
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))  # P [V, r]
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))  # Q [V, r]
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)  # W_h [r, H]
        for w in (self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight):
            nn.init.normal_(w, std=0.02)  # speculators' initializer_range

    def forward(self, hidden: torch.Tensor, predecessors: torch.Tensor) -> torch.Tensor:
        """hidden [.., H] (slot t's final-normed states), predecessors [..] (the token at slot t-1)
        -> the selector's context P[a] * (W_h h) [.., r]; S = U + context . Q[b]. The successor
        codebook is read by the caller for the candidates only (`candidate_scores`)."""
        projected = self.hidden_projection(hidden)
        return self.predecessor_codebook[predecessors] * projected.to(self.predecessor_codebook.dtype)


def predecessors(block_tokens: torch.Tensor) -> torch.Tensor:
    """[.., B] tokens at block slots 0..B-1 -> [.., B-1] the token before each drafted slot 1..B-1."""
    return block_tokens[..., :-1]


def training_candidates(candidates: torch.Tensor, labels: torch.Tensor):
    """candidates [.., K] (unary top-K), labels [..] -> (candidates with a missing label put in
    place of the K-th [.., K], the label's position [..], whether the unary top-K held it [..])."""
    hit = candidates == labels[..., None]
    contains = hit.any(-1)
    K = candidates.shape[-1]
    position = torch.where(contains, hit.long().argmax(-1), K - 1)
    out = candidates.clone()
    out[..., -1] = torch.where(contains, candidates[..., -1], labels)
    return out, position, contains


def candidate_scores(unary: torch.Tensor, context: torch.Tensor, successor_codebook: torch.Tensor,
                     candidates: torch.Tensor) -> torch.Tensor:
    """unary [.., K] U(b) at the candidates, context [.., r], candidates [.., K] -> S [.., K]."""
    transition = (context[..., None, :] * successor_codebook[candidates]).sum(-1)
    return unary + transition.to(unary.dtype)


# --- training: the K-way candidate cross-entropy, chunked like the base loss ---------------------

def _selector_pieces(h, context, successor_codebook, head_weight, logits, labels, valid, top_k: int, cfg):
    """Whole blocks: h [n, K, H] drafter states of slots 1..K, context [n, K, r], logits [n, K, V]
    (the unary logits, detached: they only choose the candidate sets), labels, valid [n, K] ->
    (numerator sum_slots w * ce, correct [n, K] (the selector's pick is the label, and the label
    was among the unary candidates, as decoding needs), contains [n, K] (it was), all valid)."""
    candidates, position, contains = training_candidates(logits.topk(top_k, dim=-1).indices, labels)
    # U(b) = h . lm_head[b] at the K candidates only: differentiable in h (the head is frozen)
    unary = (head_weight[candidates].to(h.dtype) @ h[..., None]).squeeze(-1)  # [n, K, top_k]
    scores = candidate_scores(unary, context, successor_codebook, candidates).float()
    ce = F.cross_entropy(scores.flatten(0, 1), position.flatten(), reduction="none").view(position.shape)
    correct = (scores.argmax(-1) == position) & contains & valid
    w = slot_weights(valid, ce.detach(), cfg, ce.dtype)  # D-PACE: from the selector's own CE
    if cfg.until_first_failure:
        w = w * until_first_failure(correct, valid)
    return (w * ce).sum(), correct, contains & valid


def _chunked_selector(h, context, successor_codebook, head, labels, valid, top_k, cfg, chunk: int, grads):
    """_selector_pieces over chunks of `chunk` blocks, the unary logits computed per chunk. With
    `grads` (for h [n, K, H], context [n, K, r], the successor codebook [V, r]), also writes the
    numerator's gradients there (the codebook's summed over chunks)."""
    numerator, correct, contains = 0.0, [], []
    for i in range(0, h.shape[0], chunk):
        rows = slice(i, i + chunk)
        with torch.no_grad():
            logits = head(h[rows])
        if grads is None:
            with torch.no_grad():
                num, c, cont = _selector_pieces(h[rows], context[rows], successor_codebook, head.weight,
                                                logits, labels[rows], valid[rows], top_k, cfg)
        else:
            with torch.enable_grad():
                leaves = [h[rows].detach().requires_grad_(), context[rows].detach().requires_grad_(),
                          successor_codebook.detach().requires_grad_()]
                num, c, cont = _selector_pieces(*leaves, head.weight, logits, labels[rows], valid[rows],
                                                top_k, cfg)
                g_h, g_context, g_codebook = torch.autograd.grad(num, leaves)
                grads[0][rows], grads[1][rows] = g_h, g_context
                grads[2].add_(g_codebook)
            num = num.detach()
        numerator = numerator + num
        correct.append(c)
        contains.append(cont)
    return numerator, torch.cat(correct), torch.cat(contains)


class ChunkedSelectorLoss(torch.autograd.Function):
    """The selector's numerator chunk by chunk, each chunk's gradients computed in the forward (as
    loss.ChunkedBlockLoss does): the unary logits that choose the candidates never exist whole."""

    @staticmethod
    def forward(ctx, h, context, successor_codebook, head, labels, valid, top_k, cfg, chunk):
        grads = (torch.empty_like(h), torch.empty_like(context), torch.zeros_like(successor_codebook))
        numerator, correct, contains = _chunked_selector(h, context, successor_codebook, head, labels, valid,
                                                         top_k, cfg, chunk, grads)
        ctx.save_for_backward(*grads)
        ctx.mark_non_differentiable(correct, contains)
        return numerator, correct, contains

    @staticmethod
    def backward(ctx, g, *_):
        return (*(x * g.to(x.dtype) for x in ctx.saved_tensors), None, None, None, None, None, None)


def selector_loss(selector: CandidateSelector, draft_hidden: torch.Tensor, block_tokens: torch.Tensor,
                  head: nn.Module, labels: torch.Tensor, valid: torch.Tensor, cfg, normalizer):
    """The selector's K-way candidate CE. draft_hidden [b, A, K, H] (slots 1..K), block_tokens
    [b, A, B] (the data's tokens at slots 0..B-1: slot t's predecessor is the one at t-1, teacher
    forcing), head: the target's frozen LM head, labels [b, A, K] (the base loss's), valid
    [b, A, K], cfg: the recipe's LossConfig, normalizer: the base loss's divisor. Returns
    (loss_selector = sum w * ce / normalizer, not yet multiplied by loss.selector_weight;
    correct [b, A, K]: the greedy selector walk's per-slot hits, teacher-forced; contains
    [b, A, K]: the label was among the slot's unary top-K)."""
    b, A, K, H = draft_hidden.shape
    context = selector(draft_hidden, predecessors(block_tokens))  # [b, A, K, r]
    h, ctx_, lab, ok = (x.reshape(b * A, K, *x.shape[3:]) for x in (draft_hidden, context, labels, valid))
    top_k, codebook = selector.top_k, selector.successor_codebook
    if cfg.chunk_slots == 0:
        with torch.no_grad():
            logits = head(h)
        numerator, correct, contains = _selector_pieces(h, ctx_, codebook, head.weight, logits, lab, ok,
                                                        top_k, cfg)
    else:
        chunk = max(1, cfg.chunk_slots // K)
        if torch.is_grad_enabled() and (h.requires_grad or ctx_.requires_grad):
            numerator, correct, contains = ChunkedSelectorLoss.apply(h, ctx_, codebook, head, lab, ok, top_k,
                                                                     cfg, chunk)
        else:
            numerator, correct, contains = _chunked_selector(h, ctx_, codebook, head, lab, ok, top_k, cfg,
                                                             chunk, None)
    return numerator / normalizer, correct.view(b, A, K), contains.view(b, A, K)


# --- decoding: the selector's chain and its scores for the draft tree ------------------------------

@torch.no_grad()
def edge_scores(selector: CandidateSelector, hidden: torch.Tensor, unary_logits: torch.Tensor, bonus: int):
    """hidden [L, H] (the drafted slots' final-normed states), unary_logits [L, V], bonus: the
    block's slot-0 token -> (candidates [L, K] slot t's unary top-K, best first; edges [L, K, K]).
    edges[t, p, c] = S_{t+1}(a_p, candidates[t, c]) with a_p = candidates[t-1, p] for t > 0 and
    the bonus token for t = 0 (every row p of edges[0] is the bonus row). As vLLM's _score_edges."""
    L, V = unary_logits.shape
    unary, candidates = unary_logits.topk(min(selector.top_k, V), dim=-1)  # [L, K] each
    before = torch.cat([torch.full_like(candidates[:1], bonus), candidates[:-1]])  # [L, K] slot t-1's tokens
    context = selector(hidden[:, None, :], before)  # [L, K, r]
    successors = selector.successor_codebook[candidates]  # [L, K, r]
    return candidates, unary[:, None, :] + (context @ successors.transpose(1, 2)).to(unary.dtype)


@torch.no_grad()
def selector_chain(selector: CandidateSelector, hidden: torch.Tensor, unary_logits: torch.Tensor,
                   bonus: int) -> torch.Tensor:
    """The greedy DFlash2 chain as vLLM's selector walk drafts it: slot 1 takes the best candidate
    given the bonus token, slot t+1 the best given the one taken at slot t. -> tokens [L] long."""
    candidates, edges = edge_scores(selector, hidden, unary_logits, bonus)
    best = edges.argmax(-1).tolist()  # [L, K]: under each predecessor, its best candidate (first on ties)
    tokens, p = [], 0  # slot 1's predecessor row: the bonus token
    for t, row in enumerate(candidates.tolist()):
        p = best[t][p]
        tokens.append(row[p])
    return torch.tensor(tokens, dtype=torch.long)


class SelectorScorer:
    """Path-conditioned children for `ddtree.build_tree`: the children of a node carrying token a at
    depth d are slot d+1's unary top-K candidates C_{d+1}, ranked by the selector given a.

    Their log-probabilities: log q(b | a) = log m_{d+1} + log softmax_{C_{d+1}} S_{d+1}(a, .)(b),
    where m_t = sum_{b in C_t} softmax(U_t)(b) is the unary mass of slot t's candidates: the
    selector distributes the chance that the target's token is a candidate at all (its K-way
    softmax is what it was trained for, and what vLLM samples from). Tokens outside C_t never
    enter the tree. Scores are sums of per-depth log-probabilities, so the best-first tree holds
    the top-`budget` prefixes of these candidates. Ties: the better unary rank first (so a node's
    rank-0 child is the chain's pick). Cost: one [L, K, K] table per block (`edge_scores`), then a
    row lookup per expanded node."""

    def __init__(self, selector: CandidateSelector, hidden: torch.Tensor, bonus: int):
        """hidden [B, H]: the block's final-normed states (slot 0, the bonus token's, is not read);
        bonus: slot 0's token."""
        self.selector, self.hidden, self.bonus = selector, hidden[1:], bonus

    @torch.no_grad()
    def expander(self, draft_logits: torch.Tensor, K: int):
        """draft_logits [L, V] (the unary logits) -> (expand, root token, root carry) for
        `ddtree.best_first`; expand(token, carry, depth) -> (logp [K'], ids [K'], None), K' = min(K,
        top_k)."""
        candidates, edges = edge_scores(self.selector, self.hidden, draft_logits, self.bonus)
        logits = draft_logits.float()
        log_mass = torch.logsumexp(logits.gather(-1, candidates), -1) - torch.logsumexp(logits, -1)  # [L]
        logp = torch.log_softmax(edges.float(), dim=-1) + log_mass[:, None, None]  # [L, K, K]
        logp, order = logp.sort(dim=-1, descending=True, stable=True)
        n = min(K, candidates.shape[1])
        ids = candidates[:, None, :].expand_as(order).gather(-1, order)
        logp_rows, ids_rows = logp[..., :n].double().tolist(), ids[..., :n].tolist()
        # depth d -> token -> p
        row_of = [{tok: p for p, tok in enumerate(row)} for row in candidates.tolist()]

        def expand(token, carry, depth):
            p = 0 if depth == 0 else row_of[depth - 1][token]
            return logp_rows[depth][p], ids_rows[depth][p], None

        return expand, self.bonus, None


# --- DFlash2's fields (Variant.model_keys, loss_keys, drafter_keys, speculators_keys) --------------------

class DFlash2ModelKeys(BaseModel):
    """The recipe's model section: model.variant=dflash2 = DFlash + local convolutions around each sublayer
    and a candidate selector that re-ranks each slot's unary top-K given the token before it."""
    conv_kernel_size: int = Field(2, ge=1)  # taps of each convolution (slot s reads s-k+1..s)
    conv_group_size: int = Field(16, ge=1)  # hidden channels sharing one dynamic kernel
    selector_rank: int = Field(256, ge=1)  # rank r of the selector's codebooks
    selector_top_k: int = Field(16, ge=1)  # unary candidates per slot the selector re-ranks


class DFlash2LossKeys(BaseModel):
    # weight of the selector's K-way candidate CE (slot-weighted like the terms)
    selector_weight: float = Field(1.0, ge=0)


class DFlash2DrafterKeys(BaseModel):
    """DrafterConfig's (0 for other variants): taps of each local convolution, hidden channels sharing one
    dynamic kernel, and the candidate selector's rank and candidates per slot."""
    conv_kernel_size: Index = 0
    conv_group_size: Index = 0
    selector_rank: Index = 0
    selector_top_k: Index = 0


class DFlash2SpeculatorsKeys(BaseModel):
    conv_kernel_size: Size | None = None
    conv_group_size: Size | None = None
    selector_rank: Size | None = None
    selector_top_k: Size | None = None


def check_top_k(top_k: int | None, vocab: int) -> None:
    """The selector's candidates come from the vocabulary."""
    if top_k is not None and top_k > vocab:
        raise ValueError(f"selector_top_k {top_k} exceeds the vocabulary ({vocab}): at most {vocab}")


class DFlash2(Variant):
    """The variant: local convolutions in every layer, the selector's chain and tree, and DFlash2's fields."""
    name = "dflash2"
    display_name = "DFlash2"
    model_keys, loss_keys, drafter_keys = DFlash2ModelKeys, DFlash2LossKeys, DFlash2DrafterKeys
    speculators_keys = DFlash2SpeculatorsKeys
    grows_from = ("dflash",)
    grown = ("candidate_selector.",)
    draft_vocab = False
    heads_outside_forward = True  # the selector runs after the LM head, its codebook inside the loss
    native_refusal = ("the native DFlash format has no convolutions or candidate selector: export a DFlash2 "
                      "drafter with --format speculators (vLLM 0.33 reads it as DFlash2DraftModel)")

    def chain(self, drafter, hidden, base_logits, bonus, before=None) -> ChainDraft:
        """vLLM's selector walk (`selector_chain`); base_logits are the unary logits."""
        return ChainDraft(selector_chain(drafter.candidate_selector, hidden[1:], base_logits, bonus))

    def scorer(self, drafter, hidden, bonus, before=None):
        return SelectorScorer(drafter.candidate_selector, hidden, bonus)

    # --- training -----------------------------------------------------------------------------------

    def extra_terms(self, cfg) -> list[str]:
        return ["selector"]

    def extra_loss(self, o, model, target, cfg, normalizer, block_loss, loss, m):
        """+ loss.selector_weight x the selector's candidate CE (`selector_loss`: the main loss's slot
        weights and normaliser), reported as the term "selector"; the chain's hits (m["correct"]) are then
        the selector walk's, teacher-forced."""
        block_tokens = torch.cat([o.bonus[..., None], o.tokens], dim=-1)  # [b, A, B] the data's, slots 0..B-1
        sel, correct, _ = selector_loss(model.candidate_selector, o.draft_hidden, block_tokens,
                                        target.lm_head, m["labels"], o.valid, cfg.loss, normalizer)
        m["terms"] = torch.cat([m["terms"], sel.detach().reshape(1).to(m["terms"].dtype)])
        m["correct"] = correct
        return loss + cfg.loss.selector_weight * sel, m

    def node_log_probs(self, model, lm_head, hidden, tokens, depths, parents):
        """q = softmax over C_{d+1} of S_{d+1}(x, .) (support: C_t, slot t's unary top-K, which is all the
        selector ranks; the caller restricts p to it and renormalises; the unary mass outside C_t is the
        backbone's, trained by the base loss)."""
        selector, h_next = model.candidate_selector, hidden[depths + 1]  # [m, H]
        with torch.no_grad():  # the candidate sets: slot d+1's unary top-K
            support = lm_head(hidden[1:]).topk(min(selector.top_k, lm_head.weight.shape[0]),
                                               dim=-1).indices[depths]
        unary = (lm_head.weight[support].to(h_next.dtype) @ h_next[..., None]).squeeze(-1)  # [m, K]
        context = selector(h_next, tokens)  # [m, r]
        scores = unary + (context[:, None, :] * selector.successor_codebook[support]).sum(-1).to(unary.dtype)
        return support, torch.log_softmax(scores.float(), dim=-1)

    def cpu_tree_scorer(self, model):
        """SelectorScorer over a CPU float32 copy of the selector (validation's trees)."""
        c = model.config
        copy = cpu_copy(model.candidate_selector,
                        CandidateSelector(c.vocab_size, c.hidden_size, c.selector_rank, c.selector_top_k))
        return lambda hidden, bonus, before=None: SelectorScorer(copy, hidden, bonus)

    def conv(self, config) -> tuple[int, int, int]:
        return config.block_size, config.conv_kernel_size, config.conv_group_size

    def add_modules(self, drafter, config) -> None:
        """The convolutions back to the identity that the backbone's initialisation overwrote, then the
        selector (applied by the caller after the LM head)."""
        for layer in drafter.layers:
            layer.attention_conv.reset_parameters()
            layer.mlp_conv.reset_parameters()
        drafter.candidate_selector = CandidateSelector(config.vocab_size, config.hidden_size,
                                                       config.selector_rank, config.selector_top_k)

    def check_recipe(self, cfg) -> None:
        self.refuse_markov_w1_embed(cfg)  # tree_distill trains its selector

    def drafter_fields(self, m, tc) -> dict:
        if tc.hidden_size % m.conv_group_size:
            raise UserError(f"model.conv_group_size {m.conv_group_size} does not divide the target's hidden "
                            f"size {tc.hidden_size}")
        if m.conv_kernel_size > m.block_size:
            raise UserError(f"model.conv_kernel_size {m.conv_kernel_size} exceeds model.block_size "
                            f"{m.block_size}")
        if m.selector_rank > tc.vocab_size:  # the codebooks are [V, r]: a rank above V adds nothing
            raise UserError(f"model.selector_rank {m.selector_rank} exceeds the target's vocabulary "
                            f"({tc.vocab_size})")
        if m.selector_top_k > tc.vocab_size:
            raise UserError(f"model.selector_top_k {m.selector_top_k} exceeds the target's vocabulary "
                            f"({tc.vocab_size})")
        return {"variant": "dflash2", **{k: getattr(m, k) for k in self.recipe_fields}}

    def check(self, fields) -> None:
        for k in self.recipe_fields:
            if getattr(fields, k) < 1:
                raise ValueError(f"a dflash2 drafter needs {k} >= 1, got {getattr(fields, k)}")
        check_top_k(fields.selector_top_k, fields.vocab_size)

    def check_speculators(self, config) -> None:
        check_top_k(config.selector_top_k, config.transformer_layer_config.vocab_size)

    def from_speculators(self, config: dict) -> dict:
        """Its full vocabulary is checked (speculators' DFlash2 requires it too)."""
        super().from_speculators(config)
        vocab = config["transformer_layer_config"]["vocab_size"]
        if config.get("draft_vocab_size", vocab) != vocab:
            raise UserError(f"DFlash2 config has draft_vocab_size {config['draft_vocab_size']} but a "
                            f"{vocab}-token verifier vocabulary: DFlash2 drafts over the full vocabulary")
        fields = {k: default if config.get(k) is None else int(config[k])
                  for k, default in SPECULATORS_DEFAULTS.items()}
        return {"variant": "dflash2", **fields}

    def speculators_fields(self, cfg) -> dict:
        return {k: getattr(cfg, k) for k in SPECULATORS_DEFAULTS}

    def speculators_config_class(self):
        from speculators.models.dflash2 import DFlash2SpeculatorConfig  # architectures ["DFlash2DraftModel"]
        return DFlash2SpeculatorConfig

    # --- the model card -----------------------------------------------------------------------------

    def card_algorithm(self, cfg) -> str:
        return (f"DFlash2: the DFlash block forward with {cfg.conv_kernel_size}-tap dynamic convolutions "
                f"around every sublayer (within the block), then a rank-{cfg.selector_rank} candidate "
                f"selector re-ranks each slot's top-{cfg.selector_top_k} tokens given the token before it")

    def card_vllm(self, fmt, cfg, pin, serve_ref) -> str:
        """Speculators only (native_refusal): vLLM 0.33 reads `dflash2` as DFlash2DraftModel."""
        return f"vllm serve {serve_ref}   # DFlash2DraftModel, method dflash, read from config.json"

    def card_limitations(self, cfg) -> str:
        return ("\n- vLLM drafts the chain as its selector walk; the DDTree numbers come from "
                "dflash-train's decoder, whose tree ranks each node's children by the selector given that "
                "node's token.")

    def card_training(self, m, loss) -> str:
        return f", plus the candidate selector's K-way CE (weight {loss['selector_weight']})."

    def cost_key(self, cfg) -> str | None:
        return "dflash2" if cfg.selector_rank else None
