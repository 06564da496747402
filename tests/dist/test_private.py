"""edge0/dist and the packages it drives."""


def test_dist_reads_no_private_state_of_other_packages():
    """edge0/dist asks the runtime through its public methods (pipeline/prefetch_runtime.py recount_overlap), not its
    private fields, which their owners change freely."""
    import re
    from pathlib import Path

    import edge0.dist

    private = re.compile(r"\b(?:rt|runtime|self\.rt|store|engine)\._[a-z]\w*")
    found = [f"{p.name}: {m.group(0)}" for p in Path(edge0.dist.__file__).parent.glob("*.py")
             for m in private.finditer(p.read_text())]
    assert not found, found
