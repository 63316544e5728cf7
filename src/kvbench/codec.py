"""Text <-> token ids for the protocols: a thin face over HF tokenizers, and a byte codec for tiny models."""

from __future__ import annotations


class HFCodec:
    """Wraps a transformers tokenizer; uses its chat template when it has one."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.eos_id = tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False).input_ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def prompt_parts(self, context: str, question: str) -> tuple[list[int], list[int]]:
        """Token ids of (context part, question part) of a chat prompt; the split is where the
        question begins, so the context can be compressed before the question is seen."""
        marker = "\u0000QUESTION\u0000"
        user = f"{context}\n\n{marker}"
        if self.tok.chat_template:
            text = self.tok.apply_chat_template(
                [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
            )
        else:
            text = user + "\nAnswer:"
        head, tail = text.split(marker)
        return self.encode(head), self.encode(question + tail)

    def chat(self, user: str) -> tuple[str, int] | None:
        """One user turn through the chat template (with the assistant's cue) and the offset of
        ``user`` in it; None when the tokenizer has no template."""
        if not self.tok.chat_template:
            return None
        marker = "\u0000USER\u0000"
        text = self.tok.apply_chat_template(
            [{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=True
        )
        head, tail = text.split(marker)
        return head + user + tail, len(head)

    def encode_split(self, text: str, at: int) -> tuple[list[int], list[int]]:
        """Token ids of ``text`` tokenized whole, split before the first token starting at or after
        character ``at`` (a token straddling ``at`` stays before it)."""
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        cut = sum(1 for start, _ in enc.offset_mapping if start < at)
        return enc.input_ids[:cut], enc.input_ids[cut:]

    def special_prefix(self) -> list[int]:
        """What the tokenizer puts before a text by default (a BOS token for most models)."""
        with_special = self.tok("a", add_special_tokens=True).input_ids
        plain = self.tok("a", add_special_tokens=False).input_ids
        return with_special[: len(with_special) - len(plain)] if with_special[-len(plain) :] == plain else []


class ByteCodec:
    """UTF-8 bytes as tokens (vocab 256), for tiny random models in tests."""

    eos_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i % 256 for i in ids).decode("utf-8", errors="replace")

    def prompt_parts(self, context: str, question: str) -> tuple[list[int], list[int]]:
        return self.encode(context + "\n\n"), self.encode(question + "\nAnswer:")

    def chat(self, user: str) -> tuple[str, int] | None:
        return None

    def encode_split(self, text: str, at: int) -> tuple[list[int], list[int]]:
        return self.encode(text[:at]), self.encode(text[at:])

    def special_prefix(self) -> list[int]:
        return []
