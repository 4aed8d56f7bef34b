"""The notebooks run under a real Jupyter kernel and their committed outputs are current.

They are committed with their outputs (pictures included) so that they read on
the web.  Each is executed again here, in a kernel of this Python (nbclient,
ipykernel), and the fresh outputs must have the committed ones' structure: the
same cells, and per cell the same number and kinds of outputs (stdout, pictures,
HTML, ...).  Numbers in them (timings) may differ.  Warnings on stderr vary by
machine and are not compared; an error in any cell fails.

After changing a notebook or what it shows, write it again with its outputs::

    python tests/test_notebooks.py
"""

from __future__ import annotations

import pathlib
import sys

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
TIMEOUT = 600  # seconds per cell


def execute(path: pathlib.Path):
    """The notebook at ``path`` executed top to bottom in a fresh kernel (not saved)."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    # "python3" is ipykernel's own kernel: jupyter_client starts it with this
    # interpreter (sys.executable), so the kernel sees this environment's gradfx.
    client = NotebookClient(nb, kernel_name="python3", timeout=TIMEOUT, coalesce_streams=True,
                            record_timing=False, resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    return nb


def structure(nb) -> list:
    """Per cell: its type and the kinds of its outputs, in order."""
    out = []
    for cell in nb.cells:
        kinds = []
        for o in cell.get("outputs", []):
            if o["output_type"] == "stream":
                if o["name"] != "stderr":
                    kinds.append(("stream", o["name"]))
            elif o["output_type"] in ("display_data", "execute_result"):
                kinds.append((o["output_type"], tuple(sorted(o["data"]))))
            else:
                kinds.append((o["output_type"],))
        out.append((cell.cell_type, kinds))
    return out


def errors(nb) -> list[str]:
    return [f"cell {k}: {o.get('ename')}: {o.get('evalue')}" for k, cell in enumerate(nb.cells)
            for o in cell.get("outputs", []) if o["output_type"] == "error"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_and_its_outputs_are_current(path):
    import nbformat

    committed = nbformat.read(path, as_version=4)
    code_cells = [c for c in committed.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code_cells), f"{path.name}: committed without running it"
    assert any(c.outputs for c in code_cells), f"{path.name}: committed without outputs"
    assert any("image/svg+xml" in o.get("data", {}) for c in code_cells for o in c.outputs), \
        f"{path.name}: committed without its pictures"
    fresh = execute(path)
    assert not errors(fresh), errors(fresh)
    assert structure(fresh) == structure(committed), (
        f"{path.name}: committed outputs are stale; run `python tests/test_notebooks.py` to write them again")


if __name__ == "__main__":
    import nbformat

    for path in NOTEBOOKS if len(sys.argv) < 2 else [pathlib.Path(p) for p in sys.argv[1:]]:
        nb = execute(path)
        if errors(nb):
            sys.exit(f"{path.name}: {errors(nb)}")
        nbformat.write(nb, path)
        print(f"wrote {path.name} with its outputs")
