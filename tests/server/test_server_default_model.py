"""End to end on the embedded default model (SmolLM2-135M-Instruct): one chat request."""

from __future__ import annotations

from tests.server.conftest import make_engine, running_server


def test_default_model_knows_the_capital_of_france():
    engine = make_engine(None, num_blocks=128, max_model_len=2048)  # model=None: the default
    with running_server(engine, served_model_name=None) as server:
        client = server.openai()
        assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
        r = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=20,
            temperature=0,
        )
        assert "Paris" in r.choices[0].message.content, r.choices[0].message.content
