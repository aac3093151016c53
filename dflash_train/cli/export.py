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

import sys
from pathlib import Path

from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from dflash_train.checkpoint.folders import count_parameters, distilled_steps, load_drafter, resolve_folder
from dflash_train.checkpoint.formats import NATIVE, SPECULATORS
from dflash_train.cli import locked_main
from dflash_train.core.errors import OneLineArgumentParser, UserError
from dflash_train.core.outputs import require_free_output, write_atomically
from dflash_train.core.paths import display_path, model_source
from dflash_train.export.card import model_card, pin_text, run_choice
from dflash_train.export.writer import (check_reports, check_verifier, load_verifier, portable_recipe,
                                        portable_report, push, read_reports, round_to_bf16, write_export)
from dflash_train.model.target import first_line, locate_verifier, resolve_pin

# The Hub's license identifiers, from https://huggingface.co/docs/hub/repositories-licenses
# (huggingface/hub-docs docs/hub/repositories-licenses.md; huggingface_hub ships no list). With
# `other`, name the license in the repository's LICENSE file.
HUB_LICENSES = (
    "apache-2.0 mit openrail bigscience-openrail-m creativeml-openrail-m bigscience-bloom-rail-1.0 "
    "bigcode-openrail-m afl-3.0 artistic-2.0 bsl-1.0 bsd bsd-2-clause bsd-3-clause bsd-3-clause-clear c-uda "
    "cc cc0-1.0 cc-by-2.0 cc-by-2.5 cc-by-3.0 cc-by-4.0 cc-by-sa-3.0 cc-by-sa-4.0 cc-by-nc-2.0 cc-by-nc-3.0 "
    "cc-by-nc-4.0 cc-by-nd-4.0 cc-by-nc-nd-3.0 cc-by-nc-nd-4.0 cc-by-nc-sa-2.0 cc-by-nc-sa-3.0 "
    "cc-by-nc-sa-4.0 cdla-sharing-1.0 cdla-permissive-1.0 cdla-permissive-2.0 wtfpl ecl-2.0 epl-1.0 epl-2.0 "
    "etalab-2.0 eupl-1.1 agpl-3.0 gfdl gpl gpl-2.0 gpl-3.0 lgpl lgpl-2.1 lgpl-3.0 isc lppl-1.3c ms-pl "
    "mpl-2.0 odc-by odbl openrail++ osl-3.0 postgresql ofl-1.1 ncsa unlicense zlib pddl lgpl-lr "
    "deepfloyd-if-license llama2 llama3 llama3.1 llama3.2 llama3.3 gemma unknown other").split()


def parse_args(argv):
    p = OneLineArgumentParser(prog="dflash-export", description=__doc__.splitlines()[0])
    p.add_argument("--format", required=True, help="speculators or dflash")
    p.add_argument("--checkpoint", required=True, help="drafter folder or Hub id (any supported format)")
    p.add_argument("--output", required=True)
    p.add_argument("--verifier", default=None,
                   help="verifier Hub id or folder (default: the drafter's target)")
    p.add_argument("--verifier-revision", default=None, help="Hub commit/tag of the verifier to pin")
    p.add_argument("--eval-report", action="append", default=[], help="dflash-eval report.json (repeatable)")
    p.add_argument("--license", default="other", help="the Hub's license id for the card (default: other)")
    p.add_argument("--push-to-hub", default=None, metavar="REPO")
    p.add_argument("--private", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="with --push-to-hub: list what would be uploaded")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--card-notes", default=None, metavar="FILE",
                   help="a markdown file added to the card as its Notes section (provenance, training "
                        "history)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="floating-point weights as (bf16 halves the files; d2t / t2d keep their integer "
                        "types)")
    args = p.parse_args(argv)
    if args.format not in (SPECULATORS, NATIVE):
        p.error(f"unknown --format '{args.format}' (choose speculators or dflash)")
    if args.license not in HUB_LICENSES:
        p.error(f"--license {args.license!r:.80} is not a Hub license id (e.g. apache-2.0, mit, llama3.1, "
                "other; list: https://huggingface.co/docs/hub/repositories-licenses)")
    if (args.private or args.dry_run) and not args.push_to_hub:
        p.error("--private and --dry-run go with --push-to-hub")
    if args.push_to_hub:
        try:
            validate_repo_id(args.push_to_hub)
        except HFValidationError as e:
            p.error(f"--push-to-hub '{args.push_to_hub}' is not a Hub repo id: {first_line(e)}")
    return args


