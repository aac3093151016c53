"""XPress's causal refiner on the DFlash backbone (speculators 0.9 `models/xpress/`; inference as vLLM
PR #54448 drafts it, open at the time of writing).

The backbone drafts every block slot independently (base logits b_k = lm_head(h_k), h_k the final-normed
state of slot k, slot 0 the bonus token). XPress adds a small **refiner** whose logit bias for slot k
depends on the backbone's states of the block and on the tokens at slots 0..k-1 (prev_k = the token
before slot k: prev_0 = the token before the bonus token, prev_1 = the bonus token):

    g      = mean_k h_k                                     (the whole block, slot 0 too)
    a_k    = in_proj [down_h h_k ; down_g g ; token_embed[prev_k]]          [r]
    c_k    = a_k + sum_{j<=k} mix_l[:, k, j] * a_j          a per-channel causal mixer over the block
    y_k    = c_k + mlp_down(silu(mlp_gate c_k) * mlp_up c_k)
    logits_k = b_k + readout(y_k)

No norms, no biases. Training (speculators' objective, `XPress.extra_loss`): the teacher-forced pass
(prev = the true tokens), `loss.consistency_passes` rounds fed the previous round's argmax (the first
round the backbone's argmax; stop-grad between rounds, averaged, weight `loss.consistency_weight`) and
the backbone's own logits (weight `loss.base_anchor_weight`, the "base anchor").

Decoding: the chain by Jacobi passes (`jacobi_chain`): start from the backbone's argmax, refine the
whole block on the previous pass's tokens, stop when no argmax changes (a fixed point: a further pass
changes nothing) or after `num_jacobi_passes` (K). After j passes slots 1..j are the sequential greedy
chain, so K >= B-1 passes give exactly it. The mixer is causal and g holds no drafted token, so a draft
tree node's bias follows from its ancestors' tokens alone: `XPressScorer` scores each node's children
exactly given its path (over the backbone's top-M candidates per depth, as dspark.MarkovScorer).

Parameter names and shapes are speculators' (`refiner_head.{token_embed, down_h, down_g, in_proj, mix_l,
mlp_gate, mlp_up, mlp_down, readout}`; `causal_tril` is not saved), so an export loads in speculators'
XPressDraftModel as it is. vLLM's PR reads other names (xpress_head.*): see the model card.
"""

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, Field
from torch import nn

from dflash_train.core.errors import UserError
from dflash_train.core.schema import Index, Size
from dflash_train.model.variants.base import ChainDraft, Variant, cpu_copy, kept_ids, w2_rows
from dflash_train.model.variants.dspark import TREE_CANDIDATES, _Candidates, _rows

# speculators' defaults (models/xpress/config.py)
DEFAULT_RANK, DEFAULT_MLP_RATIO, DEFAULT_PASSES = 256, 2, 6


