"""The README's Extend example runs as printed, in float32, and learns."""
import re
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def test_the_extend_example_runs_in_float32_and_learns():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    code = re.search(r"### 3\. Extend\s+```python\n(.*?)```", text, re.S).group(1)
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    model, x, y = namespace["model"], namespace["x"], namespace["y"]
    assert namespace["loss"].dtype == np.float32 and x.dtype == np.float32
    assert all(p.dtype == np.float32 for p in model.parameters())
    assert float(namespace["loss"]) < 0.9 * np.log(3)     # below chance: it learnt
    assert y.dtype.kind == "i"
