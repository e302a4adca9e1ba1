"""A Lightning `Trainer.fit` publishing onto the bus: JSONL log, divergence stop, progress.

    .venv/bin/python examples/lightning_trainer.py [--quick] [--out runs/lightning]

A small MLP learns a regression on the CPU. `EventBusCallback` publishes the loss as the
tensor Lightning holds (never `.item()`), the learning rate, validation metrics and
checkpoints; the subscribers run on the bus thread.
"""

from __future__ import annotations

import argparse
import logging
import warnings
from typing import Any

import torch

try:  # the unified package, else the standalone one: the bridge supports both
    import lightning.pytorch as pl
except ImportError:
    import pytorch_lightning as pl

from eventbus import EventBus
from eventbus.integrations.lightning import EventBusCallback
from eventbus.monitors import DivergenceDetector
from eventbus.sinks import ConsoleProgress, JsonlWriter


class Regressor(pl.LightningModule):  # type: ignore[misc]
    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()  # lands in RunStarted.config
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)  # the bridge publishes this

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))  # -> EvalEnded

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def loader(n: int, seed: int) -> torch.utils.data.DataLoader[Any]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    y = torch.sin(x[:, :4]).sum(dim=1, keepdim=True)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a few dozen steps")
    parser.add_argument("--out", default="runs/lightning", help="directory for events.jsonl")
    opts = parser.parse_args(argv)
    steps = 40 if opts.quick else 1000

    # Lightning's start-up banner and tips are INFO records of its logger (either package name);
    # torch 2.13 deprecates a class Lightning still uses: nothing this script can change.
    for name in ("lightning.pytorch", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*is deprecated", category=FutureWarning)

    torch.manual_seed(0)
    bus = EventBus()
    bus.subscribe(JsonlWriter(opts.out, overwrite=True))  # lossless: every line on disk
    bus.subscribe(DivergenceDetector(action="stop"))  # NaN at once, blow-ups in ~3 steps
    bus.subscribe(ConsoleProgress())  # replaces Lightning's bar

    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=f"{opts.out}/lightning",
        val_check_interval=min(20, steps),
        limit_val_batches=2,
        num_sanity_val_steps=0,
        callbacks=[EventBusCallback(bus)],
    )
    with bus:  # closing drains every subscriber
        trainer.fit(Regressor(), loader(4096, 0), loader(256, 1))
    if bus.should_stop:  # a detector asked the Trainer to stop
        print(f"stopped at step {trainer.global_step} ({bus.control.reason})")
    else:
        print(f"completed {trainer.global_step} steps")
    print(f"wrote {opts.out}/events.jsonl; try: eventbus summary {opts.out}/events.jsonl")


if __name__ == "__main__":
    main()
