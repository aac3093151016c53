"""What the streaming CPU linear (dflash_train/model/cpu_linear.py) changes: the verify forward by width
and the drafter's block pass, torch's GEMM against the streaming linear, alternated in one run.

    python benchmarks/cpu_linear.py --drafter checkpoints/smollm2-135m-dflash --context 300 --rounds 6

Each round runs evaluation.costs.measure_costs (decode.verify over a tree of each width, what a round's
verify stage runs) once with torch's linear and once with the streaming one, in alternating order,
so machine load lands on both alike; medians over rounds. Writes benchmarks/results/cpu_linear.json.
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_train.checkpoint.folders import load_drafter  # noqa: E402
from dflash_train.evaluation.costs import measure_costs  # noqa: E402
from dflash_train.evaluation.summary import hardware_record  # noqa: E402
from dflash_train.model.cpu_linear import use_stream_linear, use_torch_linear  # noqa: E402
from dflash_train.model.target import load_target  # noqa: E402

WIDTHS = [1, 2, 4, 5, 8, 9, 16, 17, 32, 64]


def switch(kind: str, target, drafter) -> None:
    if kind == "stream":
        for m in (target.model, drafter):
            _, why = use_stream_linear(m)
            if why is not None:
                sys.exit(f"error: the streaming linear cannot run here: {why}")
    else:
        use_torch_linear(target.model)
        use_torch_linear(drafter)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drafter", default=str(ROOT / "checkpoints" / "smollm2-135m-dflash"))
    p.add_argument("--target", default=str(ROOT / "data" / "real" / "smollm2-135m-instruct"))
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "cpu_linear.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    drafter = load_drafter(args.drafter)[0].eval()
    target = load_target(args.target)
    ms = {k: {"verify": [], "draft": []} for k in ("torch", "stream")}
    for r in range(args.rounds):
        for kind in (("torch", "stream") if r % 2 == 0 else ("stream", "torch")):
            switch(kind, target, drafter)
            c = measure_costs(target, drafter, args.context, [1], widths=WIDTHS, rounds=1, seed=r)
            ms[kind]["verify"].append(c["verify_ms"][0])
            ms[kind]["draft"].append(c["draft_ms"][0][0])
            print(kind, r, [round(x, 1) for x in c["verify_ms"][0]], round(c["draft_ms"][0][0], 1),
                  flush=True)
    med = {k: {"verify_ms_by_width": {w: statistics.median(row[i] for row in v["verify"])
                                      for i, w in enumerate(WIDTHS)},
               "draft_ms": statistics.median(v["draft"])} for k, v in ms.items()}
    for k in med:
        one = med[k]["verify_ms_by_width"][1]
        med[k]["verify_x_width_1"] = {w: round(t / one, 3)
                                      for w, t in med[k]["verify_ms_by_width"].items()}
    verify = {k: med[k]["verify_ms_by_width"] for k in ("torch", "stream")}
    med["stream_over_torch"] = {w: round(verify["stream"][w] / verify["torch"][w], 3) for w in WIDTHS}
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    out = {"command": "python " + " ".join(sys.argv), "commit": commit,
           "machine": hardware_record(torch.device("cpu")), "target": args.target, "drafter": args.drafter,
           "context": args.context, "rounds": args.rounds, "results": med, "raw_ms": ms}
    Path(args.output).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(med, indent=1))


if __name__ == "__main__":
    main()
