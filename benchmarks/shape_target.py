"""Write a randomly initialised Qwen3-8B-shaped target (few layers) and long chat data for the GPU check.

    python benchmarks/shape_target.py --out /tmp/q8 --layers 6            # Qwen3-8B widths, 6 decoder layers
    python benchmarks/shape_target.py --out /tmp/q8 --tiny                # CPU smoke test of the same script

No Hub access on the GPU machine: the tokenizer is the bundled tiny target's (its ids are a subset
of the 151,936-row vocabulary, which is all that shapes and costs depend on). Six layers keep the
drafter's fc at its real size: taps [0, 1, 2, 3, 4], one per drafter layer as for Qwen3-8B's
[1, 9, 17, 25, 33]. Data: tinychat conversations joined into ~2,000-token multi-turn chats, so
sequences and anchors are as long as a real recipe's (3,072 tokens, 512 anchors).
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "data"))
import tinychat  # noqa: E402
from gpu_costs import QWEN3_8B, TINY  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--chats", type=int, default=64, help="training conversations (each ~2,000 tokens)")
    args = p.parse_args()
    out = Path(args.out)
    tok = AutoTokenizer.from_pretrained(ROOT / "data" / "tiny-target")
    shape = {**(TINY if args.tiny else QWEN3_8B), "num_hidden_layers": args.layers,
             "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id, "bos_token_id": None}
    shape.pop("max_window_layers", None)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen3ForCausalLM(Qwen3Config(**shape)).to(torch.bfloat16 if not args.tiny else torch.float32)
    model.save_pretrained(out / "target")
    tok.save_pretrained(out / "target")
    convs = tinychat.conversations(args.chats * 12 + 32, seed=5)
    for name, n in [("train", args.chats), ("val", 4)]:
        with open(out / f"{name}.jsonl", "w") as f:
            for _ in range(n):
                messages = [m for conv in (convs.pop() for _ in range(12)) for m in conv]
                f.write(json.dumps({"messages": messages}) + "\n")
    print(f"wrote {out / 'target'} ({sum(p.numel() for p in model.parameters()) / 1e9:.2f}B "
          f"parameters) and data")
    return 0


if __name__ == "__main__":
    sys.exit(main())
