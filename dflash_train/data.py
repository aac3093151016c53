"""Conversations -> token ids with an assistant-only loss mask -> padded batches -> anchors.

The loss mask is derived from the target's own chat template: for each assistant turn,
the template is rendered up to that turn with the generation prompt, and again through
the turn; the extra tokens, up to and including the first stop token, are the
assistant's. This works for any template whose rendering of a prefix of the conversation
is a prefix of the full rendering (ChatML/Qwen3 without thinking history, Llama 3).
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from datasets import Dataset, load_dataset
from transformers import PreTrainedTokenizerBase

from dflash_train.errors import UserError


def _render_ids(tokenizer, messages, add_generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tokenize_conversation(tokenizer: PreTrainedTokenizerBase, messages: list[dict], max_length: int,
                          stop_ids: set[int]) -> tuple[list[int], list[int]] | None:
    """Returns (input_ids, loss_mask) or None if the template is not prefix-stable here."""
    ids = _render_ids(tokenizer, messages, add_generation_prompt=False)
    mask = [0] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(_render_ids(tokenizer, messages[:i], add_generation_prompt=True))
        through = _render_ids(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if through != ids[: len(through)] or start > len(through):
            return None
        for j in range(start, len(through)):
            mask[j] = 1
            if ids[j] in stop_ids:
                break
    return ids[:max_length], mask[:max_length]


def load_conversations(path: str, tokenizer: PreTrainedTokenizerBase, max_length: int,
                       stop_ids: set[int]) -> Dataset:
    """A jsonl of {"messages": [{role, content}, ...]} -> Dataset(input_ids, loss_mask)."""
    if not Path(path).is_file():
        raise UserError(f"data file '{path}' not found")
    if tokenizer.chat_template is None:
        raise UserError("the target's tokenizer has no chat template")
    try:
        raw = load_dataset("json", data_files=str(path), split="train")
    except Exception as e:  # datasets raises many types for unreadable json
        raise UserError(f"data file '{path}' is not valid JSON lines: {type(e).__name__}") from e
    if "messages" not in raw.column_names:
        raise UserError(f"data file '{path}' has no 'messages' field (columns: {raw.column_names})")

    def encode(row):
        out = tokenize_conversation(tokenizer, row["messages"], max_length, stop_ids)
        ids, mask = out if out else ([], [])
        return {"input_ids": ids, "loss_mask": mask}

    ds = raw.map(encode, remove_columns=raw.column_names, desc=f"tokenizing {Path(path).name}")
    ds = ds.filter(lambda r: sum(r["loss_mask"]) >= 2)
    if len(ds) == 0:
        raise UserError(f"data file '{path}' has no conversation with assistant tokens")
    return ds


def stop_token_ids(target_model, tokenizer) -> set[int]:
    eos = target_model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


@dataclass
class Batch:
    input_ids: torch.Tensor  # [b, T] long, right-padded
    attention_mask: torch.Tensor  # [b, T] long, 0 on padding
    loss_mask: torch.Tensor  # [b, T] bool, assistant tokens
    rows: list[int] | None = None  # dataset row of each sequence (to read an offline hidden-state cache)

    def to(self, device) -> "Batch":
        return Batch(self.input_ids.to(device), self.attention_mask.to(device), self.loss_mask.to(device), self.rows)


def collate(rows: list[dict], pad_id: int) -> Batch:
    T = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), T), dtype=torch.long)
    loss = torch.zeros((len(rows), T), dtype=torch.bool)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.tensor(r["input_ids"])
        attn[i, :n] = 1
        loss[i, :n] = torch.tensor(r["loss_mask"], dtype=torch.bool)
    return Batch(ids, attn, loss, [r["row"] for r in rows] if "row" in rows[0] else None)


def anchor_keys(rows: list[int], lengths: list[int], T: int, seed: int, step: int) -> torch.Tensor:
    """Uniform random keys [b, T] for anchor sampling, a row's keys drawn from its own generator
    seeded by (seed, step, dataset row): a sequence gets the same anchors whichever process or
    micro-batch it lands in, so runs with other process counts or padding see the same blocks."""
    keys = torch.full((len(rows), T), -1.0)
    for i, (row, n) in enumerate(zip(rows, lengths)):
        g = torch.Generator().manual_seed((seed * 1_000_003 + step) * 10_000_019 + row)
        keys[i, :n] = torch.rand(n, generator=g)
    return keys


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Random anchors among assistant tokens: a is a candidate when token a+1 is supervised
    (block slot 1 predicts it). keys [b, T] uniform in [0, 1) (see anchor_keys); the A
    candidates with the largest keys are a uniform sample without replacement.
    Returns anchors [b, A] (sorted, 0 where unused) and valid [b, A]."""
    b, T = loss_mask.shape
    cand = torch.zeros_like(loss_mask)
    cand[:, :-1] = loss_mask[:, 1:]
    keys = torch.where(cand, keys.to(loss_mask.device), torch.full_like(keys, -1.0, device=loss_mask.device))
    A = min(num_anchors, T)
    top, idx = keys.topk(A, dim=1)
    valid = top >= 0
    anchors = torch.where(valid, idx, torch.zeros_like(idx))
    order = torch.argsort(torch.where(valid, anchors, torch.full_like(anchors, T)), dim=1)
    return anchors.gather(1, order), valid.gather(1, order)


def block_labels_index(anchors: torch.Tensor, block_size: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For block slots k = 1..B-1: the predicted token's position a+k [b, A, B-1] and
    whether it is inside the sequence. The target's distribution for it sits at a+k-1."""
    k = torch.arange(1, block_size, device=anchors.device)
    pos = anchors[:, :, None] + k  # [b, A, B-1]
    inside = pos < T
    return pos.clamp(max=T - 1), inside

