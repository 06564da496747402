#!/usr/bin/env python3
"""Set up the optional llama.cpp arm of `edge0 bench`: a separate venv with llama-cpp-python built from
source, and GGUF files of the same model as an Edge0 store.

    # the store's own weights, exported by `edge0 export-gguf` (no torch, no bf16 copy; any size):
    python3 tools/llama_cpp_setup.py --sdist llama_cpp_python-0.3.36.tar.gz --venv ~/llama-venv \\
        --store /data/q3-paper.edge0 --types q4_1
    # or a Hugging Face bf16 checkpoint through llama.cpp's own converter and quantizer:
    python3 tools/llama_cpp_setup.py --sdist llama_cpp_python-0.3.36.tar.gz --venv ~/llama-venv \\
        --torch torch==2.13.0 /data/q3-small-hf
    # or only build the venv (for EDGE0_LLAMA_PYTHON in the tests):
    python3 tools/llama_cpp_setup.py --sdist llama_cpp_python-0.3.36.tar.gz --venv ~/llama-venv

With --store, the GGUFs are OUT/model-{type}.gguf (OUT defaults to STORE-gguf), written by `edge0
export-gguf` with this interpreter, and the venv needs only numpy beside the build.

What it needs:
  * the llama-cpp-python source distribution (`pip download --no-binary :all: --no-deps llama-cpp-python`);
    it vendors llama.cpp, whose convert_hf_to_gguf.py and gguf-py make the GGUF;
  * a C/C++ compiler and CMake (llama.cpp is built from source, with -march=native: minutes; the build takes
    llama.cpp's CMake options from $CMAKE_ARGS: on a virtual machine whose CPU advertises AMX but faults on it
    (the bench arm dies with -4 or -11, "Illegal instruction" in ggml_backend_amx_mul_mat), build without
    -march=native, naming the CPU's other extensions: CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON
    -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON
    -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF");
  * network access to a package index for the converter's needs in the venv: numpy, torch, transformers,
    sentencepiece, pyyaml, tqdm, requests (--torch picks the torch requirement; a CPU-only wheel is enough,
    e.g. --torch "torch --index-url https://download.pytorch.org/whl/cpu");
  * disk: one bf16/f16 GGUF (the size of the checkpoint) plus one file per --quant.

Steps of the Hugging Face route, each skipped when already done: (1) make the venv, (2) `pip install
SDIST` there (the build), (3) install the converter's needs there, (4) extract the converter from the sdist into OUT/llama.cpp-src,
(5) convert HF_DIR to OUT/model-{outtype}.gguf, (6) quantize it to OUT/model-{Q}.gguf for each --quant with
llama_cpp.llama_model_quantize, (7) print the `edge0 bench` command. Edge0 itself never imports llama_cpp;
the venv is only the bench arm's interpreter (--llama-python).

The random-weight models of `edge0 make-model` carry a small byte-level BPE tokenizer (GPT-2 style
pre-tokenization) that the converter's table of known pre-tokenizers does not list; the conversion then
records the generic `gpt-2` pre-tokenizer instead of failing (the vendored sources are not modified: the
method is wrapped at import). The bench feeds token ids, so the GGUF's tokenizer is never used to encode.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path

CONVERTER_NEEDS = {"numpy": "numpy", "yaml": "pyyaml", "tqdm": "tqdm", "requests": "requests",
                   "sentencepiece": "sentencepiece", "transformers": "transformers", "safetensors": "safetensors"}
GENERIC_PRE_TOKENIZER = "gpt-2"  # a name llama.cpp's vocabulary loader maps to its GPT-2 regex


def say(msg: str) -> None:
    print(f"llama_cpp_setup: {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], **kw) -> None:
    say("$ " + shlex.join(cmd))
    subprocess.run(cmd, check=True, **kw)


def can_import(python: Path, module: str) -> bool:
    return subprocess.run([str(python), "-c", f"import {module}"], capture_output=True).returncode == 0


def extract_converter(sdist: Path, dest: Path) -> Path:
    """vendor/llama.cpp/{convert_hf_to_gguf.py, conversion/, gguf-py/} of the sdist, under dest."""
    root = dest / "vendor" / "llama.cpp"
    if (root / "convert_hf_to_gguf.py").is_file():
        return root
    wanted = ("vendor/llama.cpp/convert_hf_to_gguf.py", "vendor/llama.cpp/conversion/", "vendor/llama.cpp/gguf-py/")
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            rel = m.name.split("/", 1)[1] if "/" in m.name else ""
            if any(rel == w or rel.startswith(w) for w in wanted):
                m.name = rel
                members.append(m)
        if not members:
            sys.exit(f"llama_cpp_setup: {sdist}: no vendor/llama.cpp/convert_hf_to_gguf.py inside; "
                     "is it the llama-cpp-python source distribution?")
        kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(dest, members=members, **kw)
    return root


def convert_in_venv(src: str, hf_dir: str, outfile: str, outtype: str) -> None:
    """Runs inside the venv: the vendored convert_hf_to_gguf, with an unknown pre-tokenizer mapped to gpt2."""
    sys.path.insert(0, src)
    sys.path.insert(1, str(Path(src) / "gguf-py"))
    import conversion.base as base
    import convert_hf_to_gguf

    known = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            base.logger.warning(f"pre-tokenizer not in the converter's table: recording '{GENERIC_PRE_TOKENIZER}' "
                                "(byte-level BPE with GPT-2 splitting, as edge0's random-weight models use)")
            return GENERIC_PRE_TOKENIZER

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = ["convert_hf_to_gguf.py", hf_dir, "--outfile", outfile, "--outtype", outtype]
    convert_hf_to_gguf.main()


def quantize_in_venv(src: str, dst: str, quant: str, threads: int) -> None:
    """Runs inside the venv: llama.cpp's quantizer (LLAMA_FTYPE_MOSTLY_{quant}) from src to dst."""
    import llama_cpp

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{quant}", None)
    if ftype is None:
        names = sorted(n.removeprefix("LLAMA_FTYPE_MOSTLY_") for n in dir(llama_cpp) if n.startswith("LLAMA_FTYPE_MOSTLY_"))
        sys.exit(f"llama_cpp_setup: --quant {quant}: unknown (choose from {', '.join(names)})")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
    if rc != 0:
        sys.exit(f"llama_cpp_setup: quantizing {src} to {quant} failed (llama_model_quantize returned {rc})")


