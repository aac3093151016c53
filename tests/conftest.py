"""Shared fixtures: the bundled tiny target, tiny Qwen3/Llama targets with random weights, small data."""

import atexit
import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

# One torch thread per process (before torch is imported): on this 2-core machine two threads spin
# against any other load (measured with one background process: the first test_decode test and its
# fixture took 403 s with torch's default 2 threads, 115 s with 1). Launched subprocesses inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Tests never reach the Hub or a tracking server.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# Weight hashes of local verifiers (target.weights_sha256) are remembered here, not in ~/.cache; the
# folder goes when the session ends (it was left in /tmp by every run).
if "DFLASH_HASH_CACHE" not in os.environ:
    _hashes = tempfile.mkdtemp(prefix="dflash-hashes-")
    atexit.register(shutil.rmtree, _hashes, ignore_errors=True)
    os.environ["DFLASH_HASH_CACHE"] = os.path.join(_hashes, "hashes.json")
# Any torch JIT build a test causes goes into this checkout's ignored .cache/, not ~/.cache (DeepSpeed's
# CPU shm op is no longer built by our launches: engines.skip_deepspeed_shm_op; test_engines checks).
os.environ["TORCH_EXTENSIONS_DIR"] = str(Path(__file__).resolve().parents[1] / ".cache" / "torch_extensions")

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
ROOT = Path(__file__).resolve().parents[1]
TINY_TARGET = ROOT / "data" / "tiny-target"
sys.path.insert(0, str(ROOT / "data"))
import tinychat  # noqa: E402

from dflash_train.model.target import load_target  # noqa: E402


@pytest.fixture
def one_thread():
    """The tiny target tokenizes and decodes far faster on one thread than on a few busy cores
    (pytestmark = pytest.mark.usefixtures("one_thread") in a module that prepares or decodes a lot)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_target():
    return load_target(str(TINY_TARGET))


def _save_random_target(out: Path, arch: str, num_layers: int = 6) -> Path:
    """A randomly initialised target of the given architecture with the bundled tokenizer."""
    tok = AutoTokenizer.from_pretrained(TINY_TARGET)
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  tie_word_embeddings=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                  bos_token_id=None)
    torch.manual_seed(0)
    model = (Qwen3ForCausalLM(Qwen3Config(**common)) if arch == "qwen3"
             else LlamaForCausalLM(LlamaConfig(**common)))
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def llama_target_dir(tmp_path_factory):
    return _save_random_target(tmp_path_factory.mktemp("llama-target"), "llama")


@pytest.fixture(scope="session")
def qwen3_random_target_dir(tmp_path_factory):
    return _save_random_target(tmp_path_factory.mktemp("qwen3-target"), "qwen3")


@pytest.fixture(scope="session")
def small_data(tmp_path_factory):
    """64 train / 16 val tinychat conversations as jsonl."""
    d = tmp_path_factory.mktemp("data")
    for name, n, seed in [("train", 64, 11), ("val", 16, 12)]:
        with open(d / f"{name}.jsonl", "w") as f:
            for conv in tinychat.conversations(n, seed):
                f.write(json.dumps({"messages": conv}) + "\n")
    return d


@pytest.fixture(scope="session")
def trained_drafter_dir(tmp_path_factory):
    """A drafter briefly trained on the bundled target (so its guesses are often accepted)."""
    from dflash_train.cli.train import main

    out = tmp_path_factory.mktemp("drafter") / "run"
    # its own schedule, not the tiny recipe's: tests lean on how well this drafter is trained
    main([f"output_dir={out}", "max_steps=100", "train.batch_size=16", "train.lr=3e-3", "data.num_anchors=32",
          "eval.every=0", "eval.max_samples=16", "checkpoint_every=0", "log_every=100"])
    return out / "final"


@pytest.fixture(scope="session")
def fresh_drafter_dir(tiny_target, tmp_path_factory):
    """An untrained drafter for the bundled target, saved as training saves final/ (cheap: no training)."""
    from dflash_train.checkpoint.folders import save_drafter
    from dflash_train.training.build import drafter_config_for
    from dflash_train.training.config import ModelConfig
    from dflash_train.model.drafter import DFlashDrafter

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("fresh") / "drafter"
    save_drafter(out, DFlashDrafter(drafter_config_for(tiny_target, ModelConfig())), tiny_target)
    return out


def broken_target(out: Path, how: str) -> Path:
    """The bundled target with a config its weights do not fill: `missing` (10 layers for 8 layers of
    weights), `unexpected` (6), `mis-shaped` (a wider MLP) or `garbage` (model.safetensors overwritten)."""
    shutil.copytree(TINY_TARGET, out)
    config = json.loads((out / "config.json").read_text())
    if how in ("missing", "unexpected"):
        n = 10 if how == "missing" else 6
        config.update(num_hidden_layers=n, layer_types=config["layer_types"][:1] * n)
    elif how == "mis-shaped":
        config["intermediate_size"] *= 2
    else:
        (out / "model.safetensors").write_bytes(b"garbage" * 100)
    (out / "config.json").write_text(json.dumps(config))
    return out


def error_line(stderr: str) -> str:
    """The one `error:` line of a failed command; nothing else of ours (no traceback)."""
    lines = [line for line in stderr.splitlines() if line.startswith("error")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


def chat_prompt(tokenizer, question: str):
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)["input_ids"]


def run_main(main, argv) -> tuple[int, str, str]:
    """A CLI's `main(argv)` in this process (no interpreter start-up) -> (exit code, stdout, stderr).
    SystemExit (cli_guard's exit 2, argparse) becomes the code; a normal return is 0."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main([str(a) for a in argv]) or 0
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return rc, out.getvalue(), err.getvalue()
