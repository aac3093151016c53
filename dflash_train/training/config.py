"""The recipe schema: typed, strict, one YAML file plus dotted `key=value` overrides.

    accelerate launch dflash_train/train.py --recipe recipes/tiny.yaml train.lr=1e-3 max_steps=50

Unknown keys, wrong types and out-of-range values stop with one line naming the key.
Each YAML in recipes/ maps onto these classes key for key.
"""

from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dflash_train.core.errors import UserError
from dflash_train.core.paths import display_path, resolve_input
from dflash_train.core.seeds import SEED_LIMIT
from dflash_train.model.variants import VARIANTS, VariantName, variant_bases

DEFAULT_RECIPE = "recipes/tiny.yaml"  # like every relative input: from the current folder, else the checkout
# Keys that were replaced: an old recipe stops with one line naming the new key.
REPLACED_KEYS = {
    "loss.ce_weight": "loss.terms (ce_weight: 1.0, kl_weight: 0.5 -> terms: {ce: 1.0, kl: 0.5})",
    "loss.kl_weight": "loss.terms (ce_weight: 1.0, kl_weight: 0.5 -> terms: {ce: 1.0, kl: 0.5})",
}


# The largest tree budget a recipe may name (validation's DDTree trees, tree distillation's trees): a
# tree's scores and masks grow with budget x block x vocabulary, and tree_distill.budget=100000 asked
# the allocator for 40 GB. 4096 is 16x the largest budget our benchmarks deploy (256). docs/training.md.
MAX_TREE_BUDGET = 4096


class Section(BaseModel):
    # extra="forbid": a misspelt key is an error, never silently ignored; allow_inf_nan=False:
    # .inf and .nan are refused (loss.terms.ce=.inf trained an all-NaN drafter).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ModelKeys(Section):
    """The model section's keys every variant reads; ModelConfig adds each variant's own."""
    target: str = "data/tiny-target"  # local folder or Hub id of the frozen target
    target_revision: str | None = None  # Hub revision (branch, tag or commit) of the target
    trust_remote_code: bool = False  # only for targets that need custom code
    num_layers: int = Field(2, ge=1)  # drafter decoder layers
    block_size: int = Field(8, ge=2)  # B: the bonus token plus B-1 drafted tokens
    # Tapped target decoder layers (z-lab convention, read as hidden_states[k+1]);
    # null = DFlash's default rule, one tap per drafter layer spread over layers 1..N-3.
    target_layer_ids: list[int] | None = None
    mask_token: str = "<|MASK|>"  # must be a single token of the target's tokenizer...
    # ...or an embedding row given by id, for targets whose tokenizer has no mask token: Qwen3
    # has 151669 tokens but 151936 embedding rows, and DFlash uses row 151669 as its mask.
    mask_token_id: int | None = Field(None, ge=0)
    # In-block attention: bidirectional (DFlash) or causal (JetSpec-style: slot i sees slots <= i).
    block_attention: Literal["bidirectional", "causal"] = "bidirectional"
    # Start drafter layer i from target decoder layer N-L+i (its top L layers: attention, MLP and
    # norms; the target's final norm for the drafter's): same width, so the fused context and the
    # block start where the target's own last layers work. q_norm / k_norm start at 1 for a
    # Llama target, which has none. fc and hidden_norm start fresh either way.
    init_layers_from_target: bool = False
    # Start from an existing drafter (ours, Speculators or native DFlash; folder or Hub id).
    # Its shape must agree with the keys above.
    init_from: str | None = None
    # One of model/variants/ (VARIANTS): dflash, or a variant that adds modules to its backbone; each
    # variant's keys (Variant.model_keys, loss_keys) are declared in its file and read by it alone.
    variant: VariantName = "dflash"


class ModelConfig(*variant_bases("model_keys"), ModelKeys):
    # Draft vocabulary (dflash_train/model/vocab.py): the drafter predicts over the N tokens most often
    # supervised in data.train (the stop tokens always among them) through the target's rows of them,
    # frozen; exported as speculators' lm_head / d2t / t2d. null = the target's whole vocabulary.
    # Not DFlash2 (its selector's [V, r] codebook spans the full vocabulary; speculators refuses one);
    # DSpark's W2 and XPress's readout are [N, r] over it.
    draft_vocab_size: int | None = Field(None, ge=2)


