"""SmolLM2's tokenizer, rebuilt from the vocabulary and merges stored in its GGUF file.

A GGUF file carries no ``tokenizer.json``; it stores the byte-level BPE vocabulary,
the merge list and the ids of the control tokens (``<|im_start|>`` and friends) as
metadata. We rebuild the same tokenizer with the ``tokenizers`` library:

* split digits one by one, then GPT-2's byte-level pre-tokenization
  (llama.cpp calls this pre-tokenizer ``smollm``; it is what SmolLM2's own
  ``tokenizer.json`` does);
* byte-level BPE with the stored merges;
* control tokens matched whole, never split.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from .checks import is_int

__all__ = ["ChatTokenizer", "build_tokenizer"]

_CONTROL = 3  # llama.cpp's token type for control (special) tokens


def build_tokenizer(tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int]) -> Tokenizer:
    """A ``tokenizers.Tokenizer`` from GGUF vocabulary, merges and token types."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, token_types) if ty == _CONTROL]
    tok.add_special_tokens(specials)
    return tok


class ChatTokenizer:
    """Thin wrapper: ``encode(str) -> list[int]``, ``decode(list[int]) -> str``, and the chat template.

    No BOS token is prepended (the GGUF says ``add_bos_token = False``, as SmolLM2 was trained).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        bos_token_id: int,
        eos_token_id: int,
        system_prompt: str = "You are a helpful AI assistant named SmolLM, trained by Hugging Face",
    ) -> None:
        self.backend = tokenizer
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id
        self.default_system_prompt = system_prompt

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = list(ids.tolist() if hasattr(ids, "tolist") else ids)  # a tensor or an array of ids too
        bad = [i for i in ids if not is_int(i) or not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"ids must be ints in [0, {self.vocab_size}), got {bad[:5]}")
        ids = [int(i) for i in ids]  # NumPy integers included
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Each id decoded on its own: handy for labelling plots with readable tokens."""
        return [self.backend.decode([i]) for i in ids]

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """SmolLM2's ChatML template (as stored in the GGUF), rendered without Jinja.

        A default system message is inserted when the first message is not one.
        """
        if not messages:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        parts = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not {"role", "content"} <= m.keys():
                raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {m!r}")
            if i == 0 and m["role"] != "system":
                parts.append(f"<|im_start|>system\n{self.default_system_prompt}<|im_end|>\n")
            parts.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)

    def encode_chat(self, user_message: str, system_prompt: str | None = None) -> list[int]:
        """Token ids of a one-turn chat, ready for the assistant's reply."""
        messages = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
        messages.append({"role": "user", "content": user_message})
        return self.encode(self.apply_chat_template(messages))

    def __call__(self, text: str) -> list[int]:
        return self.encode(text)
