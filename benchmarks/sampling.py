"""What a temperature > 0 draw costs per verify on a CPU: torch.multinomial against sample_rows
(dflash_train/model/sampling.py, the decoder's sampler), alternated in one run.

    python benchmarks/sampling.py --vocab 49152 --rounds 9

For each row count (a DDTree@b verify samples b + 1 rows, plain decoding one), each round times 10 calls of
each sampler on the same tempered probabilities, in alternating order; medians over rounds, in ms per call.
Writes benchmarks/results/sampling.json.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_train.evaluation.summary import hardware_record  # noqa: E402
from dflash_train.model.sampling import sample_rows, tempered_probs  # noqa: E402

ROWS = [1, 2, 4, 5, 8, 9, 17, 65]


def ms_per_call(fn, calls: int = 10) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return 1e3 * (time.perf_counter() - t0) / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=49152, help="SmolLM2-135M's vocabulary")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "sampling.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    samplers = {"multinomial": lambda probs: torch.multinomial(probs, 1, generator=gen),
                "sample_rows": lambda probs: sample_rows(probs, gen)}
    raw = {k: {n: [] for n in ROWS} for k in samplers}
    for n in ROWS:
        probs = tempered_probs(torch.randn(n, args.vocab, generator=gen) * 3, 1.0)
        for name, fn in samplers.items():  # warm-up
            fn(probs)
        for r in range(args.rounds):
            for name in (list(samplers) if r % 2 == 0 else list(samplers)[::-1]):
                raw[name][n].append(ms_per_call(lambda: samplers[name](probs)))
        print(n, {k: round(statistics.median(raw[k][n]), 3) for k in samplers}, flush=True)
    med = {k: {n: round(statistics.median(v[n]), 3) for n in ROWS} for k, v in raw.items()}
    med["multinomial_over_sample_rows"] = {n: round(med["multinomial"][n] / med["sample_rows"][n],
                                                    1) for n in ROWS}
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    out = {"command": "python " + " ".join(sys.argv), "commit": commit,
           "machine": hardware_record(torch.device("cpu")), "vocab": args.vocab, "rounds": args.rounds,
           "ms_per_call": med, "raw_ms": raw}
    Path(args.output).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(med, indent=1))


if __name__ == "__main__":
    main()