class DataConfig(Section):
    train: str = "data/tiny/train.jsonl"  # jsonl with an OpenAI-style `messages` list per line
    val: str = "data/tiny/val.jsonl"
    max_length: int = Field(256, ge=8)  # tokens per conversation (longer ones are truncated)
    num_anchors: int = Field(32, ge=1)  # random anchors (blocks) per sequence per step
    # dflash-cache folder of precomputed target states for data.train (offline mode: no target
    # forward in the training step; validation still runs the target online).
    hidden_state_cache: str | None = None


TermName = Literal["ce", "kl", "rkl", "jsd", "tv", "nla", "lk_hybrid"]


class LossKeys(Section):
    """The loss section's keys every variant reads; LossConfig adds each variant's own."""
    # Per-slot terms and their weights, summed (formulas in dflash_train/model/loss.py; p = target,
    # q = drafter): ce (to ce_labels), kl = KL(p||q), rkl = KL(q||p), jsd, tv = 1 - alpha,
    # nla = -log alpha, lk_hybrid. A term of weight 0 is computed and reported, not trained.
    terms: dict[TermName, Annotated[float, Field(ge=0)]] = {"ce": 1.0}
    ce_labels: Literal["target", "data"] = "target"  # target = the target's greedy tokens
    lk_eta: float = Field(3.0, ge=0)  # lk_hybrid: lam = exp(-lk_eta * alpha)
    # Slot weights: exp = exp(-(k-1)/gamma) (DFlash), dpace = D-PACE from the drafter's own
    # per-slot confidence (speculators' DFlash default), uniform = 1.
    position_weight: Literal["exp", "dpace", "uniform"] = "exp"
    gamma: float = Field(4.0, gt=0)  # exp: block position k weighs exp(-(k-1)/gamma); 7 for B=16
    dpace_alpha: float = Field(0.5, gt=0, le=1)  # dpace: confidence smoothing s = (1-a) exp(-ce) + a
    until_first_failure: bool = False  # AUF: supervise each block only through its first argmax miss
    # Slots per chunk of the full-vocabulary loss (rounded down to whole blocks): bounds its
    # memory to a few [chunk_slots, V] fp32 tensors; 0 = the whole batch at once.
    chunk_slots: int = Field(512, ge=0)


class LossConfig(*variant_bases("loss_keys"), LossKeys):
    @model_validator(mode="after")
    def _some_loss(self):
        if not any(self.terms.values()):
            raise ValueError("loss.terms has no term with a positive weight: nothing to train on")
        return self


class TrainConfig(Section):
    batch_size: int = Field(16, ge=1)  # sequences per process per micro-step
    grad_accum: int = Field(1, ge=1)  # micro-steps per optimizer step
    lr: float = Field(6e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    # AdamW's
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.95)
    warmup_ratio: float = Field(0.04, ge=0, lt=1)  # of max_steps, then cosine to 0
    clip_grad: float = Field(1.0, gt=0)
    precision: Literal["auto", "bf16", "fp32"] = "auto"  # auto = bf16 where the GPU has it, else fp32
    gradient_checkpointing: bool = False  # recompute drafter layers in backward: less memory, more compute
    # Training attention over the anchored blocks: flex = block-sparse flex attention (skips the
    # ~97% hidden tiles at 512 anchors), sdpa = dense boolean mask; auto = flex on CUDA, sdpa on CPU.
    attention: Literal["auto", "sdpa", "flex"] = "auto"


