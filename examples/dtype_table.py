"""The per-layer dtype table of a mixed-precision run, from `watch(what="dtype")`.

A Composer user wrote a callback by hand to see what autocast really does to each layer:
token ids stay int64, a projection takes float32 and gives bfloat16, the loss and every
gradient are float32. Here `watch(model, bus, what="dtype")` publishes `TensorLayout` events
(dtypes and shapes of weights, module inputs, module outputs and gradients: tensor metadata,
so no device work and no sync) and a small subscriber turns them into the table.

    .venv/bin/python examples/dtype_table.py            # 20 steps under CPU autocast (bf16)
    .venv/bin/python examples/dtype_table.py --quick
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from eventbus import Event, EventBus
from eventbus.events import TensorLayout
from eventbus.torch import watch

VOCAB, DIM, CONTEXT = 64, 32, 16
ROOT = "(model)"


class TinyLM(nn.Module):
    """Token ids -> embedding -> norm -> projection -> head -> cross-entropy loss."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.norm(self.emb(ids)))
        logits = self.head(F.gelu(h))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@dataclass
class Row:
    """One layer's dtypes ("" where it has none): its first input, output, weights, grads."""

    input: str = ""
    output: str = ""
    weight: set[str] = field(default_factory=set)
    grad: set[str] = field(default_factory=set)


class DtypeTable:
    """Collects `TensorLayout` events into one row per module (in the order they ran)."""

    events = (TensorLayout,)
    policy = "block"  # every layout event counts: they only say what changed

    def __init__(self) -> None:
        self.rows: dict[str, Row] = {}

    def on_events(self, batch: list[Event]) -> None:
        for ev in batch:
            assert isinstance(ev, TensorLayout)
            for key, info in ev.changed.items():
                self._add(key, str(info["dtype"]).removeprefix("torch."))

    def _add(self, key: str, dtype: str) -> None:
        kind, _, name = key.partition("/")
        if kind in ("weights", "grads"):  # a parameter: its module is the row
            module = name.rpartition(".")[0] or ROOT
            row = self.rows.setdefault(module, Row())
            (row.weight if kind == "weights" else row.grad).add(dtype)
            return
        module, bracket, _ = name.partition("[")
        row = self.rows.setdefault(module or ROOT, Row())
        if kind == "inputs" and not bracket and not row.input:
            row.input = dtype  # the first input (a tuple's other tensors are left out)
        elif kind == "activations" and not bracket:
            row.output = dtype

    def render(self) -> str:
        """The table as text, one line per module."""
        head = ("layer", "input", "output", "weights", "grads")
        lines = [head] + [
            (
                name + (" -> loss" if name == ROOT else ""),
                r.input,
                r.output,
                ",".join(sorted(r.weight)),
                ",".join(sorted(r.grad)),
            )
            for name, r in self.rows.items()
        ]
        widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
        return "\n".join(
            "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
            for line in lines
        )


def run(steps: int) -> DtypeTable:
    """Train `steps` steps under CPU autocast (bfloat16) with the dtypes watched."""
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    table = DtypeTable()
    bus = EventBus()
    bus.subscribe(table)
    with bus, watch(model, bus, every=1, what="dtype"):
        for step in range(1, steps + 1):
            ids = torch.randint(0, VOCAB, (8, CONTEXT + 1))
            with bus.step(step):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(ids[:, :-1], ids[:, 1:])
                loss.backward()  # gradients of float32 weights: float32
                opt.step()
                opt.zero_grad(set_to_none=True)
    return table  # the bus closed: every layout event was handled


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 steps (what the tests run)")
    args = p.parse_args(argv)
    table = run(3 if args.quick else 20)
    print(table.render())


if __name__ == "__main__":
    main()