NOTES_MAX = 64 * 1024  # bytes: a card's Notes section; /dev/zero or a stray dump is refused, not read whole


def read_notes(path: str | None) -> str | None:
    """--card-notes, read up to NOTES_MAX bytes (one more tells a larger file: it is refused)."""
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read(NOTES_MAX + 1)
        if len(data) > NOTES_MAX:
            raise UserError(f"--card-notes '{path}' is larger than {NOTES_MAX // 1024} KiB: a model card's "
                            "notes are a few paragraphs; shorten the file")
        return data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")  # as read_text did
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--card-notes '{path}' is not a readable text file ({type(e).__name__})") from None


def run(args) -> None:
    out = Path(args.output)
    inputs = [("--checkpoint", args.checkpoint), ("--verifier", args.verifier),
              ("--card-notes", args.card_notes), *[("--eval-report", r) for r in args.eval_report]]
    require_free_output(out, args.overwrite, "export", inputs)
    reports = read_reports(args.eval_report)
    notes = read_notes(args.card_notes)
    drafter, meta = load_drafter(args.checkpoint)
    cfg = drafter.config
    if drafter.variant.native_refusal and args.format == NATIVE:
        raise UserError(drafter.variant.native_refusal)
    if cfg.draft_vocab_size is not None and args.format == NATIVE:
        raise UserError(f"the native DFlash format has no draft vocabulary (this drafter drafts over "
                        f"{cfg.draft_vocab_size} of {cfg.vocab_size} tokens through its own lm_head / d2t): "
                        "export it with --format speculators")
    verifier = args.verifier or (meta.get("target") or {}).get("name_or_path")
    if not verifier:
        raise UserError("the checkpoint does not name its verifier: pass --verifier")
    revision = args.verifier_revision or (None if args.verifier
                                          else (meta.get("target") or {}).get("revision"))
    unrounded = round_to_bf16(drafter) if args.dtype == "bf16" else None  # the weights the export holds
    check_reports(reports, drafter, verifier, revision, unrounded)
    source, chosen = (verifier, None) if args.verifier else locate_verifier(
        verifier, (meta.get("target") or {}).get("pin"), "--verifier")
    if chosen:
        print(chosen, file=sys.stderr)
    source = model_source(source, "verifier")
    vconfig, vtokenizer = load_verifier(source, revision, args.trust_remote_code)
    mask_token = check_verifier(cfg, meta.get("mask_token"), vconfig, vtokenizer, verifier)
    if cfg.num_target_layers is None:  # imported without it: the verifier says
        cfg.num_target_layers = vconfig.num_hidden_layers
    pin = resolve_pin(source, revision)
    folder = resolve_folder(args.checkpoint)
    # ours: recipe.yaml; an export (re-exported, e.g. with its eval reports): training_recipe.yaml
    recipe_file = next((folder / n for n in ("recipe.yaml", "training_recipe.yaml")
                        if (folder / n).is_file()), None)
    recipe_text = portable_recipe(recipe_file.read_text()) if recipe_file else None
    name = display_path(pin["name_or_path"])  # a Hub id, or a local folder as any clone would name it
    reports = [portable_report(r, name) for r in reports]
    card = model_card(args.format, cfg, pin, name, mask_token, count_parameters(drafter), recipe_text,
                      reports, meta["format"], args.push_to_hub or display_path(out.absolute()), args.license,
                      run_choice(folder), distilled_steps(folder), notes)

    write_atomically(out,
                     lambda tmp: write_export(tmp, args.format, drafter, cfg, pin, vconfig, mask_token, card,
                                              recipe_text, reports, args.dtype), "export")
    print(f"exported {args.format} drafter to {out} (verifier {name}, {pin_text(pin)})")
    if args.push_to_hub:
        push(out, args.push_to_hub, args.private, args.dry_run)


main = locked_main(parse_args, run)


if __name__ == "__main__":
    sys.exit(main())