class EvalConfig(Section):
    every: int = Field(0, ge=0)  # validate every N steps (0: only at the end)
    num_anchors: int = Field(64, ge=1)  # anchors per held-out sequence
    max_samples: int | None = Field(None, ge=1)  # cap on held-out conversations
    # Teacher-forced DDTree acceptance at these tree budgets (tree from the drafter's block
    # distributions, walked along the target's tokens), to pick checkpoints per deployed budget.
    ddtree_budgets: list[Annotated[int, Field(ge=0, le=MAX_TREE_BUDGET)]] = [16, 64]
    # blocks scored with trees per validation, per process (CPU heap work)
    ddtree_max_blocks: int = Field(2000, ge=1)
    # The tree budget the drafter is deployed with (one of ddtree_budgets): the run names the saved
    # checkpoint (or final/) with the best held-out DDTree tau there (summary.json "chosen"), and
    # the model card and dflash-eval say which budget it was trained and chosen for. null: the chain.
    deploy_budget: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _deploy_budget_is_validated(self):
        if len(set(self.ddtree_budgets)) != len(self.ddtree_budgets):
            raise ValueError(f"eval.ddtree_budgets {self.ddtree_budgets} names a budget twice")
        if self.deploy_budget is not None and self.deploy_budget not in self.ddtree_budgets:
            raise ValueError(f"eval.deploy_budget {self.deploy_budget} is not among eval.ddtree_budgets "
                             f"{self.ddtree_budgets}: validation must measure it")
        return self


class TreeDistillConfig(Section):
    # Tree distillation (dflash_train/training/tree_distill.py): every `every` steps, the drafter's own
    # tree of `budget` nodes for up to `anchors` blocks of one sequence, labelled by one target
    # forward over them; KL toward the target at every node, weighted by `weight` (0: off).
    weight: float = Field(0.0, ge=0)
    anchors: int = Field(2, ge=1)
    budget: int = Field(16, ge=1, le=MAX_TREE_BUDGET)
    every: int = Field(1, ge=1)


class WandbConfig(Section):
    enabled: bool = False
    project: str = "dflash-train"
    mode: Literal["online", "offline"] = "offline"
    run_name: str | None = None


class RunConfig(Section):
    output_dir: str = "runs/tiny"
    max_steps: int = Field(200, ge=1)  # optimizer steps
    checkpoint_every: int = Field(0, ge=0)  # steps between checkpoints (0: none besides final/)
    seed: int = Field(0, ge=0, lt=SEED_LIMIT)  # as dflash-prepare --seed and dflash-eval --seed
    log_every: int = Field(10, ge=1)  # steps between progress-bar refreshes of the live metrics
    overwrite: bool = False  # replace a non-empty output_dir
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    loss: LossConfig = LossConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    tree_distill: TreeDistillConfig = TreeDistillConfig()
    wandb: WandbConfig = WandbConfig()

    @model_validator(mode="after")
    def _conditional_head_options_have_a_head(self):
        m = self.model
        VARIANTS[m.variant].check_recipe(self)  # model.markov_w1_embed, tree_distill: a head to train
        if self.tree_distill.weight > 0 and m.draft_vocab_size is not None:
            raise ValueError("tree_distill scores nodes over the full vocabulary: it does not run with "
                             "model.draft_vocab_size; set one of them off")
        if m.init_layers_from_target and m.init_from is not None:
            raise ValueError("model.init_layers_from_target and model.init_from both give the drafter's "
                             "layers: choose one")
        if m.draft_vocab_size is not None and not VARIANTS[m.variant].draft_vocab:
            takers = ", ".join(name for name, v in VARIANTS.items() if v.draft_vocab)
            raise ValueError(f"model.draft_vocab_size is for variants {takers}: model.variant={m.variant} "
                             "drafts over the full vocabulary (its selector's codebook spans it); leave "
                             "draft_vocab_size null")
        if self.tree_distill.weight > 0 and self.tree_distill.every > self.max_steps:
            raise ValueError(f"tree_distill.every={self.tree_distill.every} is past "
                             f"max_steps={self.max_steps}: no step would ever distil (lower every, or set "
                             "tree_distill.weight=0)")
        return self


def _format_error(e: ValidationError) -> str:
    err = e.errors()[0]
    key = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        return (f"'{key}' was replaced by {REPLACED_KEYS[key]}" if key in REPLACED_KEYS
                else f"unknown key '{key}'")
    if not key:  # a check across sections (RunConfig's validators): the whole recipe is no help
        return err["msg"].removeprefix("Value error, ")
    return f"'{key}': {err['msg']} (got {err['input']!r})"


