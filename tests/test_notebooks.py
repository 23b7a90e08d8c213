"""The example notebooks: each jupytext `py:percent` source matches its stored `.ipynb`.

The notebooks themselves are executed by `pytest --nbmake examples/notebooks`; these tests only
check that the pairs are in sync and that the stored `.ipynb` files carry no outputs.
Regenerate a pair after editing the `.py` with `jupytext --sync examples/notebooks/NAME.py`.
"""

import json
import pathlib

import pytest

jupytext = pytest.importorskip("jupytext")

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "examples" / "notebooks"
STEMS = sorted({path.stem for path in (*NOTEBOOKS.glob("*.py"), *NOTEBOOKS.glob("*.ipynb"))})


def _cells(path):
    notebook = jupytext.read(path)
    return [(cell.cell_type, cell.source.strip()) for cell in notebook.cells]


@pytest.mark.parametrize("stem", STEMS)
def test_pair_exists(stem):
    for suffix in (".py", ".ipynb"):
        assert (NOTEBOOKS / f"{stem}{suffix}").is_file(), f"{stem}{suffix} is missing"


@pytest.mark.parametrize("stem", STEMS)
def test_pair_in_sync(stem):
    py, ipynb = NOTEBOOKS / f"{stem}.py", NOTEBOOKS / f"{stem}.ipynb"
    if not (py.is_file() and ipynb.is_file()):
        pytest.skip("not a pair (test_pair_exists fails)")
    py_cells, ipynb_cells = _cells(py), _cells(ipynb)
    assert len(py_cells) == len(ipynb_cells), (
        f"{stem}: {len(py_cells)} cells in the .py, {len(ipynb_cells)} in the .ipynb; "
        f"run `jupytext --sync {py}`"
    )
    for index, (a, b) in enumerate(zip(py_cells, ipynb_cells, strict=True)):
        assert a == b, f"{stem}: cell {index} differs; run `jupytext --sync {py}`"
    formats = jupytext.read(py).metadata.get("jupytext", {}).get("formats", "")
    assert set(formats.split(",")) == {"ipynb", "py:percent"}, f"{stem}: formats {formats!r}"


@pytest.mark.parametrize("stem", STEMS)
def test_ipynb_has_no_outputs(stem):
    ipynb = NOTEBOOKS / f"{stem}.ipynb"
    if not ipynb.is_file():
        pytest.skip("no .ipynb (test_pair_exists fails)")
    notebook = json.loads(ipynb.read_text(encoding="utf-8"))
    for index, cell in enumerate(notebook["cells"]):
        if cell["cell_type"] != "code":
            continue
        assert cell.get("outputs") == [], f"{stem}: code cell {index} has stored outputs"
        assert cell.get("execution_count") is None, f"{stem}: code cell {index} was executed"
