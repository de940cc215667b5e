"""The tiny checkpoints' tokenizer: character-level, byte-level BPE without merges, the same for every family."""

from __future__ import annotations

import json
import string
from pathlib import Path

SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>")
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
# Most useful characters first, so a truncated vocabulary (--vocab smaller than the full one) keeps them.
CHARACTERS = (" \n" + string.ascii_lowercase + string.digits + ".,!?'\"-:;()" + string.ascii_uppercase
              + "".join(c for c in string.punctuation if c not in ".,!?'\"-:;()"))
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def full_vocab_size() -> int:
    return len(SPECIAL_TOKENS) + len(CHARACTERS)


def _byte_level_char(c: str) -> str:
    """GPT-2's byte-to-unicode map for one ASCII character (what a ByteLevel pre-tokenizer emits)."""
    b = ord(c)
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    if b in printable:
        return c
    return chr(256 + [x for x in range(256) if x not in printable].index(b))


def _vocab(vocab_size: int) -> dict[str, int]:
    n_chars = min(len(CHARACTERS), vocab_size - len(SPECIAL_TOKENS))
    if n_chars < 2:
        raise ValueError(f"vocab_size={vocab_size} is too small: need at least {len(SPECIAL_TOKENS) + 2} "
                         f"({len(SPECIAL_TOKENS)} special tokens + 2 characters)")
    tokens = list(SPECIAL_TOKENS) + [_byte_level_char(c) for c in CHARACTERS[:n_chars]]
    return {tok: i for i, tok in enumerate(tokens)}


def write_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """A character-level tokenizer: byte-level BPE without merges, so every ASCII character is one token.

    Byte-level (like Qwen2's) because transformers rebuilds a qwen2 checkpoint's tokenizer with Qwen2's
    byte-level pipeline from the vocabulary; the same vocabulary then works for every family.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = _vocab(vocab_size)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    # The special tokens are already in the vocabulary, so add_special_tokens keeps their ids.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    for t in SPECIAL_TOKENS:
        if tok.token_to_id(t) != vocab[t]:
            raise RuntimeError(f"tokenizers assigned {t!r} id {tok.token_to_id(t)}, expected {vocab[t]}")
    tok.save(str(out_dir / "tokenizer.json"))
    special_map = {"pad_token": "<|pad|>", "bos_token": "<|bos|>", "eos_token": "<|eos|>", "unk_token": "<|pad|>",
                   "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20,
              "add_bos_token": False, "add_eos_token": False, "add_prefix_space": False,
              "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE, **special_map}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
