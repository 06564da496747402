"""The lab shelf: tests of the finished studies in tools/lab/. The default run leaves them out (pyproject's
addopts: -m "not lab"); `python -m pytest -m lab tests/lab` runs them."""


def selects_lab(expr: str) -> bool:
    """Whether a -m expression can select a test marked only `lab` (no expression: every test)."""
    if not expr:
        return True
    try:
        from _pytest.mark.expression import Expression
    except ImportError:  # pytest moved it: collect, and let -m deselect
        return True
    return Expression.compile(expr).evaluate(lambda name, **_: name == "lab")


def pytest_ignore_collect(collection_path, config):
    """Not even imported unless selected: a study's stale import never breaks the default run's collection."""
    if collection_path.name != "conftest.py" and not selects_lab(config.getoption("markexpr") or ""):
        return True
    return None
