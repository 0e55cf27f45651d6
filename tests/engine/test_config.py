"""EngineConfig: validation names the option, resolution picks device, dtype and KV blocks."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from engine import config as config_module
from engine import device as device_module
from engine import kernels as kernels_module
from engine.config import EngineConfig
from engine.device import GpuMemory, gpu_kv_cache_budget
from engine.execution_plan import (
    Quantization,
    check_quantization,
    resolve_dtype,
    resolve_quantization,
)
from engine.kernels import switch, visible_flags

# SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64; bf16 is 2 bytes.
# One block of 16 tokens = 2 (K, V) * 30 * 16 * 3 * 64 * 2 bytes.
SMOL = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "dtype_bytes": 2}
SMOL_BLOCK_BYTES = 368_640
GiB = 1 << 30


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"model": ""}, "model must be"),
        ({"dtype": "f32"}, "dtype must be one of auto, float32, bfloat16, float16, got 'f32'"),
        ({"device": "gpu"}, "device must be one of auto, cpu, cuda, cuda:N, got 'gpu'"),
        ({"device": "cuda:x"}, "device must be one of"),
        ({"block_size": 3}, "block_size must be a positive power of two (e.g. 16), got 3"),
        ({"block_size": 0}, "block_size must be a positive power of two"),
        ({"block_size": -16}, "block_size must be a positive power of two"),
        ({"block_size": 16.0}, "block_size must be a positive power of two"),
        ({"block_size": True}, "block_size must be a positive power of two"),
        ({"num_blocks": 0}, "num_blocks must be a positive integer or None, got 0"),
        ({"kv_cache_memory": -1}, "kv_cache_memory must be a positive number of bytes"),
        ({"num_blocks": 8, "kv_cache_memory": GiB}, "num_blocks and kv_cache_memory are exclusive"),
        ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization must be in (0, 1], got 0.0"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in (0, 1]"),
        ({"max_num_seqs": 0}, "max_num_seqs must be a positive integer, got 0"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be a positive integer"),
        ({"max_model_len": 0}, "max_model_len must be a positive integer or None, got 0"),
        ({"enable_prefix_caching": "yes"}, "enable_prefix_caching must be True or False"),
        (
            {"prefix_cache_hash": "md5"},
            "prefix_cache_hash must be one of builtin, sha256, got 'md5'",
        ),
        ({"seed": 1.5}, "seed must be an integer, got 1.5"),
        ({"attention_backend": "flash"}, "attention_backend must be one of auto"),
        ({"cache_dir": ""}, "cache_dir must be a directory path or None"),
        (
            {"quantization": "int3"},
            "quantization must be one of auto, none, int8, int4 or None, got 'int3'",
        ),
    ],
)
def test_bad_values_fail_naming_the_option(fields, message):
    with pytest.raises(ValueError) as excinfo:
        EngineConfig(**fields)
    assert str(excinfo.value).startswith(message)


def test_a_field_changes_only_through_replace_which_validates():
    config = EngineConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_size = 12  # type: ignore[misc]
    with pytest.raises(ValueError, match="^block_size "):
        dataclasses.replace(config, block_size=12)


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"model": "/some/dir", "dtype": "bfloat16", "device": "cpu", "block_size": 1},
        {"dtype": "float16", "device": "cuda:1", "block_size": 256, "num_blocks": 4},
        {"kv_cache_memory": 1, "gpu_memory_utilization": 1.0, "max_model_len": 1},
        {"prefix_cache_hash": "sha256", "enable_prefix_caching": False, "seed": -3},
        {"attention_backend": "reference"},
        {"attention_backend": "sdpa", "cache_dir": "/tmp/x"},
    ],
)
def test_good_values_are_accepted(fields):
    config = EngineConfig(**fields)
    for name, value in fields.items():
        assert getattr(config, name) == value


def test_unknown_option_is_a_type_error():
    with pytest.raises(TypeError, match="blocksize"):
        EngineConfig(blocksize=16)


# -- device and dtype ---------------------------------------------------------------------


def test_device_auto_is_cuda_when_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert EngineConfig().resolve_device() == torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert EngineConfig().resolve_device() == torch.device("cpu")


def test_explicit_cuda_without_cuda_fails_naming_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="^device 'cuda:1' .*CUDA is not available"):
        EngineConfig(device="cuda:1").resolve_device()
    assert EngineConfig(device="cpu").resolve_device() == torch.device("cpu")


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)],
)
def test_explicit_dtype_is_used_on_any_device(name, dtype):
    config = EngineConfig(dtype=name)
    assert resolve_dtype(config, torch.device("cpu")) == dtype
    assert resolve_dtype(config, torch.device("cuda")) == dtype


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({"avx512f", "avx512_bf16"}, torch.bfloat16),
        ({"avx512f", "amx_bf16", "amx_tile"}, torch.bfloat16),
        ({"avx2", "avx512f"}, torch.float32),
        (set(), torch.float32),
    ],
)
def test_auto_dtype_on_cpu_follows_bf16_hardware(monkeypatch, flags, expected):
    monkeypatch.setattr(kernels_module, "cpu_flags", lambda: frozenset(flags))
    assert resolve_dtype(EngineConfig(), torch.device("cpu")) == expected


def _flags_from_proc_cpuinfo() -> set[str]:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        line = next(line for line in f if line.startswith("flags"))
    return set(line.split(":", 1)[1].split())


def test_auto_dtype_on_this_cpu_reads_the_real_flags():
    flags = visible_flags(frozenset(_flags_from_proc_cpuinfo()), switch())  # as the switch says
    expected = torch.bfloat16 if flags & {"avx512_bf16", "amx_bf16"} else torch.float32
    assert resolve_dtype(EngineConfig(), torch.device("cpu")) == expected


@pytest.mark.parametrize(("bf16", "expected"), [(True, torch.bfloat16), (False, torch.float16)])
def test_auto_dtype_on_cuda(monkeypatch, bf16, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    assert resolve_dtype(EngineConfig(), torch.device("cuda")) == expected


# -- KV cache size --------------------------------------------------------------------------


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize(
    ("device", "dtype"),
    [("cpu", torch.float32), ("cpu", torch.float16), ("cuda", torch.bfloat16)],
)
def test_quantization_is_refused_off_its_cpu_kernel(device, dtype, quantization):
    with pytest.raises(
        ValueError, match=f"^quantization '{quantization}' needs device cpu and dtype bfloat16"
    ):
        check_quantization(quantization, torch.device(device), dtype)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantization_without_the_kernel_is_refused_naming_the_cpu(monkeypatch, quantization):
    monkeypatch.setattr(kernels_module, "cpu_kernels", lambda: None)
    with pytest.raises(ValueError, match="needs a CPU with AVX512-BF16"):
        check_quantization(quantization, torch.device("cpu"), torch.bfloat16)


def test_auto_quantization_serves_a_gguf_in_its_own_blocks(monkeypatch):
    monkeypatch.setattr(kernels_module, "ggml_kernels", lambda: object())
    cpu, bf16, f32 = torch.device("cpu"), torch.bfloat16, torch.float32
    auto = EngineConfig()
    assert auto.quantization == "auto"
    native = Quantization("gguf", "gguf")
    assert resolve_quantization(auto, cpu, bf16, True) == native
    assert resolve_quantization(auto, cpu, f32, True) == native  # dtype auto resolved to f32
    assert resolve_quantization(auto, cpu, bf16, False) == Quantization()  # Hugging Face dir
    # Blocks hold the weights, so "auto"'s dtype is the activations': bf16 ones where the
    # AVX-512 kernels run the whole decode step natively, float32 ones elsewhere.
    monkeypatch.setattr(kernels_module, "cpu_kernels", lambda: None)
    assert resolve_dtype(auto, cpu, True) == f32
    monkeypatch.setattr(kernels_module, "cpu_kernels", lambda: object())
    assert resolve_dtype(auto, cpu, True) == bf16
    assert resolve_dtype(EngineConfig(dtype="bfloat16"), cpu, True) == bf16
    reference = EngineConfig(dtype="float32")  # asked for: every weight dequantized exactly
    assert resolve_quantization(reference, cpu, f32, True) == Quantization()
    assert resolve_quantization(auto, torch.device("cuda"), bf16, True) == Quantization()
    assert resolve_quantization(EngineConfig(tensor_parallel_size=2), cpu, bf16, True) == (
        Quantization()
    )
    for off in (None, "none"):
        assert resolve_quantization(EngineConfig(quantization=off), cpu, bf16, True) == (None, None)
    monkeypatch.setattr(kernels_module, "cpu_kernels", lambda: object())
    asked = resolve_quantization(EngineConfig(quantization="int8"), cpu, bf16, True)
    assert asked == Quantization("int8", None)  # asked for: the head stays as it is
    monkeypatch.setattr(kernels_module, "ggml_kernels", lambda: None)
    assert resolve_quantization(auto, cpu, bf16, True) == Quantization()  # no AVX2 kernels
    assert resolve_dtype(auto, cpu, True) == resolve_dtype(auto, cpu, False)


def test_bytes_per_block():
    assert EngineConfig().kv_cache_bytes_per_block(**SMOL) == SMOL_BLOCK_BYTES
    assert EngineConfig(block_size=32).kv_cache_bytes_per_block(**SMOL) == 2 * SMOL_BLOCK_BYTES


def test_num_blocks_wins_and_needs_no_memory_figure():
    assert EngineConfig(num_blocks=7).kv_cache_num_blocks(**SMOL) == 7


def test_explicit_budget_is_floored_to_whole_blocks():
    config = EngineConfig(kv_cache_memory=SMOL_BLOCK_BYTES * 10 + 5)
    assert config.kv_cache_num_blocks(**SMOL, free_memory=1) == 10


def test_cpu_default_budget_is_2_gib_when_ram_is_plentiful():
    config = EngineConfig()
    blocks = config.kv_cache_num_blocks(**SMOL, free_memory=100 * GiB, device=torch.device("cpu"))
    assert blocks == 5825  # 2 GiB // 368640


def test_cpu_default_budget_is_capped_by_available_ram():
    config = EngineConfig()
    blocks = config.kv_cache_num_blocks(**SMOL, free_memory=GiB, device=torch.device("cpu"))
    assert blocks == 1165  # int(0.4 GiB) // 368640


def test_default_budget_measures_available_ram_when_not_given():
    blocks = EngineConfig(device="cpu").kv_cache_num_blocks(**SMOL)
    assert 1 <= blocks <= 5825


def test_budget_below_one_block_fails_naming_the_option():
    config = EngineConfig(kv_cache_memory=SMOL_BLOCK_BYTES - 1)
    with pytest.raises(ValueError, match="^kv_cache_memory: .*368640 bytes"):
        config.kv_cache_num_blocks(**SMOL)


# -- context length, names, description --------------------------------------------------------


def test_max_model_len_defaults_to_the_model_and_may_shrink():
    model = SimpleNamespace(max_position_embeddings=8192)
    assert EngineConfig().resolve_max_model_len(model) == 8192
    assert EngineConfig(max_model_len=2048).resolve_max_model_len(model) == 2048
    assert EngineConfig(max_model_len=8192).resolve_max_model_len(8192) == 8192


def test_max_model_len_larger_than_the_model_fails():
    with pytest.raises(ValueError, match="^max_model_len 8193 is larger than .* 8192"):
        EngineConfig(max_model_len=8193).resolve_max_model_len(
            SimpleNamespace(max_position_embeddings=8192)
        )


@pytest.mark.parametrize(
    ("model", "name"),
    [
        (None, "SmolLM2-135M-Instruct"),
        ("/models/Qwen2-0.5B", "Qwen2-0.5B"),
        ("/models/Qwen2-0.5B/", "Qwen2-0.5B"),
        ("weights/tinyllama.Q8_0.gguf", "tinyllama.Q8_0"),
    ],
)
def test_served_name(model, name):
    assert EngineConfig(model=model).served_name() == name


def test_describe_reports_blocks_and_concurrent_tokens():
    config = EngineConfig(block_size=32, max_num_seqs=8)
    assert config.describe_kv_cache(100) == (
        "KV cache: 100 blocks of 32 tokens (3200 tokens max concurrently)"
    )


# -- KV cache on a GPU: total x gpu_memory_utilization - memory in use at the profiling peak ----

CUDA = torch.device("cuda")


def test_gpu_budget_is_the_utilization_share_minus_the_peak_in_use():
    assert gpu_kv_cache_budget(total=80 * GiB, peak_used=10 * GiB, gpu_memory_utilization=0.9) == (
        int(72 * GiB) - 10 * GiB
    )
    assert gpu_kv_cache_budget(16 * GiB, 0, 1.0) == 16 * GiB
    # More in use than the share allows: nothing is left (negative, reported by the caller).
    assert gpu_kv_cache_budget(16 * GiB, 12 * GiB, 0.5) == -4 * GiB


def test_cuda_blocks_come_from_fake_total_and_peak_figures():
    memory = GpuMemory(total=16 * GiB, peak_used=4 * GiB)
    half = EngineConfig(gpu_memory_utilization=0.5)
    assert half.kv_cache_num_blocks(**SMOL, device=CUDA, gpu_memory=memory) == 11650  # 4 GiB
    default = EngineConfig()  # 0.9, vLLM's default
    assert default.gpu_memory_utilization == 0.9
    expected = (int(16 * GiB * 0.9) - 4 * GiB) // SMOL_BLOCK_BYTES
    assert default.kv_cache_num_blocks(**SMOL, device=CUDA, gpu_memory=memory) == expected


def test_cuda_ignores_free_ram_and_the_cpu_2_gib_default():
    memory = GpuMemory(total=80 * GiB, peak_used=2 * GiB)
    blocks = EngineConfig().kv_cache_num_blocks(
        **SMOL, free_memory=GiB, device=CUDA, gpu_memory=memory
    )
    assert blocks == (int(72 * GiB) - 2 * GiB) // SMOL_BLOCK_BYTES
    assert blocks * SMOL_BLOCK_BYTES > 2 * GiB


@pytest.mark.parametrize("peak_used", [8 * GiB, 8 * GiB - SMOL_BLOCK_BYTES + 1, 15 * GiB])
def test_cuda_share_already_used_fails_naming_gpu_memory_utilization(peak_used):
    config = EngineConfig(gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match="^gpu_memory_utilization: 0.5 of the GPU's 16.00 GiB"):
        config.kv_cache_num_blocks(**SMOL, device=CUDA, gpu_memory=GpuMemory(16 * GiB, peak_used))


def test_cuda_explicit_budget_or_blocks_need_no_gpu_figures(monkeypatch):
    def no_measuring(device):
        raise AssertionError("GPU memory measured although the size was given")

    monkeypatch.setattr(config_module, "measure_gpu_memory", no_measuring)
    config = EngineConfig(kv_cache_memory=SMOL_BLOCK_BYTES * 3)
    assert config.kv_cache_num_blocks(**SMOL, device=CUDA) == 3
    assert EngineConfig(num_blocks=5).kv_cache_num_blocks(**SMOL, device=CUDA) == 5


def _fake_cuda_memory(monkeypatch, free, total, max_reserved, reserved):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: max_reserved)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)


def test_measure_gpu_memory_is_total_minus_free(monkeypatch):
    # The allocator still holds its peak reservation: nothing to add back.
    _fake_cuda_memory(monkeypatch, free=10 * GiB, total=24 * GiB, max_reserved=GiB, reserved=GiB)
    assert device_module.measure_gpu_memory(CUDA) == GpuMemory(24 * GiB, 14 * GiB)


def test_measure_gpu_memory_adds_back_what_the_allocator_released_since_the_peak(monkeypatch):
    # empty_cache() after the profiling pass handed 3 GiB of activations back to the driver.
    _fake_cuda_memory(monkeypatch, 13 * GiB, 24 * GiB, max_reserved=5 * GiB, reserved=2 * GiB)
    assert device_module.measure_gpu_memory(CUDA) == GpuMemory(24 * GiB, 14 * GiB)


def test_cuda_blocks_are_measured_when_no_figures_are_given(monkeypatch):
    _fake_cuda_memory(monkeypatch, free=12 * GiB, total=16 * GiB, max_reserved=0, reserved=0)
    blocks = EngineConfig(gpu_memory_utilization=0.5).kv_cache_num_blocks(**SMOL, device=CUDA)
    assert blocks == 11650  # 8 GiB share - 4 GiB in use = 4 GiB


@pytest.mark.parametrize(
    ("flags", "expected_blocks"),
    [
        ([], (int(40 * GiB * 0.9) - 6 * GiB) // SMOL_BLOCK_BYTES),
        (["--gpu-memory-utilization", "0.5"], (20 * GiB - 6 * GiB) // SMOL_BLOCK_BYTES),
        (["--gpu-memory-utilization", "0.25"], (10 * GiB - 6 * GiB) // SMOL_BLOCK_BYTES),
        (["--kv-cache-memory", "1GiB"], GiB // SMOL_BLOCK_BYTES),
        (["--num-blocks", "42"], 42),
    ],
)
def test_cli_memory_flags_size_the_kv_cache(flags, expected_blocks):
    from server.cli import build_parser, engine_config_from_args

    args = build_parser().parse_args(["serve", *flags])
    config = engine_config_from_args(args)
    memory = GpuMemory(total=40 * GiB, peak_used=6 * GiB)
    assert config.kv_cache_num_blocks(**SMOL, device=CUDA, gpu_memory=memory) == expected_blocks


@pytest.mark.parametrize(
    ("fields", "device", "expected"),
    [
        ({}, CUDA, True),
        ({"num_blocks": 8}, CUDA, False),
        ({"kv_cache_memory": GiB}, CUDA, False),
        ({}, torch.device("cpu"), False),
    ],
)
def test_profiling_pass_only_when_the_gpu_budget_needs_the_activation_peak(
    fields, device, expected
):
    assert EngineConfig(**fields).profiles_memory(device) is expected


# -- device-specific helpers: no-ops on CPU, torch.cuda calls on CUDA --------------------------


def test_device_helpers_do_nothing_on_cpu(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("torch.cuda called for a CPU device")

    for name in ("reset_peak_memory_stats", "synchronize", "is_available"):
        monkeypatch.setattr(torch.cuda, name, boom)
    cpu = torch.device("cpu")
    device_module.reset_peak_memory_stats(cpu)
    device_module.synchronize(cpu)
    assert device_module.uses_pinned_memory(cpu) is False


def test_device_helpers_call_cuda_on_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: calls.append(("reset", d)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d: calls.append(("sync", d)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    device_module.reset_peak_memory_stats(CUDA)
    device_module.synchronize(CUDA)
    assert calls == [("reset", CUDA), ("sync", CUDA)]
    assert device_module.uses_pinned_memory(CUDA) is True


def test_the_config_imports_no_implementation_until_a_choice_is_read():
    """The options sit below the code they configure (engine/registry.py): importing the
    config loads no attention backend, kernel, model, weight format or loader, and reading
    --attention-backend's and --quantization's choices loads the registering modules."""
    import subprocess
    import sys

    code = (
        "import sys, engine.config as c\n"
        "before = sorted(m for m in sys.modules if m.startswith('engine.'))\n"
        "flags = {f.name: flag for f, flag in c.engine_flags()}\n"
        "print(before)\n"
        "print(flags['attention_backend'].choice_list(), flags['quantization'].choice_list())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, choices = out.stdout.splitlines()
    assert before == str(  # (template_bounds: the chat template timeout's default)
        ["engine.config", "engine.default_model", "engine.device", "engine.kv_layout",
         "engine.registry", "engine.template_bounds"]
    )  # fmt: skip
    assert "'cpu-paged'" in choices and "'int4'" in choices and "'int8'" in choices
