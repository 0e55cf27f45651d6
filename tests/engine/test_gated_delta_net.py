"""engine/models/gated_delta_net.py against transformers' own Qwen3.5 functions: the conv,
the chunked and recurrent gated delta rule, with grouped value heads (Hk != Hv), states
continued across prefill pieces, snapshots at save points, and decode on scattered slots."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from engine.kernels import cpu_kernels, ggml_kernels
from engine.models import gated_delta_net
from engine.models.gated_delta_net import (
    GDNDims,
    decode_torch,
    gdn_decode,
    gdn_prefill,
)

DIMS = GDNDims(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=24, conv_kernel=4)
ATOL = 1e-5


def inputs(t: int, seed: int, device, dims: GDNDims = DIMS) -> dict[str, torch.Tensor]:
    """Random per-token inputs of a layer: mixed_qkv [t, C], g [t, Hv] (log decay <= 0, as
    -exp(A_log) * softplus(a + dt_bias)), beta [t, Hv] in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    hv = dims.num_v_heads
    return {
        "mixed_qkv": torch.randn(t, dims.conv_dim, generator=gen).to(device),
        "g": (-torch.rand(hv, generator=gen) * 2 * torch.rand(t, hv, generator=gen)).to(device),
        "beta": torch.rand(t, hv, generator=gen).to(device),
    }


def weights(seed: int, device, dims: GDNDims = DIMS) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(dims.conv_dim, dims.conv_kernel, generator=gen) * 0.5).to(device)


def initial_states(seed: int, device, dims: GDNDims = DIMS, slots: int = 1):
    """Random (conv_states [slots, C, K-1], states [slots, Hv, Dk, Dv]): a request midway."""
    gen = torch.Generator().manual_seed(seed)
    conv = torch.randn(slots, dims.conv_dim, dims.conv_kernel - 1, generator=gen)
    shape = (slots, dims.num_v_heads, dims.head_k_dim, dims.head_v_dim)
    return conv.to(device), (torch.randn(shape, generator=gen) * 0.1).to(device)


def split_heads(mixed: torch.Tensor, dims: GDNDims = DIMS):
    """transformers' split of the conv's output [1, T, C] into q, k, v [1, T, heads, dim],
    q and k repeated to the value heads as its module does (from transformers 5.2x the
    rule's functions repeat them too; 5.17's, on the GPU host, do not)."""
    q, k, v = torch.split(mixed, [dims.key_dim, dims.key_dim, dims.value_dim], dim=-1)
    t, group = mixed.shape[1], dims.num_v_heads // dims.num_k_heads
    q, k = (x.reshape(1, t, -1, dims.head_k_dim).repeat_interleave(group, dim=2) for x in (q, k))
    return q, k, v.reshape(1, t, -1, dims.head_v_dim)


