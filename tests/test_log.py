"""The log's lines for a failure: an Edge0Error (a failed read, a bad file) is its one clear line, anything else (a
fault of Edge0's own) comes with its traceback."""

from edge0.errors import Edge0Error
from edge0.log import configure, log_failure


def test_an_edge0_error_is_one_line_and_an_internal_error_keeps_its_traceback(capsys):
    log_failure("generation failed", Edge0Error("/s/experts/layer_003.safetensors: read of expert 31 failed\n(EIO)"))
    err = capsys.readouterr().err
    assert err == ("edge0: error: generation failed "
                   "(error=/s/experts/layer_003.safetensors: read of expert 31 failed (EIO))\n")
    try:
        raise RuntimeError("injected")
    except RuntimeError as e:
        log_failure("a batched step failed", e)
    err = capsys.readouterr().err
    assert err.startswith("edge0: error: a batched step failed (error=RuntimeError('injected') traceback=Traceback")
    assert "test_log.py" in err


def test_json_lines_carry_the_same_fields(capsys):
    configure(json=True)
    try:
        log_failure("generation failed", Edge0Error("short read"))
    finally:
        configure()
    assert '"event": "generation failed"' in capsys.readouterr().err


def test_library_notes_go_through_the_log(models, tmp_path, monkeypatch, capsys):
    """verify's problems and the training BLAS notice are log events: JSON lines once the log is configured so."""
    import json
    import shutil

    from edge0.cli.verify import verify as verify_cli
    from edge0.train import loop

    store = tmp_path / "store"
    shutil.copytree(models("qwen3_moe"), store)
    (store / "config.json").write_text((store / "config.json").read_text() + " ")  # its checksum no longer holds
    monkeypatch.setattr(loop, "blas", lambda: "reference BLAS (MLX's Linux CPU wheel)")
    configure(json=True)
    try:
        assert verify_cli(str(store)) == 1
        loop.blas_notice(loop.World(0, 1), True)
    finally:
        configure()
    events = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    assert [e["level"] for e in events] == ["error", "info"]
    assert str(store / "config.json") in events[0]["event"] and "reference BLAS" in events[1]["event"]
