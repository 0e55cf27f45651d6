"""Same request, same answer, through the server on the default start with `--deterministic`
(the embedded default model's GGUF blocks): a greedy completion sent alone, again (its prompt
now a prefix-cache hit), beside 15 concurrent requests and after another request shared its
prefix, and a seeded sample alone and beside 7 others, each with speculative decoding off
and on, give the same tokens and logprobs. The tokens are read as ids
(`return_tokens_as_token_ids` is not needed: the logprobs' token strings and values are
compared whole)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.kernels import ggml_kernels
from server.limits import ConnectionLimits
from tests.engine.test_batch_invariance import COPY_EDIT, INSTRUCTION, OTHERS
from tests.server.conftest import make_engine, running_server

pytestmark = pytest.mark.skipif(ggml_kernels() is None, reason="the GGUF kernels need AVX2")
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module", params=["off", "ngram"], ids=["speculative off", "ngram"])
def server(request):
    # The default start (dtype, quantization and attention "auto") and --deterministic.
    engine = make_engine(None, dtype="auto", speculative=request.param, max_model_len=2048,
                         deterministic=True)  # fmt: skip
    assert engine.core.config.plan.batch_invariant
    # A kept-alive connection the client pool reuses after it idled past the server's 5 s
    # (16 requests queue behind one another here; a busy CI machine stretches them) can be
    # closed by the server just as the request goes out: "Server disconnected without
    # sending a response" (once in CI, 2026-11-29). The SDK's retries would hide it; these
    # clients do not retry, so the connections stay open past any gap in this test.
    limits = ConnectionLimits(keep_alive_timeout_s=300)
    with running_server(engine, limits=limits, served_model_name=None) as s:
        yield s
        assert s.all_blocks_free()


def _complete(client, prompt: str, **sampling) -> tuple[list[str], list[float]]:
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=120, logprobs=0,
                                  extra_body={"ignore_eos": True}, **sampling)  # fmt: skip
    return r.choices[0].logprobs.tokens, r.choices[0].logprobs.token_logprobs


def _beside(client, others: list[str], prompt: str, **sampling) -> tuple[list[str], list[float]]:
    """``prompt``'s answer while ``others`` are served concurrently (greedy, 120 tokens)."""
    with ThreadPoolExecutor(len(others) + 1) as pool:
        running = [pool.submit(_complete, client, o, temperature=0) for o in others]
        answer = pool.submit(_complete, client, prompt, **sampling).result()
        for future in running:
            future.result()
    return answer


def test_the_same_request_gets_the_same_answer_whatever_else_the_server_does(server):
    client = server.openai()
    server.http().post("/reset_prefix_cache").raise_for_status()
    alone = _complete(client, COPY_EDIT, temperature=0)
    assert _complete(client, COPY_EDIT, temperature=0) == alone, "again (a prefix-cache hit)"
    assert _beside(client, OTHERS, COPY_EDIT, temperature=0) == alone, "beside 15 others"
    _complete(client, INSTRUCTION * 3 + "Another sentence shares the prefix.", temperature=0)
    assert _complete(client, COPY_EDIT, temperature=0) == alone, "after a shared prefix"
    seeded = _complete(client, COPY_EDIT, temperature=0.8, seed=1234)
    assert _beside(client, OTHERS[:7], COPY_EDIT, temperature=0.8, seed=1234) == seeded
