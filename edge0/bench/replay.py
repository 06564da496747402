"""`edge0 bench`'s replay.json: the prompt ids and forced decode tokens every arm replays."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .route_arms import route_flags
from ..errors import Edge0Error


def make_replay(args, out: Path) -> Path:
    """Prompt ids cut from Python source, and the exact path's greedy tokens for them: replay.json."""
    import inspect
    import json as json_mod

    from mlx_lm.utils import load_tokenizer

    path = out / "replay.json"
    if getattr(args, "replay_text", None):
        path.write_text(json.dumps(text_replay(args.replay_text, Path(args.store), args.prompt_tokens, args.max_tokens)))
        return path
    if args.replay:
        given = given_replay(args.replay)
        path.write_text(json.dumps(given))
        if given.get("tokens"):
            return path
        ids = given["prompt"]
    else:
        tok = load_tokenizer(Path(args.store))
        ids = tok.encode(inspect.getsource(json_mod.decoder) * 8)[:args.prompt_tokens]
        path.write_text(json.dumps({"prompt": ids, "tokens": []}))
    cmd = [sys.executable, "-m", "edge0.run", "--model", str(args.store), "--replay", str(path), "--max-tokens",
           str(args.max_tokens), "--ignore-eos", "--json", "--dtype", args.dtype, "--routing", "native",
           "--executor", "exact", *route_flags(args)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise Edge0Error(f"recording the replay tokens failed: {proc.stderr.strip()[-300:]}")
    tokens = json.loads(proc.stdout.strip().splitlines()[-1])["tokens"]
    path.write_text(json.dumps({"prompt": ids, "tokens": tokens}))
    return path


def text_replay(text: str, store: Path, prompt_tokens: int, max_tokens: int) -> dict:
    """--replay-text FILE: the prompt and the forced tokens cut from FILE in the store's tokenizer."""
    from mlx_lm.utils import load_tokenizer

    try:
        ids = load_tokenizer(store).encode(Path(text).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise Edge0Error(f"--replay-text {text}: cannot be read as text ({e})") from None
    if len(ids) < prompt_tokens + max_tokens:
        raise Edge0Error(f"--replay-text {text}: {len(ids)} tokens, fewer than --prompt-tokens {prompt_tokens} + "
                         f"--max-tokens {max_tokens}")
    return {"prompt": ids[:prompt_tokens], "tokens": ids[prompt_tokens:prompt_tokens + max_tokens]}


def given_replay(path: str) -> dict:
    """--replay FILE: {"prompt": [ids], "tokens": [ids]} (tokens may be absent), checked."""
    from ..io.manifest import read_json

    if not Path(path).is_file():
        raise Edge0Error(f"--replay {path}: no such file")
    data = read_json(Path(path))
    ok = isinstance(data, dict) and not set(data) - {"prompt", "tokens"} and data.get("prompt") and all(
        isinstance(data.get(k, []), list) and all(type(t) is int and t >= 0 for t in data.get(k, []))
        for k in ("prompt", "tokens"))
    if not ok:
        raise Edge0Error(f"--replay {path}: expected {{\"prompt\": [token ids], \"tokens\": [token ids]}}")
    return data
