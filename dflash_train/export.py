"""`dflash-export`: write a drafter as a Speculators or native DFlash checkpoint with a model card.

    dflash-export --format speculators --checkpoint runs/demo/final --output export/out/spec \\
        --eval-report runs/demo/eval/report.json
    dflash-export --format dflash --checkpoint D --output O --verifier Qwen/Qwen3-8B --verifier-revision SHA
    dflash-export ... --push-to-hub me/qwen3-8b-dflash [--private] [--dry-run]

--checkpoint takes any drafter folder (ours, Speculators, native DFlash) or Hub id. The verifier
is pinned (Hub commit from the local Hub cache, --verifier-revision, or for a plain local folder
the SHA-256 of its weights, remembered per file size and mtime: target.weights_sha256), checked
against the drafter, and named in config.json and the card. Every input file is checked against
its schema (drafter config.json: formats.py; eval reports: report.EvalReport) before the verifier
is read, and --license must be one of the Hub's license ids (the card's front matter stays valid).
"""

import json
import re
import sys
from pathlib import Path

import yaml
from huggingface_hub import HfApi, ModelCard, ModelCardData
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from safetensors.torch import save_file
from transformers import AutoConfig, AutoTokenizer

from dflash_train.checkpoint import (count_parameters, drafter_fingerprint, load_drafter, mask_token_text, recipe_trained_for,
                                     resolve_folder)
from dflash_train.dspark import TREE_CANDIDATES
from dflash_train.errors import OneLineArgumentParser, UserError, cli_guard
from dflash_train.formats import NATIVE, SPECULATORS, native_config, speculators_config
from dflash_train.outputs import MARKER, model_source, require_free_output, write_atomically
from dflash_train.report import plural, read_report
from dflash_train.speed import verdict_text
from dflash_train.target import LOAD_ERRORS, check_tap_layers, first_line, model_identity, resolve_pin

TEMPLATE = Path(__file__).resolve().parents[1] / "export" / "model_card_template.md"
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
# The Hub's license identifiers, from https://huggingface.co/docs/hub/repositories-licenses
# (huggingface/hub-docs docs/hub/repositories-licenses.md; huggingface_hub ships no list). With
# `other`, name the license in the repository's LICENSE file.
HUB_LICENSES = (
    "apache-2.0 mit openrail bigscience-openrail-m creativeml-openrail-m bigscience-bloom-rail-1.0 bigcode-openrail-m "
    "afl-3.0 artistic-2.0 bsl-1.0 bsd bsd-2-clause bsd-3-clause bsd-3-clause-clear c-uda cc cc0-1.0 cc-by-2.0 "
    "cc-by-2.5 cc-by-3.0 cc-by-4.0 cc-by-sa-3.0 cc-by-sa-4.0 cc-by-nc-2.0 cc-by-nc-3.0 cc-by-nc-4.0 cc-by-nd-4.0 "
    "cc-by-nc-nd-3.0 cc-by-nc-nd-4.0 cc-by-nc-sa-2.0 cc-by-nc-sa-3.0 cc-by-nc-sa-4.0 cdla-sharing-1.0 "
    "cdla-permissive-1.0 cdla-permissive-2.0 wtfpl ecl-2.0 epl-1.0 epl-2.0 etalab-2.0 eupl-1.1 agpl-3.0 gfdl gpl "
    "gpl-2.0 gpl-3.0 lgpl lgpl-2.1 lgpl-3.0 isc lppl-1.3c ms-pl mpl-2.0 odc-by odbl openrail++ osl-3.0 postgresql "
    "ofl-1.1 ncsa unlicense zlib pddl lgpl-lr deepfloyd-if-license llama2 llama3 llama3.1 llama3.2 llama3.3 gemma "
    "unknown other").split()


# --- the verifier: check and pin ---------------------------------------------------------------

