"""Offline hidden-state cache: the target's tapped states, computed once, read by training.

    dflash-cache --data data/tiny/train.jsonl --target data/tiny-target --output data/cache/tiny
    accelerate launch dflash_train/train.py data.hidden_state_cache=data/cache/tiny

Per conversation (row) it stores the taps [T, n*H] (decoder-layer outputs, the same
`target_forward` training runs online), the target's final-normed last hidden state
[T, H], from which training applies the frozen LM head for KL-type terms and alpha, and the
target's greedy token after each position (int32 [T], from the fp32 states before rounding),
which a draft-vocabulary step uses instead of the full LM head. Rows go into
sharded safetensors (`shard_00000.safetensors`, keys `taps.<row>`, `last.<row>`, `labels.<row>`) with a
manifest naming the target and its pin, the tap layers, dtype, token counts, the dataset's
hash and each shard's SHA-256. Shards are written atomically, so an interrupted build
resumes from the last complete shard. bf16 by default; fp8 (e4m3, one scale per token and
tensor) halves that again; float32 is exact.
"""

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from dflash_train.core.errors import UserError
from dflash_train.core.outputs import file_sha256, match_umask, move_aside, write_marker
from dflash_train.core.progress import BAR_INTERVAL
from dflash_train.core.schema import read_json
from dflash_train.model.target import Target, check_tap_layers, resolve_pin, target_forward

MANIFEST, PARTIAL = "manifest.json", "manifest.partial.json"
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "fp8": torch.float8_e4m3fn}
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Opening a cache hashes its shards when they hold at most this many bytes in all; larger caches
# are checked by size and safetensors header only (hashing 100s of GiB would take minutes).
HASH_LIMIT = 1 << 30


class CacheShard(BaseModel):
    model_config = ConfigDict(extra="forbid")
    file: str = Field(pattern=r"^shard_\d{5}\.safetensors$")
    rows: tuple[Annotated[int, Field(ge=0)], Annotated[int, Field(ge=0)]]  # [lo, hi)
    tokens: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    bytes: int | None = Field(None, ge=0)  # absent in caches from before it was recorded


class CacheManifest(BaseModel):
    """manifest.json (and manifest.partial.json, whose bytes_on_disk is absent)."""
    model_config = ConfigDict(extra="forbid")
    target: str
    target_pin: dict
    target_layer_ids: list[int]
    hidden_size: int = Field(ge=1)
    dtype: Literal["bfloat16", "float32", "fp8"]
    # what the target computed in (bf16, fp32); None: not recorded (older caches)
    target_dtype: str | None = None
    rows: int = Field(ge=0)
    tokens: int = Field(ge=0)
    bytes_per_token: int = Field(ge=1)
    dataset_sha256: str
    shard_rows: int = Field(ge=1)
    shards: list[CacheShard]
    bytes_on_disk: int | None = Field(None, ge=0)
    # labels.<row>: the target's greedy token after each position (int32 [T]); False in older caches
    labels: bool = False

    @model_validator(mode="after")
    def _shards_tile_the_rows(self):
        # HiddenStateCache finds row r in shard r // shard_rows
        for s, shard in enumerate(self.shards):
            want = (s * self.shard_rows, min((s + 1) * self.shard_rows, self.rows))
            if tuple(shard.rows) != want or shard.file != f"shard_{s:05d}.safetensors":
                raise ValueError(f"shard {s} is {shard.file} rows {list(shard.rows)}, expected "
                                 f"shard_{s:05d}.safetensors rows {list(want)}")
        return self


def dataset_hash(ds) -> str:
    """SHA-256 over every row's token ids and loss mask: the cache belongs to exactly this data."""
    h = hashlib.sha256()
    for ids, mask in zip(ds["input_ids"], ds["loss_mask"]):
        h.update(torch.tensor(ids, dtype=torch.int64).numpy().tobytes())
        h.update(bytes(mask))
    return h.hexdigest()


