"""Plain DFlash as a variant, and what the rest of the package asks of one.

A variant is one object of `VARIANTS` (model/variants/__init__.py), named by DrafterConfig.variant and
reached as `drafter.variant`. DSpark (dspark.py) and DFlash2 (dflash2.py) override what they change;
everything here is DFlash's: no modules beyond the backbone, each slot's argmax as the chain, DDTree
from the backbone's marginals, no fields of its own.

    decoding      chain, states_confidence, scorer
    drafter       conv, add_modules
    training      teacher_forced, logit_bias, extra_loss, extra_terms, needs_alpha, node_log_probs,
                  side_optimizer, heads_outside_forward
    validation    cpu_tree_scorer, validation_count_size, validation_counts, validation_entries,
                  validation_record
    fields        model_keys, loss_keys, drafter_keys, speculators_keys (declared once, in its file)
    recipes       drafter_fields, recipe_fields, grows_from, grown, check_recipe
    checkpoints   check, check_speculators, draft_vocab, from_speculators, speculators_fields,
                  speculators_config_class, native_refusal
    export        display_name, card_algorithm, card_vllm, card_limitations, card_training,
                  card_training_notes
    evaluation    cost_key

`before` (chain, scorer, teacher_forced) is the token before the bonus (anchor) token: XPress's refiner
reads it at slot 0; the other variants ignore it.
"""

from dataclasses import dataclass

import torch
from pydantic import BaseModel
from torch import nn

from dflash_train.core.errors import UserError


@dataclass
class ChainDraft:
    """One block's greedy chain."""
    tokens: torch.Tensor  # [B-1] long, the drafted slots 1..B-1
    confidence: torch.Tensor | None = None  # [B-1] acceptance logits (DSpark's confidence head), or None
    passes: int | None = None  # XPress: the Jacobi passes run (None: not an iterative chain)


def kept_ids(drafter) -> torch.Tensor | None:
    """[N] the target id of each draft index (speculators' d2v: i + d2t[i]); None: the full vocabulary."""
    return (None if drafter.lm_head is None
            else drafter.d2t + torch.arange(len(drafter.d2t), device=drafter.d2t.device))


def w2_rows(drafter) -> torch.Tensor | None:
    """[V] the draft index of each target id (0 outside the draft vocabulary, whose logits are -inf: the
    row of a [N, r] table over draft space that a [.., V] logit column reads), on the CPU; None: the
    full vocabulary."""
    return None if drafter.lm_head is None else (drafter.t2d.long().cumsum(0) - 1).clamp(min=0).cpu()


def cpu_copy(module: nn.Module, copy: nn.Module) -> nn.Module:
    """`copy` (a fresh module of module's shape) loaded with module's weights as CPU float32, in eval mode;
    under FSDP the shards are gathered, so every process calls it (validation's tree scorers)."""
    from torch.distributed.tensor import DTensor

    state = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().to("cpu", torch.float32)
             for k, v in module.state_dict().items()}
    copy.load_state_dict(state)
    return copy.eval()


