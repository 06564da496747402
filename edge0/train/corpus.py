"""The training corpus every machine with Python has: the standard library's own sources, minus tests.

    from edge0.train.corpus import prepare_corpus
    data = prepare_corpus("/tmp/run/data", vocab_size=4096)   # tokenizer + token streams, cached
    data.train, data.heldout                                  # np.uint32 token streams

Files are split into train and held-out by a hash of their path relative to the stdlib root, so the
split does not depend on the order files are listed in or on the files present. A byte-level BPE
(the `tokenizers` package) is trained on the train split only. Each file is one document followed by
<|endoftext|>. Everything is cached under the data directory and rebuilt only when its key changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge0.errors import Edge0Error
from edge0.io.atomic import atomic_path, write_atomic
from edge0.model.tokenizer import train_bpe as train_tokenizer

HELDOUT_PERCENT = 5  # share of files (by path hash) kept out of training
# Directories that are tests, vendored third-party code, or data tables rather than Python as written.
EXCLUDED_DIRS = frozenset({
    "test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
    "encodings", "pydoc_data", "lib2to3", "turtledemo", "ensurepip",
})
EXCLUDED_PREFIXES = ("_sysconfigdata", "config-")
MAX_FILE_BYTES = 1 << 20  # a file larger than this is generated data, not code
DOC_SEP = "<|endoftext|>"
CACHE_VERSION = 2  # 2: uint32 streams (uint16 wrapped ids >= 65536)
TOKEN_DTYPE = np.uint32  # token streams; uint16 would wrap vocabularies over 65536 (Qwen3: 151k)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: str | os.PathLike | None = None) -> list[str]:
    """Relative paths of the stdlib's .py files that make the corpus, sorted."""
    root = Path(root) if root is not None else stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS and not d.startswith(EXCLUDED_PREFIXES))
        for name in filenames:
            if not name.endswith(".py") or name.startswith(EXCLUDED_PREFIXES) or name.startswith("test_"):
                continue
            path = Path(dirpath) / name
            if path.stat().st_size <= MAX_FILE_BYTES:
                out.append(path.relative_to(root).as_posix())
    if not out:
        raise Edge0Error(f"{root}: no Python standard-library sources found")
    return sorted(out)


def is_heldout(rel: str) -> bool:
    """The deterministic split: a file is held out when the hash of its relative path says so."""
    h = int.from_bytes(hashlib.blake2b(rel.encode(), digest_size=8).digest(), "little")
    return h % 100 < HELDOUT_PERCENT


def split_files(files: list[str]) -> tuple[list[str], list[str]]:
    """(train, heldout) relative paths."""
    return [f for f in files if not is_heldout(f)], [f for f in files if is_heldout(f)]


def read_text(root: Path, rel: str) -> str:
    return (root / rel).read_text(encoding="utf-8", errors="replace")


