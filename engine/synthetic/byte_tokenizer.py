"""A byte-level tokenizer the project builds itself, so tiny checkpoints need no download.

Every UTF-8 byte is one token whose id is the byte value (no merges), plus the
ChatML special tokens. It is deterministic by construction: no training data, no randomness.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

END_OF_TEXT = "<|endoftext|>"
TURN_START = "<|im_start|>"
TURN_END = "<|im_end|>"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _byte_symbols() -> list[str]:
    """The symbol ByteLevel pre-tokenization uses for each byte 0..255 (GPT-2's printable remapping)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    symbols, shifted = [], 0
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + shifted))
            shifted += 1
    return symbols


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """A 256-byte vocabulary plus <|endoftext|>, <|im_start|>, <|im_end|>, with a ChatML chat template."""
    vocab = {symbol: byte for byte, symbol in enumerate(_byte_symbols())}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([END_OF_TEXT, TURN_START, TURN_END])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=TURN_END,
        pad_token=END_OF_TEXT,
        chat_template=CHATML_TEMPLATE,
    )
