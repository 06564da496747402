"""Exports of a store to other runtimes' formats (GGUF for llama.cpp); numpy only, no MLX."""
