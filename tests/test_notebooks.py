"""The notebooks run top to bottom (their code cells, in order, in one namespace)."""

import json
import pathlib

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path):
    nb = json.loads(path.read_text())
    namespace = {"__name__": "__main__"}
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            assert not cell.get("outputs"), f"{path.name} is committed with outputs"
            source = "".join(cell["source"])
            exec(compile(source, f"{path.name}", "exec"), namespace)
