"""The engine's start-up options, their validation, and their resolution to concrete values.

Every CLI flag maps onto one `EngineConfig` field, and `LLM(**fields)` takes the same names:
a field's `flag()` declares its flag's help, kind and choices (server/config_flags.py builds
the flags from them, and server/server_config.py's ServerConfig declares the server's the
same way) and the check that its kind implies.
A bad value fails here, at start-up, with a ValueError naming the option. What the options
resolve to on this machine (dtype, quantization, attention backend, kernels) is the
`ExecutionPlan`'s business (engine/execution_plan.py); device helpers live in
engine/device.py.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, get_args, get_type_hints

import torch

from engine.default_model import DEFAULT_MODEL_NAME
from engine.device import (
    CPU_DEFAULT_KV_BYTES,
    GiB,
    GpuMemory,
    available_ram,
    gpu_kv_cache_budget,
    is_cuda,
    measure_gpu_memory,
    resolve_device,
    valid_device_name,
)
from engine.kv_layout import KV_CACHE_DTYPES, kv_row_bytes
from engine.registry import ATTENTION_BACKENDS, QUANTIZATION_METHODS
from engine.template_bounds import DEFAULT_TIMEOUT_S
from scheduler.config import SCHEDULING_POLICIES

if TYPE_CHECKING:
    from transformers import PretrainedConfig

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
PREFIX_CACHE_HASHES = ("builtin", "sha256")


# Without an explicit budget the CPU KV cache gets 2 GiB, but never more than this share of
# the RAM that is available at start-up (the weights and activations need the rest).
CPU_KV_MAX_FRACTION = 0.4

# -- the options' declarations: each field's flag and kind ---------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(value: object) -> bool:
    return _is_int(value) and value >= 1  # type: ignore[operator]


def _seconds(value: object) -> bool:
    # The upper bound refuses inf (and the comparisons refuse nan).
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return number and 0 <= value < 1e9  # type: ignore[operator]


def _positive_seconds(value: object) -> bool:
    return _seconds(value) and value > 0  # type: ignore[operator]


class Kind(NamedTuple):
    """A kind of option value: how the command line parses it, and the check `validate()`
    runs on every field of the kind."""

    parse: str | None  # the key of server/config_flags.py's parser for it; None: as given
    noun: str = ""  # a bad value "must be {noun}"
    check: Callable[[object], bool] | None = None  # None: `_problems` checks the field


TEXT = Kind(None)
INTEGER = Kind("int", "an integer", _is_int)
POSITIVE_INT = Kind("positive_int", "a positive integer", _positive_int)
BYTES = Kind("size", "a positive number of bytes", _positive_int)  # "2GiB" on the CLI
SECONDS = Kind("seconds", "a number of seconds >= 0", _seconds)
POSITIVE_SECONDS = Kind("positive_float", "a number of seconds > 0", _positive_seconds)
# A field whose flag flips its default (`--no-prefix-caching`).
SWITCH = Kind("switch", "True or False", lambda value: isinstance(value, bool))


@dataclass(frozen=True)
class Flag:
    """A config field's command-line flag (server/config_flags.py adds one per field, in
    field order) and the check its kind or choices imply."""

    kind: Kind = TEXT
    help: str | None = None
    # The values --help lists and `validate()` checks: a tuple, or a function reading a
    # registry (engine/registry.py), so the config imports no implementation to list them.
    choices: tuple[str, ...] | Callable[[], tuple[str, ...]] = ()
    name: str | None = None  # the flag without "--", where it is not the field's name
    exclusive: str | None = None  # flags that name the same group cannot be given together
    group: str | None = None  # its --help section; None: the one the caller names
    metavar: str | None = None  # the value's name in --help, where not the flag's
    env: str | None = None  # the environment variable whose value is the flag's default

    def problem(self, value: object, nullable: bool) -> str | None:
        """Why `value` is bad for the field (None may be allowed), or None: fine, or left
        to `_problems`."""
        if nullable and value is None:
            return None
        if choices := self.choice_list():
            ok, noun = value in choices, f"one of {', '.join(choices)}"
        elif self.kind.check is not None:
            ok, noun = self.kind.check(value), self.kind.noun
        else:
            return None
        return None if ok else f"must be {noun}{' or None' if nullable else ''}, got {value!r}"

    def choice_list(self) -> tuple[str, ...]:
        return self.choices() if callable(self.choices) else self.choices


def flag(
    default: Any,
    kind: Kind = TEXT,
    *,
    help: str | None = None,
    choices: tuple[str, ...] | Callable[[], tuple[str, ...]] = (),
    name: str | None = None,
    exclusive: str | None = None,
    group: str | None = None,
    metavar: str | None = None,
    env: str | None = None,
) -> Any:
    """A config field with its flag: a new option (engine or server) is this one declaration."""
    declared = Flag(kind, help, choices, name, exclusive, group, metavar, env)
    return field(default=default, metadata={"flag": declared})


@dataclass(frozen=True)  # changed only by `dataclasses.replace`, which validates the copy
class EngineConfig:
    # None: the embedded default model
    model: str | None = flag(
        None,
        help="a Hugging Face model directory or a .gguf file "
        "(default: the embedded SmolLM2-135M-Instruct)",
    )
    dtype: str = flag(
        "auto",
        choices=("auto", *DTYPES),
        help="auto (default): bfloat16 on CUDA and on CPUs with bf16 dot products "
        "(AVX512-BF16, AMX), else float32; float32 is the token-exact reference",
    )
    device: str = flag("auto", help="auto, cpu, cuda or cuda:N (default auto)")
    # A power of two, which `_problems` checks.
    block_size: int = flag(16, Kind("positive_int"), help="tokens per KV block (default 16)")
    kv_cache_memory: int | None = flag(
        None,
        BYTES,
        exclusive="kv cache size",
        help="KV cache budget, e.g. 2GiB or a number of bytes",
    )
    num_blocks: int | None = flag(
        None, POSITIVE_INT, exclusive="kv cache size", help="number of KV blocks"
    )
    # A linear-attention model's state slots (kv_cache/state_group.py): each running
    # request's state and the prefix cache's snapshots of states.
    state_slots: int | None = flag(
        None,
        POSITIVE_INT,
        help="linear-attention models: state slots (each running request's state and the "
        "prefix cache's snapshots; default: half the KV cache budget)",
    )
    state_snapshot_interval: int = flag(
        16,
        POSITIVE_INT,
        help="linear-attention models: blocks between the prefix cache's snapshots of a "
        "sequence's state, besides one at the end of each prompt (default 16)",
    )
    # "auto": the model's dtype; "int8": rows of int8 values and a float16 scale per token
    # and KV head (engine/attention/kv_cache.py), 1.94x bf16's blocks, 3.9x float32's.
    kv_cache_dtype: str = flag(
        "auto",
        choices=KV_CACHE_DTYPES,
        help="auto (default): the model's dtype; int8: int8 values and a "
        "float16 scale per token and KV head, 1.94x bf16's blocks in the "
        "same bytes (3.9x float32's)",
    )
    # The prefix cache's second tier: blocks the pool evicts go to a memory-mapped file of
    # this many bytes under cache_dir/kv-tier, and come back on a hit; the file outlives
    # the process. None: no tier.
    kv_offload_bytes: int | None = flag(
        None,
        BYTES,
        help="a second tier for the prefix cache: blocks the "
        "pool evicts go to a memory-mapped file of this size "
        "(e.g. 4GiB) under the cache dir and come back on a "
        "hit; it outlives the process (default: none)",
    )
    gpu_memory_utilization: float = flag(  # `_problems` checks (0, 1]
        0.9,
        Kind("float"),
        help="CUDA: the fraction of the GPU's memory pagedserve may use; the KV cache "
        "takes what the weights and activations leave (default 0.9)",
    )
    max_num_seqs: int = flag(256, POSITIVE_INT, help="requests per batch")
    max_num_batched_tokens: int = flag(2048, POSITIVE_INT, help="tokens per step")
    # None: the model's max_position_embeddings
    max_model_len: int | None = flag(None, POSITIVE_INT, help="context length")
    enable_prefix_caching: bool = flag(
        True, SWITCH, name="no-prefix-caching", help="disable prefix caching"
    )
    prefix_cache_hash: str = flag(
        "builtin",
        choices=PREFIX_CACHE_HASHES,
        help="the prefix cache's block hashes: builtin (default), or sha256, which "
        "cannot collide across tenants",
    )
    # Admission order (scheduler/config.py): "fcfs", or "lpm" (longest cached prefix first;
    # past age_bound_s seconds of waiting, arrival order again).
    scheduling_policy: str = flag(
        "fcfs",
        choices=SCHEDULING_POLICIES,
        help="admission order: fcfs (default), or lpm: the waiting "
        "request with the longest cached prefix first",
    )
    age_bound_s: float = flag(
        5.0,
        SECONDS,
        name="age-bound",
        help="lpm: seconds after which a waiting request is admitted in "
        "arrival order, before any the cache prefers (default 5)",
    )
    seed: int = flag(0, INTEGER, help="torch's seed at start-up (default 0)")
    # "auto": the execution plan picks (engine/execution_plan.py); else a registered backend.
    attention_backend: str = flag(
        "auto",
        choices=lambda: ("auto", *ATTENTION_BACKENDS.names()),
        help="auto (default): the execution plan's pick (cpu-paged on CPUs with the paged "
        "decode kernel, triton on CUDA, else sdpa); the others for comparisons",
    )
    # CUDA: decode steps replay graphs captured at start-up (engine/cuda_graphs.py) where
    # the attention backend allows it; this keeps every step eager (for debugging, or to
    # save the graphs' start-up time and memory).
    enforce_eager: bool = flag(
        False,
        SWITCH,
        help="CUDA: run decode steps eagerly, capturing no CUDA graphs (default: "
        "captured at start-up with the triton attention backend)",
    )
    # "int8" / "int4": weight-only (CPUs with AVX512-BF16); None or "none": off (a GGUF is
    # dequantized); "auto": a GGUF's own blocks where the GGUF kernels run, else off.
    quantization: str | None = flag(
        "auto",
        choices=lambda: ("auto", "none", *from_float_formats()),
        help="weight-only int8, or int4 in Q4_1's blocks (CPUs with "
        "AVX512-BF16); auto (default): a GGUF served from its own "
        "blocks where the GGUF kernels run (AVX2), else none",
    )
    # None: $PAGEDSERVE_CACHE or ~/.cache/pagedserve
    cache_dir: str | None = flag(None, help="where converted models are kept")
    # Ranks the model is split over (engine/distributed.py); 1: one process, no split.
    tensor_parallel_size: int = flag(
        1,
        POSITIVE_INT,
        help="split the model over this many processes "
        "(torch.distributed: gloo on CPU, NCCL on CUDA); it must "
        "divide the heads (default 1)",
    )
    # Batch invariance (engine/execution_plan.py's `batch_variance`): every row of a step
    # through the kernel that computes one row alone, so a request's output does not depend
    # on what else is batched, cached or chunked with it. Off by default: it costs 16-50% of
    # the default model's throughput (bench/README.md, "Same request, same answer").
    deterministic: bool = flag(
        False,
        SWITCH,
        help="the same request gives the same tokens whatever else the server is doing "
        "(batched, cached or chunked with it), at the cost of slower prefills: a GGUF's blocks "
        "on a CPU with the GGUF kernels, bf16 weights on AVX512-BF16 (default: off, each "
        "call's fastest kernel)",
    )
    # Speculative decoding without a draft model (engine/speculative/): each decoding
    # request may verify draft tokens taken from what it has seen, several tokens a step.
    speculative: str = flag(
        "off",
        choices=("ngram", "suffix", "off"),
        help="ngram: draft tokens from the request's own prompt and output (prompt "
        "lookup), verified in one step; suffix: the same, and from earlier requests' "
        "outputs too (retried or repeated steps); the output is unchanged, repetitive answers "
        "come faster (default off)",
    )
    num_speculative_tokens: int = flag(
        8, POSITIVE_INT, help="the most draft tokens a request verifies in one step (default 8)"
    )
    # A model's chat template is its file's code: each render is bounded (docs/limits.md),
    # in time by this; the template is checked at load under the same bounds.
    chat_template_timeout: float = flag(
        DEFAULT_TIMEOUT_S,
        POSITIVE_SECONDS,
        help="seconds one render of a chat template may take; past it the request is "
        "answered 500 (400 when its own messages are that large), and a template that "
        "takes longer on the probe chats at load is refused (default %(default)s)",
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad option."""
        for name, message in _problems(self):
            raise ValueError(f"{name} {message}")

    # -- resolution ---------------------------------------------------------------------

    def resolve_device(self) -> torch.device:
        return resolve_device(self.device)

    def resolve_max_model_len(self, model: PretrainedConfig | int) -> int:
        """The model's context length (its config's max_position_embeddings, or that number)
        unless a smaller one is asked for; a larger one is an error."""
        model_max_len = model if isinstance(model, int) else int(model.max_position_embeddings)
        if self.max_model_len is None:
            return model_max_len
        if self.max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len {self.max_model_len} is larger than the model's "
                f"max_position_embeddings {model_max_len}"
            )
        return self.max_model_len

    def served_name(self, model_dir: str | os.PathLike | None = None) -> str:
        """The model's name in API responses: the default's name, or the path's last part."""
        if self.model is None:
            return DEFAULT_MODEL_NAME
        name = Path(self.model).expanduser().name or Path(model_dir or self.model).name
        return name.removesuffix(".gguf")

    @property
    def kv_cache_quantized(self) -> bool:
        return self.kv_cache_dtype == "int8"

    def kv_cache_bytes_per_block(
        self, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int
    ) -> int:
        # K and V, for every layer, for every slot of the block.
        row = kv_row_bytes(head_dim, dtype_bytes, self.kv_cache_quantized)
        return 2 * num_layers * self.block_size * num_kv_heads * row

    def kv_cache_num_blocks(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype_bytes: int,
        free_memory: int | None = None,
        device: torch.device | None = None,
        gpu_memory: GpuMemory | None = None,
    ) -> int:
        """How many KV blocks to allocate: `num_blocks`, or as many as the byte budget holds.

        The budget is `kv_cache_memory` when set. Otherwise, on CPU, it is derived from
        `free_memory` (the RAM available now, after the weights are loaded); on CUDA from
        `gpu_memory` (the device's total and the memory in use at the peak of a profiling
        forward pass, see `gpu_kv_cache_budget`). Either figure is measured when None.
        """
        if self.num_blocks is not None:
            return self.num_blocks
        per_block = self.kv_cache_bytes_per_block(num_layers, num_kv_heads, head_dim, dtype_bytes)
        if self.kv_cache_memory is not None:
            return _whole_blocks(self.kv_cache_memory, per_block)
        device = device if device is not None else self.resolve_device()
        if gpu_memory is not None:
            return self._gpu_num_blocks(per_block, gpu_memory)
        if is_cuda(device):
            return self._gpu_num_blocks(per_block, measure_gpu_memory(device))
        if free_memory is None:
            free_memory = available_ram()
        budget = min(CPU_DEFAULT_KV_BYTES, int(free_memory * CPU_KV_MAX_FRACTION))
        return _whole_blocks(budget, per_block)

    def profiles_memory(self, device: torch.device) -> bool:
        """Whether the engine runs a profiling forward pass before sizing the KV cache.

        Only on CUDA, where the budget subtracts the largest step's activations (see
        `gpu_kv_cache_budget`), and only when neither `num_blocks` nor `kv_cache_memory`
        fixes the size. CPU sizing reads available RAM and needs no pass.
        """
        return is_cuda(device) and self.num_blocks is None and self.kv_cache_memory is None

    def _gpu_num_blocks(self, per_block: int, memory: GpuMemory) -> int:
        budget = gpu_kv_cache_budget(memory.total, memory.peak_used, self.gpu_memory_utilization)
        if budget < per_block:
            raise ValueError(
                f"gpu_memory_utilization: {self.gpu_memory_utilization} of the GPU's "
                f"{memory.total / GiB:.2f} GiB leaves {max(budget, 0)} bytes for the KV cache "
                f"after the {memory.peak_used / GiB:.2f} GiB in use (weights, activations, "
                f"other processes), less than one KV block of {per_block} bytes; raise "
                f"--gpu-memory-utilization, lower --max-num-batched-tokens, or set "
                f"--kv-cache-memory"
            )
        return budget // per_block

    def split_for_states(self, num_blocks: int, per_block: int, slot_bytes: int) -> tuple[int, int]:
        """(KV blocks, state slots) of a model with linear-attention layers, out of the
        `num_blocks` its budget holds: the slots `state_slots` asks for, else half the
        budget's (at least 2, at most 4 per running request); the blocks what is left,
        unless `num_blocks` fixed them."""
        slots = self.state_slots
        if slots is None:
            slots = min(max(num_blocks * per_block // 2 // slot_bytes, 2), 4 * self.max_num_seqs)
        if self.num_blocks is not None:
            return num_blocks, slots
        return max((num_blocks * per_block - slots * slot_bytes) // per_block, 1), slots

    def describe_kv_cache(self, num_blocks: int, num_state_slots: int = 0) -> str:
        tokens = num_blocks * self.block_size
        states = (f"; {num_state_slots} state slots, a snapshot every "
                  f"{self.state_snapshot_interval} blocks" if num_state_slots else "")  # fmt: skip
        return (
            f"KV cache: {num_blocks} blocks of {self.block_size} tokens "
            f"({tokens} tokens max concurrently){states}"
        )


def engine_flags() -> Iterator[tuple[Field[Any], Flag]]:
    """Each EngineConfig field that has a flag, with it, in field order."""
    return flags_of(EngineConfig)


def flags_of(cls: type) -> Iterator[tuple[Field[Any], Flag]]:
    """Each field of a dataclass declared with `flag()`, with its Flag, in field order."""
    for f in fields(cls):
        if "flag" in f.metadata:
            yield f, f.metadata["flag"]


@functools.cache
def _nullable_fields(cls: type) -> frozenset[str]:
    """The fields whose type admits None (`int | None`): None passes their check."""
    hints = get_type_hints(cls)
    return frozenset(name for name, hint in hints.items() if type(None) in get_args(hint))


def declared_problems(c: Any) -> list[tuple[str, str]]:
    """(option, message) for every value of the config `c` (EngineConfig, ServerConfig)
    that its field's declared kind or choices reject."""
    nullable = _nullable_fields(type(c))
    found = ((f.name, flag.problem(getattr(c, f.name), f.name in nullable))
             for f, flag in flags_of(type(c)))  # fmt: skip
    return [(name, message) for name, message in found if message is not None]


def _problems(c: EngineConfig) -> list[tuple[str, str]]:
    """(option, message) for every bad value: each field's own in field order (its declared
    kind's, or one of the checks below), then the checks across fields."""
    checks: list[tuple[bool, str, str]] = [
        (c.model is None or (isinstance(c.model, str) and c.model != ""), "model",
         f"must be a model directory, a .gguf file or None (the default model), got {c.model!r}"),
        (valid_device_name(c.device), "device",
         f"must be one of auto, cpu, cuda, cuda:N, got {c.device!r}"),
        (_positive_int(c.block_size) and c.block_size & (c.block_size - 1) == 0, "block_size",
         f"must be a positive power of two (e.g. 16), got {c.block_size!r}"),
        (isinstance(c.gpu_memory_utilization, (int, float))
         and not isinstance(c.gpu_memory_utilization, bool)
         and 0.0 < c.gpu_memory_utilization <= 1.0, "gpu_memory_utilization",
         f"must be in (0, 1], got {c.gpu_memory_utilization!r}"),
        (c.cache_dir is None or (isinstance(c.cache_dir, str) and c.cache_dir != ""), "cache_dir",
         f"must be a directory path or None, got {c.cache_dir!r}"),
        (c.num_blocks is None or c.kv_cache_memory is None, "num_blocks and kv_cache_memory",
         "are exclusive: set one or neither"),
    ]  # fmt: skip
    found = declared_problems(c) + [(name, message) for ok, name, message in checks if not ok]
    order = {f.name: i for i, f in enumerate(fields(EngineConfig))}
    # A stable sort: a cross-field check names no single field and stays last.
    return sorted(found, key=lambda problem: order.get(problem[0], len(order)))


def from_float_formats() -> tuple[str, ...]:
    """The weight formats packed from float weights at load, which --quantization names."""
    return QUANTIZATION_METHODS.names(lambda method: method.from_float)


def _whole_blocks(budget: int, per_block: int) -> int:
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory: a budget of {budget} bytes holds no KV block of "
            f"{per_block} bytes; give more memory or set num_blocks"
        )
    return num_blocks
