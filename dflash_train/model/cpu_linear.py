"""A weight-streaming fp32 linear for CPU decoding, so a verify forward of a few tokens costs about one.

On a CPU, one token's forward is bound by reading the weights from memory; a block or tree verify
of 2-65 tokens reads the same weights but MKL's small-row GEMM spends 2-3x the one-row time on them
(AVX2, SmolLM2-135M, one thread: 1 / 4 / 9 rows through all its linears 43 / 75 / 95 ms with torch,
33 / 35 / 52 ms here). So in fp32 a chain's 9-token verify cost ~2x a plain step, and a drafter needed
tau > 2.1 just to break even. cpu_linear.c reads each weight row once for up to 12 rows of x (a tile
stays in L2 for the next 12), and each output is the same sum in the same order whatever the row
count: a token's logits do not depend on how many tokens were verified beside it.

    from dflash_train.model.cpu_linear import use_stream_linear
    n, why = use_stream_linear(target.model)  # linears switched; (0, the reason) where it cannot run

A linear whose fp32 weights are all bf16 values (a drafter exported in bf16, its frozen head too) keeps a
bf16 copy and streams that: half the bytes, widened to fp32 in registers, so the same products and sums
bit for bit (SmolLM2's drafter pass 8.8 -> 7.3 ms: benchmarks/results/round_overheads.json). The copy is
dropped if the weight changes in place.

Plain decoding goes through the same linears, so speedups compare like with like. Built at first use
with the system C compiler (cc) into ~/.cache/dflash-train/, keyed by the source's hash; without a
compiler or AVX2+FMA, torch's linear stays (`kernel()` says why). Used with no autograd only.
"""

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

SOURCE = Path(__file__).with_name("cpu_linear.c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]
# Above this many rows torch's GEMM is as fast or faster (32 rows: 0.98x of its time, 64: 1.10x; prefill,
# training): benchmarks/results/cpu_linear.json
MAX_ROWS = 32
CHOICES = ("auto", "stream", "torch")  # dflash-eval --cpu-linear

_kernel: tuple[ctypes.CDLL | None, str | None] | None = None


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dflash-train"


def _build() -> tuple[ctypes.CDLL | None, str | None]:
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None, f"this CPU has no AVX2 (torch reports {torch.backends.cpu.get_cpu_capability()})"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None, "no C compiler (cc) to build it"
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join([cc, *FLAGS]).encode()).hexdigest()[:16]
    lib = cache_dir() / f"cpu_linear-{digest}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_name(f"{lib.name}.{os.getpid()}.tmp")  # renamed whole: a killed build leaves no .so
        try:
            done = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(tmp)], capture_output=True, text=True)
        except OSError as e:
            return None, f"{cc} did not run: {e}"
        if done.returncode:
            tmp.unlink(missing_ok=True)
            why = (done.stderr.strip().splitlines() or ["no message"])[0]
            return None, f"{cc} failed: {why}"
        os.replace(tmp, lib)
    dll = ctypes.CDLL(str(lib))
    for fn in (dll.stream_linear, dll.stream_linear_bf16):
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        fn.restype = None
    return dll, None


def kernel() -> tuple[ctypes.CDLL | None, str | None]:
    """(the built library, None) or (None, why it cannot run here); built once per process."""
    global _kernel
    if _kernel is None:
        _kernel = _build()
    return _kernel


def stream_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for fp32 CPU x with in_features % 8 == 0: x [..., I], weight [O, I] -> [..., O]. A bf16
    weight is widened to fp32 as it is read (the result: x times those fp32 values)."""
    dll, why = kernel()
    if dll is None:
        raise RuntimeError(f"the streaming linear cannot run here: {why}")
    O, I = weight.shape  # noqa: E741 (the docstring's and the C kernel's shape letters)
    x2 = x.reshape(-1, I).contiguous()
    w = weight.contiguous()
    y = torch.empty(x2.shape[0], O, dtype=torch.float32)
    fn = dll.stream_linear_bf16 if w.dtype == torch.bfloat16 else dll.stream_linear
    fn(x2.data_ptr(), w.data_ptr(), y.data_ptr(), x2.shape[0], I, O, torch.get_num_threads())
    if bias is not None:
        y += bias
    return y.reshape(*x.shape[:-1], O)


class StreamLinear(nn.Linear):
    """nn.Linear whose forward streams its weights for up to MAX_ROWS rows without autograd; its state
    dict, parameters and results otherwise are nn.Linear's (swapped in and out by changing the class).
    weight_bf16: the weight's bf16 copy when every value is a bf16 value (else None), with the weight's
    (data_ptr, _version) when it was made: a weight changed since is streamed from its fp32 self."""
    weight_bf16: torch.Tensor | None = None
    bf16_of: tuple[int, int] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if (rows > MAX_ROWS or x.dtype != torch.float32 or x.device.type != "cpu"
                or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
            return F.linear(x, self.weight, self.bias)
        if self.weight_bf16 is not None and self.bf16_of == (self.weight.data_ptr(), self.weight._version):
            return stream_linear(x, self.weight_bf16, self.bias)
        return stream_linear(x, self.weight, self.bias)

    def keep_bf16_copy(self) -> bool:
        """Keep a bf16 copy of the weight if it loses nothing (every value is a bf16 value). -> kept"""
        w = self.weight.detach()
        w16 = w.bfloat16()
        if not torch.equal(w16.float(), w):
            return False
        self.weight_bf16, self.bf16_of = w16, (w.data_ptr(), w._version)
        return True


def eligible(module: nn.Module) -> bool:
    # a contiguous weight: stream_linear would otherwise copy it on every call
    return (type(module) is nn.Linear and module.weight.dtype == torch.float32
            and module.weight.device.type == "cpu" and module.weight.is_contiguous()
            and module.in_features % 8 == 0)


def use_stream_linear(model: nn.Module) -> tuple[int, str | None]:
    """Switch every fp32 CPU nn.Linear of `model` (contiguous weight, in_features % 8 == 0) to StreamLinear.
    -> (how many were switched, why none could be: None when the kernel runs here)."""
    dll, why = kernel()
    if dll is None:
        return 0, why
    switched = [m for m in model.modules() if eligible(m)]
    for m in switched:
        m.__class__ = StreamLinear
        m.keep_bf16_copy()
    return len(switched), None


def use_torch_linear(model: nn.Module) -> int:
    """Undo use_stream_linear. -> how many linears were switched back."""
    switched = [m for m in model.modules() if type(m) is StreamLinear]
    for m in switched:
        m.__dict__.pop("weight_bf16", None)
        m.__dict__.pop("bf16_of", None)
        m.__class__ = nn.Linear
    return len(switched)
