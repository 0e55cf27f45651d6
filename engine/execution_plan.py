"""How a step executes here, decided once: the `ExecutionPlan`.

`resolve_plan` reads the user's options (`EngineConfig`), the model's config and this
machine (device, CPU flags through `engine.kernels`, CUDA) and fixes every choice the model,
the runner and the CUDA graphs make: dtype, weight quantization, attention backend, the
layers' small ops (torch's or a native kernels build), whether decode steps may run as one
native call, and whether they replay CUDA graphs. Nothing else probes the machine: the model
is built from the plan, the runner executes it, and the start-up line, `/metrics` and the
dashboard print it (`describe`). Environment switches are inputs, named in the plan
(``$PAGEDSERVE_CPU_KERNELS``).

Two facts are only known once the weights are packed (which formats each projection kept,
and so how many rows the decode stack takes); `with_weights` records them, and the engine
core keeps that final plan.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NamedTuple

import torch

from engine import kernels
from engine.attention.registry import DEFAULT_BACKEND, backend_class, cpu_paged_fits
from engine.config import DTYPES
from engine.device import gpu_has_bf16, is_cpu, is_cuda
from engine.models.registry import get_model_class
from kv_cache.groups import kv_cache_groups

# CPU flags that mean bfloat16 matmuls run in hardware (AVX512-BF16 dot products or AMX
# tiles); without them torch emulates bf16 and float32 is faster. With them bf16 halves
# the weight bytes a decode step reads. Measured on an AVX512-BF16 AMD EPYC (Zen 5, no
# AMX; torch 2.13), engines stepping in turns (`python -m bench.dtype_step`): the default
# model's decode step is 1.07-1.19x faster in bf16 at batch 1 and 1.73-1.84x at batch 32,
# and perplexity on tests/data/quality_text.txt moves by +0.05% (`python -m
# bench.quality`). An earlier AVX512-BF16 Xeon measurement found bf16 no faster, before
# projection weights were stored [in, out]; `--dtype float32` keeps the token-exact
# reference everywhere.
FAST_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})

# The layers' small ops (norms, rotary and the KV write, silu): torch's, one of the two
# native builds of `engine.kernels` (bf16 on AVX512-BF16; float32 on a GGUF's blocks), or
# Triton kernels on CUDA (bf16 / fp16: engine/models/triton_ops.py).
TORCH_OPS = "torch"
TRITON_OPS = "triton"
AVX512_OPS = "AVX-512 BF16"
VNNI512_OPS = "AVX-512 VNNI"  # the float32 build with 512-bit VNNI GGUF kernels
AVX2_OPS = "AVX2"


class Quantization(NamedTuple):
    """What the engine quantizes: the decoder layers' projections and the LM head."""

    layers: str | None = None  # "int8", "int4"; "gguf": a GGUF's own blocks
    head: str | None = None  # "gguf": the GGUF's head (and embedding) blocks as well


