"""Training data -> token ids with an assistant-only loss mask -> padded batches.

The loss mask comes from `chat.encode_conversations` (the same code as dflash-prepare): the
conversation is rendered once with the target's chat template, each assistant reply is located
in the text, and the tokens from the reply's start through the template's end-of-turn token are
supervised, checked against the tokenizer's offsets.
"""

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow.compute as pc
import torch
from datasets import Dataset, load_from_disk
from datasets.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
from transformers import PreTrainedTokenizerBase

from dflash_train.core.errors import UserError
from dflash_train.data import chat


def check_data_path(path: str) -> None:
    """Cheap, before the target is loaded: the data is there."""
    if not Path(path).exists():
        raise UserError(f"data file '{path}' not found")


@contextlib.contextmanager
def quiet_datasets():
    """No datasets progress bars (its Filter / Flattening bars would print on every run)."""
    was_quiet = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        yield
    finally:
        if not was_quiet:
            enable_progress_bars()


def load_conversations(path: str, tokenizer: PreTrainedTokenizerBase, max_length: int) -> Dataset:
    """Training data -> Dataset(input_ids, loss_mask), cut to max_length, rows with >= 2 supervised tokens.

    `path` is a folder written by `dflash-prepare` (OUT, OUT/train or OUT/val: a `save_to_disk`
    dataset with input_ids/loss_mask columns), or a jsonl of {"messages": [...]} rows masked by the
    same code as dflash-prepare (`chat.encode_conversations`)."""
    p = Path(path)
    check_data_path(path)
    if p.is_dir():
        ds = _load_prepared(p, tokenizer)
        longest = pc.max(pc.list_value_length(ds.data.column("input_ids"))).as_py() or 0
        if longest > max_length:  # in memory: never write cache files into the prepared folder
            ds = ds.map(lambda r: {"input_ids": r["input_ids"][:max_length],
                                   "loss_mask": r["loss_mask"][:max_length]},
                        keep_in_memory=True, desc=f"cutting {p.name} to {max_length} tokens")
    else:
        ds = _tokenize_jsonl(p, tokenizer, max_length)
    with quiet_datasets():  # flattened here, so adding a column later needs no pass of its own
        ds = ds.filter(lambda r: sum(r["loss_mask"]) >= 2,
                       keep_in_memory=True).flatten_indices(keep_in_memory=True)
    if len(ds) == 0:
        raise UserError(f"data file '{path}' has no conversation with assistant tokens")
    return ds


def _tokenize_jsonl(path: Path, tokenizer, max_length: int) -> Dataset:
    """A messages jsonl, every row well formed (training has no report to count skipped rows in)."""
    fields = chat.Fields(*chat.FORMATS["messages"], chat.ROLE_NAMES)
    rows = chat.read_rows(str(path), "json", "train", None)
    conversations, _ = chat.read_conversations(rows, "messages", fields, strict=True, source=str(path))
    eot = chat.end_of_turn(tokenizer)
    encoded = chat.encode_conversations(tokenizer, conversations, eot, max_length, enable_thinking=False)
    return chat.to_dataset([r for r in encoded if not isinstance(r, str)])


def _load_prepared(folder: Path, tokenizer) -> Dataset:
    """A dflash-prepare dataset folder, checked against the training target's tokenizer."""
    if not (folder / "state.json").is_file():
        splits = sorted(d.name for d in folder.iterdir() if (d / "state.json").is_file())
        hint = f"it holds the splits {', '.join(splits)}: pass '{folder / splits[0]}'" if splits else \
            "no dataset saved by dflash-prepare (state.json) in it"
        raise UserError(f"data folder '{folder}': {hint}")
    try:
        ds = load_from_disk(str(folder))
    except Exception as e:  # datasets raises many types for damaged folders
        raise UserError(f"data folder '{folder}' cannot be read as a dataset: {type(e).__name__}: "
                        f"{e}") from None
    missing = {"input_ids", "loss_mask"} - set(ds.column_names)
    if missing:
        raise UserError(f"data folder '{folder}' lacks the columns {sorted(missing)} (has "
                        f"{ds.column_names}); prepare it with dflash-prepare")
    info = next((f for f in (folder / chat.INFO_FILE, folder.parent / chat.INFO_FILE) if f.is_file()), None)
    if info is not None and tokenizer.chat_template is not None:
        made = prepared_with(info, folder)
        if made["template"].get("sha256") != chat.template_sha256(tokenizer):
            raise UserError(f"data folder '{folder}' was prepared with another chat template (target "
                            f"'{made['target'].get('name_or_path')}'): prepare it again for this target")
        # the same template over another tokenizer: other ids for the same text (older infos lack it)
        if made["tokenizer"].get("sha256") not in (None, chat.tokenizer_sha256(tokenizer)):
            raise UserError(f"data folder '{folder}' was prepared with another tokenizer (target "
                            f"'{made['target'].get('name_or_path')}'): prepare it again for this target")
    top = pc.max(pc.list_flatten(ds.data.column("input_ids"))).as_py() if len(ds) else None
    if top is not None and top >= len(tokenizer):
        raise UserError(f"data folder '{folder}' holds token id {top}, outside this target's vocabulary "
                        f"({len(tokenizer)} ids): prepare it again for this target")
    return ds


def prepared_with(info: Path, folder: Path) -> dict:
    """The prepare_info.json beside a training data folder: its template, tokenizer and target entries
    (each a mapping, maybe empty); a cut or edited file is one line, not a traceback."""
    try:
        made = json.loads(info.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"data folder '{folder}': its {info.name} is damaged "
                        f"({type(e).__name__}): prepare it "
                        "again") from None
    parts = {k: made.get(k, {}) if isinstance(made, dict) else None
             for k in ("template", "tokenizer", "target")}
    if not all(isinstance(v, dict) for v in parts.values()):
        raise UserError(f"data folder '{folder}': its {info.name} is damaged (not what "
                        "dflash-prepare writes): prepare it again")
    return parts


def stop_token_ids(target_model, tokenizer, end_of_turn: str | None = None) -> set[int]:
    """The ids a target's answer ends at: the model's generation_config EOS (target_model None: a model
    not loaded here, vLLM's), the tokenizer's EOS, and the chat template's end-of-turn token when given
    (regeneration, which records them sorted in its resume key; decoding stops at the EOS ids alone)."""
    eos = target_model.generation_config.eos_token_id if target_model is not None else None
    ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if end_of_turn is not None:
        ids.add(tokenizer.convert_tokens_to_ids(end_of_turn))
    return ids


@dataclass
class Batch:
    input_ids: torch.Tensor  # [b, T] long, right-padded
    attention_mask: torch.Tensor  # [b, T] long, 0 on padding
    loss_mask: torch.Tensor  # [b, T] bool, assistant tokens
    rows: list[int] | None = None  # dataset row of each sequence (to read an offline hidden-state cache)

    def to(self, device) -> "Batch":
        return Batch(self.input_ids.to(device), self.attention_mask.to(device), self.loss_mask.to(device),
                     self.rows)


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
