"""Write docs/api.md: every public Tensor method, function of ``tinytf`` and ``F``, ``nn``
module, ``init`` function, optimizer and schedule, with its signature and the first line of
its docstring, read from the code itself.

    python scripts/api_doc.py            # rewrite docs/api.md
    python scripts/api_doc.py --check    # exit 1 if docs/api.md is not current

tests/test_api_doc.py runs the check, so the page cannot fall behind the code.
"""
from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

import tinytf
from tinytf import nn, optim
from tinytf.engine.tensor import Tensor
from tinytf.engine.tensor_methods import TensorMethods
from tinytf.nn import functional as F
from tinytf.optim import lr_scheduler, schedule

OUT = Path(__file__).resolve().parent.parent / "docs" / "api.md"

HEADER = """# API reference

Every public name a model builder uses, with its signature and the first line of its
docstring, generated from the code by `python scripts/api_doc.py` (`tests/test_api_doc.py`
fails when this page is not current). The mathematics of each op, forward and backward, is
in its file under `tinytf/ops/`; [autograd.md](autograd.md) explains the engine and
[extending.md](extending.md) builds models with these pieces.

## Differences from PyTorch

- **No in-place ops** on tensors that are part of a graph (no `add_`, `relu_`, ...): every op
  makes a new tensor. The `init` functions write into parameters before any graph exists.
- **No higher-order gradients**: `backward` runs once through a graph and frees it (no
  `create_graph`, no `retain_graph`); `tinytf.gradcheck` checks first derivatives.
- **Dtypes**: Python floats and lists make float32 tensors, NumPy arrays keep their dtype; an
  op never changes the dtype (float32 in, float32 out; float64 for gradient checks), and
  `Function.apply` refuses a forward that upcasts.
- **Classes last**: `F.cross_entropy` and `F.nll_loss` take logits (..., C) and targets (...);
  PyTorch puts the classes second, (N, C, d1, ...).
- **`max(dim)` / `min(dim)`** return (values, indices) as PyTorch's; NumPy's `axis=`
  keyword returns the values (as `amax`). Reductions take `dim`/`keepdim` or `axis`/`keepdims`.
- **`==` and `!=` compare identity** (tensors stay usable as dict keys); `eq` and `ne` give
  elementwise masks. `<`, `<=`, `>`, `>=` give boolean tensors without gradient.
- **`F.gelu`** is the tanh form (PyTorch's `approximate="tanh"`); `F.softplus` follows
  PyTorch's `beta` and `threshold`.
- **Recurrent layers** run one direction (no `bidirectional`); `batch_first=False` by default,
  as PyTorch's.
- **Optimizers** count updates once for the optimizer (PyTorch keeps a count per parameter:
  the same while every parameter gets a gradient). `optim.Adam`'s defaults are the paper's,
  betas (0.9, 0.98) and eps 1e-9; `optim.AdamW`'s are PyTorch's. `state_dict` keys are names,
  not PyTorch's nested layout.
- **Initialisation**: `nn.Embedding` draws N(0, dim^-1/2) (PyTorch: N(0, 1)); `nn.Linear`,
  the convolutions and the recurrent layers draw as PyTorch's.
"""


def first_line(obj) -> str:
    """The first line of ``obj``'s docstring (the summary)."""
    doc = inspect.getdoc(obj) or ""
    return doc.strip().split("\n\n")[0].replace("\n", " ")