def build(sdist: Path, venv: Path, jobs: int) -> Path:
    """The venv's python, with llama_cpp built from the sdist (skipped when it imports already)."""
    py = venv / "bin" / "python"
    if not py.exists():
        run([sys.executable, "-m", "venv", str(venv)])
    if not can_import(py, "llama_cpp"):
        say(f"building llama.cpp from {sdist.name} with {jobs} jobs (several minutes; about an hour on 2 cores)")
        env = {**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(jobs))}
        run([str(py), "-m", "pip", "install", str(sdist), "numpy"], env=env)
    return py


def from_hf(args, py: Path, sdist: Path, hf: Path, out: Path) -> list[Path]:
    """Convert HF_DIR with llama.cpp's converter, then quantize: [the converted GGUF, one per --quant]."""
    missing = [req for mod, req in CONVERTER_NEEDS.items() if not can_import(py, mod)]
    if not can_import(py, "torch"):
        missing += shlex.split(args.torch)
    if missing:
        run([str(py), "-m", "pip", "install", *missing])
    out.mkdir(parents=True, exist_ok=True)
    src = extract_converter(sdist, out / "llama.cpp-src")
    base = out / f"model-{args.outtype}.gguf"
    if not base.is_file():
        run([str(py), str(Path(__file__).resolve()), "_convert", str(src), str(hf), str(base), args.outtype])
    made = [base]
    for q in [q for q in args.quant.split(",") if q]:
        dst = out / f"model-{q}.gguf"
        if not dst.is_file():
            run([str(py), str(Path(__file__).resolve()), "_quantize", str(base), str(dst), q, str(args.jobs)])
        made.append(dst)
    return made