class Variant:
    name = "dflash"
    display_name = "DFlash"  # the model card's name for it
    # Its fields, each a pydantic model declared in its file (None: none; DFlash's are the backbone's): the
    # recipe's model and loss sections' keys with their recipe defaults (training/config.py's ModelConfig and
    # LossConfig inherit them), the drafter's config fields with their defaults when another variant is
    # drafted (DrafterConfig in model/drafter.py, config.json's `drafter` in checkpoint/formats.py) and its
    # keys of a Speculators config.json (speculators' names; absent: speculators' defaults).
    model_keys: type[BaseModel] | None = None
    loss_keys: type[BaseModel] | None = None
    drafter_keys: type[BaseModel] | None = None
    speculators_keys: type[BaseModel] | None = None
    # variants whose drafter may start this one (model.init_from), and the state-dict prefixes of the
    # modules it then adds fresh (DFlash2's convolutions too, at the identity: they are checked apart)
    grows_from: tuple[str, ...] = ()
    grown: tuple[str, ...] = ()
    # whether it can draft in a draft vocabulary (model/vocab.py); DFlash2 cannot: its selector's
    # successor codebook is a [V, r] table over the full vocabulary, and speculators refuses one
    draft_vocab = True
    # why the native DFlash format (z-lab's config.json) cannot hold this drafter (a class attribute in a
    # variant's file); None: it can. The native format holds the plain backbone only, so a variant that
    # does not say is refused (native_refusal below), rather than exported without its own weights.
    # whether its heads run after the backbone's forward (and their weights are used inside the loss),
    # outside any sharded unit's forward: FSDP must then keep parameters unsharded, ZeRO-3 cannot serve it
    heads_outside_forward = False

    @property
    def native_refusal(self) -> str | None:
        if type(self) is Variant:  # plain DFlash: the native format is its own
            return None
        return (f"the native DFlash format holds the plain DFlash backbone only: export a "
                f"{self.display_name} drafter with --format speculators")

    # --- decoding ---------------------------------------------------------------------------------

    def chain(self, drafter, hidden: torch.Tensor, base_logits: torch.Tensor, bonus: int,
              before: int | None = None) -> ChainDraft:
        """The greedy chain of one block: hidden [B, H] the drafter's final-normed states (slot 0: the
        bonus token's), base_logits [B-1, V] the backbone's (-inf outside a draft vocabulary).
        DFlash: every slot's argmax, drafted independently."""
        return ChainDraft(base_logits.argmax(-1))

    def states_confidence(self, drafter) -> bool:
        """Whether `chain` states each slot's acceptance (decoding then tabulates it against the target)."""
        return False

    def scorer(self, drafter, hidden: torch.Tensor, bonus: int, before: int | None = None):
        """The path-conditioned children of this block's DDTree (for `ddtree.build_tree`), from hidden
        [B, H]; None: the tree from the backbone's marginals."""
        return None

    # --- the drafter's modules ----------------------------------------------------------------------

    def conv(self, config) -> tuple[int, int, int] | None:
        """Each decoder layer's local convolutions as (block_size, kernel_size, group_size); None: none."""
        return None

    def add_modules(self, drafter: nn.Module, config) -> None:
        """Add this variant's modules to a drafter whose backbone is built and initialised."""

    # --- training -----------------------------------------------------------------------------------

    def teacher_forced(self, drafter, block_hidden: torch.Tensor, block_tokens: torch.Tensor,
                       before: torch.Tensor | None = None) -> dict:
        """What the variant's heads give on the true previous tokens (training.blocks.BlockOutputs.heads,
        read back only by this variant's own methods): block_hidden [b, A, B, H] every slot's state,
        block_tokens [b, A, B] the true tokens, before [b, A] the token before each anchor."""
        return {}

    def logit_bias(self, model, heads: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The low-rank logit bias of the drafted slots, added in the loss's chunks: (u [b, A, K, r], w2
        [N, r]) for logits += u . w2^T (N: the head's vocabulary), from teacher_forced's `heads`; None:
        none."""
        return None

    def extra_loss(self, o, model, target, cfg, normalizer, block_loss, loss: torch.Tensor, m: dict):
        """Terms beyond the main loss `loss` (metrics m) -> (loss, m with m["terms"] grown by
        extra_terms(cfg)). o: the anchored blocks (training.blocks.BlockOutputs), target: the frozen
        target, normalizer: the main loss's divisor. block_loss(bias=None, grad=True) -> (loss, m) is the
        block's loss again (same head, labels, target, normaliser) with another low-rank logit bias (u,
        w2), or none; its m["pred"] is the argmax in the head's index space."""
        return loss, m

    def extra_terms(self, cfg) -> list[str]:
        """The names of the terms extra_loss appends to m["terms"]."""
        return []

    def needs_alpha(self, model, cfg) -> bool:
        """Whether extra_loss reads the per-slot acceptance rate m["alpha"] on every step (a draft
        vocabulary's ce step computes the target's probabilities only when something needs them)."""
        return False

    def node_log_probs(self, model, lm_head, hidden: torch.Tensor, tokens: torch.Tensor, depths: torch.Tensor,
                       parents: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Tree distillation's q: the drafter's next-slot log-probabilities at m tree nodes, exactly as the
        decoder's tree scores their children. hidden [B, H] the block's final states (grad flows into the
        variant's head only: the caller detaches them), lm_head the target's frozen head, tokens, depths
        [m] (the root first: the bonus token, depth 0), parents [m] each node's parent among these m (-1:
        the root; parents come before children) -> (support [m, S] long, the tokens q spans, or None:
        the whole vocabulary; logq [m, S] float32). DFlash: the marginal softmax(lm_head(h_{d+1}))."""
        return None, torch.log_softmax(lm_head(hidden[depths + 1]).float(), dim=-1)

    def side_optimizer(self, drafter, cfg, engine: str, embed_weight: torch.Tensor, schedule):
        """A parameter of the variant's own trained beside the drafter's AdamW (drafter unwrapped, cfg the
        RunConfig, engine as training/engines.py names it, embed_weight the target's input embedding
        [V, H], schedule the drafter's lr factor per step) -> an object with step() (called after each
        optimizer step, before the gradients are cleared), state_dict() and load_state_dict() (saved in
        the trainer state for resume); None: none."""
        return None

    # --- validation ---------------------------------------------------------------------------------

    def cpu_tree_scorer(self, model):
        """Validation's path-conditioned trees: (block hidden [B, H], bonus, before) -> scorer over a CPU
        float32 copy of the variant's head (every process calls it: FSDP gathers; base.cpu_copy); None: the
        marginal tree."""
        return None

    def validation_count_size(self, model, cfg) -> int:
        """The length of the summable counts validation_counts gives per validation chunk (0: none)."""
        return 0

    def validation_counts(self, o, m: dict) -> torch.Tensor:
        """This variant's summable float64 counts [validation_count_size] of one validation chunk: o the
        anchored blocks (training.blocks.BlockOutputs), m the loss's metrics (teacher-forced)."""
        return torch.zeros(0, dtype=torch.float64)

    def validation_entries(self, counts: torch.Tensor, cfg) -> dict:
        """The counts summed over the validation set and processes -> this variant's entries of validate()'s
        result."""
        return {}

    def validation_record(self, val: dict) -> dict:
        """validate()'s result -> this variant's val_* keys of a metrics record."""
        return {}

    # --- recipes ------------------------------------------------------------------------------------

    @property
    def recipe_fields(self) -> tuple[str, ...]:
        """DrafterConfig fields of this variant that the recipe's model section names alike; model.init_from
        refuses a drafter whose fields differ from the recipe's."""
        if self.model_keys is None or self.drafter_keys is None:
            return ()
        return tuple(k for k in self.model_keys.model_fields if k in self.drafter_keys.model_fields)

    def check_recipe(self, cfg) -> None:
        """What this variant refuses of a whole recipe (RunConfig; raises ValueError, one line). DFlash has
        none of the heads that model.markov_w1_embed and tree_distill train."""
        self.refuse_markov_w1_embed(cfg)
        self.refuse_tree_distill(cfg)

    def refuse_markov_w1_embed(self, cfg) -> None:
        """model.markov_w1_embed without DSpark's Markov W1 (any variant but DSpark with markov_rank > 0)."""
        m = cfg.model
        if m.markov_w1_embed:
            raise ValueError("model.markov_w1_embed trains DSpark's Markov W1 (model.variant=dspark with "
                             f"markov_rank > 0); model.variant={m.variant} with markov_rank {m.markov_rank} "
                             "has none")

    def refuse_tree_distill(self, cfg) -> None:
        """tree_distill without a path-conditioned head it trains (training/tree_distill.py)."""
        if cfg.tree_distill.weight > 0:
            raise ValueError("tree_distill trains a conditional head (model.variant=dspark with markov_rank "
                             f"> 0, or dflash2); model.variant={cfg.model.variant} has none")

    def drafter_fields(self, m, tc) -> dict:
        """This variant's part of a DrafterConfig from the recipe's model section `m`, checked against
        the target's config `tc` before anything is allocated ({}: DrafterConfig's defaults)."""
        return {}

    # --- checkpoints --------------------------------------------------------------------------------

    def check(self, fields) -> None:
        """What this variant needs of a drafter config.json's fields (raises ValueError)."""

    def check_speculators(self, config) -> None:
        """What this variant needs of a Speculators config.json's fields (formats.SpeculatorsFile; raises
        ValueError)."""

    def from_speculators(self, config: dict) -> dict:
        """This variant's DrafterConfig fields from a Speculators config.json. dflash-train drafts B-1
        tokens after the bonus token (slot 0), so only sample_from_anchor false is read."""
        if config.get("sample_from_anchor"):
            raise UserError("Speculators config has sample_from_anchor true: dflash-train reads only "
                            "false (the bonus token at block slot 0, B-1 drafted tokens)")
        return {}

    def speculators_fields(self, cfg) -> dict:
        """This variant's fields of its Speculators config (speculators' names), from a DrafterConfig."""
        return {}

    def speculators_config_class(self):
        """speculators' config class for this variant (imported when asked: speculators is heavy)."""
        from speculators.models.dflash import DFlashSpeculatorConfig
        return DFlashSpeculatorConfig

    # --- the model card (the defaults are plain DFlash's text) ---------------------------------------

    def card_algorithm(self, cfg) -> str:
        """The card's one-line account of the drafting."""
        return f"DFlash: one non-causal forward predicts a block `[bonus token, MASK x {cfg.block_size - 1}]`"

    def card_vllm(self, fmt: str, cfg, pin: dict, serve_ref: str) -> str | None:
        """The commands that serve (or, with none released, run) the export; None: the export format's
        own DFlash commands (export/card.py, which knows the formats)."""
        return None

    def card_limitations(self, cfg) -> str:
        """Limitation lines ("\n- ...") beyond the template's."""
        return ""

    def card_training(self, m: dict, loss: dict) -> str | None:
        """The end of the training sentence (recipe sections model `m` and loss), for its extra terms;
        None: "." (no extra terms)."""
        return None

    def card_training_notes(self, m: dict) -> list[str]:
        """Lines on how the recipe (model section `m`) trained the variant's heads, after the tree
        distillation's line and before the checkpoint choice's."""
        return []

    # --- evaluation ---------------------------------------------------------------------------------

    def cost_key(self, cfg) -> str | None:
        """Which of benchmarks/gpu_costs.py's scored tree builds and chain walks this drafter decodes
        with; None: the plain tree and the argmax chain."""
        return None
