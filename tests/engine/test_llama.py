"""Our Llama-family model against transformers on tiny random-weight models."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from engine.attention import AttentionMetadata, allocate_kv_cache
from engine.config import EngineConfig
from engine.execution_plan import resolve_plan
from engine.models import get_model_class
from engine.models.llama import LlamaForCausalLM
from engine.models.mistral import MistralForCausalLM
from engine.models.qwen2 import Qwen2ForCausalLM

BLOCK_SIZE = 4
TOL = 1e-4

_COMMON = dict(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=112,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,  # livelier logits than the default 0.02: fewer near-ties
    bos_token_id=None,
    eos_token_id=None,  # generation runs the full length on both sides
    pad_token_id=0,
)


def _configs():
    return {
        "llama-tied": LlamaConfig(**_COMMON, num_hidden_layers=2, tie_word_embeddings=True),
        "llama-untied-bias": LlamaConfig(
            **_COMMON,
            num_hidden_layers=3,
            tie_word_embeddings=False,
            attention_bias=True,
            mlp_bias=True,
        ),
        "qwen2": Qwen2Config(**_COMMON, num_hidden_layers=2, tie_word_embeddings=False),
        "mistral": MistralConfig(
            **_COMMON, num_hidden_layers=2, head_dim=None, sliding_window=None
        ),
        "llama3-rope": LlamaConfig(
            **_COMMON,
            num_hidden_layers=2,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
        "linear-rope": LlamaConfig(
            **_COMMON,
            num_hidden_layers=2,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        ),
    }


CONFIG_NAMES = list(_configs())


def _hf_model(config):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    # Biases start at zero in transformers; make them matter.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    return model


_CACHE: dict = {}


def models(name: str, dtype=torch.float32, backend="auto"):
    """(transformers model, our model with its weights) for a named config; built once."""
    key = (name, dtype, backend)
    if key not in _CACHE:
        if name not in _CACHE:
            _CACHE[name] = _hf_model(_configs()[name])
        hf = _CACHE[name]
        # The plan the engine would make here for this dtype and backend.
        asked = EngineConfig(dtype=str(dtype).removeprefix("torch."), attention_backend=backend)
        plan = resolve_plan(asked, hf.config, torch.device("cpu"), gguf=False)
        ours = get_model_class(hf.config)(hf.config, plan)
        ours.load_weights(hf.state_dict().items())
        _CACHE[key] = (hf, ours)
    return _CACHE[key]


class PagedDriver:
    """A tiny stand-in for the model runner: block tables from a shuffled pool, one step at a time."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int = 128, seed: int = 0) -> None:
        self.model = model
        self.kv = allocate_kv_cache(
            model.num_layers, num_blocks, BLOCK_SIZE, model.num_kv_heads, model.head_dim,
            model.dtype, "cpu",
        )  # fmt: skip
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    def share_prefix(self, req: str, donor: str, num_blocks: int) -> None:
        """Start ``req`` with ``donor``'s first full blocks already computed (a prefix-cache hit)."""
        self.tables[req] = list(self.tables[donor][:num_blocks])
        self.computed[req] = num_blocks * BLOCK_SIZE

    @torch.inference_mode()
    def step(self, work: list[tuple[str, list[int]]]) -> torch.Tensor:
        """Run each (request, new tokens); return logits ``[len(work), V]`` at each last token."""
        query_lens, seq_lens, tables, ids = [], [], [], []
        for req, tokens in work:
            table = self.tables.setdefault(req, [])
            seq_len = self.computed.get(req, 0) + len(tokens)
            while len(table) * BLOCK_SIZE < seq_len:
                table.append(self.free.pop())
            query_lens.append(len(tokens))
            seq_lens.append(seq_len)
            tables.append(table)
            ids.extend(tokens)
            self.computed[req] = seq_len
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE, "cpu")
        self.model.attn_backend.prepare(meta)
        hidden = self.model(torch.tensor(ids), meta.positions, self.kv, meta)
        last = torch.tensor(meta.query_start_loc_list[1:]) - 1
        return self.model.compute_logits(hidden[last])


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 1000) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_full_prompt_logits_match_transformers(name):
    hf, ours = models(name)
    batch = prompts(1, [5, 13, 1, 22])
    lens = [len(p) for p in batch]
    tables, free = [], list(range(40))
    random.Random(3).shuffle(free)
    for n in lens:
        tables.append([free.pop() for _ in range((n + BLOCK_SIZE - 1) // BLOCK_SIZE)])
    kv = allocate_kv_cache(
        ours.num_layers, 40, BLOCK_SIZE, ours.num_kv_heads, ours.head_dim, torch.float32, "cpu"
    )
    meta = AttentionMetadata.build(lens, lens, tables, BLOCK_SIZE, "cpu")
    ours.attn_backend.prepare(meta)
    with torch.inference_mode():
        hidden = ours(torch.tensor(sum(batch, [])), meta.positions, kv, meta)
        logits = ours.compute_logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (sum(lens), 1000)
    for r, tokens in enumerate(batch):
        start, end = meta.query_start_loc_list[r], meta.query_start_loc_list[r + 1]
        torch.testing.assert_close(logits[start:end], hf_logits(hf, tokens), atol=TOL, rtol=TOL)


@pytest.mark.parametrize(
    ("name", "backend"),
    [(n, "sdpa") for n in CONFIG_NAMES]
    + [("llama-untied-bias", "reference"), ("qwen2", "reference")],
)
def test_incremental_chunks_prefix_hits_and_decodes_match_transformers(name, backend):
    hf, ours = models(name, backend=backend)
    a, b = prompts(2, [23, 10])
    c = a[:8] + prompts(4, [6])[0]  # shares a's first two blocks
    driver = PagedDriver(ours, seed=5)
    seqs = {"a": [], "b": [], "c": []}

    def run(work):
        logits = driver.step(work)
        for (req, tokens), row in zip(work, logits, strict=True):
            seqs[req] += tokens
            torch.testing.assert_close(row, hf_logits(hf, seqs[req])[-1], atol=TOL, rtol=TOL)

    run([("a", a[:7])])  # first chunk of a
    run([("a", a[7:16]), ("b", b)])  # second chunk of a + whole b
    run([("b", [17]), ("a", a[16:])])  # b decodes while a finishes its prompt
    driver.share_prefix("c", "a", 2)
    seqs["c"] = c[:8]
    run([("a", [5]), ("b", [6]), ("c", c[8:])])  # c prefills on a cached prefix
    rng = random.Random(9)
    for _ in range(5):  # decode steps, decodes only
        run([(req, [rng.randrange(1, 1000)]) for req in ("c", "a", "b")])


def greedy_paged(
    model: LlamaForCausalLM, batch: list[list[int]], new_tokens: int
) -> list[list[int]]:
    driver = PagedDriver(model, seed=11)
    names = [str(i) for i in range(len(batch))]
    next_ids = driver.step(list(zip(names, batch, strict=True))).argmax(-1).tolist()
    out = [[t] for t in next_ids]
    for _ in range(new_tokens - 1):
        next_ids = (
            driver.step([(n, [t]) for n, t in zip(names, next_ids, strict=True)])
            .argmax(-1)
            .tolist()
        )
        for seq, t in zip(out, next_ids, strict=True):
            seq.append(t)
    return out


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_greedy_generation_matches_transformers_generate(name):
    hf, ours = models(name)
    batch = prompts(6, [3, 11, 7, 18])
    ours_out = greedy_paged(ours, batch, 16)
    for tokens, got in zip(batch, ours_out, strict=True):
        with torch.no_grad():
            gen = hf.generate(
                torch.tensor([tokens]),
                attention_mask=torch.ones(1, len(tokens), dtype=torch.long),
                do_sample=False,
                max_new_tokens=16,
                pad_token_id=0,
            )
        assert got == gen[0, len(tokens) :].tolist()


@pytest.mark.parametrize("name", ["llama-tied", "qwen2"])
def test_bfloat16_runs_and_stays_close_to_float32(name):
    """Eight prompts, then three decode steps each: 32 rows of logits. Measured on Zen 3
    (torch's bf16 ops, 2026-11-27): the largest difference 1.1% of the largest logit, and
    the same most likely token in 93.8% (llama-tied) and 96.9% (qwen2) of the rows. (The
    AVX-512 figures were not taken with these rows: a failure there is a first measurement.)"""
    _, ours32 = models(name)
    _, ours16 = models(name, dtype=torch.bfloat16)
    assert ours16.embed_tokens.dtype == torch.bfloat16
    batch = prompts(8, [9, 30, 4, 17, 25, 1, 12, 40])
    rng = random.Random(2)
    steps = [[rng.randrange(1, 1000) for _ in batch] for _ in range(3)]
    results = []
    for model in (ours32, ours16):
        driver = PagedDriver(model)
        rows = [driver.step([(str(i), p) for i, p in enumerate(batch)])]
        rows += [driver.step([(str(i), [t]) for i, t in enumerate(step)]) for step in steps]
        results.append(torch.cat(rows))
    full, half = results
    assert half.dtype == torch.float32 and torch.isfinite(half).all()
    assert (half - full).abs().max() < 0.02 * full.abs().max()
    assert (half.argmax(-1) == full.argmax(-1)).float().mean() >= 0.9


def test_load_weights_rejects_unknown_and_missing_names():
    hf, _ = models("llama-tied")
    ours = LlamaForCausalLM(hf.config)
    weights = dict(hf.state_dict())
    with pytest.raises(ValueError, match="unexpected weight name 'model.layers.0.mlp.foo.weight'"):
        ours.load_weights([*weights.items(), ("model.layers.0.mlp.foo.weight", torch.zeros(1))])
    del weights["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match=r"layers\.1\.qkv_proj\[k_proj\]"):
        ours.load_weights(weights.items())
    untied = Qwen2ForCausalLM(_configs()["qwen2"])
    qwen_weights = {
        k: v for k, v in models("qwen2")[0].state_dict().items() if k != "lm_head.weight"
    }
    with pytest.raises(ValueError, match="lm_head"):
        untied.load_weights(qwen_weights.items())


def test_tied_head_is_the_embedding_and_qwen2_has_qkv_bias_only():
    _, tied = models("llama-tied")
    assert tied.lm_head is tied.embed_tokens
    _, qwen = models("qwen2")
    attn, mlp = qwen.layers[0].self_attn, qwen.layers[0].mlp
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None
    assert mlp.gate_up_proj.bias is None and mlp.down_proj.bias is None


def test_registry_maps_architectures_and_rejects_others():
    classes = (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)
    for cls in classes:
        assert get_model_class(LlamaConfig(architectures=[cls.__name__])) is cls
    assert issubclass(Qwen2ForCausalLM, LlamaForCausalLM)  # Llama with q/k/v biases
    assert get_model_class(Qwen2Config()) is Qwen2ForCausalLM  # no architectures: model_type
    with pytest.raises(ValueError, match="unsupported model architecture GPT2LMHeadModel"):
        get_model_class(LlamaConfig(architectures=["GPT2LMHeadModel"]))