def from_store(store: Path, out: Path, types: str) -> list[Path]:
    """`edge0 export-gguf STORE OUT/model-{type}.gguf` for each type (this interpreter's edge0)."""
    out.mkdir(parents=True, exist_ok=True)
    made = []
    for t in [t for t in types.split(",") if t]:
        dst = out / f"model-{t}.gguf"
        if not dst.is_file():
            run([sys.executable, "-m", "edge0.cli", "export-gguf", str(store), str(dst), "--type", t])
        made.append(dst)
    return made


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("hf_dir", metavar="HF_DIR", nargs="?", help="Hugging Face checkpoint (edge0 make-model --format hf)")
    p.add_argument("--store", metavar="DIR", help="Edge0 store to export with `edge0 export-gguf` instead of HF_DIR")
    p.add_argument("--types", default="q4_1", help="with --store: comma-separated export types (default q4_1)")
    p.add_argument("--sdist", required=True, metavar="TAR.GZ", help="llama-cpp-python source distribution")
    p.add_argument("--venv", required=True, metavar="DIR", help="venv for llama.cpp (made when absent)")
    p.add_argument("--out", metavar="DIR", help="directory for the GGUF files (default HF_DIR-gguf or STORE-gguf)")
    p.add_argument("--outtype", default="bf16", choices=["bf16", "f16", "f32"], help="the converted GGUF (default bf16)")
    p.add_argument("--quant", default="Q4_0,Q4_K_M", help="comma-separated llama.cpp quantizations (default Q4_0,Q4_K_M)")
    p.add_argument("--torch", default="torch", metavar="REQ", help="pip requirement for torch (default: torch)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="build and quantize threads (default: all)")
    return p.parse_args()


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_convert":  # inside the venv
        convert_in_venv(*sys.argv[2:6])
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "_quantize":
        quantize_in_venv(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
        return 0
    args = parse_args()
    sdist = Path(args.sdist).resolve()
    if not sdist.is_file():
        sys.exit(f"llama_cpp_setup: --sdist {sdist}: no such file")
    if args.store and args.hf_dir:
        sys.exit("llama_cpp_setup: give HF_DIR or --store, not both")
    src = Path(args.store or args.hf_dir).resolve() if (args.store or args.hf_dir) else None
    if args.hf_dir and not (src / "config.json").is_file():
        sys.exit(f"llama_cpp_setup: {src}: no config.json (a Hugging Face checkpoint directory is needed)")
    if args.store and not (src / "edge0.json").is_file():
        sys.exit(f"llama_cpp_setup: --store {src}: no edge0.json (an Edge0 store is needed)")
    py = build(sdist, Path(args.venv).resolve(), args.jobs)
    if src is None:
        say(f"built: {py} (EDGE0_LLAMA_PYTHON={py}; bench: --llama-python {py})")
        return 0
    out = Path(args.out).resolve() if args.out else src.with_name(src.name + "-gguf")
    made = from_store(src, out, args.types) if args.store else from_hf(args, py, sdist, src, out)
    for f in made:  # llama.cpp must load what was written (its vocabulary included)
        run([str(py), "-c", "import sys, llama_cpp; llama_cpp.Llama(model_path=sys.argv[1], vocab_only=True, "
                             "verbose=False)", str(f)])
        say(f"{f} ({f.stat().st_size / 2**20:.0f} MiB)")
    gguf = made[1] if len(made) > 1 and not args.store else made[0]
    store = src if args.store else "STORE"
    print(f"edge0 bench --store {store} --arms staged@edge0,llama.cpp --gguf {gguf} --llama-python {py}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
