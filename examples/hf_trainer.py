"""The Hugging Face Trainer publishing onto the bus: JSONL log, divergence stop, progress.

    .venv/bin/python examples/hf_trainer.py [--quick] [--out runs/hf]

A tiny GPT-2 built from its config (no download) learns a repeating token pattern on the
CPU. `EventBusCallback` turns the Trainer's hooks into events; the subscribers run on the
bus thread, so none of them costs the training step anything.
"""

from __future__ import annotations

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, PrinterCallback, Trainer, TrainingArguments

from eventbus import EventBus
from eventbus.integrations.transformers import EventBusCallback
from eventbus.monitors import DivergenceDetector
from eventbus.sinks import ConsoleProgress, JsonlWriter


class Patterns(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Sequences of a few repeating token patterns: a language a tiny model can learn."""

    def __init__(self, n: int, length: int = 32, vocab: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        motifs = torch.randint(0, vocab, (8, 4), generator=g)
        picks = torch.randint(0, len(motifs), (n,), generator=g)
        self.ids = motifs[picks].repeat(1, length // 4)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a few dozen steps")
    parser.add_argument("--out", default="runs/hf", help="directory for events.jsonl")
    opts = parser.parse_args(argv)
    steps = 30 if opts.quick else 300

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    args = TrainingArguments(
        output_dir=f"{opts.out}/trainer",
        max_steps=steps,
        per_device_train_batch_size=16,
        learning_rate=3e-3,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=steps // 3,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        log_level="error",
    )

    bus = EventBus()
    bus.subscribe(JsonlWriter(opts.out, overwrite=True))  # lossless: every line on disk
    bus.subscribe(DivergenceDetector(action="stop"))  # NaN at once, blow-ups in ~3 steps
    # The Trainer hides NaN losses from its logs by default (logging_nan_inf_filter): watch
    # the gradient norm too, which it logs as computed.
    bus.subscribe(DivergenceDetector("grad_norm", action="stop"))
    bus.subscribe(ConsoleProgress())  # total steps from RunStarted

    trainer = Trainer(
        model=GPT2LMHeadModel(config),
        args=args,
        train_dataset=Patterns(512),
        eval_dataset=Patterns(64),
        callbacks=[EventBusCallback(bus)],
    )
    trainer.remove_callback(PrinterCallback)  # ConsoleProgress shows progress instead
    with bus:  # closing drains every subscriber
        trainer.train()
    step, loss = trainer.state.global_step, trainer.state.log_history[-1].get("train_loss")
    if bus.should_stop:  # a detector asked the Trainer to stop
        print(f"stopped at step {step} ({bus.control.reason}); train_loss {loss:.3f}")
    else:
        print(f"completed {step} steps; train_loss {loss:.3f}")
    print(f"wrote {opts.out}/events.jsonl; try: eventbus summary {opts.out}/events.jsonl")


if __name__ == "__main__":
    main()