def signature(obj, name: str) -> str:
    """``name(arguments)`` without ``self``, or the bare name when there is none."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return name
    sig = sig.replace(parameters=[p for p in sig.parameters.values()
                                  if p.name not in ("self", "cls")],
                      return_annotation=inspect.Signature.empty)
    return f"{name}{sig}".replace("'", "")


def row(obj, name: str) -> str:
    """One table row: the signature in code, then the summary."""
    summary = first_line(obj).replace("|", "\\|")
    return f"| `{signature(obj, name).replace('|', chr(92) + '|')}` | {summary} |"


def table(title: str, rows: list, intro: str = "") -> list:
    lines = [f"## {title}", ""]
    if intro:
        lines += [intro, ""]
    return lines + ["| name | what |", "|---|---|"] + rows + [""]


def public_functions(module) -> list:
    """(name, function) defined in ``module`` itself and not private, sorted."""
    return sorted((n, f) for n, f in vars(module).items() if not n.startswith("_")
                  and inspect.isfunction(f) and f.__module__ == module.__name__)


def tensor_members() -> list:
    rows = []
    members = {**vars(TensorMethods), **vars(Tensor)}     # Tensor and its conveniences
    for name, member in sorted(members.items()):
        if name.startswith("_") and name not in ("__init__",):
            continue
        if isinstance(member, property):
            rows.append(f"| `.{name}` | {first_line(member)} |")
        elif inspect.isfunction(member) or isinstance(member, (staticmethod, classmethod)):
            fn = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
            if name == "__init__":
                rows.append(f"| `{signature(fn, 'Tensor')}` | {first_line(Tensor)} |")
            else:
                rows.append(row(fn, f".{name}"))
    return rows


def class_rows(classes, prefix: str) -> list:
    """A row per class (its constructor) and per public method defined on it with a
    docstring of its own (an override such as ``forward`` is the class's own summary)."""
    rows = []
    for cls in classes:
        rows.append(row(cls, f"{prefix}{cls.__name__}"))
        for name, member in sorted(vars(cls).items()):
            if isinstance(member, (classmethod, staticmethod)):
                member = member.__func__                   # Translator.load, ...
            if (name.startswith("_") and name != "__call__") or not inspect.isfunction(member) \
                    or member.__doc__ is None:
                continue
            rows.append(row(member, f"{prefix}{cls.__name__}.{name}"))
    return rows


def build() -> str:
    top = [row(getattr(tinytf, n), f"tinytf.{n}") for n in sorted(tinytf.__all__)
           if callable(getattr(tinytf, n)) and not inspect.isclass(getattr(tinytf, n))
           and not inspect.ismodule(getattr(tinytf, n))]
    modules = [getattr(nn, n) for n in nn.__all__ if inspect.isclass(getattr(nn, n))
               and n != "init"]
    init = [row(getattr(nn.init, n), f"nn.init.{n}") for n in sorted(vars(nn.init))
            if not n.startswith("_")]
    optimizers = [optim.Optimizer, optim.SGD, optim.Adam, optim.AdamW]
    clip = [row(getattr(optim, n), f"optim.{n}") for n in
            ("clip_grad_norm", "clip_grad_norm_", "clip_grad_value_", "grad_norm")]
    schedulers = [c for _, c in sorted(vars(lr_scheduler).items())
                  if inspect.isclass(c) and c.__module__ == lr_scheduler.__name__]
    lines = [HEADER]
    lines += table("Tensor", tensor_members(), "`tinytf.Tensor` (`tinytf/engine/tensor.py`); "
                   "operators `+ - * / @ **` (also `scalar ** t`), unary `-`, `abs()`, "
                   "indexing, `float(t)`, `int(t)`, comparisons.")
    lines += table("tinytf", top, "Creation helpers, gradient checks and the engine's switches.")
    lines += table("tinytf.nn.functional (F)",
                   [row(f, f"F.{n}") for n, f in public_functions(F)])
    lines += table("tinytf.nn", class_rows(modules, "nn."),
                   "Modules as `torch.nn`'s: the same parameter names and shapes.")
    lines += table("tinytf.nn.init", init)
    lines += table("tinytf.optim", class_rows(optimizers, "optim.") + clip)
    lines += table("tinytf.optim.lr_scheduler", class_rows(schedulers, "lr_scheduler."),
                   "Schedulers for any optimizer's parameter groups.")
    lines += table("tinytf.optim.schedule",
                   class_rows([schedule.Schedule], "schedule.") +
                   [row(f, f"schedule.{n}") for n, f in public_functions(schedule)],
                   "The Transformer's learning-rate schedules (update numbers from 1).")
    from tinytf.fast.loss_scaler import DynamicLossScaler  # noqa: PLC0415
    from tinytf.nn import amp  # noqa: PLC0415
    lines += table("tinytf.nn.amp", class_rows([amp.Policy], "amp.") +
                   [row(f, f"amp.{n}") for n, f in public_functions(amp)] +
                   class_rows([DynamicLossScaler], "fast.loss_scaler."),
                   "Mixed precision (docs/gpu.md): `with amp.autocast(\"bf16\"):` around the "
                   "forward pass; float16's loss scaling.")
    from tinytf.decoding.ensemble import EnsembleTranslator  # noqa: PLC0415
    from tinytf.decoding.translation import Translator  # noqa: PLC0415
    lines += table("tinytf.Translator", class_rows([Translator, EnsembleTranslator], ""),
                   "Translating from Python (docs/decoding.md); `tinytf.train(...)` above trains.")
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is stale")
    args = p.parse_args(argv)
    text = build()
    if args.check:
        current = OUT.read_text(encoding="utf-8") if OUT.exists() else ""
        if current != text:
            print(f"{OUT} is not current: run python scripts/api_doc.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT} ({text.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