def _has_glued_key(value) -> bool:
    """Did a flow mapping lose its values? YAML reads `{tv:1.0}` as the key 'tv:1.0' with no value."""
    if isinstance(value, dict):
        return any((isinstance(k, str) and ":" in k and v is None) or _has_glued_key(v)
                   for k, v in value.items())
    return isinstance(value, list) and any(_has_glued_key(v) for v in value)


def _space_colons(raw: str) -> str:
    """`{tv:1.0,kl:0.5}` (Hydra's spelling) -> `{tv: 1.0,kl: 0.5}` (YAML's): a space after each
    colon outside quotes."""
    out, quote = [], None
    for i, ch in enumerate(raw):
        out.append(ch)
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == ":" and i + 1 < len(raw) and not raw[i + 1].isspace():
            out.append(" ")
    return "".join(out)


def parse_value(raw: str):
    """An override's value as YAML (3 -> int, [1, 2] -> list, {ce: 1.0} -> dict), also in Hydra's
    spelling without spaces ({ce:1.0,kl:0.5}); not YAML -> the string itself."""
    if raw == "":
        return None
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw
    if _has_glued_key(value):
        try:
            return yaml.safe_load(_space_colons(raw))
        except yaml.YAMLError:
            pass
    return value


def apply_override(tree: dict, override: str) -> None:
    """Set `a.b.c=value` in a nested dict; the value is parsed by parse_value."""
    key, sep, raw = override.partition("=")
    if not sep or not key:
        raise UserError(f"override '{override}' is not of the form key=value (e.g. train.lr=1e-4)")
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise UserError(f"override '{override}': '{part}' is not a section")
    node[parts[-1]] = parse_value(raw)


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load keeps the last of two equal keys (`loss:` twice dropped the first section): refuse."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None,
                                                        f"key '{key}' appears twice in one mapping",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_recipe(path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    path = Path(path or DEFAULT_RECIPE)
    file = Path(resolve_input(str(path)))
    if file.is_dir():
        raise UserError(f"recipe '{path}' is a folder: give a recipe .yaml file (recipes/*.yaml)")
    if not file.is_file():
        raise UserError(f"recipe '{path}' not found")
    try:
        tree = yaml.load(file.read_text(encoding="utf-8"), Loader=UniqueKeyLoader) or {}
    except UnicodeDecodeError:
        raise UserError(f"recipe '{path}' is not UTF-8 text (a binary file?)") from None
    except yaml.YAMLError as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        what = next((line for line in lines if "appears twice" in line),
                    lines[0] if lines else type(e).__name__)
        raise UserError(f"recipe '{path}' is not valid YAML: {what}") from e
    if not isinstance(tree, dict):
        raise UserError(f"recipe '{path}' must be a mapping of keys to values")
    for override in overrides:
        apply_override(tree, override)
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as e:
        raise UserError(f"recipe '{path}': {_format_error(e)}") from e


# Recipe keys naming inputs: compared as resolved paths on resume, so data/x and ./data/x/ are the same
# input, and written relative to the checkout where they lie inside it.
PATH_KEYS = {"model.target", "model.init_from", "data.train", "data.val", "data.hidden_state_cache"}


def with_paths(recipe: dict, show) -> dict:
    """The recipe with each path (PATH_KEYS and output_dir) replaced by show(path)."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in recipe.items()}
    for key in (*PATH_KEYS, "output_dir"):
        *section, name = key.split(".")
        tree = out[section[0]] if section else out
        if isinstance(tree, dict) and isinstance(tree.get(name), str):
            tree[name] = show(tree[name])
    return out


def dump_recipe(cfg: RunConfig) -> str:
    """The recipe saved with a run: inputs inside the checkout relative to it (any clone resolves them
    the same way); others absolute, as the run on this machine resumes from them."""
    return yaml.safe_dump(with_paths(cfg.model_dump(mode="json"),
                                     lambda p: display_path(p, keep_outside=True)),
                          sort_keys=False)