def load_verifier(source: str, revision: str | None, trust_remote_code: bool):
    """config and tokenizer of the verifier (a local folder's absolute path or a Hub id)."""
    try:
        config = AutoConfig.from_pretrained(source, revision=revision, trust_remote_code=trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(source, revision=revision, trust_remote_code=trust_remote_code)
    except LOAD_ERRORS as e:
        raise UserError(f"cannot load verifier '{source}': {first_line(e)}") from e
    return config, tokenizer


def check_verifier(cfg, mask_token: str | None, vconfig, vtokenizer, verifier: str) -> str:
    """The drafter must fit the verifier exactly. Returns the mask token's text."""
    for name, mine, theirs in [("hidden size", cfg.hidden_size, vconfig.hidden_size),
                               ("vocabulary size", cfg.vocab_size, vconfig.vocab_size),
                               ("layer count", cfg.num_target_layers, vconfig.num_hidden_layers)]:
        if mine is not None and mine != theirs:
            raise UserError(f"verifier '{verifier}' does not match the drafter: {name} {theirs} vs drafter {mine}")
    try:
        check_tap_layers(cfg.target_layer_ids, vconfig.num_hidden_layers)
    except UserError as e:
        raise UserError(f"verifier '{verifier}' does not match the drafter: {e}") from None
    token = mask_token_text(vtokenizer, cfg.mask_token_id)
    if mask_token is not None and token != mask_token:  # trained with a named token: it must be there
        raise UserError(f"verifier '{verifier}' has no mask token {mask_token} at id {cfg.mask_token_id} "
                        f"(found {token!r})")
    return token or f"(embedding row {cfg.mask_token_id}, no token text)"


def pin_text(pin: dict) -> str:
    if pin["kind"] == "revision":
        return f"revision `{pin['revision']}` (given with `--verifier-revision`)"
    if pin["kind"] == "hub_snapshot":
        return f"Hub commit `{pin['revision']}` (the snapshot in the local Hub cache)"
    return (f"no Hub revision (a local folder); pinned by the SHA-256 of its weights "
            f"({', '.join(pin['files'])}): `{pin['sha256']}`")


# --- eval reports -> card sections -------------------------------------------------------------

def read_reports(paths: list[str]) -> list[dict]:
    return [{**read_report(p), "_path": str(p)} for p in paths]


def check_reports(reports: list[dict], drafter, verifier: str, revision: str | None) -> None:
    """A report goes into the card only if it measured this very drafter (its tensors' fingerprint),
    at its block size, against this verifier."""
    fingerprint, B = drafter_fingerprint(drafter), drafter.config.block_size
    mine = model_identity(verifier, revision)
    for rep in reports:
        where = f"eval report '{rep['_path']}'"
        if not rep.get("drafter_fingerprint"):
            raise UserError(f"{where} has no drafter_fingerprint (written by an older dflash-eval), so it cannot be "
                            "matched to this checkpoint: evaluate the checkpoint again")
        if rep["drafter_fingerprint"] != fingerprint:
            raise UserError(f"{where} measured another drafter (fingerprint {rep['drafter_fingerprint'][:12]}, this "
                            f"checkpoint's is {fingerprint[:12]})")
        if rep.get("block_size") != B:
            raise UserError(f"{where} was measured at block size {rep.get('block_size')}, this checkpoint has {B}")
        theirs = model_identity(str(rep.get("target")), rep.get("target_revision"))
        if theirs[0] != mine[0] or (None not in (theirs[1], mine[1]) and theirs[1] != mine[1]):
            raise UserError(f"{where} was measured against target '{rep.get('target')}'"
                            f"{' @ ' + theirs[1] if theirs[1] else ''}, not the verifier '{verifier}'"
                            f"{' @ ' + mine[1] if mine[1] else ''}: evaluate against the verifier")


def _speedup_cell(r: dict) -> str:
    if r["speedup"] is None:
        return "n/a"
    iv = r["speedup_interval"]
    return f"{r['speedup']:.2f}x" + (f" ({iv[0]:.2f}-{iv[1]:.2f})" if iv and iv[0] != iv[1] else "")


def acceptance_section(reports: list[dict]) -> str:
    if not reports:
        return "No acceptance was measured for this export (no `--eval-report` was given)."
    out = []
    for rep in reports:
        for suite in dict.fromkeys(r["suite"] for r in rep["results"]):
            rows = [r for r in rep["results"] if r["suite"] == suite]
            r0 = rows[0]
            out += [f"**{suite}** ({plural(r0['prompts'], 'prompt')}, temperature {r0['temperature']}, "
                    f"max {r0['max_new_tokens']} new tokens per turn; target `{rep['target']}`; "
                    f"{rep['hardware']['device']}):", "",
                    "| method | budget | tau (tokens per target forward) | lossless | speedup vs plain decoding "
                    "(90% interval) |", "|---|---:|---:|---|---:|"]
            for r in rows:
                lossless = {True: "yes", False: "NO", None: "n/a"}[r["lossless"]]
                out.append(f"| {r['method']} | {r['budget']} | {r['tau']} | {lossless} | {_speedup_cell(r)} |")
            out.append("")
    out.append("tau counts the bonus token; `dflash` is the DFlash chain, `ddtree` a draft tree of "
               "`budget` nodes verified in one forward, `ar` plain decoding. Speedup: the median over prompts of "
               "plain decoding's time per token / the method's on the same prompt, all methods run back to back "
               "per prompt on the hardware named; the interval is a 90% bootstrap over prompts and repeats. "
               "Values are copied from the eval reports (`eval_reports/` in this repository).")
    return "\n".join(out)


def validated_on_section(reports: list[dict]) -> str:
    if not reports:
        return "Not validated: no eval report was given. Not validated on a GPU."
    seen = {}
    for rep in reports:
        hw = rep["hardware"]
        line = f"- {hw['device']} ({hw['device_type']}), torch {hw['torch']}"
        if hw.get("cuda"):
            line += f", CUDA {hw['cuda']}, driver {hw.get('driver')}"
        seen.setdefault(line, hw["device_type"])
    text = "\n".join(seen)
    if "cuda" not in seen.values():
        text += "\n\nNot validated on a GPU."
    return text


def budget_section(reports: list[dict]) -> str:
    lines = []
    for rep in reports:
        hw = rep["hardware"]["device"]
        for suite, adv in rep["advice"].items():
            lines.append(f"- {suite}, measured on {hw}, one request at a time: {verdict_text(adv['measured'])}")
            for c, v in adv["concurrency"].items():
                if int(c) > 1:
                    lines.append(f"- {suite} on {hw}, {c} concurrent requests (predicted from the verify cost "
                                 f"measured at each width): {verdict_text(v)}")
            if "device" in adv:
                for c, v in adv["device"]["concurrency"].items():
                    lines.append(f"- {suite} on {adv['device']['name']}, {c} request{'s' * (int(c) > 1)} (predicted "
                                 f"from that device's measured costs): {verdict_text(v)}")
    if not lines:
        return "No recommended tree budget (no eval report was given)."
    return ("Which method to run (dflash-eval's advice; a budget is named only when it beats every other method by "
            "more than the measured spread, otherwise the methods that cannot be told apart are listed):\n\n"
            + "\n".join(lines))


def run_choice(folder: Path) -> dict | None:
    """The training run's checkpoint choice (summary.json "chosen", train.choose_checkpoint) for a
    drafter folder inside a run (final/ or checkpoints/step_N/), with "this": whether it is this
    folder; None elsewhere."""
    for run in (folder.parent, folder.parent.parent):
        summary = run / "summary.json"
        if summary.is_file():
            chosen = json.loads(summary.read_text()).get("chosen")
            if chosen:
                return chosen | {"this": (run / chosen["folder"]).resolve() == folder.resolve()}
    return None


def choice_text(r: dict, choice: dict | None) -> str:
    """The budget the drafter was trained and chosen for, and its tree distillation, for the card."""
    lines, trained = [], recipe_trained_for(r)
    td, budget = trained["tree_distill"], trained["deploy_budget"]
    if td:
        lines.append(f"Trained for its tree: every {td['every']} step(s), {td['anchors']} blocks' own {td['budget']}-node "
                     f"trees were labelled by one verifier forward (ancestor-only mask) and the conditional head's "
                     f"scores at every node pulled toward the verifier's (KL, weight {td['weight']}).")
    if (r.get("model") or {}).get("markov_w1_embed"):
        lines.append("The Markov head's W1 was trained as a table plus the verifier's input embedding times a learned "
                     "[H, r] map, folded into the table every step (model.markov_w1_embed), so tokens seldom seen "
                     "before a slot (a tree's siblings) have trained rows; it is served as the plain table.")
    if choice is not None:
        what = f"DDTree budget **{choice['budget']}**" if choice["budget"] else "the chain"
        scores = ", ".join(f"step {s}: {v:.2f}" for s, v in choice["validated"].items())
        lines.append(f"Chosen for {what} by held-out teacher-forced "
                     f"{'tree tau' if choice['budget'] else 'chain EAL'} ({scores}): "
                     + ("this is the best of the validated drafters." if choice["this"] else
                        f"this checkpoint is not the best; step {choice['step']} (`{choice['folder']}`) is."))
    elif budget:
        lines.append(f"Trained for DDTree budget **{budget}** (eval.deploy_budget).")
    return "\n".join(lines)


def training_section(recipe_text: str | None, fmt: str, choice: dict | None = None) -> str:
    if recipe_text is None:
        return f"Training recipe not recorded (this drafter was imported from a {fmt} checkpoint)."
    r = yaml.safe_load(recipe_text)
    m, d, t, loss, chosen = r["model"], r["data"], r["train"], r["loss"], choice_text(r, choice)
    return "\n".join([
        f"Trained with dflash-train against `{m['target']}` for **{r['max_steps']} steps** "
        f"(batch {t['batch_size']} x {t['grad_accum']} accumulation, AdamW lr {t['lr']}, cosine with "
        f"{t['warmup_ratio']} warmup, clip {t['clip_grad']}), {d['num_anchors']} anchors per sequence, "
        f"loss {' + '.join(f'{w} {n}' for n, w in loss['terms'].items())} with {loss['position_weight']} slot weights"
        f"{' and accept-until-fail' if loss['until_first_failure'] else ''}"
        + (f", plus the confidence head's BCE (weight {loss['confidence_weight']})."
           if m.get("variant") == "dspark" and m.get("confidence_head") else "")
        + (f", plus the candidate selector's K-way CE (weight {loss['selector_weight']})."
           if m.get("variant") == "dflash2" else "."),
        f"Data: `{d['train']}` (validation `{d['val']}`), up to {d['max_length']} tokens per conversation.",
        *(["", chosen] if chosen else []),
        "", "<details><summary>Full recipe (training_recipe.yaml)</summary>", "", "```yaml", recipe_text.strip(),
        "```", "", "</details>"])


def model_card(fmt: str, cfg, pin: dict, verifier: str, mask_token: str, params: int, recipe_text: str | None,
               reports: list[dict], source_format: str, serve_ref: str, license_id: str,
               choice: dict | None = None) -> ModelCard:
    hub_verifier = pin["name_or_path"] if HUB_ID.match(pin["name_or_path"] or "") and not Path(
        pin["name_or_path"]).exists() else None
    datasets = []
    if recipe_text:
        d = yaml.safe_load(recipe_text)["data"]
        datasets = [p for p in (d["train"], d["val"]) if HUB_ID.match(p) and not Path(p).exists()]
    dspark, dflash2 = cfg.variant == "dspark", cfg.variant == "dflash2"
    name = {"dflash": "DFlash", "dspark": "DSpark", "dflash2": "DFlash2"}[cfg.variant]
    card_data = ModelCardData(base_model=hub_verifier, library_name="speculators" if fmt == SPECULATORS else "vllm",
                              tags=["speculators", "speculative-decoding", "dflash", "ddtree"]
                              + [cfg.variant] * (dspark or dflash2),
                              license=license_id, datasets=datasets or None, pipeline_tag="text-generation")
    algorithm_text = f"DFlash: one non-causal forward predicts a block `[bonus token, MASK x {cfg.block_size - 1}]`"
    if dspark:
        algorithm_text = (f"DSpark: the DFlash block forward, then a {cfg.markov_head_type} Markov logit-bias head "
                          f"(rank {cfg.markov_rank}) conditions each slot on the token drafted before it"
                          + ("; a confidence head predicts each slot's acceptance" if cfg.confidence_head else ""))
    if dflash2:
        algorithm_text = (f"DFlash2: the DFlash block forward with {cfg.conv_kernel_size}-tap dynamic convolutions "
                          f"around every sublayer (within the block), then a rank-{cfg.selector_rank} candidate "
                          f"selector re-ranks each slot's top-{cfg.selector_top_k} tokens given the token before it")
    if fmt == SPECULATORS and dspark:  # vLLM reads `speculators_model_type: dspark` as method dspark
        spec = json.dumps({"method": "dspark", "model": serve_ref, "num_speculative_tokens": cfg.block_size - 1})
        vllm = (f"vllm serve {serve_ref}   # method dspark, read from config.json\n"
                f"vllm serve {pin['name_or_path']} --speculative-config '{spec}'")
    elif fmt == SPECULATORS and dflash2:  # vLLM 0.33 reads `dflash2` as DFlash2DraftModel under method dflash
        vllm = f"vllm serve {serve_ref}   # DFlash2DraftModel, method dflash, read from config.json"
    elif fmt == SPECULATORS:
        vllm = f"vllm serve {serve_ref}"
    else:
        spec = json.dumps({"method": "dflash", "model": serve_ref, "num_speculative_tokens": cfg.block_size - 1})
        vllm = f"vllm serve {pin['name_or_path']} --speculative-config '{spec}'"
    extra = "" if pin["kind"] != "content_sha256" else (
        "- The verifier is a local folder with no Hub revision; publish it or re-export with "
        "`--verifier <hub id> --verifier-revision <commit>` before sharing this drafter.")
    if dspark and cfg.markov_head_type != "vanilla":
        extra += ("\n- vLLM 0.33's DSpark runtime (`Qwen3DSparkModel`) implements the vanilla Markov head only: "
                  f"this `{cfg.markov_head_type}` head's weights are not served there (speculators and dflash-train "
                  "load them).")
    if dspark:
        extra += ("\n- The path-conditioned DDTree (dflash-train's decoder) scores each node's children with the "
                  f"Markov bias on the backbone's top-{TREE_CANDIDATES} tokens per depth; vLLM drafts the DSpark "
                  "chain.")
    if dflash2:
        extra += ("\n- vLLM drafts the chain as its selector walk; the DDTree numbers come from dflash-train's decoder, "
                  "whose tree ranks each node's children by the selector given that node's token.")
    return ModelCard.from_template(
        card_data, template_path=str(TEMPLATE), title=f"{name} drafter for {verifier}",
        algorithm=name, algorithm_text=algorithm_text,
        verifier=verifier,
        verifier_md=f"[`{hub_verifier}`](https://huggingface.co/{hub_verifier})" if hub_verifier else f"`{verifier}`",
        format_name={SPECULATORS: "Speculators", NATIVE: "native DFlash (z-lab)"}[fmt], pin_text=pin_text(pin),
        block_size=cfg.block_size, num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
        taps=cfg.target_layer_ids, aux_ids=[k + 1 for k in cfg.target_layer_ids], mask_token=f"`{mask_token}`",
        mask_token_id=cfg.mask_token_id, params=f"{params:,}", training=training_section(recipe_text, source_format, choice),
        acceptance=acceptance_section(reports), validated_on=validated_on_section(reports),
        vllm_command=vllm, budget_text=budget_section(reports), extra_limitations=extra)


# --- writing -----------------------------------------------------------------------------------

def write_export(tmp: Path, fmt: str, drafter, cfg, pin, vconfig, mask_token, card, recipe_text, reports) -> None:
    state = {k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items()}
    if fmt == SPECULATORS:
        # Same names as speculators saves DFlash: no embed_tokens, lm_head or verifier_* tensors.
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
        info = api.upload_folder(folder_path=str(out), repo_id=repo, repo_type="model", ignore_patterns=[MARKER],
                                 commit_message="Upload DFlash drafter (dflash-export)")
    except Exception as e:  # auth, network, permissions: one line, no token
        raise UserError(f"push to '{repo}' failed: {type(e).__name__}: {str(e).strip().splitlines()[0][:200]}") from e
    print(f"pushed to https://huggingface.co/{repo} ({info.oid if hasattr(info, 'oid') else 'done'})")


def parse_args(argv):
    p = OneLineArgumentParser(prog="dflash-export", description=__doc__.splitlines()[0])
    p.add_argument("--format", required=True, help="speculators or dflash")
    p.add_argument("--checkpoint", required=True, help="drafter folder or Hub id (any supported format)")
    p.add_argument("--output", required=True)
    p.add_argument("--verifier", default=None, help="verifier Hub id or folder (default: the drafter's target)")
    p.add_argument("--verifier-revision", default=None, help="Hub commit/tag of the verifier to pin")
    p.add_argument("--eval-report", action="append", default=[], help="dflash-eval report.json (repeatable)")
    p.add_argument("--license", default="other", help="the Hub's license id for the card (default: other)")
    p.add_argument("--push-to-hub", default=None, metavar="REPO")
    p.add_argument("--private", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="with --push-to-hub: list what would be uploaded")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--trust-remote-code", action="store_true")
    args = p.parse_args(argv)
    if args.format not in (SPECULATORS, NATIVE):
        p.error(f"unknown --format '{args.format}' (choose speculators or dflash)")
    if args.license not in HUB_LICENSES:
        p.error(f"--license {args.license!r:.80} is not a Hub license id (e.g. apache-2.0, mit, llama3.1, other; "
                "list: https://huggingface.co/docs/hub/repositories-licenses)")
    if (args.private or args.dry_run) and not args.push_to_hub:
        p.error("--private and --dry-run go with --push-to-hub")
    if args.push_to_hub:
        try:
            validate_repo_id(args.push_to_hub)
        except HFValidationError as e:
            p.error(f"--push-to-hub '{args.push_to_hub}' is not a Hub repo id: {first_line(e)}")
    return args


@cli_guard
def main(argv=None):
    args = parse_args(argv)
    out = Path(args.output)
    inputs = [("--checkpoint", args.checkpoint), ("--verifier", args.verifier),
              *[("--eval-report", r) for r in args.eval_report]]
    require_free_output(out, args.overwrite, "export", inputs)
    reports = read_reports(args.eval_report)
    drafter, meta = load_drafter(args.checkpoint)
    cfg = drafter.config
    if cfg.variant == "dspark" and args.format == NATIVE:
        raise UserError("the native DFlash format has no Markov or confidence head: export a DSpark drafter with "
                        "--format speculators (served by vLLM as method dspark)")
    if cfg.variant == "dflash2" and args.format == NATIVE:
        raise UserError("the native DFlash format has no convolutions or candidate selector: export a DFlash2 "
                        "drafter with --format speculators (vLLM 0.33 reads it as DFlash2DraftModel)")
    verifier = args.verifier or (meta.get("target") or {}).get("name_or_path")
    if not verifier:
        raise UserError("the checkpoint does not name its verifier: pass --verifier")
    revision = args.verifier_revision or (None if args.verifier else (meta.get("target") or {}).get("revision"))
    check_reports(reports, drafter, verifier, revision)
    source = model_source(verifier, "verifier")
    vconfig, vtokenizer = load_verifier(source, revision, args.trust_remote_code)
    mask_token = check_verifier(cfg, meta.get("mask_token"), vconfig, vtokenizer, verifier)
    if cfg.num_target_layers is None:  # imported without it: the verifier says
        cfg.num_target_layers = vconfig.num_hidden_layers
    pin = resolve_pin(source, revision)
    folder = resolve_folder(args.checkpoint)
    recipe_file = folder / "recipe.yaml"
    recipe_text = recipe_file.read_text() if recipe_file.is_file() else None
    card = model_card(args.format, cfg, pin, verifier, mask_token, count_parameters(drafter), recipe_text, reports,
                      meta["format"], args.push_to_hub or str(out), args.license, run_choice(folder))

    write_atomically(out, lambda tmp: write_export(tmp, args.format, drafter, cfg, pin, vconfig, mask_token, card,
                                                   recipe_text, reports), "export")
    print(f"exported {args.format} drafter to {out} (verifier {verifier}, {pin_text(pin)})")
    if args.push_to_hub:
        push(out, args.push_to_hub, args.private, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