def encode_files(tokenizer_json: str, root: Path, files: list[str]) -> np.ndarray:
    """One uint32 stream: each file's tokens followed by <|endoftext|>."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    sep = tok.token_to_id(DOC_SEP)
    encs = tok.encode_batch([read_text(root, f) for f in files], add_special_tokens=False)
    parts = []
    for e in encs:
        parts.append(np.asarray(e.ids, dtype=TOKEN_DTYPE))
        parts.append(np.array([sep], dtype=TOKEN_DTYPE))
    return np.concatenate(parts) if parts else np.zeros(0, TOKEN_DTYPE)


@dataclass
class Corpus:
    """Token streams of the split, and the tokenizer they were made with."""

    train: np.ndarray  # uint32 token ids of the train files
    heldout: np.ndarray  # uint32 token ids of the held-out files
    tokenizer_json: str  # serialized byte-level BPE
    train_files: list[str]  # relative to root
    heldout_files: list[str]
    root: Path  # stdlib directory the files came from


def prepare_corpus(data_dir: str | os.PathLike, *, vocab_size: int = 4096, root: str | os.PathLike | None = None,
                   max_files: int | None = None) -> Corpus:
    """Discover, split, train the tokenizer and tokenize; cached under data_dir (keyed on the inputs).

    max_files: keep only the first N train and N held-out files (tests).
    """
    root = Path(root) if root is not None else stdlib_root()
    data_dir = Path(data_dir)
    train_files, heldout_files = split_files(stdlib_files(root))
    if max_files is not None:
        train_files, heldout_files = train_files[:max_files], heldout_files[:max(1, max_files // 4)]
    key = hashlib.blake2b(json.dumps(
        [CACHE_VERSION, str(root), vocab_size, train_files, heldout_files,
         [(root / f).stat().st_size for f in train_files + heldout_files]]).encode(), digest_size=16).hexdigest()
    meta_path = data_dir / "corpus.json"
    if meta_path.exists() and json.loads(meta_path.read_text()).get("key") == key:
        return Corpus(np.load(data_dir / "train.npy"), np.load(data_dir / "heldout.npy"),
                      (data_dir / "tokenizer.json").read_text(encoding="utf-8"), train_files, heldout_files, root)
    if not heldout_files:
        raise Edge0Error(f"{root}: no file falls in the held-out split; add files or raise max_files")
    data_dir.mkdir(parents=True, exist_ok=True)
    tok_json = train_tokenizer([read_text(root, f) for f in train_files], vocab_size)
    train = encode_files(tok_json, root, train_files)
    heldout = encode_files(tok_json, root, heldout_files)
    _atomic_save(data_dir / "train.npy", train)
    _atomic_save(data_dir / "heldout.npy", heldout)
    _atomic_write(data_dir / "tokenizer.json", tok_json.encode())
    meta = dict(key=key, root=str(root), vocab_size=vocab_size, train_files=len(train_files),
                heldout_files=len(heldout_files), train_tokens=int(train.size), heldout_tokens=int(heldout.size),
                train_bytes=sum((root / f).stat().st_size for f in train_files),
                heldout_bytes=sum((root / f).stat().st_size for f in heldout_files))
    _atomic_write(meta_path, (json.dumps(meta, indent=2) + "\n").encode())  # last: marks the cache complete
    return Corpus(train, heldout, tok_json, train_files, heldout_files, root)


def heldout_stream(tokenizer_dir: str | os.PathLike, data: str | os.PathLike) -> np.ndarray:
    """Tokenize a file, or every .py file under a directory (sorted), with the tokenizer in tokenizer_dir."""
    data = Path(data)
    if data.suffix == ".npy" and data.is_file():
        return load_token_ids(data, vocab_size(tokenizer_dir))
    tok_json = (Path(tokenizer_dir) / "tokenizer.json").read_text(encoding="utf-8")
    if data.is_dir():
        files = sorted(p.relative_to(data).as_posix() for p in data.rglob("*.py"))
        if not files:
            raise Edge0Error(f"{data}: no .py files")
        return encode_files(tok_json, data, files)
    if not data.is_file():
        raise Edge0Error(f"{data}: no such file or directory")
    return encode_files(tok_json, data.parent, [data.name])


def vocab_size(model_dir: str | os.PathLike) -> int | None:
    """The model's vocabulary (config.json's vocab_size), else its tokenizer's; None when neither says."""
    model_dir = Path(model_dir)
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
        from ..model.arch import vocab_size as config_vocab

        n = config_vocab(cfg)
        if n:
            return int(n)
    except (OSError, ValueError, AttributeError):
        pass
    try:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    except Exception:
        return None


def load_token_ids(path: Path, vocab: int | None) -> np.ndarray:
    """A .npy of token ids, checked: integers, every one in [0, vocab)."""
    try:
        arr = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise Edge0Error(f"{path}: not a .npy array of token ids ({e})") from None
    if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "iu":
        raise Edge0Error(f"{path}: token ids must be integers, got dtype {arr.dtype}")
    arr = arr.reshape(-1)
    if arr.size and (arr.min() < 0 or (vocab is not None and arr.max() >= vocab)):
        bad = arr.min() if arr.min() < 0 else arr.max()
        raise Edge0Error(f"{path}: token id {bad} is out of range [0, {vocab - 1 if vocab else 'inf'}]"
                         " (the model's vocabulary)")
    return arr.astype(TOKEN_DTYPE)


def _atomic_write(path: Path, data: bytes) -> None:
    write_atomic(path, data)


def _atomic_save(path: Path, arr: np.ndarray) -> None:
    with atomic_path(path) as tmp:
        np.save(tmp, arr)


def token_stream(tokenizer_dir: Path, data: str | os.PathLike | None) -> tuple[np.ndarray, str]:
    """(token ids, description) of data (a file, a directory's .py files, a .npy of ids); None means the
    stdlib held-out split."""
    if data is not None:
        return heldout_stream(tokenizer_dir, data), str(data)
    root = stdlib_root()
    _, heldout = split_files(stdlib_files(root))
    tok_json = (Path(tokenizer_dir) / "tokenizer.json").read_text(encoding="utf-8")
    return encode_files(tok_json, root, heldout), f"stdlib held-out split ({len(heldout)} files under {root})"


STDLIB = "stdlib"  # --data stdlib: the whole stdlib train split


def train_stream(tokenizer_dir: Path, data: str | os.PathLike | None, max_files: int = 400) -> tuple[np.ndarray, str]:
    """(token ids, description) of training text: data (as token_stream reads it; "stdlib": the whole stdlib
    train split), else the first max_files files of the stdlib train split."""
    if data == STDLIB:
        max_files = None
    elif data is not None:
        return heldout_stream(tokenizer_dir, data), str(data)
    root = stdlib_root()
    train, _ = split_files(stdlib_files(root))
    max_files = max_files or len(train)
    tok_json = (Path(tokenizer_dir) / "tokenizer.json").read_text(encoding="utf-8")
    return encode_files(tok_json, root, train[:max_files]), f"stdlib train split (first {max_files} of {len(train)} files)"