class RefinerHead(nn.Module):
    """speculators' XPressRefinerHead: the same names, shapes, init and math. The token embedding spans
    the verifier's vocabulary (prev tokens are target ids), the readout the draft vocabulary (N = the
    drafter's draft_vocab_size, or V): the bias adds to the drafter's logits in draft space."""

    def __init__(self, vocab_size: int, hidden_size: int, block_size: int, rank: int, mlp_ratio: int,
                 draft_vocab_size: int | None = None):
        super().__init__()
        if rank <= 0 or mlp_ratio <= 0:
            raise ValueError(f"RefinerHead needs rank > 0 and mlp_ratio > 0, got {rank}, {mlp_ratio}")
        self.rank, self.block_size = rank, block_size
        r = rank
        self.token_embed = nn.Embedding(vocab_size, r)  # over the verifier's vocabulary
        self.down_h = nn.Linear(hidden_size, r, bias=False)
        self.down_g = nn.Linear(hidden_size, r, bias=False)
        self.in_proj = nn.Linear(3 * r, r, bias=False)  # input [down_h(h) ; down_g(g) ; token_embed(prev)]
        self.mix_l = nn.Parameter(torch.zeros(r, block_size, block_size))  # used under its lower triangle
        self.mlp_gate = nn.Linear(r, mlp_ratio * r, bias=False)
        self.mlp_up = nn.Linear(r, mlp_ratio * r, bias=False)
        self.mlp_down = nn.Linear(mlp_ratio * r, r, bias=False)
        self.readout = nn.Linear(r, draft_vocab_size or vocab_size, bias=False)
        self.register_buffer("causal_tril", torch.tril(torch.ones(block_size, block_size)), persistent=False)
        # speculators' init: N(0, 0.02) everywhere, the mixer 0 (the drafter's own init ran before this)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def hidden_cache(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, B, H] (every slot) -> [N, B, 2r] = [down_h(h_k) ; down_g(mean h)], the same for
        every refine pass of the block."""
        hidden = hidden.to(self.down_h.weight.dtype)
        g = hidden.mean(dim=1, keepdim=True).expand_as(hidden)
        return torch.cat([self.down_h(hidden), self.down_g(g)], dim=-1)

    def latent(self, prev: torch.Tensor, hcache: torch.Tensor) -> torch.Tensor:
        """prev [N, B] (slot k's previous token), hcache [N, B, 2r] -> y [N, B, r]; slot k's bias is
        readout(y_k), left to the caller (the loss adds it chunk by chunk)."""
        emb = self.token_embed(prev.long()).to(hcache.dtype)
        x = self.in_proj(torch.cat([hcache, emb], dim=-1))
        mix = self.mix_l * self.causal_tril.to(self.mix_l.dtype)
        x = x + torch.einsum("ckj,njc->nkc", mix, x)  # c_k = a_k + sum_{j<=k} mix[:, k, j] a_j
        return x + self.mlp_down(F.silu(self.mlp_gate(x)) * self.mlp_up(x))

    def forward(self, prev: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """prev [N, B], hidden [N, B, H] -> the bias [N, B, draft vocabulary] (speculators' block_bias)."""
        return self.readout(self.latent(prev, self.hidden_cache(hidden)))


def previous_tokens(before: torch.Tensor, block_tokens: torch.Tensor) -> torch.Tensor:
    """before [..] (the token before slot 0), block_tokens [.., B] -> [.., B] the token before each slot."""
    return torch.cat([before[..., None], block_tokens[..., :-1]], dim=-1)


def teacher_forced(drafter, block_hidden: torch.Tensor, block_tokens: torch.Tensor, before: torch.Tensor):
    """block_hidden [b, A, B, H], block_tokens [b, A, B] (true tokens, slot 0 the anchor), before [b, A]
    -> (y [b, A, K, r] of the drafted slots on the true previous tokens, hcache [b*A, B, 2r])."""
    b, A, B, H = block_hidden.shape
    head = drafter.refiner_head
    hcache = head.hidden_cache(block_hidden.reshape(b * A, B, H))
    y = head.latent(previous_tokens(before, block_tokens).reshape(b * A, B), hcache)
    return y[:, 1:].reshape(b, A, B - 1, -1), hcache


@torch.no_grad()
def refined_logits(head: RefinerHead, hcache: torch.Tensor, base_logits: torch.Tensor, prev: torch.Tensor):
    """One refine pass of one block: hcache [1, B, 2r], base_logits [B-1, N], prev [B] (target ids) ->
    [B-1, N]."""
    y = head.latent(prev[None], hcache)[0, 1:]
    return base_logits + head.readout(y.to(head.readout.weight.dtype)).to(base_logits.dtype)


@torch.no_grad()
def jacobi_chain(drafter, hidden: torch.Tensor, base_logits: torch.Tensor, bonus: int, before: int,
                 passes: int | None = None) -> tuple[torch.Tensor, int]:
    """The greedy XPress chain by Jacobi passes (vLLM PR #54448's recurrence, with the true token before
    the bonus token, as training feeds it). hidden [B, H], base_logits [B-1, N] (a draft vocabulary's
    indices, or N = V) -> (tokens [B-1] in the same indices, passes run). Pass j refines every slot on
    pass j-1's tokens (pass 0: the backbone's argmax); it stops at the first pass that changes no token
    (counted: it is run), and after B-1 passes (the chain is then the sequential greedy one, a fixed
    point), so the tokens are those of `passes` (default num_jacobi_passes) passes."""
    head, B, kept = drafter.refiner_head, hidden.shape[0], kept_ids(drafter)
    passes = drafter.config.num_jacobi_passes if passes is None else passes
    hcache = head.hidden_cache(hidden[None])
    tokens = base_logits.argmax(-1)
    fixed = torch.tensor([before, bonus], device=tokens.device)
    for used in range(1, min(passes, B - 1) + 1):
        drafted = tokens[:-1] if kept is None else kept[tokens[:-1]]  # the refiner reads target ids
        new = refined_logits(head, hcache, base_logits, torch.cat([fixed, drafted])).argmax(-1)
        if torch.equal(new, tokens):
            return tokens, used
        tokens = new
    return tokens, min(passes, B - 1)


class XPressScorer:
    """Path-conditioned children for `ddtree.build_tree`: the children of a node at depth d carrying x_d
    are ranked by the drafter's slot-(d+1) distribution given its path (before, bonus, x_1..x_d): the
    refiner's mixer is causal, so that is exact (no later token enters).

    As dspark.MarkovScorer: per depth the candidates C_d are the backbone's top-M tokens (M = min(
    candidates, N)), the bias is added on them only, and log p is normalised over the whole (draft)
    vocabulary with the non-candidates at their backbone logits (exact when M >= N). The carry of a node
    is its path's mixer inputs a_0..a_d [d+1, r]; per node: one [r, r] mat-vec for the token's input, the
    mixer (d+2 terms), the SwiGLU ([m r, r] twice and back) and the candidates' readout [M, r]; float32
    numpy. With a draft vocabulary either the logits are [L, N] in draft space (`kept`: [N] target id of
    each column; the nodes carry target ids, build_tree then takes no token_ids), or [L, V] scattered
    with -inf outside it (`readout_row`: [V] the readout row of each target id, validation's trees).
    """

    def __init__(self, head: RefinerHead, hidden: torch.Tensor, bonus: int, before: int,
                 candidates: int = TREE_CANDIDATES, kept: torch.Tensor | None = None,
                 readout_row: torch.Tensor | None = None):
        """hidden [B, H]: the block's final-normed states (slot 0 = the bonus token)."""
        self.head, self.hidden, self.bonus, self.before = head, hidden, bonus, before
        self.candidates, self.kept, self.readout_row = candidates, kept, readout_row

    @torch.no_grad()
    def expander(self, draft_logits: torch.Tensor, K: int):
        """draft_logits [L, V] (depth d = row d-1) -> (expand, root token, root carry) for
        ddtree.best_first."""
        head, V = self.head, draft_logits.shape[-1]
        M, K = min(self.candidates, V), min(K, self.candidates, V)
        # token_embed and readout play W1's and W2's parts: rows by target id, and by column
        embed = head.token_embed.weight.detach()
        cands = _Candidates(draft_logits, M, embed, head.readout.weight, self.kept, self.readout_row)
        step = _RefineStep(head, self.hidden)

        def expand(token: int, carry, depth: int):
            e = _rows(embed, [token])[0] if depth == 0 else cands.w1_of(depth, token)
            y, child_carry = step(e, carry, depth + 1)
            z = cands.vals[depth] + cands.w2_of(depth) @ y  # [M] the candidates' refined logits
            peak = z.max()
            log_norm = np.logaddexp(cands.rest[depth], peak + np.log(np.exp(z - peak).sum()))
            order = np.argsort(-z, kind="stable")[:K]  # ties: the better backbone rank first
            return (z[order] - log_norm).tolist(), cands.ids[depth, order].tolist(), child_carry

        # a_0: slot 0 after the token before it
        root_carry = step.first(_rows(embed, [self.before])[0])
        return expand, self.bonus, root_carry


class _RefineStep:
    """RefinerHead.latent for one slot at a time, in float32 numpy, its slot part precomputed."""

    def __init__(self, head: RefinerHead, hidden: torch.Tensor):
        r = head.rank
        f32 = lambda w: w.detach().to("cpu", torch.float32).numpy()  # noqa: E731
        w_in = head.in_proj.weight.detach()
        hcache = head.hidden_cache(hidden[None].to(w_in.device))[0]  # [B, 2r]
        self.slot_part = f32(hcache.to(w_in.dtype) @ w_in[:, :2 * r].T)  # [B, r]
        self.w_e = f32(w_in[:, 2 * r:])  # [r, r]
        self.mix = f32(head.mix_l * head.causal_tril.to(head.mix_l.dtype))  # [r, B, B]
        self.gate, self.up, self.down = (f32(head.mlp_gate.weight), f32(head.mlp_up.weight),
                                         f32(head.mlp_down.weight))

    def first(self, e: np.ndarray) -> np.ndarray:
        """The carry of slot 0 (prev = the token before the bonus token, embedding e [r]): [[a_0]]."""
        return (self.slot_part[0] + self.w_e @ e)[None]

    def __call__(self, e: np.ndarray, carry: np.ndarray, slot: int):
        """y of `slot` after a token with embedding e [r], given carry a_0..a_{slot-1} -> (y [r], carry +
        a)."""
        a = self.slot_part[slot] + self.w_e @ e
        path = np.concatenate([carry, a[None]])  # [slot+1, r]
        c = a + (self.mix[:, slot, : slot + 1] * path.T).sum(-1)
        g = self.gate @ c
        return c + self.down @ (g / (1.0 + np.exp(-g)) * (self.up @ c)), path


# --- XPress's fields (Variant.model_keys, loss_keys, drafter_keys, speculators_keys) ---------------------

class XPressModelKeys(BaseModel):
    """The recipe's model section: model.variant=xpress = DFlash + a causal refiner that biases each slot's
    logits given the tokens before it, drafted by Jacobi passes."""
    xpress_rank: int = Field(256, ge=1)  # the refiner's rank r (at most the target's hidden size)
    xpress_mlp_ratio: int = Field(2, ge=1)  # the refiner's SwiGLU is r -> ratio * r -> r
    num_jacobi_passes: int = Field(6, ge=1)  # the chain's Jacobi passes at most (K; stops at a fixed point)


class XPressLossKeys(BaseModel):
    # speculators' defaults: the consistency rounds (each fed the previous round's argmax, the first the
    # backbone's; their losses averaged) and their weight, and the weight of the backbone's own loss (the
    # "base anchor"); each the same terms, slot weights and divisor as the teacher-forced pass.
    # speculators' XPress recipe also sets terms {ce: 0.1, tv: 0.9}.
    consistency_weight: float = Field(0.3, ge=0, allow_inf_nan=False)
    consistency_passes: int = Field(3, ge=0)
    base_anchor_weight: float = Field(0.6, ge=0, allow_inf_nan=False)


class XPressDrafterKeys(BaseModel):
    """DrafterConfig's (0 for other variants): the refiner's rank and SwiGLU ratio, and the Jacobi passes of
    its chain at most (speculators' names)."""
    xpress_rank: Index = 0
    xpress_mlp_ratio: Index = 0
    num_jacobi_passes: Index = 0


class XPressSpeculatorsKeys(BaseModel):
    xpress_rank: Size | None = None
    xpress_mlp_ratio: Size | None = None
    num_jacobi_passes: Size | None = None


class XPress(Variant):
    """The variant: the refiner after the backbone, its Jacobi chain and exact tree, its fields and loss."""
    name = "xpress"
    display_name = "XPress"
    model_keys, loss_keys, drafter_keys = XPressModelKeys, XPressLossKeys, XPressDrafterKeys
    speculators_keys = XPressSpeculatorsKeys
    grows_from = ("dflash",)
    grown = ("refiner_head.",)
    # a draft vocabulary: the readout is [N, r] over it (speculators'), the token embedding stays [V, r]
    draft_vocab = True
    heads_outside_forward = True
    native_refusal = ("the native DFlash format has no refiner head: export an XPress drafter with "
                      "--format speculators")

    def chain(self, drafter, hidden, base_logits, bonus, before=None) -> ChainDraft:
        tokens, passes = jacobi_chain(drafter, hidden, base_logits, bonus,
                                      bonus if before is None else before)
        return ChainDraft(tokens, passes=passes)

    def scorer(self, drafter, hidden, bonus, before=None):
        return XPressScorer(drafter.refiner_head, hidden, bonus, bonus if before is None else before,
                            kept=kept_ids(drafter))

    def add_modules(self, drafter, config) -> None:
        drafter.refiner_head = RefinerHead(config.vocab_size, config.hidden_size, config.block_size,
                                           config.xpress_rank, config.xpress_mlp_ratio,
                                           config.draft_vocab_size)

    def teacher_forced(self, drafter, block_hidden, block_tokens, before=None) -> dict:
        y, hcache = teacher_forced(drafter, block_hidden, block_tokens,
                                   block_tokens[..., 0] if before is None else before)
        return {"y": y, "hcache": hcache}  # the refiner's latents [b, A, K, r], hcache [b*A, B, 2r]

    def logit_bias(self, model, heads):
        """The refiner's bias y . readout^T (readout [N, r] over the head's vocabulary)."""
        return heads["y"], model.refiner_head.readout.weight

    def cpu_tree_scorer(self, model):
        """XPressScorer over a CPU float32 copy of the refiner (validation's logits are [.., V], -inf outside
        a draft vocabulary: readout_row maps a target id to its readout row; outside ids stay at -inf)."""
        c = model.config
        fresh = RefinerHead(c.vocab_size, c.hidden_size, c.block_size, c.xpress_rank, c.xpress_mlp_ratio,
                            c.draft_vocab_size)
        copy = cpu_copy(model.refiner_head, fresh)
        row = w2_rows(model)
        return lambda hidden, bonus, before: XPressScorer(copy, hidden, bonus, before, readout_row=row)

    def extra_terms(self, cfg) -> list[str]:
        return ["consistency", "base_anchor"]

    def extra_loss(self, o, model, target, cfg, normalizer, block_loss, loss, m):
        """speculators' XPress loss: + consistency_weight x the mean of the free-running rounds' losses
        + base_anchor_weight x the backbone's own loss (the same terms, slot weights and normaliser as
        the teacher-forced pass, which `loss` is). Reported as the terms "consistency", "base_anchor".
        A round's argmax is in draft indices; the refiner reads it as target ids (speculators' d2v)."""
        L, head, w2, kept = cfg.loss, model.refiner_head, model.refiner_head.readout.weight, kept_ids(model)
        rounds_on = L.consistency_weight > 0 and L.consistency_passes > 0
        zero = loss.new_zeros(())
        base = zero
        if L.base_anchor_weight > 0:
            base, mb = block_loss()
        elif rounds_on:
            _, mb = block_loss(grad=False)  # only the seed: the backbone's argmax
        rounds = []
        if rounds_on:
            b, A, K = o.tokens.shape
            pred, hcache = mb["pred"], o.heads["hcache"]
            fixed = torch.stack([o.before, o.bonus], dim=-1)  # [b, A, 2]
            for _ in range(L.consistency_passes):
                drafted = pred[..., :-1] if kept is None else kept[pred[..., :-1]]
                prev = torch.cat([fixed, drafted], dim=-1).reshape(b * A, K + 1)
                y = head.latent(prev, hcache)[:, 1:].reshape(b, A, K, -1)
                round_loss, mj = block_loss((y, w2))
                rounds.append(round_loss)
                pred = mj["pred"]
        consistency = torch.stack(rounds).mean() if rounds else zero
        total = loss + L.consistency_weight * consistency + L.base_anchor_weight * base
        extra = torch.stack([consistency.detach(), base.detach()]).to(m["terms"].dtype)
        return total, {**m, "terms": torch.cat([m["terms"], extra])}

    def check_recipe(self, cfg) -> None:
        self.refuse_markov_w1_embed(cfg)
        if cfg.tree_distill.weight > 0:
            raise ValueError("tree_distill is not implemented for model.variant=xpress (no path-conditioned "
                             "node scores in training): set tree_distill.weight=0")

    def drafter_fields(self, m, tc) -> dict:
        if not 1 <= m.xpress_rank <= tc.hidden_size:  # down_h / down_g project H -> r: above H adds nothing
            raise UserError(f"model.xpress_rank {m.xpress_rank} must be in 1..{tc.hidden_size} (the target's "
                            "hidden size: the refiner projects the drafter's states down to it)")
        return {"variant": "xpress", "xpress_rank": m.xpress_rank, "xpress_mlp_ratio": m.xpress_mlp_ratio,
                "num_jacobi_passes": m.num_jacobi_passes}

    def check(self, fields) -> None:
        if fields.xpress_rank < 1 or fields.xpress_mlp_ratio < 1 or fields.num_jacobi_passes < 1:
            raise ValueError(f"an xpress drafter needs xpress_rank, xpress_mlp_ratio and "
                             f"num_jacobi_passes >= 1, got {fields.xpress_rank}, {fields.xpress_mlp_ratio}, "
                             f"{fields.num_jacobi_passes}")
        if fields.xpress_rank > fields.hidden_size:
            raise ValueError(f"xpress_rank {fields.xpress_rank} is above the hidden size "
                             f"{fields.hidden_size}")

    def from_speculators(self, config: dict) -> dict:
        """speculators' XPress default is sample_from_anchor false, the only layout read. A draft
        vocabulary (draft_vocab_size < V, lm_head / d2t / t2d) is read as for DFlash (formats.py)."""
        if config.get("sample_from_anchor", False):
            raise UserError("XPress config has sample_from_anchor true: dflash-train reads only false (the "
                            "bonus token at block slot 0, B-1 drafted tokens)")
        rank, hidden = (int(config.get("xpress_rank", DEFAULT_RANK)),
                        config["transformer_layer_config"]["hidden_size"])
        if rank > hidden:
            raise UserError(f"XPress config has xpress_rank {rank} above the hidden size {hidden}")
        return {"variant": "xpress", "xpress_rank": rank,
                "xpress_mlp_ratio": int(config.get("xpress_mlp_ratio", DEFAULT_MLP_RATIO)),
                "num_jacobi_passes": int(config.get("num_jacobi_passes", DEFAULT_PASSES))}

    def speculators_fields(self, cfg) -> dict:
        return {"xpress_rank": cfg.xpress_rank, "xpress_mlp_ratio": cfg.xpress_mlp_ratio,
                "num_jacobi_passes": cfg.num_jacobi_passes}

    def speculators_config_class(self):
        from speculators.models.xpress import XPressSpeculatorConfig
        return XPressSpeculatorConfig

    # --- the model card -----------------------------------------------------------------------------

    def card_algorithm(self, cfg) -> str:
        return (f"XPress: the DFlash block forward, then a rank-{cfg.xpress_rank} causal "
                "refiner adds a logit bias to each slot given the tokens before it, drafted by "
                f"Jacobi passes (at most {cfg.num_jacobi_passes}, stopping at a fixed point)")

    def card_vllm(self, fmt, cfg, pin, serve_ref) -> str:
        return ("# No released vLLM serves XPress (speculators 0.9 trains it and has no inference code).\n"
                "# vLLM PR #54448 (open) adds it, under other weight names (xpress_head.w1 / w2 / mix.L /\n"
                "# mlp.*) and config keys (xpress_num_passes, ...): this export needs converting for it.\n"
                "# Meanwhile, decode with dflash-train (Jacobi chain or exact DDTree):\n"
                f"dflash-eval --drafter {serve_ref}")

    def card_limitations(self, cfg) -> str:
        vocab = ("\n- vLLM PR #54448's XPress refuses a draft vocabulary (draft_vocab_size "
                 "< the verifier's); speculators and dflash-train read it." if cfg.draft_vocab_size else "")
        return vocab + ("\n- vLLM PR #54448 feeds the anchor token in place of the token before it "
                "(slot 0's previous token); dflash-train trains and decodes with the true one, so the "
                "first mixer column sees other inputs there.\n- The DDTree scores each node's children with "
                f"the refiner's bias on the backbone's top-{TREE_CANDIDATES} tokens per depth, exactly "
                "given the node's path.\n- speculators 0.9.0's `from_pretrained` leaves "
                "`refiner_head.causal_tril` (a buffer that is not saved) as uninitialised memory: after "
                f"loading, set it to `torch.tril(torch.ones({cfg.block_size}, {cfg.block_size}))`.")

    def card_training(self, m, loss) -> str:
        return (f", plus {loss['consistency_passes']} consistency rounds (weight "
                f"{loss['consistency_weight']}) and the backbone's own loss (weight "
                f"{loss['base_anchor_weight']}).")

    def cost_key(self, cfg) -> str | None:
        return "xpress"
