"""A small byte-level BPE tokenizer for random-weight test models, trained offline in about a second.

The corpus is a fixed set of Python standard-library sources, present on every machine with
Python; a different Python version may give a slightly different vocabulary, never a different
vocabulary size, so model weights do not depend on it.
"""

from __future__ import annotations

import functools
import json
import sysconfig
from pathlib import Path

VOCAB_SIZE = 1024  # the size every preset's embedding uses; the trained vocabulary never exceeds it
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# Small, long-lived modules: about 300 KB of text, so training takes about a second.
CORPUS_FILES = (
    "textwrap.py",
    "string.py",
    "heapq.py",
    "bisect.py",
    "functools.py",
    "json/decoder.py",
    "json/encoder.py",
    "contextlib.py",
    "dataclasses.py",
)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for name in CORPUS_FILES:
        path = stdlib / name
        if path.is_file():
            texts.append(path.read_text(encoding="utf-8", errors="replace"))
    return texts


def train_bpe(texts: list[str], vocab_size: int) -> str:
    """Train a byte-level BPE (the special tokens first) on texts; the serialized tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok.to_str()


@functools.lru_cache(maxsize=4)
def tokenizer_json(vocab_size: int = VOCAB_SIZE) -> str:
    """Train (once per process) and return the serialized `tokenizer.json` text of the test models."""
    return train_bpe(_corpus(), vocab_size)


def special_token_ids() -> dict[str, int]:
    """Ids of the special tokens (they come first in the vocabulary)."""
    return {t: i for i, t in enumerate(SPECIAL_TOKENS)}


def save_tokenizer(out: str | Path, vocab_size: int = VOCAB_SIZE) -> None:
    """The test models' tokenizer files into `out`."""
    save_tokenizer_files(out, tokenizer_json(vocab_size))


def save_tokenizer_files(out: str | Path, tokenizer_json: str) -> None:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json, as mlx-lm's loader wants them;
    each written atomically."""
    from ..io.atomic import write_atomic

    out = Path(out)
    write_atomic(out / "tokenizer.json", tokenizer_json.encode())
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "bos_token": None,
        "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "unk_token": None,
        "clean_up_tokenization_spaces": False, "model_max_length": 262144, "chat_template": CHAT_TEMPLATE,
    }
    write_atomic(out / "tokenizer_config.json", (json.dumps(config, indent=2) + "\n").encode())
    special = {"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    write_atomic(out / "special_tokens_map.json", (json.dumps(special, indent=2) + "\n").encode())
