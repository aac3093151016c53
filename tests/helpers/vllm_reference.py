"""vLLM 0.33's own code for how it reads a drafter checkpoint (from tests/fetch_vllm.py's copy).

- `vllm_draft_config(folder)`: the draft model's config as vLLM builds it: SpeculatorsConfig's
  conversion for a Speculators checkpoint, transformers' AutoConfig for a native one.
- `vllm_layer_causal(config, i)`: vLLM's `_dflash_layer_causal`, executed from qwen3_dflash.py's
  source (that module imports GPU-only packages; the function itself is plain Python).
"""

import ast
import contextlib
import json
import sys
from pathlib import Path

import pytest

from fetch_vllm import DEST, VERSION


def _require():
    if not (DEST / "vllm").is_dir():
        pytest.skip(f"vLLM {VERSION} sources not fetched (run `make vllm-ref` or python tests/fetch_vllm.py)")


@contextlib.contextmanager
def _vllm_importable():
    """vLLM on sys.path only while its conversion runs, and out of sys.modules afterwards: other
    tests check what happens when vLLM is not installed (e.g. `dflash-prepare --backend vllm`)."""
    _require()
    sys.path.insert(0, str(DEST))
    try:
        yield
    finally:
        sys.path.remove(str(DEST))
        for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
            del sys.modules[name]


def speculators_conversion(folder: Path) -> tuple[dict, dict]:
    """-> (the draft model's config dict, vLLM's speculative config) for a Speculators checkpoint."""
    config_dict = json.loads((Path(folder) / "config.json").read_text())
    with _vllm_importable():
        from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

        spec = SpeculatorsConfig.extract_vllm_speculative_config(config_dict)
        return SpeculatorsConfig.extract_transformers_pre_trained_config(config_dict), spec


def vllm_draft_config(folder: Path):
    config_dict = json.loads((Path(folder) / "config.json").read_text())
    if "speculators_config" in config_dict:
        with _vllm_importable():
            from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

            return SpeculatorsConfig.from_pretrained(str(folder))
    _require()
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(folder))


def vllm_layer_causal(config, layer_idx: int) -> bool:
    _require()
    source = (DEST / "vllm" / "model_executor" / "models" / "qwen3_dflash.py").read_text()
    tree = ast.parse(source)
    keep = [n for n in tree.body
            if (isinstance(n, ast.FunctionDef) and n.name == "_dflash_layer_causal")
            or (isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "_SLIDING_ATTENTION"
                                                  for t in n.targets))]
    if len(keep) != 2:
        pytest.fail("vLLM's qwen3_dflash.py no longer has _dflash_layer_causal / "
                    "_SLIDING_ATTENTION as expected")
    namespace = {"Qwen3Config": object}
    exec(compile(ast.Module(body=keep, type_ignores=[]), "qwen3_dflash.py", "exec"), namespace)  # noqa: S102
    return namespace["_dflash_layer_causal"](config, layer_idx)
