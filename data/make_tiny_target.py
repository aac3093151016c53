"""Regenerate the bundled tiny target (`data/tiny-target/`) and tiny data (`data/tiny/`).

The target is a real `Qwen3ForCausalLM` with its own byte-level BPE tokenizer, a ChatML
chat template and a `<|MASK|>` token appended at the end of the vocabulary (as DFlash
appends it to Qwen3's). It is trained here, on CPU, on the generated tinychat domain
(`data/tinychat.py`), so nothing is downloaded and everything is license-clean.

    .venv/bin/python data/make_tiny_target.py            # about 15 minutes on 2 cores
    .venv/bin/python data/make_tiny_target.py --steps 50 # a quick smoke run

Writes data/tiny-target/ (safetensors weights, config, tokenizer, chat template),
data/tiny/{train,val}.jsonl (drafter data, disjoint seeds from the target's corpus) and
data/tiny-target/training_log.json (held-out loss, sizes), which data/README.md quotes.
"""

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
import tinychat  # noqa: E402

HERE = Path(__file__).parent
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MASK = "<|MASK|>"


def render(messages: list[dict]) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 1, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>", bos_token=None)
    hf.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", MASK]})
    assert hf.convert_tokens_to_ids(MASK) == vocab_size - 1, "MASK must be the last id"
    hf.chat_template = CHAT_TEMPLATE
    hf.model_max_length = 512
    return hf


def packed_batches(ids: list[int], seq_len: int, batch: int, rng: random.Random):
    """Endless random windows of the concatenated corpus: [batch, seq_len + 1]."""
    data = torch.tensor(ids)
    while True:
        starts = [rng.randrange(len(ids) - seq_len - 1) for _ in range(batch)]
        yield torch.stack([data[s : s + seq_len + 1] for s in starts])


@torch.no_grad()
def heldout_loss(model, ids: list[int], seq_len: int) -> float:
    model.eval()
    data = torch.tensor(ids)
    n = (len(ids) - 1) // seq_len
    losses = []
    for i in range(0, n, 16):
        rows = [data[j * seq_len : j * seq_len + seq_len + 1] for j in range(i, min(i + 16, n))]
        x = torch.stack(rows)
        losses.append(model(input_ids=x[:, :-1], labels=x[:, :-1].clone()).loss.item())
    model.train()
    return sum(losses) / len(losses)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--out", type=Path, default=HERE / "tiny-target")
    p.add_argument("--data-out", type=Path, default=HERE / "tiny")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    t0 = time.time()

    # Corpora: the target's LM corpus, and the drafter's train/val conversations, from disjoint seeds.
    corpus = tinychat.conversations(40000, seed=101)
    heldout = tinychat.conversations(500, seed=102)
    args.data_out.mkdir(parents=True, exist_ok=True)
    for name, n, seed in [("train", 3000, 201), ("val", 200, 202)]:
        with open(args.data_out / f"{name}.jsonl", "w") as f:
            for conv in tinychat.conversations(n, seed):
                f.write(json.dumps({"messages": conv}) + "\n")

    tok = train_tokenizer([render(c) for c in corpus[:10000]], args.vocab)
    train_ids = [i for c in corpus for i in tok(render(c))["input_ids"]]
    heldout_ids = [i for c in heldout for i in tok(render(c))["input_ids"]]
    print(f"corpus: {len(train_ids)} train tokens, {len(heldout_ids)} held-out tokens")

    config = Qwen3Config(
        vocab_size=args.vocab, hidden_size=128, intermediate_size=384, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = Qwen3ForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / warmup, 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / args.steps)))))
    batches = packed_batches(train_ids, args.seq_len, args.batch, random.Random(args.seed))
    for step in range(args.steps):
        x = next(batches)
        loss = model(input_ids=x[:, :-1], labels=x[:, :-1].clone()).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:5d} loss {loss.item():.3f} lr {sched.get_last_lr()[0]:.2e} "
                  f"{time.time() - t0:.0f}s", flush=True)

    val = heldout_loss(model, heldout_ids, args.seq_len)
    print(f"held-out loss {val:.3f} (perplexity {math.exp(val):.2f})")
    args.out.mkdir(parents=True, exist_ok=True)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(args.out, safe_serialization=True)
    tok.save_pretrained(args.out)
    log = {"parameters": n_params, "vocab_size": args.vocab,
           "train_tokens_seen": args.steps * args.batch * args.seq_len, "corpus_tokens": len(train_ids),
           "steps": args.steps, "heldout_loss": round(val, 4), "wall_s": round(time.time() - t0, 1),
           "seed": args.seed}
    (args.out / "training_log.json").write_text(json.dumps(log, indent=2) + "\n")
    print(json.dumps(log))


if __name__ == "__main__":
    main()
