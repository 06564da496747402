"""A store's tokenizer as GGUF metadata (llama.cpp's `gpt2` BPE vocabulary), read from tokenizer.json.

llama.cpp takes the vocabulary size from the token list, and the embedding must have that many rows:
ids the tokenizer does not use are written as unused `[PAD{id}]` tokens, as llama.cpp's converter does.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import Edge0Error
from ..io.manifest import read_json
from ..log import log

# Pre-tokenizers llama.cpp knows, by what tokenizer.json says: GPT-2's byte-level split, Qwen2's regex.
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
               r"\s+(?!\S)|\s+")


def pre_tokenizer(tok: dict) -> str | None:
    """llama.cpp's name for tokenizer.json's pre-tokenizer, or None when it has none for it."""
    pre = tok.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    if pre.get("type") == "Sequence":
        regexes = [p.get("pattern", {}).get("Regex") for p in pre.get("pretokenizers", []) if p.get("type") == "Split"]
        if regexes == [QWEN2_REGEX]:
            return "qwen2"
    return None


def tokens_and_types(tok: dict, vocab_size: int, path: Path) -> tuple[list[str], list[int]]:
    """The token strings by id (padded to vocab_size) and their GGUF token types."""
    from gguf import TokenType

    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [int(TokenType.UNUSED)] * vocab_size
    added = {t["content"]: t for t in tok.get("added_tokens", [])}
    entries = dict(tok["model"]["vocab"])
    entries.update({t["content"]: t["id"] for t in added.values()})
    for text, i in entries.items():
        if not 0 <= i < vocab_size:
            raise Edge0Error(f"{path}: token id {i} ({text!r}) is outside the model's vocabulary of {vocab_size}")
        tokens[i] = text
        special = added.get(text, {}).get("special")
        types[i] = int(TokenType.CONTROL if special else TokenType.USER_DEFINED if text in added else TokenType.NORMAL)
    return tokens, types


def add_vocab(writer, root: Path, vocab_size: int, eos_token_id) -> None:
    """tokenizer.ggml.* (and the chat template) of the store's tokenizer files."""
    path = root / "tokenizer.json"
    if not path.is_file():
        raise Edge0Error(f"{path}: missing (the GGUF needs the store's tokenizer)")
    tok = read_json(path)
    model = tok.get("model") if isinstance(tok, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE":
        raise Edge0Error(f"{path}: only BPE tokenizers are exported (llama.cpp's gpt2 vocabulary)")
    tokens, types = tokens_and_types(tok, vocab_size, path)
    pre = pre_tokenizer(tok)
    if pre is None:
        pre = "default"
        log.warning("export-gguf: pre-tokenizer unknown to llama.cpp; recorded as 'default' (text may split "
                    "differently there; token ids given directly are unaffected)", file=str(path))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])])
    eos = eos_token_id[0] if isinstance(eos_token_id, list) else eos_token_id
    if isinstance(eos, int):
        writer.add_eos_token_id(eos)
    writer.add_add_bos_token(False)
    config = read_json(root / "tokenizer_config.json") if (root / "tokenizer_config.json").is_file() else {}
    pad = config.get("pad_token") if isinstance(config, dict) else None
    if isinstance(pad, str) and pad in tokens:
        writer.add_pad_token_id(tokens.index(pad))
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, str):
        writer.add_chat_template(template)
