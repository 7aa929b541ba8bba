"""docs/api.md is generated from the code (scripts/api_doc.py) and must be current: a new
public name, a changed signature or docstring fails here until the page is regenerated.
Every listed name has a summary line."""
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_script():
    spec = importlib.util.spec_from_file_location("api_doc", ROOT / "scripts" / "api_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_doc_is_current():
    text = load_script().build()
    assert (ROOT / "docs" / "api.md").read_text(encoding="utf-8") == text, \
        "docs/api.md is stale: run python scripts/api_doc.py"


def test_every_name_has_a_summary_and_the_pieces_are_listed():
    text = load_script().build()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    empty = [line for line in rows if re.search(r"\|\s*\|$", line)]
    assert not empty, empty
    for name in ("`.transpose(dim0, dim1)`", "`F.conv2d(", "`nn.GRU(", "`nn.LSTMCell(",
                 "`optim.SGD(", "`optim.AdamW(", "`lr_scheduler.CosineAnnealingLR(",
                 "`nn.init.uniform_(t: Tensor, low: float, high: float)`",
                 "`schedule.Schedule.__call__(step: int, progress: float = 0.0)`",
                 "`tinytf.gradcheck_module(", "`tinytf.zeros(", "`nn.Embedding(num: int, dim: int"):
        assert name in text, name