class ModelShape(NamedTuple):
    """What of the model's architecture the plan depends on (this rank's share of heads)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    silu: bool  # the MLP's activation is silu (what the fused ops compute)
    # Why the native layer ops (Llama's norms and full-width rotary) cannot compute the
    # model's layer, and why the native decode stack (Llama's whole layer) cannot run it;
    # None: they can (`Architecture.layer_ops_misfit`, `decode_stack_misfit`).
    layer_ops_misfit: str | None = None
    decode_stack_misfit: str | None = None
    # Whether any layer attends a sliding window, and the KV cache groups of its layers
    # (kv_cache/groups.py: more than one when windowed and full layers mix).
    sliding_window: bool = False
    kv_cache_groups: int = 1
    recurrent: bool = False  # layers that keep a state (kv_cache/state_group.py)
    experts: bool = False  # layers whose MLP is a mixture of experts (engine/models/moe.py)
    sinks: bool = False  # attention sinks (engine/attention/sinks.py)

    @classmethod
    def of(cls, hf_config: Any, tp_size: int = 1) -> ModelShape:
        model = get_model_class(hf_config)
        arch = model.architecture(hf_config)
        heads, kv_heads = arch.num_heads, arch.num_kv_heads
        windows, states = model.layer_windows(hf_config), model.state_layers(hf_config)
        return cls(heads // tp_size, max(kv_heads // tp_size, 1), arch.head_dim,
                   arch.act == "silu", arch.layer_ops_misfit(), arch.decode_stack_misfit(),
                   any(windows), len(kv_cache_groups(windows, states)), bool(states),
                   arch.moe is not None and bool(arch.moe.layers), arch.attn_sinks)  # fmt: skip


@dataclass(frozen=True)
class ExecutionPlan:
    device: torch.device
    dtype: torch.dtype  # the activations' (and unquantized weights')
    quantization: Quantization
    attention: str  # the attention backend's registry name, "auto" resolved
    layer_ops: str  # TORCH_OPS, AVX512_OPS, VNNI512_OPS, AVX2_OPS or TRITON_OPS
    kernels_switch: str  # $PAGEDSERVE_CPU_KERNELS as read (auto, avx2, avx512_vnni, off)
    # Whether decode-only steps may run as one native call (`engine.decode_stack`): native
    # layer ops and the cpu-paged backend. Its row limit is known once the weights are packed.
    decode_stack: bool
    cuda_graphs_off: str | None  # why decode steps run eagerly; None: they replay graphs
    decode_stack_rows: int = 0  # set by `with_weights`: 0 where a projection has no kernel
    weights: str = ""  # set by `with_weights`: each weight group's format
    # Where the model's layer is not Llama's: what it kept from the native paths, and why
    # (e.g. "no decode stack: q/k norms"); "" where nothing.
    model_layer: str = ""
    # Every row of every call through the kernel that computes one row alone, so that a
    # request's tokens do not depend on what else its steps hold (`--deterministic`).
    batch_invariant: bool = False

    def layer_kernels(self) -> ModuleType | None:
        """The native module whose layer ops serve the model, or None (torch's ops)."""
        if self.layer_ops in (TORCH_OPS, TRITON_OPS):
            return None
        return kernels.layer_kernels(self.dtype, self.device, self.quantization.layers)

    def with_weights(self, weights: str, decode_stack_rows: int) -> ExecutionPlan:
        return dataclasses.replace(self, weights=weights, decode_stack_rows=decode_stack_rows)

    def describe(self) -> str:
        """The start-up line's account of how the model computes here."""
        parts = [f"attention {self.attention}"]
        if self.layer_ops == TRITON_OPS:
            parts.append("Triton layer ops")
        elif self.layer_ops != TORCH_OPS:
            gemm = "skinny GEMM, " if self.dtype == torch.bfloat16 else ""
            stack = ", decode stack" if self.decode_stack_rows else ""
            switch = (
                ""
                if self.kernels_switch == "auto"
                else f", ${kernels.SWITCH}={self.kernels_switch}"
            )
            parts.append(f"CPU kernels {self.layer_ops}{switch} ({gemm}fused ops{stack})")
        elif self.kernels_switch in kernels.SWITCH_SETTINGS[1:] and is_cpu(self.device):
            parts.append(f"torch's layer ops (${kernels.SWITCH}={self.kernels_switch})")
        if self.layer_ops == TORCH_OPS and self.decode_stack_rows:
            parts.append("decode stack")
        if self.quantization.layers == "gguf":
            parts.append("GGUF blocks through the GGUF kernels (int8 activations)")
        if self.model_layer:
            parts.append(self.model_layer)
        if self.batch_invariant:
            parts.append("batch-invariant")
        if self.weights:
            parts.append(f"weights: {self.weights}")
        if is_cuda(self.device):
            parts.append("CUDA graphs" if self.cuda_graphs_off is None
                         else f"CUDA graphs off ({self.cuda_graphs_off})")  # fmt: skip
        return ", ".join(parts)

    def info(self) -> dict[str, str]:
        """The plan as labels (`/metrics`' info, the dashboard)."""
        return {
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "quantization": self.quantization.layers or "none",
            "attention": self.attention,
            "layer_ops": self.layer_ops,
            "cpu_kernels_switch": self.kernels_switch,
            "decode_stack_rows": str(self.decode_stack_rows),
            "cuda_graphs": "on" if self.cuda_graphs_off is None else "off",
            "weights": self.weights,
            "batch_invariant": "yes" if self.batch_invariant else "no",
        }


def resolve_plan(config: Any, hf_config: Any, device: torch.device, gguf: bool) -> ExecutionPlan:
    """The plan for `config` (an `EngineConfig`) serving a model of `hf_config` on `device`;
    ``gguf``: the model comes from a GGUF file. ValueError for what cannot be served."""
    tp = config.tensor_parallel_size
    shape = ModelShape.of(hf_config, tp)
    dtype = resolve_dtype(config, device, gguf)
    quantization = resolve_quantization(config, device, dtype, gguf)
    if tp > 1 and quantization.layers:
        raise ValueError("tensor parallelism takes unquantized weights (quantization none)")
    if tp > 1 and shape.kv_cache_groups > 1:
        raise ValueError("tensor parallelism does not serve models that mix sliding-window "
                         "and full-attention layers yet")  # fmt: skip
    if tp > 1 and shape.recurrent:
        raise ValueError("tensor parallelism does not serve linear-attention layers yet")
    if config.deterministic and shape.recurrent:
        raise batch_variant_error("linear-attention layers prefill in chunks whose sums "
                                  "round by where a step cuts the prompt")  # fmt: skip
    if tp > 1 and shape.experts:
        raise ValueError("tensor parallelism does not serve mixtures of experts yet")
    if config.deterministic and shape.experts:
        raise batch_variant_error("a mixture of experts' router goes through torch's matmul, "
                                  "which rounds by call size")  # fmt: skip
    kv_int8 = config.kv_cache_dtype == "int8"
    layer_ops = _layer_ops(dtype, device, quantization.layers, shape, tp, kv_int8)
    attention = resolve_attention(config, device, dtype, quantization.layers, shape)
    graphs_off = graphs_off_reason(device, config.enforce_eager, attention, tp)
    if graphs_off is None and shape.recurrent:
        graphs_off = "linear-attention layers"  # (their state steps are not captured)
    if graphs_off is None and shape.experts:
        graphs_off = "mixture of experts"  # (its tokens per expert are read on the host)
    llama_layer = shape._replace(silu=True, layer_ops_misfit=None, decode_stack_misfit=None)
    native = _layer_ops(dtype, device, quantization.layers, llama_layer, tp, kv_int8)
    # The stack runs the native build's kernels also where the model's Python layers keep
    # torch's ops (Qwen3.5's: engine/decode_stack.py).
    stack = native not in (TORCH_OPS, TRITON_OPS) and attention == "cpu-paged"
    model_layer = ""
    if shape.layer_ops_misfit and native != TORCH_OPS:
        model_layer = f"torch's layer ops ({shape.layer_ops_misfit})"
    elif shape.decode_stack_misfit and stack:
        model_layer = f"no decode stack ({shape.decode_stack_misfit})"
    plan = ExecutionPlan(
        device=device,
        dtype=dtype,
        quantization=quantization,
        attention=attention,
        layer_ops=layer_ops,
        kernels_switch=kernels.switch(),
        decode_stack=stack and shape.decode_stack_misfit is None,
        cuda_graphs_off=graphs_off,
        model_layer=model_layer,
        batch_invariant=config.deterministic,
    )
    if config.deterministic and (why := batch_variance(device, dtype, quantization, attention, tp)):
        raise batch_variant_error(why)
    return plan


def batch_variance(
    device: torch.device, dtype: torch.dtype, quantization: Quantization, attention: str,
    tp: int = 1,
) -> str | None:  # fmt: skip
    """Why this path cannot make a row's result independent of its step, or None: it can.

    Batch invariance needs each op to compute a row the same way at every call size. The
    GGUF kernels do (`ggml_linear` adds a row's blocks in one order in every tile), and so
    does the skinny GEMM on bf16 weights; the layer ops work row by row, and the paged
    decode kernel attends each query row alone over fixed 256-key chunks. So the plan sends
    every call through those: projections of every size through the int8 dot products or
    the skinny GEMM (not the bf16 GEMM that serves large calls otherwise), every query
    token through the paged kernel (not SDPA's blocked prefill). torch's matmul, SDPA and
    cuBLAS choose kernels by shape (a float32 call of 1 row and of 2 round differently), so
    other paths are not invariant."""
    if not is_cpu(device):
        return "on CUDA, cuBLAS and the Triton kernels choose their tiles by shape"
    if tp > 1:
        return "tensor parallelism's head goes through torch's matmul"
    gguf = quantization.layers == "gguf" and quantization.head == "gguf"
    skinny = (quantization.layers is None and dtype == torch.bfloat16
              and kernels.cpu_kernels() is not None)  # fmt: skip
    if not (gguf or skinny):
        return "these weights go through torch's matmul, which rounds by call size"
    if attention != "cpu-paged":
        return f"the {attention} attention backend computes a prefill otherwise than a decode"
    return None


def batch_variant_error(why: str) -> ValueError:
    return ValueError(
        f"--deterministic: this model cannot be served batch-invariant here ({why}); a "
        "GGUF served from its own blocks on a CPU with the GGUF kernels can, and bf16 "
        "weights on a CPU with AVX512-BF16"
    )


def manual_plan(
    dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
    attention: str = DEFAULT_BACKEND, quantization: str | None = None,
) -> ExecutionPlan:  # fmt: skip
    """A plan given by hand (tests, benchmarks that build a model directly): these choices,
    torch's layer ops, no decode stack, no graphs, nothing probed."""
    device = torch.device(device) if device is not None else torch.get_default_device()
    head = quantization if quantization == "gguf" else None  # a GGUF's head blocks kept too
    return ExecutionPlan(device=device, dtype=dtype, quantization=Quantization(quantization, head),
                         attention=attention, layer_ops=TORCH_OPS, kernels_switch="manual",
                         decode_stack=False, cuda_graphs_off="a manual plan")  # fmt: skip


def cpu_has_fast_bf16() -> bool:
    return not FAST_BF16_CPU_FLAGS.isdisjoint(kernels.cpu_flags())


def resolve_dtype(config: Any, device: torch.device, gguf: bool = False) -> torch.dtype:
    """The model's dtype. For "auto": bf16 where the hardware multiplies it fast. For a GGUF
    served from its own blocks (``gguf``: the model is one) the blocks hold the weights, so
    the dtype is only the activations': bf16 where the AVX-512 kernels run a decode step
    natively (a batch-1 step 1.9x faster than float32's Python loop at 135M, 1.3x at 1B),
    float32 on other CPUs. Decode-sized multiplies quantize the activations to int8, as
    llama.cpp does: perplexity through the decode path +1.2% (bf16) or +0.9-1.0% (float32)
    against the same weights in bf16 (tests/engine/test_quality_gate.py)."""
    if config.dtype != "auto":
        return DTYPES[config.dtype]
    if is_cuda(device):
        # Pre-Ampere GPUs have no bf16 units; half precision is their fast path.
        return torch.bfloat16 if gpu_has_bf16(device) else torch.float16
    if _serves_gguf_blocks(config, device, gguf):
        return torch.bfloat16 if kernels.cpu_kernels() is not None else torch.float32
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def resolve_quantization(
    config: Any, device: torch.device, dtype: torch.dtype, gguf: bool
) -> Quantization:
    """The weights to quantize: as asked (checked), or for "auto" a GGUF's own blocks where
    the GGUF kernels serve them (`_serves_gguf_blocks`). A Hugging Face checkpoint stays as
    it is."""
    if config.quantization == "auto":
        native = _serves_gguf_blocks(config, device, gguf)
        return Quantization("gguf", "gguf") if native else Quantization()
    if config.quantization in (None, "none"):
        return Quantization()
    check_quantization(config.quantization, device, dtype)
    return Quantization(layers=config.quantization)


def _serves_gguf_blocks(config: Any, device: torch.device, gguf: bool) -> bool:
    """Whether "auto" serves a GGUF (``gguf``) from its own blocks: on a CPU with the GGUF
    kernels (AVX2), in one process, unless dtype float32 was asked for (the token-exact
    reference, which dequantizes every weight exactly)."""
    return (
        gguf
        and config.quantization == "auto"
        and is_cpu(device)
        and config.dtype != "float32"
        and config.tensor_parallel_size == 1
        and kernels.ggml_kernels() is not None
    )


def check_quantization(quantization: str, device: torch.device, dtype: torch.dtype) -> None:
    """Quantized weights run through the skinny GEMM kernel, which needs AVX512-BF16 and
    bf16 activations: refuse the combinations it cannot serve fast."""
    if not is_cpu(device) or dtype != torch.bfloat16:
        raise ValueError(
            f"quantization {quantization!r} needs device cpu and dtype bfloat16, "
            f"got {device} and {str(dtype).removeprefix('torch.')}"
        )
    if kernels.cpu_kernels() is None:
        raise ValueError(
            f"quantization {quantization!r} needs a CPU with AVX512-BF16 and a C++ "
            "compiler for its kernel (see the log)"
        )


def _layer_ops(
    dtype: torch.dtype, device: torch.device, quantization: str | None, shape: ModelShape,
    tp: int, kv_int8: bool,
) -> str:  # fmt: skip
    """Which build's fused ops serve the layers: on CUDA Triton's for bf16 / fp16 (float32
    keeps torch's, transformers' arithmetic; the KV write stays the attention backend's);
    on CPU bf16 on AVX512-BF16, float32 where a GGUF's blocks serve the projections; torch's
    where none applies, under tensor parallelism (one process's whole layers only), for an
    activation other than silu, for a layer the fused ops do not compute (`ModelShape`'s
    `layer_ops_misfit`), and for bf16 over an int8 KV cache (the bf16 kernels write bf16
    rows only; the float32 ones write int8)."""
    if not shape.silu or shape.head_dim % 2 or tp > 1 or shape.layer_ops_misfit:
        return TORCH_OPS
    if is_cuda(device):
        fits = dtype != torch.float32 and triton_applies(device, kv_int8)
        return TRITON_OPS if fits else TORCH_OPS
    module = kernels.layer_kernels(dtype, device, quantization)
    if module is None or (kv_int8 and dtype != torch.float32):
        return TORCH_OPS
    return kernels.path_name(module)  # AVX512_OPS, VNNI512_OPS or AVX2_OPS


def resolve_attention(
    config: Any, device: torch.device, dtype: torch.dtype, quantization: str | None,
    shape: ModelShape,
) -> str:  # fmt: skip
    """The attention backend: as asked (checked against what can run), or for "auto" triton
    on CUDA where it applies, cpu-paged where its kernel serves this dtype and head layout
    (4-6x SDPA's decode attention), else SDPA."""
    kv_int8 = config.kv_cache_dtype == "int8"
    paged = is_cpu(device) and cpu_paged_fits(*shape[:3]) and (
        kernels.layer_kernels(dtype, device, quantization) is not None
    )  # fmt: skip
    asked = config.attention_backend
    if asked == "auto":
        # (sliding windows included; not attention sinks yet, which SDPA takes on CUDA)
        if triton_applies(device, kv_int8) and not shape.sinks:
            return "triton"
        return "cpu-paged" if paged else DEFAULT_BACKEND
    if shape.sinks and not backend_class(asked).attention_sinks:
        raise ValueError(f"attention backend {asked!r} takes no attention sinks, which this "
                         f"model's layers have; use sdpa or cpu-paged")  # fmt: skip
    if shape.sliding_window and not backend_class(asked).sliding_windows:
        raise ValueError(f"attention backend {asked!r} has no sliding window, which this "
                         f"model's layers attend; use sdpa")  # fmt: skip
    if asked == "cpu-paged" and not paged:
        raise ValueError(
            "attention backend 'cpu-paged' needs device cpu, dtype bfloat16 on a CPU with "
            "AVX512-BF16 or float32 on a GGUF's blocks (AVX2), head_dim a multiple of 16 up to "
            f"256 and at most 16 query heads per KV head; got {device}, "
            f"{str(dtype).removeprefix('torch.')}, head_dim {shape.head_dim}"
        )
    return asked


def triton_applies(device: torch.device, kv_cache_quantized: bool) -> bool:
    """Whether the triton backend serves here: a CUDA device with triton installed (it comes
    with torch's CUDA build) and a float KV cache (it reads no int8 rows)."""
    return (
        is_cuda(device)
        and not kv_cache_quantized
        and importlib.util.find_spec("triton") is not None
    )


def graphs_off_reason(
    device: torch.device, enforce_eager: bool, attention: str, tp: int
) -> str | None:
    """Why decode steps run eagerly here, or None: they are captured."""
    if not is_cuda(device):
        return "not on CUDA"
    if enforce_eager:
        return "--enforce-eager"
    if not backend_class(attention).cuda_graphs:
        return "the attention backend plans on the host (triton captures)"
    if tp > 1:
        return "tensor parallelism"
    return None