def bytes_per_token(n_taps: int, hidden: int, dtype: str) -> int:
    """taps + last hidden + an int32 label per token; fp8 adds one float32 scale per tensor per token."""
    values = (n_taps + 1) * hidden * (1 if dtype == "fp8" else torch.finfo(DTYPES[dtype]).bits // 8)
    return values + (2 * 4 if dtype == "fp8" else 0) + 4


def _encode(x: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
    """[T, D] float -> stored tensors ({"": values} or fp8 values + per-token scale)."""
    if dtype != "fp8":
        return {"": x.to(DTYPES[dtype]).contiguous()}
    scale = (x.abs().amax(-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)  # [T, 1]
    return {"": (x.float() / scale).to(torch.float8_e4m3fn).contiguous(), "_scale": scale.contiguous()}


def _decode(f, key: str, dtype: str) -> torch.Tensor:
    x = f.get_tensor(key)
    return x.float() * f.get_tensor(key + "_scale") if dtype == "fp8" else x.float()


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def _settings(target: Target, ds, layer_ids: list[int], dtype: str, shard_rows: int) -> dict:
    """The manifest's head: what a cache is for. All of it is the resume key."""
    H = target.model.config.hidden_size
    return {"target": target.name_or_path, "target_pin": resolve_pin(target.name_or_path, target.revision),
            "target_layer_ids": list(layer_ids), "hidden_size": H, "dtype": dtype,
            # part of the resume key: a cache is never resumed in another dtype (bf16 and fp32 states mixed)
            "target_dtype": {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(target.model.dtype,
                                                                                str(target.model.dtype)[6:]),
            "rows": len(ds), "tokens": sum(len(ids) for ids in ds["input_ids"]),
            "bytes_per_token": bytes_per_token(len(layer_ids), H, dtype),
            "dataset_sha256": dataset_hash(ds), "shard_rows": shard_rows, "labels": True}


# The fields a cache of the first rows of a dataset differs in from a cache of all of it.
GROWS = {"rows", "tokens", "dataset_sha256"}


def _prefix_of(found: dict, head: dict, ds) -> bool:
    """Is `found` (a manifest) a cache of the first found['rows'] rows of `ds`, with head's settings?"""
    differ = {k for k in head if found.get(k) != head[k]}
    return (bool(differ) and differ <= GROWS and 0 < found.get("rows", 0) < len(ds)
            and dataset_hash(ds.select(range(found["rows"]))) == found["dataset_sha256"])


def _reuse_or_replace(out: Path, head: dict, ds, overwrite: bool,
                      append: bool) -> tuple[dict | None, Path | None]:
    """What `out` holds decides the build: -> (the manifest whose shards may be reused, or None; a folder
    moved aside to delete once the new build has started, or None). Returns the complete manifest itself,
    with no folder, when `out` is already a complete cache of these settings (nothing to do)."""
    if not ((out / MANIFEST).exists() or (out / PARTIAL).exists()):
        return None, None
    complete = (out / MANIFEST).exists()
    try:
        found = read_json(out / (MANIFEST if complete else PARTIAL), CacheManifest).model_dump(mode="json",
                                                                                    exclude_none=True)
    except UserError as e:  # a damaged manifest in a cache of ours (require_free_output checked the marker)
        if not overwrite:
            raise UserError(f"{e} (pass --overwrite to replace this cache)") from None
        return None, move_aside(out)
    differ = [k for k in head if found.get(k) != head[k]]
    if not differ and complete and not overwrite:
        try:
            check_complete(out)
        except UserError as e:  # a shard was deleted or damaged since: rebuild what is missing
            print(f"{e}: rebuilding it", file=sys.stderr)
            _write_json(out / PARTIAL, {k: v for k, v in found.items() if k != "bytes_on_disk"})
            (out / MANIFEST).unlink()  # no longer complete: training refuses it until rebuilt
            return found, None
        return found | {"complete": True}, None
    if overwrite:
        return None, move_aside(out)  # `--output .`: the current folder stays, emptied
    if differ and complete and _prefix_of(found, head, ds):
        if not append:
            raise UserError(f"'{out}' holds a cache of the first {found['rows']} of these {len(ds)} rows: "
                            "pass --append to extend it (its full shards are kept), or --overwrite to "
                            "replace it")
        # Full shards of the prefix are the same rows of this data; the prefix's last, short shard is rebuilt.
        kept = [s for s in found["shards"] if s["rows"][1] - s["rows"][0] == head["shard_rows"]]
        print(f"extending '{out}' from {found['rows']} to {len(ds)} rows ({len(kept)} full shard(s) kept)",
              file=sys.stderr)
        _write_json(out / PARTIAL, {**head, "shards": kept})
        (out / MANIFEST).unlink()  # no longer complete for the data it now serves
        return found | {"shards": kept}, None
    if differ:
        raise UserError(f"'{out}' holds a {'complete' if complete else 'partial'} cache for other settings "
                        f"({', '.join(differ)} differ): pass --overwrite to replace it")
    return found, None  # a partial build of these settings: resume it


def _shard_tensors(target: Target, ds, lo: int, hi: int, layer_ids: list[int], dtype: str,
                   batch_size: int) -> dict[str, torch.Tensor]:
    """Rows [lo, hi) through the target, batch_size at a time -> the shard's tensors (taps, last, labels)."""
    device = target.embed.weight.device
    pad = target.tokenizer.pad_token_id or 0
    tensors = {}
    for b in range(lo, hi, batch_size):
        rows = list(range(b, min(b + batch_size, hi)))
        lengths = [len(ds[r]["input_ids"]) for r in rows]
        ids = torch.full((len(rows), max(lengths)), pad, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, : lengths[i]] = torch.tensor(ds[r]["input_ids"])
            attn[i, : lengths[i]] = 1
        taps, last = target_forward(target, ids.to(device), attn.to(device), layer_ids)
        for i, r in enumerate(rows):
            for key, x in [("taps", taps[i, : lengths[i]]), ("last", last[i, : lengths[i]])]:
                for suffix, t in _encode(x.cpu(), dtype).items():
                    tensors[f"{key}.{r}{suffix}"] = t
            tensors[f"labels.{r}"] = greedy_labels(target, last[i, : lengths[i]])
    return tensors


def _write_shard(out: Path, name: str, tensors: dict, rows: tuple[int, int], tokens: int) -> dict:
    """Atomically: a shard is either absent or complete. -> its manifest record."""
    tmp = out / f".{name}.tmp"
    save_file(tensors, tmp)
    match_umask(tmp)  # safetensors writes 0600
    os.replace(tmp, out / name)
    return {"file": name, "rows": list(rows), "tokens": tokens, "sha256": file_sha256(out / name),
            "bytes": (out / name).stat().st_size}


@torch.no_grad()
def build_cache(target: Target, ds, layer_ids: list[int], out: Path, dtype: str = "bfloat16",
                shard_rows: int = 256, batch_size: int = 8, overwrite: bool = False,
                append: bool = False) -> dict:
    """Compute and store the states of every row of `ds`; resumes from complete shards in `out`.
    A complete cache for the same settings is left as it is. `overwrite` replaces a cache made
    with other settings (moved aside, deleted once the new one is started); `append` extends a
    complete cache of the first rows of `ds` (a corpus that grew at its end), keeping its full shards."""
    check_tap_layers(layer_ids, target.num_layers)
    head = _settings(target, ds, layer_ids, dtype, shard_rows)
    found, old = _reuse_or_replace(out, head, ds, overwrite, append)
    if found is not None and found.pop("complete", False):
        print(f"hidden-state cache '{out}' is already complete ({found['rows']} rows, {found['tokens']:,} "
              "tokens): nothing to do", file=sys.stderr)
        return found
    out.mkdir(parents=True, exist_ok=True)
    write_marker(out, "cache")
    if old is not None:
        shutil.rmtree(old)
    for stale in out.glob(".shard_*.tmp"):  # cut off by an interruption
        stale.unlink()
    done = {s["file"]: s for s in (found or {}).get("shards", [])
            if (out / s["file"]).is_file() and file_sha256(out / s["file"]) == s["sha256"]}
    print(f"hidden-state cache: {len(ds)} rows, {head['tokens']:,} tokens, {head['bytes_per_token']:,} "
          f"bytes/token ({dtype}), {head['tokens'] * head['bytes_per_token'] / 2**20:,.1f} MiB in all; "
          f"{len(done)} shard(s) already done", file=sys.stderr)
    lengths = [len(ids) for ids in ds["input_ids"]]
    shards = []
    for s in tqdm(range(-(-len(ds) // shard_rows)), desc="cache shards", mininterval=BAR_INTERVAL):
        name = f"shard_{s:05d}.safetensors"
        if name in done:
            shards.append(done[name])
            continue
        lo, hi = s * shard_rows, min((s + 1) * shard_rows, len(ds))
        tensors = _shard_tensors(target, ds, lo, hi, layer_ids, dtype, batch_size)
        shards.append(_write_shard(out, name, tensors, (lo, hi), sum(lengths[lo:hi])))
        _write_json(out / PARTIAL, {**head, "shards": shards})
    manifest = {**head, "shards": shards,
                "bytes_on_disk": sum((out / s["file"]).stat().st_size for s in shards)}
    _write_json(out / MANIFEST, manifest)
    (out / PARTIAL).unlink(missing_ok=True)
    return manifest


def greedy_labels(target: Target, last: torch.Tensor, rows: int = 512) -> torch.Tensor:
    """last [T, H] (the target's final-normed states, before any cache rounding) -> its greedy token
    after each position, int32 [T]: a draft-vocabulary step reads these instead of the full LM head."""
    return torch.cat([target.lm_head(last[i : i + rows]).argmax(-1) for i in range(0, len(last), rows)]).to(
        "cpu", torch.int32)


def shards_done(out: Path) -> int:
    """Complete shards of a partial cache (its manifest lists them)."""
    try:
        return len(json.loads((out / PARTIAL).read_text())["shards"])
    except (OSError, ValueError, KeyError):
        return 0


class HiddenStateCache:
    """Reads rows of a complete cache (memory-mapped safetensors), padded into batches."""

    def __init__(self, path: Path, manifest: dict):
        self.path, self.manifest = path, manifest
        self.dtype, self.shard_rows = manifest["dtype"], manifest["shard_rows"]
        self._open: dict[int, object] = {}

    def _shard(self, row: int):
        s = row // self.shard_rows
        if s not in self._open:
            self._open[s] = safe_open(str(self.path / self.manifest["shards"][s]["file"]), framework="pt")
        return self._open[s]

    def batch(self, rows: list[int], T: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """-> taps [b, T, n*H], last [b, T, H] (zeros past each row's end, like right padding)."""
        taps = [_decode(self._shard(r), f"taps.{r}", self.dtype) for r in rows]
        last = [_decode(self._shard(r), f"last.{r}", self.dtype) for r in rows]
        pad = lambda xs: torch.stack([torch.nn.functional.pad(x, (0, 0, 0, T - x.shape[0]))  # noqa: E731
                                      for x in xs])
        return pad(taps).to(device, dtype), pad(last).to(device, dtype)

    def labels(self, rows: list[int], T: int, device) -> torch.Tensor | None:
        """-> the target's greedy labels [b, T] long (-1 past each row's end), None in a cache without
        them."""
        if not self.manifest.get("labels"):
            return None
        out = torch.full((len(rows), T), -1, dtype=torch.long)
        for i, r in enumerate(rows):
            x = self._shard(r).get_tensor(f"labels.{r}")
            out[i, : len(x)] = x.long()
        return out.to(device)


def check_complete(path: Path) -> dict:
    """A cache training can read from start to end, else one UserError line: the manifest is whole
    and well-formed, and every shard it lists is there with its recorded size and a readable
    safetensors header holding its rows (and, up to HASH_LIMIT bytes in all, its recorded SHA-256).
    Runs before a training run touches its output_dir. -> the manifest."""
    if not (path / MANIFEST).is_file():
        hint = (" (its build did not finish: rerun dflash-cache to resume)" if (path / PARTIAL).is_file()
                else "")
        raise UserError(f"'{path}' is not a complete hidden-state cache{hint}")
    m = read_json(path / MANIFEST, CacheManifest)
    if len(m.shards) != -(-m.rows // m.shard_rows):
        raise UserError(f"'{path / MANIFEST}': field 'shards': lists {len(m.shards)} shards for {m.rows} "
                        f"rows of {m.shard_rows}")
    rebuild = "rerun the dflash-cache command that made it to rebuild the shard"
    sizes = []
    for shard in m.shards:
        f = path / shard.file
        if not f.is_file():
            raise UserError(f"hidden-state cache '{path}' is missing {shard.file} (listed in its manifest): "
                            f"{rebuild}")
        sizes.append(f.stat().st_size)
        if shard.bytes is not None and sizes[-1] != shard.bytes:
            raise UserError(f"hidden-state cache '{path}': {shard.file} is {sizes[-1]:,} bytes, its manifest "
                            f"says {shard.bytes:,} (truncated or replaced): {rebuild}")
    if m.bytes_on_disk is not None and sum(sizes) != m.bytes_on_disk:
        raise UserError(f"hidden-state cache '{path}': its shards hold {sum(sizes):,} bytes, its manifest "
                        f"says {m.bytes_on_disk:,} (a shard was truncated or replaced): {rebuild}")
    for shard in m.shards:
        lo, hi = shard.rows
        try:
            with safe_open(str(path / shard.file), framework="pt") as f:
                keys = set(f.keys())
        except (SafetensorError, OSError) as e:
            raise UserError(f"hidden-state cache '{path}': {shard.file} is not a readable safetensors file "
                            f"({str(e).splitlines()[0] if str(e) else type(e).__name__}): "
                            f"{rebuild}") from None
        names = ("taps", "last", "labels") if m.labels else ("taps", "last")
        if not all(f"{name}.{r}" in keys for r in range(lo, hi) for name in names):
            raise UserError(f"hidden-state cache '{path}': {shard.file} does not hold rows {lo}..{hi - 1}: "
                            f"{rebuild}")
    if sum(sizes) <= HASH_LIMIT:
        for shard in m.shards:
            if file_sha256(path / shard.file) != shard.sha256:
                raise UserError(f"hidden-state cache '{path}': {shard.file} does not match the SHA-256 in "
                                f"its manifest (damaged or replaced): {rebuild}")
    return m.model_dump(exclude_none=True)


def open_cache(path: str | Path, target: Target, layer_ids: list[int], ds) -> HiddenStateCache:
    """Open a cache for training; refuse one made for another target, tap set or dataset, or one
    whose shards are missing or damaged (check_complete)."""
    path = Path(path)
    m = check_complete(path)
    pin = resolve_pin(target.name_or_path, target.revision)
    mine = {k: v for k, v in pin.items() if k != "name_or_path"}
    theirs = {k: v for k, v in m["target_pin"].items() if k != "name_or_path"}
    if mine != theirs:
        raise UserError(f"hidden-state cache '{path}' was made for another target ({m['target']}, "
                        f"{m['target_pin'].get('revision') or m['target_pin'].get('sha256', '')[:12]})")
    if m["target_layer_ids"] != list(layer_ids):
        raise UserError(f"hidden-state cache '{path}' has taps {m['target_layer_ids']}, the drafter needs "
                        f"{layer_ids}")
    if m["rows"] != len(ds) or m["dataset_sha256"] != dataset_hash(ds):
        raise UserError(f"hidden-state cache '{path}' was made for other data than data.train")
    return HiddenStateCache(path, m)
