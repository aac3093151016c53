"""Fetch vLLM 0.33.0's pure-Python sources once, for the tests that run vLLM's own config conversion.

    python tests/fetch_vllm.py            # -> .cache/vllm-0.33.0 (ignored by git); `make vllm-ref`

vLLM is not a dependency: its wheel (~340 MB, CUDA kernels) is downloaded with `pip download
--no-deps`, and only its Python files are unpacked (~180 MB). Its speculators config conversion
(`vllm.transformers_utils.configs.speculators`) imports on a CPU-only machine; the tests skip with
a reason when the folder is absent. DFLASH_VLLM_SRC points the tests at another copy.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

VERSION = "0.33.0"
DEST = Path(os.environ.get("DFLASH_VLLM_SRC") or Path(__file__).resolve().parents[1] / ".cache"
            / f"vllm-{VERSION}")


def main() -> int:
    if (DEST / "vllm" / "transformers_utils" / "configs" / "speculators" / "algos.py").is_file():
        print(f"vLLM {VERSION} sources already in {DEST}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                            "--disable-pip-version-check", "-d", tmp, f"vllm=={VERSION}"])
        if r.returncode != 0:
            print(f"could not download vllm=={VERSION}; the vLLM conversion tests will be skipped",
                  file=sys.stderr)
            return 1
        wheel = next(Path(tmp).glob("vllm-*.whl"))
        partial = DEST.with_name(DEST.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        with zipfile.ZipFile(wheel) as z:
            z.extractall(partial, [n for n in z.namelist() if n.endswith(".py") or n.endswith(".json")])
        partial.replace(DEST)  # complete or absent
    print(f"vLLM {VERSION} sources in {DEST}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
