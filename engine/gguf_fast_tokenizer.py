"""The tokenizer of a GGUF's cached directory, without importing transformers.

The directory holds a `tokenizers` tokenizer.json, tokenizer_config.json and the chat
template (engine/gguf_tokenizer.py wrote them from the file). `FastTokenizer` answers the
part of transformers' `PreTrainedTokenizerFast` interface that the server, the engine and
their tests call (encode, decode, the special tokens, `apply_chat_template`, the Rust
`backend_tokenizer`), with transformers' semantics; `transformers_tokenizer()` is
transformers' own object over the same backend, for the libraries that want exactly that
class (xgrammar).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from engine.gguf_chat_template import render_chat

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


class FastTokenizer:
    """A `tokenizers.Tokenizer` with its special tokens and chat template."""

    is_fast = True
    padding_side = "right"
    model_max_length = int(1e30)

    def __init__(self, backend: Tokenizer, config: dict[str, Any], name_or_path: str = "") -> None:
        self.backend_tokenizer = backend
        self.name_or_path = name_or_path
        self.init_kwargs = dict(config)
        self.chat_template: str | None = config.get("chat_template")
        self.add_bos_token = bool(config.get("add_bos_token", False))
        self.add_eos_token = bool(config.get("add_eos_token", False))
        for name in _SPECIAL:
            setattr(self, name, config.get(name))

    @classmethod
    def from_pretrained(cls, path: str | Path) -> FastTokenizer:
        path = Path(path)
        config = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
        template = path / TEMPLATE_FILE
        if template.is_file():
            config["chat_template"] = template.read_text(encoding="utf-8")
        return cls(Tokenizer.from_file(str(path / TOKENIZER_FILE)), config, str(path))

    def save_pretrained(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backend_tokenizer.save(str(directory / TOKENIZER_FILE))
        config = {k: v for k, v in self.init_kwargs.items() if k != "chat_template"}
        (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        if self.chat_template:
            (directory / TEMPLATE_FILE).write_text(self.chat_template, encoding="utf-8")

    # -- ids and text ----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True, **_: Any) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str | list[str], add_special_tokens: bool = True, **_: Any) -> dict:
        if isinstance(text, str):
            return {"input_ids": self.encode(text, add_special_tokens)}
        return {"input_ids": [self.encode(t, add_special_tokens) for t in text]}

    def decode(self, ids: int | list[int], skip_special_tokens: bool = False, **_: Any) -> str:
        ids = [ids] if isinstance(ids, int) else list(ids)
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences: list[list[int]], skip_special_tokens: bool = False,
                     **_: Any) -> list[str]:  # fmt: skip
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self._id(tokens)
        return [self._id(t) for t in tokens]

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """The base vocabulary's size (transformers': added tokens not counted)."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    # -- special tokens --------------------------------------------------------------------

    @property
    def bos_token_id(self) -> int | None:
        return self._id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id(self.eos_token)

    @property
    def unk_token_id(self) -> int | None:
        return self._id(self.unk_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id(self.pad_token)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {name: getattr(self, name) for name in _SPECIAL if getattr(self, name)}

    @property
    def all_special_tokens(self) -> list[str]:
        added = self.backend_tokenizer.get_added_tokens_decoder().values()
        named = list(dict.fromkeys(self.special_tokens_map.values()))
        return named + [t.content for t in added if t.special and t.content not in named]

    @property
    def all_special_ids(self) -> list[int]:
        return [i for i in (self._id(t) for t in self.all_special_tokens) if i is not None]

    # -- chat ------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        **kwargs: Any,
    ) -> str | list[int]:
        """transformers' `apply_chat_template` for one conversation: the text, or its ids
        (encoded without adding special tokens: the template writes them)."""
        template = chat_template or self.chat_template
        if not template:
            raise ValueError("this tokenizer has no chat template")
        for key in ("return_dict", "return_tensors", "padding", "truncation", "max_length"):
            kwargs.pop(key, None)
        text = render_chat(template, conversation, self.special_tokens_map, tools, documents,
                           add_generation_prompt, **kwargs)  # fmt: skip
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def transformers_tokenizer(self) -> Any:
        """transformers' `PreTrainedTokenizerFast` over the same backend (imports
        transformers: only for a library that wants that class)."""
        from transformers import PreTrainedTokenizerFast

        config = {k: v for k, v in self.init_kwargs.items() if k != "tokenizer_class"}
        return PreTrainedTokenizerFast(tokenizer_object=self.backend_tokenizer, **config)
