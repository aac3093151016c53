"""Proof for a refactor of the variants (issue 44 item 1, "the same numbers"): short tiny-target runs of every
variant, their decodes and exports, fingerprinted, so two commits can be compared field by field.

    .venv/bin/python benchmarks/variant_parity.py --output /tmp/before.json
    (change the code)
    .venv/bin/python benchmarks/variant_parity.py --output /tmp/after.json --compare /tmp/before.json

Per case (recipes/tiny*.yaml on the bundled tiny target and 64 / 16 tinychat conversations as the tests'
small_data, 4 steps, seed 0, one thread): the training metrics
(losses, terms, EAL, the validation record; no timings), the final weights' SHA-256, the chain's and
DDTree@8's tokens and accept lengths on two tinychat prompts (temperature 0, and the chain at temperature 1
with a fixed seed), and the Speculators export's weights, config.json and card (and, for plain DFlash, the
native export's). --compare prints each field that differs and exits 1 if any does.
"""

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ["What is 23 + 59?", "Please sort 12, 5, 33, 8."]
BASE = [f"model.target={ROOT / 'data/tiny-target'}", "max_steps=4", "log_every=1", "checkpoint_every=0",
        "eval.every=2", "eval.max_samples=4", "eval.ddtree_budgets=[4, 16]", "train.batch_size=4",
        "data.num_anchors=8", "seed=0"]
# name -> (recipe, overrides)
CASES = {
    "dflash": ("tiny.yaml", []),
    "dflash-vocab": ("tiny.yaml", ["model.draft_vocab_size=128", "loss.terms={ce: 0.1, tv: 0.9}"]),
    "dspark-vanilla": ("tiny-dspark.yaml", ["tree_distill.weight=0.5", "tree_distill.every=2"]),
    "dspark-rnn-vocab": ("tiny-dspark.yaml", ["model.markov_head_type=rnn", "model.draft_vocab_size=128"]),
    "dspark-gated-embed": ("tiny-dspark.yaml", ["model.markov_head_type=gated",
                                                "model.markov_w1_embed=true"]),
    "dflash2": ("tiny-dflash2.yaml", ["tree_distill.weight=0.5", "tree_distill.every=2"]),
    "xpress-vocab": ("tiny.yaml", ["model.variant=xpress", "model.xpress_rank=16",
                                   "model.draft_vocab_size=128", "loss.consistency_weight=0.3",
                                   "loss.consistency_passes=2", "loss.base_anchor_weight=0.6"]),
}
VOLATILE = ("time", "per_s", "elapsed", "_s", "date", "seconds")


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def metrics(run: Path) -> list[dict]:
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        out.append({k: v for k, v in r.items() if not any(w in k for w in VOLATILE)})
    return out


def decodes(run: Path) -> dict:
    from dflash_train.checkpoint.folders import load_drafter
    from dflash_train.data.dataset import stop_token_ids
    from dflash_train.decoding.decode import decode
    from dflash_train.model.target import load_target

    drafter = load_drafter(run / "final")[0].eval()
    target = load_target(str(ROOT / "data/tiny-target"))
    stops = stop_token_ids(target.model, target.tokenizer)
    out = {}
    for i, q in enumerate(QUESTIONS):
        ids = target.tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                   add_generation_prompt=True, return_tensors="pt",
                                                   return_dict=True)["input_ids"]
        for method, budget, temperature in [("dflash", 0, 0.0), ("ddtree", 8, 0.0), ("dflash", 0, 1.0)]:
            g = torch.Generator().manual_seed(5)
            r = decode(target, drafter, ids, method, budget, temperature=temperature, max_new_tokens=32,
                       stop_ids=stops, generator=g)
            out[f"{i}/{method}@{budget}/T{temperature:g}"] = {"tokens": r.tokens, "accept": r.accept_lengths}
    return out


def export(run: Path, fmt: str, dest: Path) -> dict:
    from dflash_train.cli.export import main

    main(["--format", fmt, "--checkpoint", str(run / "final"), "--output", str(dest)])
    weights = sorted(dest.glob("*.safetensors"))
    config = json.loads((dest / "config.json").read_text())
    card = (dest / "README.md").read_text() if (dest / "README.md").exists() else ""
    # the card names the run's folder (a temporary path): compare it with that path taken out
    card = card.replace(str(run), "<run>").replace(str(dest), "<out>")
    return {"weights": {w.name: sha(w) for w in weights}, "config": config,
            "card_sha": hashlib.sha256(card.encode()).hexdigest()[:16]}


def write_data(work: Path) -> None:
    """tests/conftest.py's small_data: 64 train / 16 val tinychat conversations."""
    sys.path.insert(0, str(ROOT / "data"))
    import tinychat

    for split, n, seed in [("train", 64, 11), ("val", 16, 12)]:
        (work / f"{split}.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n"
                                                     for c in tinychat.conversations(n, seed)))


def case(name: str, work: Path) -> dict:
    from dflash_train.cli.train import main

    recipe, extra = CASES[name]
    run = work / name
    data = [f"data.train={work / 'train.jsonl'}", f"data.val={work / 'val.jsonl'}"]
    main(["--recipe", str(ROOT / "recipes" / recipe), f"output_dir={run}", *BASE, *data, *extra])
    out = {"metrics": metrics(run), "weights": sha(run / "final" / "model.safetensors"),
           "decode": decodes(run), "speculators": export(run, "speculators", work / f"{name}-spec")}
    if name == "dflash":
        out["dflash"] = export(run, "dflash", work / f"{name}-native")
    return out


def differences(a, b, where="") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b), key=str)
                for d in differences(a.get(k, "<missing>"), b.get(k, "<missing>"), f"{where}/{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {json.dumps(a)[:120]} != {json.dumps(b)[:120]}"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", required=True)
    p.add_argument("--compare", help="a previous --output: print what differs, exit 1 if anything does")
    p.add_argument("--cases", default=",".join(CASES))
    args = p.parse_args()
    torch.set_num_threads(1)
    os.chdir(ROOT)
    with tempfile.TemporaryDirectory() as work:
        write_data(Path(work))
        result = {name: case(name, Path(work)) for name in args.cases.split(",")}
    Path(args.output).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    if args.compare:
        diffs = differences(json.loads(Path(args.compare).read_text()), result)
        print("\n".join(diffs) if diffs else f"identical: {', '.join(result)}")
        return 1 if diffs else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
