"""Writing an export: the verifier checked against the drafter, eval reports matched to it, the
folder (config.json in the chosen format, weights, card, recipe, reports), and the Hub push."""

import json
from pathlib import Path

import torch
import yaml
from huggingface_hub import HfApi
from safetensors.torch import save_file
from transformers import AutoConfig, AutoTokenizer

from dflash_train.checkpoint.folders import drafter_fingerprint, mask_token_text, size_mismatch
from dflash_train.checkpoint.formats import SPECULATORS, native_config, speculators_config
from dflash_train.core.errors import UserError
from dflash_train.core.outputs import MARKER
from dflash_train.core.paths import display_path
from dflash_train.evaluation.report import read_report
from dflash_train.model.target import LOAD_ERRORS, check_tap_layers, first_line, model_identity
from dflash_train.training.config import with_paths


# --- the verifier: check it against the drafter ------------------------------------------------

def load_verifier(source: str, revision: str | None, trust_remote_code: bool):
    """config and tokenizer of the verifier (a local folder's absolute path or a Hub id)."""
    try:
        config = AutoConfig.from_pretrained(source, revision=revision, trust_remote_code=trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(source, revision=revision,
                                                  trust_remote_code=trust_remote_code)
    except LOAD_ERRORS as e:
        raise UserError(f"cannot load verifier '{source}': {first_line(e)}") from e
    return config, tokenizer


def check_verifier(cfg, mask_token: str | None, vconfig, vtokenizer, verifier: str) -> str:
    """The drafter must fit the verifier exactly. Returns the mask token's text."""
    differs = size_mismatch([("hidden size", cfg.hidden_size, vconfig.hidden_size),
                             ("vocabulary size", cfg.vocab_size, vconfig.vocab_size),
                             ("layer count", cfg.num_target_layers, vconfig.num_hidden_layers)])
    if differs:
        name, mine, theirs = differs
        raise UserError(f"verifier '{verifier}' does not match the drafter: {name} {theirs} vs drafter "
                        f"{mine}")
    try:
        check_tap_layers(cfg.target_layer_ids, vconfig.num_hidden_layers)
    except UserError as e:
        raise UserError(f"verifier '{verifier}' does not match the drafter: {e}") from None
    token = mask_token_text(vtokenizer, cfg.mask_token_id)
    if mask_token is not None and token != mask_token:  # trained with a named token: it must be there
        raise UserError(f"verifier '{verifier}' has no mask token {mask_token} at id {cfg.mask_token_id} "
                        f"(found {token!r})")
    return token or f"(embedding row {cfg.mask_token_id}, no token text)"


# --- eval reports: read, and matched to the drafter -------------------------------------------

def read_reports(paths: list[str]) -> list[dict]:
    return [{**read_report(p), "_path": str(p)} for p in paths]


def round_to_bf16(drafter) -> str:
    """Round every floating tensor of the drafter (parameters and buffers, as write_export casts them)
    to bf16 values, in place: the drafter a bf16 export holds. -> the fingerprint before rounding."""
    before = drafter_fingerprint(drafter)
    with torch.no_grad():
        for t in drafter.state_dict().values():
            if t.is_floating_point():
                t.copy_(t.bfloat16())
    return before


def check_reports(reports: list[dict], drafter, verifier: str, revision: str | None,
                  unrounded: str | None = None) -> None:
    """A report goes into the card only if it measured this very drafter (its tensors' fingerprint, as
    exported: with --dtype bf16 the rounded weights; `unrounded` is the fingerprint before rounding),
    at its block size, against this verifier."""
    fingerprint, B = drafter_fingerprint(drafter), drafter.config.block_size
    mine = model_identity(verifier, revision)
    for rep in reports:
        where = f"eval report '{rep['_path']}'"
        if not rep.get("drafter_fingerprint"):
            raise UserError(f"{where} has no drafter_fingerprint (written by an older dflash-eval), so it "
                            "cannot be matched to this checkpoint: evaluate the checkpoint again")
        if unrounded not in (None, fingerprint) and rep["drafter_fingerprint"] == unrounded:
            raise UserError(f"{where} measured the drafter's fp32 weights, and this export "
                            "holds them rounded to bf16 (--dtype bf16): export without the report, "
                            "evaluate the export and export again with that report, or "
                            "export with --dtype fp32")
        if rep["drafter_fingerprint"] != fingerprint:
            raise UserError(f"{where} measured another drafter (fingerprint "
                            f"{rep['drafter_fingerprint'][:12]}, this checkpoint's is {fingerprint[:12]})")
        if rep.get("block_size") != B:
            raise UserError(f"{where} was measured at block size {rep.get('block_size')}, this checkpoint "
                            f"has {B}")
        theirs = model_identity(str(rep.get("target")), rep.get("target_revision"))
        if theirs[0] != mine[0] or (None not in (theirs[1], mine[1]) and theirs[1] != mine[1]):
            raise UserError(f"{where} was measured against target '{rep.get('target')}'"
                            f"{' @ ' + theirs[1] if theirs[1] else ''}, not the verifier '{verifier}'"
                            f"{' @ ' + mine[1] if mine[1] else ''}: evaluate against the verifier")


# --- what travels: no machine's paths ---------------------------------------------------------

def portable_recipe(text: str) -> str:
    """A run's recipe as the export carries it: every path relative to the checkout or `<local>/NAME`."""
    recipe = yaml.safe_load(text)
    if not isinstance(recipe, dict):
        return text
    return yaml.safe_dump(with_paths(recipe, display_path), sort_keys=False)


def portable_report(rep: dict, verifier: str) -> dict:
    """An eval report as the export carries it: the target named as the export names its verifier
    (check_reports matched every report to it), the drafter and the command's paths made portable."""
    out = dict(rep, target=verifier, drafter=display_path(rep.get("drafter")))
    if isinstance(rep.get("command"), str):
        out["command"] = " ".join(display_path(w) for w in rep["command"].split(" "))
    return out


# --- writing -----------------------------------------------------------------------------------

def write_export(tmp: Path, fmt: str, drafter, cfg, pin, vconfig, mask_token, card, recipe_text, reports,
                 dtype: str = "fp32") -> None:
    cast = torch.bfloat16 if dtype == "bf16" else torch.float32
    state = {k: (v.to(cast) if v.is_floating_point() else v).detach().cpu().contiguous()
             for k, v in drafter.state_dict().items()}
    if fmt == SPECULATORS:
        # Same names as speculators saves DFlash: no embed_tokens or verifier_* tensors, and lm_head /
        # d2t / t2d only for a draft vocabulary (its own frozen head).
        speculators_config(cfg, pin["name_or_path"], list(vconfig.architectures or []), pin,
                           mask_token).save_pretrained(str(tmp))
    else:
        (tmp / "config.json").write_text(json.dumps(native_config(cfg, pin, mask_token), indent=2) + "\n")
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    card.save(tmp / "README.md")
    if recipe_text is not None:
        (tmp / "training_recipe.yaml").write_text(recipe_text)
    if reports:
        (tmp / "eval_reports").mkdir()
        for i, rep in enumerate(reports):
            clean = {k: v for k, v in rep.items() if k != "_path"}
            (tmp / "eval_reports" / f"report_{i}.json").write_text(json.dumps(clean, indent=2) + "\n")


def push(out: Path, repo: str, private: bool, dry_run: bool) -> None:
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != MARKER)
    if dry_run:
        print(f"dry run: would create {'private' if private else 'public'} model repo '{repo}' and upload "
              f"{len(files)} files:")
        for p in files:
            print(f"  {p.relative_to(out)}  ({p.stat().st_size:,} bytes)")
        return
    api = HfApi()  # token from HF_TOKEN or the cached login; never printed
    try:
        api.create_repo(repo, private=private, exist_ok=True, repo_type="model")
        info = api.upload_folder(folder_path=str(out), repo_id=repo, repo_type="model",
                                 ignore_patterns=[MARKER],
                                 commit_message="Upload DFlash drafter (dflash-export)")
    except Exception as e:  # auth, network, permissions: one line, no token
        raise UserError(f"push to '{repo}' failed: {type(e).__name__}: "
                        f"{str(e).strip().splitlines()[0][:200]}") from e
    print(f"pushed to https://huggingface.co/{repo} ({info.oid if hasattr(info, 'oid') else 'done'})")