def hf_prefill(x, weight, conv_state, state, dims: GDNDims = DIMS):
    """Qwen3_5GatedDeltaNet.forward's prefill with a cache: the conv over the cached inputs
    then the new ones (causal_conv1d_fn), the chunked rule from the cached state. Returns
    (out [T, Hv, Dv], conv state [C, K-1], state)."""
    t = x["mixed_qkv"].shape[0]
    full = torch.cat([conv_state, x["mixed_qkv"].t()], dim=-1).unsqueeze(0)
    mixed = hf.causal_conv1d_fn(full, weight, None, activation="silu")[:, :, -t:]
    out, final = hf.torch_chunk_gated_delta_rule(
        *split_heads(mixed.transpose(1, 2), dims), g=x["g"][None], beta=x["beta"][None],
        initial_state=state[None], output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    return out[0], full[0, :, -(dims.conv_kernel - 1) :], final[0]


def hf_step(x, weight, conv_state, state, dims: GDNDims = DIMS):
    """transformers' cached decode of one token (causal_conv1d_update, then the recurrent
    rule); conv_state [C, K-1] is updated in place. Returns (out [Hv, Dv], state)."""
    mixed = hf.causal_conv1d_update(x["mixed_qkv"].reshape(1, -1, 1), conv_state[None],
                                    weight, None, "silu")  # fmt: skip
    out, final = hf.torch_recurrent_gated_delta_rule(
        *split_heads(mixed.transpose(1, 2), dims), g=x["g"].reshape(1, 1, -1),
        beta=x["beta"].reshape(1, 1, -1), initial_state=state[None], output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    return out[0, 0], final[0]


def close(a: torch.Tensor, b: torch.Tensor, atol: float = ATOL) -> None:
    torch.testing.assert_close(a, b, atol=atol, rtol=1e-5)


@pytest.mark.device
@pytest.mark.parametrize("t", [1, 5, 64, 65, 130])
def test_prefill_matches_transformers(t: int, device) -> None:
    x, weight = inputs(t, seed=t, device=device), weights(1, device)
    conv, state = (s[0] for s in initial_states(2, device))
    expected = hf_prefill(x, weight, conv, state)
    out = gdn_prefill(**x, conv_weight=weight, conv_state=conv, state=state, dims=DIMS)
    assert out.shape == (t, DIMS.num_v_heads, DIMS.head_v_dim)
    close(out, expected[0])
    close(conv, expected[1])
    close(state, expected[2])


@pytest.mark.device
def test_fresh_prefill_matches_transformers_without_cache(device) -> None:
    """A zeroed slot is transformers' first prefill: zero left padding, no initial state."""
    x, weight = inputs(70, seed=3, device=device), weights(4, device)
    conv = torch.zeros(DIMS.conv_dim, DIMS.conv_kernel - 1, device=device)
    state = torch.zeros(DIMS.num_v_heads, DIMS.head_k_dim, DIMS.head_v_dim, device=device)
    mixed = hf.causal_conv1d_fn(x["mixed_qkv"].t()[None], weight, None, activation="silu")
    expected, final = hf.torch_chunk_gated_delta_rule(
        *split_heads(mixed.transpose(1, 2)), g=x["g"][None], beta=x["beta"][None],
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    out = gdn_prefill(**x, conv_weight=weight, conv_state=conv, state=state, dims=DIMS)
    close(out, expected[0])
    close(state, final[0])
    close(conv, x["mixed_qkv"][-3:].t())


@pytest.mark.device
@pytest.mark.parametrize("piece", [1, 3, 17, 64])
def test_prefill_in_pieces_equals_one_prefill(piece: int, device) -> None:
    t = 130
    x, weight = inputs(t, seed=5, device=device), weights(6, device)
    conv0, state0 = (s[0] for s in initial_states(7, device))
    conv, state = conv0.clone(), state0.clone()
    whole = gdn_prefill(**x, conv_weight=weight, conv_state=conv, state=state, dims=DIMS)
    conv_p, state_p, outs = conv0.clone(), state0.clone(), []
    for start in range(0, t, piece):
        part = {name: value[start : start + piece] for name, value in x.items()}
        outs.append(gdn_prefill(**part, conv_weight=weight, conv_state=conv_p,
                                state=state_p, dims=DIMS))  # fmt: skip
    close(torch.cat(outs), whole)
    close(conv_p, conv)
    close(state_p, state)


@pytest.mark.device
def test_saves_hold_the_state_of_each_prefix(device) -> None:
    t, points = 130, [1, 16, 64, 65, 100, 130]
    x, weight = inputs(t, seed=8, device=device), weights(9, device)
    conv0, state0 = (s[0] for s in initial_states(10, device))
    conv_dst, state_dst = initial_states(11, device, slots=len(points))  # garbage to overwrite
    conv, state = conv0.clone(), state0.clone()
    saves = [(p, conv_dst[i], state_dst[i]) for i, p in enumerate(points)]
    saves = saves[::-1]  # in any order
    out = gdn_prefill(**x, conv_weight=weight, conv_state=conv, state=state, dims=DIMS, saves=saves)
    plain = gdn_prefill(**x, conv_weight=weight, conv_state=conv0.clone(),
                        state=state0.clone(), dims=DIMS)  # fmt: skip
    close(out, plain)
    for i, p in enumerate(points):
        _, conv_p, state_p = hf_prefill({n: v[:p] for n, v in x.items()}, weight, conv0, state0)
        close(conv_dst[i], conv_p)
        close(state_dst[i], state_p)
    close(conv, conv_dst[-1])
    close(state, state_dst[-1])


@pytest.mark.device
def test_save_outside_the_tokens_is_refused(device) -> None:
    x, weight = inputs(4, seed=1, device=device), weights(1, device)
    conv, state = (s[0] for s in initial_states(1, device))
    with pytest.raises(ValueError):
        gdn_prefill(**x, conv_weight=weight, conv_state=conv, state=state, dims=DIMS,
                    saves=[(5, conv.clone(), state.clone())])  # fmt: skip


@pytest.mark.device
def test_decode_steps_scattered_slots_and_leaves_the_others(device) -> None:
    slots = [4, 0, 2]
    x, weight = inputs(len(slots), seed=12, device=device), weights(13, device)
    conv_states, states = initial_states(14, device, slots=6)
    conv_before, states_before = conv_states.clone(), states.clone()
    out = gdn_decode(**x, conv_weight=weight, conv_states=conv_states, states=states,
                     slots=torch.tensor(slots, device=device), dims=DIMS)  # fmt: skip
    assert out.shape == (len(slots), DIMS.num_v_heads, DIMS.head_v_dim)
    for b, slot in enumerate(slots):
        conv = conv_before[slot].clone()
        step = {name: value[b] for name, value in x.items()}
        expected, state = hf_step(step, weight, conv, states_before[slot])
        close(out[b], expected)
        close(conv_states[slot], conv)
        close(states[slot], state)
    for slot in (1, 3, 5):
        assert torch.equal(conv_states[slot], conv_before[slot])
        assert torch.equal(states[slot], states_before[slot])


@pytest.mark.device
def test_prefill_then_decode_matches_transformers(device) -> None:
    t, steps = 37, 3
    x, weight = inputs(t + steps, seed=15, device=device), weights(16, device)
    conv_states = torch.zeros(2, DIMS.conv_dim, DIMS.conv_kernel - 1, device=device)
    states = torch.zeros(2, DIMS.num_v_heads, DIMS.head_k_dim, DIMS.head_v_dim, device=device)
    prompt = {name: value[:t] for name, value in x.items()}
    gdn_prefill(**prompt, conv_weight=weight, conv_state=conv_states[1], state=states[1],
                dims=DIMS)  # fmt: skip
    _, conv, state = hf_prefill(prompt, weight, conv_states[0], states[0])
    for i in range(t, t + steps):
        step = {name: value[i] for name, value in x.items()}
        expected, state = hf_step(step, weight, conv, state)
        out = gdn_decode(**{n: v[None] for n, v in step.items()}, conv_weight=weight,
                         conv_states=conv_states, states=states,
                         slots=torch.tensor([1], device=device), dims=DIMS)  # fmt: skip
        close(out[0], expected)
    close(conv_states[1], conv)
    close(states[1], state)


@pytest.mark.device
def test_bf16_inputs_keep_a_float32_state(device) -> None:
    """bf16 activations, conv weight and conv state; the state stays float32 and the results
    stay near float32's on the same (bf16) values."""
    t, bf = 70, torch.bfloat16
    x, weight = inputs(t + 1, seed=17, device=device), weights(18, device).to(bf)
    x["mixed_qkv"] = x["mixed_qkv"].to(bf)
    x["beta"] = x["beta"].to(bf)
    conv_states, states = initial_states(19, device, slots=2)
    conv_states = conv_states.to(bf)
    conv32, states32 = conv_states.float(), states.clone()
    prompt = {name: value[:t] for name, value in x.items()}
    last = {name: value[t:] for name, value in x.items()}
    out = gdn_prefill(**prompt, conv_weight=weight, conv_state=conv_states[1],
                      state=states[1], dims=DIMS)  # fmt: skip
    step = gdn_decode(**last, conv_weight=weight, conv_states=conv_states, states=states,
                      slots=torch.tensor([1], device=device), dims=DIMS)  # fmt: skip
    assert out.dtype == step.dtype == bf and states.dtype == torch.float32
    as32 = {name: value.float() for name, value in x.items()}
    out32 = gdn_prefill(**{n: v[:t] for n, v in as32.items()}, conv_weight=weight.float(),
                        conv_state=conv32[1], state=states32[1], dims=DIMS)  # fmt: skip
    step32 = gdn_decode(**{n: v[t:] for n, v in as32.items()}, conv_weight=weight.float(),
                        conv_states=conv32, states=states32,
                        slots=torch.tensor([1], device=device), dims=DIMS)  # fmt: skip
    close(out.float(), out32, atol=3e-2)
    close(step.float(), step32, atol=3e-2)
    close(states, states32, atol=3e-2)
    assert torch.equal(states[0], states32[0])


# Where no native build exists, decided at collection (not in a test body).
needs_kernels = pytest.mark.skipif(
    ggml_kernels() is None, reason="no native CPU kernels here (no AVX2/FMA/F16C, or no compiler)"
)


@pytest.fixture(scope="module")
def kernels():
    """The native module with the float32 layer ops (AVX-512 here, or the AVX2 build under
    $PAGEDSERVE_CPU_KERNELS=avx2): gated_delta_decode is in both builds."""
    return ggml_kernels()


# Dv 24: 8-column tiles only; Dv 72: a 64-column tile then an 8-column one.
@pytest.mark.parametrize("dims", [DIMS, GDNDims(1, 2, 32, 72, 3)], ids=["dv24", "dv72"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@needs_kernels
def test_kernel_equals_torch_ops(kernels, dims: GDNDims, dtype: torch.dtype) -> None:
    slots = torch.tensor([5, 1, 3])
    x, weight = inputs(len(slots), seed=20, device="cpu", dims=dims), weights(21, "cpu", dims)
    x["mixed_qkv"], weight = x["mixed_qkv"].to(dtype), weight.to(dtype)
    conv_states, states = initial_states(22, "cpu", dims, slots=6)
    conv_states = conv_states.to(dtype)
    pools = conv_states.clone(), states.clone()
    expected = decode_torch(**x, conv_weight=weight, conv_states=pools[0], states=pools[1],
                            slots=slots, dims=dims)  # fmt: skip
    out = kernels.gated_delta_decode(x["mixed_qkv"], x["g"], x["beta"], weight, conv_states,
                                     states, slots, dims.num_k_heads)  # fmt: skip
    assert out.dtype == dtype
    atol = ATOL if dtype == torch.float32 else 2e-2
    close(out.float(), expected.float(), atol=atol)
    assert torch.equal(conv_states, pools[0])  # the untouched slots too
    close(states, pools[1], atol=1e-6 if dtype == torch.float32 else 1e-2)
    for slot in (0, 2, 4):
        assert torch.equal(states[slot], initial_states(22, "cpu", dims, slots=6)[1][slot])


@pytest.mark.parametrize("slots", [[2], [1, 1]], ids=["outside", "twice"])
@needs_kernels
def test_kernel_refuses_a_slot_outside_the_pool_or_twice(kernels, slots: list[int]) -> None:
    x, weight = inputs(len(slots), seed=23, device="cpu"), weights(24, "cpu")
    conv_states, states = initial_states(25, "cpu", slots=2)
    with pytest.raises(RuntimeError, match="slot"):
        kernels.gated_delta_decode(x["mixed_qkv"], x["g"], x["beta"], weight, conv_states,
                                   states, torch.tensor(slots), DIMS.num_k_heads)  # fmt: skip


@pytest.mark.skipif(cpu_kernels() is None, reason="bf16 kernels need AVX512-BF16")
def test_bf16_decode_on_cpu_runs_the_kernel(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("torch's ops ran")

    monkeypatch.setattr(gated_delta_net, "decode_torch", refuse)
    x, weight = inputs(2, seed=26, device="cpu"), weights(27, "cpu").to(torch.bfloat16)
    conv_states, states = initial_states(28, "cpu", slots=3)
    fused = torch.cat([x["mixed_qkv"], x["beta"]], dim=1).to(torch.bfloat16)  # a fused projection
    mixed = fused[:, : DIMS.conv_dim]  # not contiguous: copied for the kernel
    out = gdn_decode(mixed, x["g"], x["beta"], weight, conv_states.to(torch.bfloat16), states,
                     torch.tensor([2, 0]), DIMS)  # fmt: skip
    assert out.shape == (2, DIMS.num_v_heads, DIMS.head_v_dim)


@needs_kernels
def test_float32_decode_of_a_gguf_layer_runs_the_kernel(monkeypatch) -> None:
    """float32 activations where a GGUF's blocks serve the projections (the GGUF path on a
    CPU without AVX512-BF16) take the native step, equal to torch's ops; a float32 layer of
    other weights stays on torch's ops, the token-exact reference."""
    x, weight = inputs(2, seed=29, device="cpu"), weights(30, "cpu")
    pools = initial_states(31, "cpu", slots=3)
    expected = decode_torch(**x, conv_weight=weight, conv_states=pools[0].clone(),
                            states=pools[1].clone(), slots=torch.tensor([2, 0]), dims=DIMS)  # fmt: skip
    assert gated_delta_net.decode_kernels(x["mixed_qkv"], weight, *pools, DIMS) is None

    def refuse(*args, **kwargs):
        raise AssertionError("torch's ops ran")

    monkeypatch.setattr(gated_delta_net, "decode_torch", refuse)
    out = gdn_decode(**x, conv_weight=weight, conv_states=pools[0], states=pools[1],
                     slots=torch.tensor([2, 0]), dims=DIMS, quantization="gguf")  # fmt: skip
    close(out, expected)
