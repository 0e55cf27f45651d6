"""The CUDA path is the CPU path: engine code never names a device.

Every tensor is created on the configured device, which `resolve_device()`
(engine/device.py, the one place that names devices) hands out. This test scans the AST of
every module under engine/ for what would make one device's run break on the other:

- a device named literally: the strings "cpu", "cuda", "cuda:N" (e.g. a `device="cpu"`
  default), anywhere but engine/device.py;
- `.cpu()` / `.cuda()`: moving a tensor to a named device (bring a small result to the host
  with `.tolist()` / `.item()` instead, which work on either);
- `.numpy()`: fails on a CUDA tensor (use `.tolist()`, or `.cpu()` via an allow-listed spot);
- `torch.cuda.*` outside engine/device.py: fails on a CPU-only build or machine (device.py
  has device-agnostic helpers: `synchronize`, `reset_peak_memory_stats`,
  `measure_gpu_memory`, `uses_pinned_memory`, `is_cpu`, `gpu_has_bf16`);
- a tensor factory (`torch.tensor`, `torch.zeros`, `torch.arange`, `torch.Generator`, ...)
  without `device=`: it lands on the host. Allowed when the result is moved at once
  (`torch.tensor(x).to(device)`) or is an explicit pinned staging buffer (`pin_memory=`).

Deliberate exceptions are listed in ALLOWED with the reason; an entry that no longer matches
anything fails too, so the list stays exact.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENGINE = REPO / "engine"
# Resolves the configured device: the only module allowed to name one.
DEVICE_RESOLVER = "engine/device.py"

DEVICE_STRING = re.compile(r"(cpu|cuda)(:\d+)?")
MOVE_METHODS = frozenset({"cpu", "cuda"})
HOST_ONLY_METHODS = frozenset({"numpy"})
# torch functions that create a tensor (or generator) on the default device, i.e. the host,
# unless given device=. *_like factories follow their argument's device and are fine.
TENSOR_FACTORIES = frozenset(
    {
        "tensor", "as_tensor", "from_numpy", "zeros", "ones", "empty", "full", "arange",
        "range", "linspace", "logspace", "eye", "rand", "randn", "randint", "randperm",
        "empty_strided", "Generator",
    }
)  # fmt: skip


@dataclass(frozen=True)
class Finding:
    path: str  # relative to the repo, posix
    line: int
    scope: str  # enclosing qualified name, "<module>" at top level
    kind: str  # what was found, e.g. 'device string "cpu"' or "torch.arange without device="

    def key(self) -> tuple[str, str, str]:
        return (self.path, self.scope, self.kind)

    def __str__(self) -> str:
        return f"{self.path}:{self.line} in {self.scope}: {self.kind}"


_GGUF_HOST = (
    "a GGUF file is read in host memory (memory-mapped) like safetensors; its blocks "
    "stay there for the CPU kernels, or are dequantized and copied into parameters on "
    "the configured device (dest.copy_)"
)
# (path, enclosing scope, kind) -> why it is correct on CPU and on CUDA alike.
_TIER_HOST = (
    "the KV tier keeps blocks in host memory (a memory-mapped file): a block's bytes leave the "
    "cache's device for the host and come back with .to(the cache's device)"
)
ALLOWED: dict[tuple[str, str, str], str] = {
    ("engine/cuda_graphs.py", "CudaGraphCapture.__call__", "torch.cuda"): (
        "the one CUDA seam of the graph runner (capture and synchronize): built only where "
        "the execution plan says the device is CUDA; the tests replace it on CPU"
    ),
    ("engine/kv_tier.py", "read_blocks", ".cpu()"): _TIER_HOST,
    ("engine/kv_tier.py", "read_blocks", ".numpy()"): _TIER_HOST,
    ("engine/kv_tier.py", "write_blocks", "torch.from_numpy without device="): _TIER_HOST,
    (
        "engine/gguf_weights.py",
        "GGUFTensor.dequantize",
        "torch.from_numpy without device=",
    ): _GGUF_HOST,
    ("engine/gguf_weights.py", "GGUFTensor.dequantize", ".numpy()"): _GGUF_HOST,
    ("engine/gguf_weights.py", "qk_row_order", "torch.arange without device="): _GGUF_HOST,
    ("engine/gguf_weights.py", "v_head_order", "torch.arange without device="): _GGUF_HOST,
    ("engine/gguf_weights.py", "qwen35_orders", "torch.arange without device="): _GGUF_HOST,
    ("engine/gguf_weights.py", "_float_tensor", "torch.from_numpy without device="): _GGUF_HOST,
    ("engine/gguf_weights.py", "read_tensors", "torch.from_numpy without device="): _GGUF_HOST,
    ("engine/gguf_weights.py", "_experts", "torch.from_numpy without device="): _GGUF_HOST,
    ("engine/loader.py", "_safetensors", 'device string "cpu"'): (
        "safetensors reads each weight into host memory; load_weights copies it into the "
        "parameter on the configured device (dest.copy_), so loading is the same on both"
    ),
    ("engine/distributed.py", "distributed_backend", 'device string "cuda"'): (
        "the collective library follows the device type (NCCL between CUDA devices, gloo on "
        "the CPU): a choice of backend, not a placement"
    ),
    ("engine/attention/decode_plan.py", "_decode_groups", 'device string "cpu"'): (
        "a tuning choice, not placement: on CPU decode queries are gathered in groups to bound "
        "the padded key gather; both branches run correctly on either device"
    ),
    ("engine/kernels/__init__.py", "bf16_cpu_kernels", 'device string "cpu"'): (
        "a kernel choice, not placement: the kernels are CPU code; a model on another device "
        "runs its matmuls, attention and small ops through torch, tested equal to them"
    ),
    ("engine/kernels/__init__.py", "layer_kernels", 'device string "cpu"'): (
        "a kernel choice, not placement: the float32 layer kernels are CPU code; a GGUF on "
        "another device is dequantized and runs through torch, tested equal to them"
    ),
    ("engine/kernels/__init__.py", "host_kernels", 'device string "cpu"'): (
        "a kernel choice, not placement: the grammar mask's AVX-512 kernel is CPU code; "
        "logits on another device take xgrammar's apply, tested equal to it"
    ),
    ("engine/quantization/dense.py", "DenseMethod.pack", 'device string "cpu"'): (
        "a layout choice, not placement: torch's CPU fp32 matmul is faster on [in, out] "
        "weights; the weight stays on its device either way"
    ),
    ("engine/attention/sdpa.py", "attention_with_lse", 'device string "cpu"'): (
        "a kernel choice, not placement: torch's fused flash kernel with log-sum-exp exists "
        "only for CPU tensors; other devices take attention_with_lse_ops, tested equal to it"
    ),
    ("engine/attention/kv_cache.py", "_zeroed", 'device string "cpu"'): (
        "a memory choice, not placement: on CPU the cache comes from an anonymous mapping "
        "(resident only where used); other devices get torch.zeros on their device"
    ),
    ("engine/attention/kv_cache.py", "_zeroed", "torch.zeros without device="): (
        "the empty (zero-element) cache on the CPU branch, where the device is the host"
    ),
    ("engine/models/rotary.py", "rope_inv_freq", "torch.arange without device="): (
        "inverse RoPE frequencies are computed on the host, as transformers does, so they are "
        "bit-identical to it; RotaryEmbedding moves them to the configured device once"
    ),
    ("engine/model_runner.py", "ModelRunner._prepare_inputs", ".numpy()"): (
        "host staging: the step's token ids are written into the reusable (pinned on CUDA) "
        "host buffer through its numpy view, then copied to the device with non_blocking=True"
    ),
    ("engine/cuda_graphs.py", "DecodeBuffers.load", ".numpy()"): (
        "host staging: a decode step's inputs are written into the host twins (pinned on "
        "CUDA) of the graphs' buffers through their numpy views, then copied to the device"
    ),
    ("engine/sampling_metadata.py", "_padded", "torch.as_tensor without device="): (
        "host staging: the per-request id lists are padded on the host and the padded batch "
        "is moved with one .to(device) two lines below"
    ),
}


class _Scanner(ast.NodeVisitor):
    def __init__(self, path: str) -> None:
        self.path = path
        self.scopes: list[str] = []
        self.findings: list[Finding] = []
        self._moved_at_once: set[int] = set()  # id() of factory calls that are .to(...)'d

    def _add(self, node: ast.AST, kind: str) -> None:
        scope = ".".join(self.scopes) or "<module>"
        self.findings.append(Finding(self.path, node.lineno, scope, kind))

    def _visit_scope(self, node: ast.AST) -> None:
        self.scopes.append(node.name)  # type: ignore[attr-defined]
        self.generic_visit(node)
        self.scopes.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _visit_scope

    def visit_Constant(self, node: ast.Constant) -> None:
        if (
            self.path != DEVICE_RESOLVER
            and isinstance(node.value, str)
            and DEVICE_STRING.fullmatch(node.value)
        ):
            self._add(node, f'device string "{node.value}"')

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if (
            self.path != DEVICE_RESOLVER
            and node.attr == "cuda"
            and isinstance(node.value, ast.Name)
            and node.value.id == "torch"
        ):
            self._add(node, "torch.cuda")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute):
            if func.attr in MOVE_METHODS and not _is_torch(func.value):
                self._add(node, f".{func.attr}()")
            if func.attr in HOST_ONLY_METHODS:
                self._add(node, f".{func.attr}()")
            if func.attr == "to" and isinstance(func.value, ast.Call):
                self._moved_at_once.add(id(func.value))
            if (
                _is_torch(func.value)
                and func.attr in TENSOR_FACTORIES
                and id(node) not in self._moved_at_once
                and not any(k.arg in ("device", "pin_memory") for k in node.keywords)
            ):
                self._add(node, f"torch.{func.attr} without device=")
        self.generic_visit(node)


def _is_torch(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "torch"


def scan_source(source: str, path: str) -> list[Finding]:
    scanner = _Scanner(path)
    scanner.visit(ast.parse(source, filename=path))
    return scanner.findings


def scan_engine() -> list[Finding]:
    findings: list[Finding] = []
    for file in sorted(ENGINE.rglob("*.py")):
        rel = file.relative_to(REPO).as_posix()
        findings += scan_source(file.read_text(encoding="utf-8"), rel)
    return findings


def test_engine_names_no_device_outside_config() -> None:
    found = scan_engine()
    violations = [f for f in found if f.key() not in ALLOWED]
    assert not violations, (
        "engine code that assumes one device (create tensors on the configured device, move "
        "results with .tolist(), put device-specific calls in engine/device.py, or add a "
        "reasoned ALLOWED entry):\n" + "\n".join(f"  {v}" for v in violations)
    )


def test_every_allowed_entry_still_matches() -> None:
    matched = {f.key() for f in scan_engine()}
    stale = [key for key in ALLOWED if key not in matched]
    assert not stale, f"ALLOWED entries that match nothing any more (remove them): {stale}"


# -- the scanner itself: it finds each kind of device assumption, and nothing in clean code ----

DIRTY = """
import torch

