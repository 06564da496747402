"""The package's front door: `edge0` exports the public API, its docstring's example runs, and importing it
stays cheap (MLX loads on first use of a name that needs it)."""

import subprocess
import sys
import textwrap

import edge0


def docstring_example() -> str:
    lines = edge0.__doc__.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("from edge0 import"))
    end = next((i for i in range(start, len(lines)) if lines[i] and not lines[i].startswith("    ")), len(lines))
    return textwrap.dedent("\n".join(lines[start:end]))


def test_the_docstring_example_runs_on_the_demo_model(capsys):
    code = docstring_example()
    assert "max_tokens=32" in code
    scope = {}
    exec(code.replace("max_tokens=32", "max_tokens=4"), scope)
    figures, out = scope["figures"], capsys.readouterr().out
    assert 1 <= figures.completion_tokens <= 4 and figures.prompt_tokens > 0
    assert out == f"{figures.text}\n{figures.line()}\n"


def test_the_public_names_are_the_modules_own():
    from edge0.config import EngineConfig
    from edge0.engine import open_engine
    from edge0.decode.request import Figures, GenRequest

    assert (edge0.open_engine, edge0.EngineConfig, edge0.GenRequest, edge0.Figures) == \
        (open_engine, EngineConfig, GenRequest, Figures)
    assert set(edge0.__all__) <= set(dir(edge0)) and isinstance(edge0.__version__, str)


def test_import_edge0_does_not_load_mlx():
    code = ("import sys, edge0; assert 'mlx' not in sys.modules, 'import edge0 loaded mlx'\n"
            "edge0.GenRequest; assert 'mlx' not in sys.modules, 'GenRequest loaded mlx'\n"
            "edge0.open_engine; assert 'mlx.core' in sys.modules\n"
            "try:\n    edge0.nothing\nexcept AttributeError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out == "module 'edge0' has no attribute 'nothing'\n"


def test_library_errors_name_settings_and_the_command_line_names_flags():
    """A bad setting found once the store is read (more slots than the model has experts, a kernel name) is said with
    EngineConfig's paths to a library caller and with the flags on the command line."""
    import pytest

    from edge0.errors import SettingError

    with pytest.raises(SettingError, match=r"^io\.slots 999: at most the model's \d+ experts"):
        edge0.open_engine(edge0.EngineConfig.of({"io.slots": 999}))
    with pytest.raises(SettingError, match=r"^kernel\.dtype float8: choose auto"):
        from edge0.model.load import compute_dtype
        compute_dtype("float8")
    proc = subprocess.run([sys.executable, "-m", "edge0.run", "--slots", "999", "--max-tokens", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--slots 999: at most the model's" in proc.stderr
    assert "Traceback" not in proc.stderr and "io.slots" not in proc.stderr
