"""Which objective trains the best drafter? One drafter per objective on the tiny setup, the same
data, seed, drafter shape and steps, each then decoded by dflash-eval (lossless, temperature 0)
on the bundled prompts.

    .venv/bin/python benchmarks/objectives.py   # the full table (the tiny recipe's steps, all prompts)
    .venv/bin/python benchmarks/objectives.py --steps 20 --limit 4    # a quick check that every row runs
    .venv/bin/python benchmarks/objectives.py --rows kl tv --set data.num_anchors=64

Per row: training steps and wall time (summary.json), tau of the DFlash chain and of DDTree at
budgets 16 and 64 from dflash-eval's decoding (tokens per target forward, bonus included) and
whether every output equalled plain decoding, then training's own teacher-forced validation:
the chain's EAL, DDTree tau at 16 and 64 and the mean acceptance rate alpha over slots.
A row whose override the recipe schema does not know (e.g. `model.block_attention` before it
lands) is skipped with a note. Writes OUTPUT/<row>/ (run + eval), OUTPUT/objectives.md and .json.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_train.core.errors import UserError  # noqa: E402
from dflash_train.training.config import load_recipe  # noqa: E402

RECIPE = ROOT / "recipes" / "tiny.yaml"
# row id -> (label, recipe overrides on top of the tiny recipe)
ROWS = {
    "ce-exp": ("CE + exp (default)", []),
    "ce-dpace": ("CE + D-PACE", ["loss.position_weight=dpace"]),
    "kl": ("KL", ["loss.terms={kl: 1.0}"]),
    "tv": ("TV", ["loss.terms={tv: 1.0}"]),
    "nla": ("NLA", ["loss.terms={nla: 1.0}"]),
    "lk-hybrid": ("LK hybrid (eta 3)", ["loss.terms={lk_hybrid: 1.0}"]),
    "ce-tv": ("0.1 CE + 0.9 TV", ["loss.terms={ce: 0.1, tv: 0.9}"]),
    "ce-exp-auf": ("CE + exp + AUF", ["loss.until_first_failure=true"]),
    "causal-kl": ("causal blocks + KL", ["model.block_attention=causal", "loss.terms={kl: 1.0}"]),
}
BUDGETS = [16, 64]


def run(cmd: list[str], log: Path, env: dict) -> None:
    with open(log, "w") as fh:
        r = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env=env)
    if r.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd[:4])} ... failed (exit {r.returncode}); see {log}")


def schema_problem(overrides: list[str]) -> str | None:
    """None if the recipe schema accepts these overrides, else the reason (unknown keys only)."""
    try:
        load_recipe(RECIPE, overrides)
    except UserError as e:
        if "unknown key" in str(e):
            return str(e)
        raise SystemExit(f"error: {e}") from None
    return None


def eval_row(report: dict) -> dict:
    by = {(r["method"], r["budget"]): r for r in report["results"]}
    chain = next(r for r in report["results"] if r["method"] == "dflash")
    ddtree = {b: by[("ddtree", b)] for b in BUDGETS}
    return {"tau_chain": chain["tau"], **{f"tau_ddtree_{b}": ddtree[b]["tau"] for b in BUDGETS},
            "lossless": all(r["lossless"] for r in report["results"] if r["method"] != "ar"),
            "prompts": chain["prompts"]}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None,
                   help="training steps per row (default: the tiny recipe's)")
    p.add_argument("--limit", type=int, default=None, help="prompts per suite for dflash-eval (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="dflash-eval tokens per assistant turn")
    p.add_argument("--rows", nargs="+", choices=sorted(ROWS), default=list(ROWS), help="rows to run")
    p.add_argument("--set", nargs="*", default=[], metavar="key=value",
                   help="extra recipe overrides for every row")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (OMP_NUM_THREADS)")
    p.add_argument("--output", default="runs/objectives")
    args = p.parse_args()

    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    common = [f"seed={args.seed}", "checkpoint_every=0", "eval.every=0", f"eval.ddtree_budgets={BUDGETS}",
              "overwrite=true", "log_every=1000", *([f"max_steps={args.steps}"] if args.steps else []),
              *args.set]
    results, skipped = [], []
    for row in args.rows:
        label, overrides = ROWS[row]
        problem = schema_problem(common + overrides)
        if problem:
            print(f"note: skipping '{row}' ({label}): {problem} (not in this checkout's recipe schema yet)",
                  flush=True)
            skipped.append({"row": row, "label": label, "reason": problem})
            continue
        run_dir = out / row
        t0 = time.time()
        run([sys.executable, "-m", "dflash_train.train", "--recipe", str(RECIPE),
             f"output_dir={run_dir / 'run'}", *common, *overrides], out / f"{row}.train.log", env)
        run([sys.executable, "-m", "dflash_train.cli.eval", "--drafter", str(run_dir / "run" / "final"),
             "--budgets", ",".join(map(str, BUDGETS)), "--max-new-tokens", str(args.max_new_tokens),
             "--output", str(run_dir / "eval"), "--overwrite", "--device", "cpu", "--seed", str(args.seed),
             *(["--limit", str(args.limit)] if args.limit else [])], out / f"{row}.eval.log", env)
        summary = json.loads((run_dir / "run" / "summary.json").read_text())
        report = json.loads((run_dir / "eval" / "report.json").read_text())
        tf = summary["eval"]
        results.append({
            "row": row, "label": label, "overrides": overrides, "steps": summary["steps"],
            "train_s": summary["wall_s"], **eval_row(report), "tf_eal": tf["eal"],
            **{f"tf_ddtree_{b}": tf["ddtree_tau"][str(b)] for b in BUDGETS},
            "tf_alpha": sum(tf["alpha_per_position"]) / len(tf["alpha_per_position"]),
            "tf_acc_1": tf["acc_per_position"][0],
        })
        r = results[-1]
        print(f"{row}: {r['steps']} steps in {r['train_s']:.0f}s, tau chain {r['tau_chain']:.3f}, DDTree@16 "
              f"{r['tau_ddtree_16']:.3f}, @64 {r['tau_ddtree_64']:.3f} (lossless {r['lossless']}); "
              f"teacher-forced EAL {r['tf_eal']:.3f} ({time.time() - t0:.0f}s with eval)", flush=True)

    lines = ["| objective | steps | train s | tau chain | DDTree@16 | DDTree@64 | lossless | TF "
             "EAL | TF DDTree@16 | TF DDTree@64 | TF alpha | TF acc@1 |",
             "|---|---:|---:|---:|---:|---:|:-:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['label']} | {r['steps']} | {r['train_s']:.0f} | {r['tau_chain']:.3f} | "
                     f"{r['tau_ddtree_16']:.3f} | {r['tau_ddtree_64']:.3f} | "
                     f"{'yes' if r['lossless'] else 'NO'} | {r['tf_eal']:.3f} | {r['tf_ddtree_16']:.3f} | "
                     f"{r['tf_ddtree_64']:.3f} | {r['tf_alpha']:.3f} | {r['tf_acc_1']:.3f} |")
    for s in skipped:
        lines.append(f"| {s['label']} | skipped: {s['reason']} | | | | | | | | | | |")
    prompts = results[0]["prompts"] if results else 0
    table = "\n".join(lines)
    print(f"\n{prompts} prompts per eval, seed {args.seed}, overrides {common}\n\n{table}")
    (out / "objectives.md").write_text(table + "\n")
    record = {"common": common, "rows": results, "skipped": skipped}
    (out / "objectives.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