class Runner:
    def __init__(self, device: str = "cpu") -> None:
        self.buf = torch.zeros(4)

    def step(self, x, ids):
        y = x.cuda()
        ids = torch.tensor(ids)
        torch.cuda.synchronize()
        return y.cpu().numpy(), torch.device("cuda:1")
"""

CLEAN = """
import torch

class Runner:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buf = torch.zeros(4, device=device)
        self.staging = torch.empty(4, dtype=torch.long, pin_memory=True)
        self.gen = torch.Generator(device=device)

    def step(self, x, ids):
        ids = torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True)
        y = torch.zeros_like(x).to(x.device)
        return y.tolist(), ids.sum().item(), "a cpu-friendly docstring", self.helper.cuda_graphs
"""


def test_scanner_finds_every_kind_of_device_assumption() -> None:
    found = {(f.line, f.scope, f.kind) for f in scan_source(DIRTY, "engine/x.py")}
    assert found == {
        (5, "Runner.__init__", 'device string "cpu"'),
        (6, "Runner.__init__", "torch.zeros without device="),
        (9, "Runner.step", ".cuda()"),
        (10, "Runner.step", "torch.tensor without device="),
        (11, "Runner.step", "torch.cuda"),
        (12, "Runner.step", ".cpu()"),
        (12, "Runner.step", ".numpy()"),
        (12, "Runner.step", 'device string "cuda:1"'),
    }


def test_scanner_passes_device_agnostic_code() -> None:
    assert scan_source(CLEAN, "engine/x.py") == []


@pytest.mark.parametrize("source", ['DEVICE = "cuda"', "torch.cuda.synchronize()"])
def test_only_engine_config_may_name_devices_and_torch_cuda(source: str) -> None:
    assert scan_source(source, DEVICE_RESOLVER) == []
    assert len(scan_source(source, "engine/model_runner.py")) == 1
