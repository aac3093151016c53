"""DFlash2 against DFlash on the tiny setup: the same data, seed, backbone shape and steps
(recipes/tiny.yaml and recipes/tiny-dflash2.yaml differ only in the DFlash2 keys), each drafter
then decoded by dflash-eval (temperature 0, lossless) on the bundled prompts.

    .venv/bin/python benchmarks/dflash2_table.py   # the table (200 steps, all prompts)
    .venv/bin/python benchmarks/dflash2_table.py --steps 10 --limit 2 --max-new-tokens 24   # a quick check

Rows: DFlash (the tiny recipe), DFlash2 with the DDTree built from its unary marginals alone
(`--tree-scores marginal`), DFlash2 with the selector's path-conditioned tree (`conditional`).
Columns as in the issue-12 table (docs/benchmarks/dspark-vs-dflash.md): tau of the chain (DFlash2's is the
greedy selector walk) and of DDTree at budgets 16 / 64 / 256 (tokens per target forward, bonus
included), off-spine accuracy at budget 64 (along the accepted path, how often the drafter's best
child under an accepted node that was not the drafter's argmax is the target's next token;
ddtree.spine_counts) with its node count, on-spine accuracy, training's teacher-forced validation
(EAL, DDTree @16 / @64, off- / on-spine of the budget-64 tree; DFlash2's validation trees are the
selector's), lossless, and the wall time per training step relative to DFlash, measured in one
process by alternating optimizer steps of the two drafters on the same batches
(`--timing-steps` each, medians).
Writes OUTPUT/{dflash,dflash2}/ (run + evals), OUTPUT/dflash2_table.md and .json.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

RECIPES = {"dflash": ROOT / "recipes" / "tiny.yaml", "dflash2": ROOT / "recipes" / "tiny-dflash2.yaml"}
ROWS = [("DFlash (tiny recipe)", "dflash", "marginal"),
        ("DFlash2, tree from the unary marginals", "dflash2", "marginal"),
        ("DFlash2, selector tree", "dflash2", "conditional")]
BUDGETS = [16, 64, 256]
SPINE_BUDGET = 64


def run(cmd: list[str], log: Path, env: dict) -> None:
    with open(log, "w") as fh:
        r = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env=env)
    if r.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd[:4])} ... failed (exit {r.returncode}); see {log}")


def eval_row(report: dict) -> dict:
    by = {(r["method"], r["budget"]): r for r in report["results"]}
    chain = next(r for r in report["results"] if r["method"] == "dflash")
    spine = by[("ddtree", SPINE_BUDGET)]
    return {"tau_chain": chain["tau"], **{f"tau_ddtree_{b}": by[("ddtree", b)]["tau"] for b in BUDGETS},
            "off_spine_acc": spine["off_spine_acc"], "off_spine_nodes": spine["off_spine_nodes"],
            "on_spine_acc": spine["on_spine_acc"],
            "lossless": all(r["lossless"] for r in report["results"] if r["method"] != "ar"),
            "prompts": chain["prompts"]}


def step_times(steps: int, overrides: list[str], seed: int) -> dict[str, list[float]]:
    """Seconds per optimizer step of each drafter, alternating DFlash and DFlash2 step by step
    (which one goes first alternates too) on the same batches and anchors, in this process."""
    from torch.utils.data import DataLoader

    from dflash_train.training.blocks import anchored_blocks, block_slots, draw_anchors
    from dflash_train.training.build import init_drafter
    from dflash_train.training.config import load_recipe
    from dflash_train.data.dataset import collate, load_conversations
    from dflash_train.model.loss import loss_divisor
    from dflash_train.model.target import load_target
    from dflash_train.training.objective import training_loss

    cfgs = {k: load_recipe(p, overrides) for k, p in RECIPES.items()}
    target = load_target(cfgs["dflash"].model.target)
    runs = {}
    for name, cfg in cfgs.items():
        torch.manual_seed(seed)
        drafter = init_drafter(target, cfg.model)
        runs[name] = (cfg, drafter, torch.optim.AdamW(drafter.parameters(), lr=cfg.train.lr))
    cfg = cfgs["dflash"]
    ds = load_conversations(cfg.data.train, target.tokenizer, cfg.data.max_length)
    ds = ds.add_column("row", list(range(len(ds))))
    loader = DataLoader(ds, batch_size=cfg.train.batch_size, shuffle=False, drop_last=True,
                        collate_fn=lambda rows: collate(rows, pad_id=target.tokenizer.pad_token_id or 0))
    times = {name: [] for name in runs}
    for i, batch in zip(range(steps + 1), loader):  # the first step of each warms up and is not counted
        anchors, anchor_valid = draw_anchors(batch, cfg.data.num_anchors, seed, i)
        for name in (list(runs) if i % 2 == 0 else list(runs)[::-1]):
            c, drafter, opt = runs[name]
            B, ids, mask = (drafter.config.block_size, drafter.config.target_layer_ids,
                            drafter.config.mask_token_id)
            t0 = time.perf_counter()
            o = anchored_blocks(drafter, target, batch, anchors, anchor_valid, ids, B, mask)
            normalizer = loss_divisor(block_slots(batch, anchors, anchor_valid, B)[1], c.loss).clamp(min=1e-8)
            loss, _ = training_loss(o, target, drafter, c, normalizer)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), c.train.clip_grad)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i > 0:
                times[name].append(time.perf_counter() - t0)
    return times


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None,
                   help="training steps per drafter (default: the tiny recipe's)")
    p.add_argument("--limit", type=int, default=None, help="prompts per suite for dflash-eval (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="dflash-eval tokens per assistant turn")
    p.add_argument("--timing-steps", type=int, default=20,
                   help="alternating steps per drafter for the step time")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (OMP_NUM_THREADS)")
    p.add_argument("--output", default="runs/dflash2-table")
    args = p.parse_args()

    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    common = [f"seed={args.seed}", "overwrite=true", *([f"max_steps={args.steps}"] if args.steps else [])]
    for variant, recipe in RECIPES.items():
        run([sys.executable, "-m", "dflash_train.train", "--recipe", str(recipe),
             f"output_dir={out / variant / 'run'}", *common], out / f"{variant}.train.log", env)
    results = []
    for label, variant, scores in ROWS:
        name = f"eval-{scores}"
        run([sys.executable, "-m", "dflash_train.cli.eval", "--drafter", str(out / variant / "run" / "final"),
             "--budgets", ",".join(map(str, BUDGETS)), "--tree-scores", scores, "--max-new-tokens",
             str(args.max_new_tokens), "--output", str(out / variant / name), "--overwrite",
             *(["--limit", str(args.limit)] if args.limit else [])],
            out / f"{variant}.{name}.log", env)
        report = json.loads((out / variant / name / "report.json").read_text())
        summary = json.loads((out / variant / "run" / "summary.json").read_text())
        tf = summary["eval"]
        results.append({"label": label, "variant": variant, "tree_scores": scores, "steps": summary["steps"],
                        "train_s": summary["wall_s"], **eval_row(report), "tf_eal": tf["eal"],
                        "tf_ddtree": [tf["ddtree_tau"][k] for k in ("16", "64")],
                        "tf_spine": [tf["off_spine_acc"], tf["on_spine_acc"]]})
        print(f"{label}: {results[-1]}", flush=True)

    torch.set_num_threads(args.threads)
    times = step_times(args.timing_steps, [f"seed={args.seed}"], args.seed)
    median = {k: statistics.median(v) for k, v in times.items()}
    ratio = median["dflash2"] / median["dflash"]
    for r in results:
        r["step_time_vs_dflash"] = 1.0 if r["variant"] == "dflash" else ratio

    def f(x, digits=3):
        return "n/a" if x is None else f"{x:.{digits}f}"

    lines = ["| row | chain tau | DDTree tau @16 / @64 / @256 | off-spine acc @64 (nodes) | on-spine acc @64 "
             "| TF EAL | TF DDTree @16 / @64 | TF off- / on-spine | lossless | step time vs DFlash |",
             "|---|---:|---|---:|---:|---:|---|---|:-:|---:|"]
    for r in results:
        # validation's trees are conditional
        tf = r["tree_scores"] == "conditional" or r["variant"] == "dflash"
        lines.append(f"| {r['label']} | {f(r['tau_chain'], 2)} | "
                     + " / ".join(f(r[f'tau_ddtree_{b}'], 2) for b in BUDGETS)
                     + f" | {f(r['off_spine_acc'])} ({r['off_spine_nodes']}) | {f(r['on_spine_acc'])} "
                     f"| {f(r['tf_eal'], 2)} "
                     f"| " + (" / ".join(f(x, 2) for x in r["tf_ddtree"]) if tf else "-")
                     + " | " + (" / ".join(f(x) for x in r["tf_spine"]) if tf else "-")
                     + f" | {'yes' if r['lossless'] else 'NO'} | {r['step_time_vs_dflash']:.2f}x |")
    table = "\n".join(lines)
    note = (f"{results[0]['prompts']} prompts, {results[0]['steps']} steps, seed {args.seed}; "
            f"step time: median of {args.timing_steps} alternating steps, DFlash "
            f"{1000 * median['dflash']:.0f} ms, DFlash2 {1000 * median['dflash2']:.0f} ms")
    print(f"\n{note}\n\n{table}")
    (out / "dflash2_table.md").write_text(table + "\n\n" + note + "\n")
    record = {"rows": results, "step_s": times, "note": note}
    (out / "dflash2_table.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
