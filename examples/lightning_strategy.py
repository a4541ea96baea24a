"""Lightning's Trainer driving zerodist: `strategy="zerodist_stage_3"` on CPU ranks.

    zerodist run --nproc 2 examples/lightning_strategy.py --out OUT [--stage 3] [--steps 20]

Needs `pip install 'zerodist[lightning]'`. A LightningModule (zerodist's small GPT on the byte
corpus of `zerodist train`) is trained by `lightning.Trainer` with zerodist's strategy: the engine
runs Lightning's accumulation and clipping, and Lightning's checkpoints (OUT/*.ckpt, one per
epoch) are the engine's sharded checkpoints, with Lightning's state inside. Launched by
`zerodist run` (or torchrun), Lightning starts no processes of its own.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

import zerodist.integrations.lightning  # noqa: F401  (registers "zerodist", "zerodist_stage_1/2/3")
from zerodist.data import TokenDataset, stdlib_corpus
from zerodist.models import GPT, gpt_config


class ByteGPT(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.gpt = GPT(gpt_config("tiny"))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.gpt(inputs)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        logits = self(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        self.log("loss", loss, prog_bar=False, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--stage", type=int, default=3, choices=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    data = TokenDataset(stdlib_corpus(max_bytes=200_000), seq_len=32)
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    trainer = pl.Trainer(strategy=f"zerodist_stage_{args.stage}", accelerator="cpu", devices=2,
                         max_steps=args.steps, accumulate_grad_batches=2, gradient_clip_val=1.0,
                         default_root_dir=args.out, logger=False, enable_progress_bar=False,
                         callbacks=[pl.callbacks.ModelCheckpoint(dirpath=args.out, every_n_train_steps=10)])
    trainer.fit(ByteGPT(), loader)
    engine = trainer.strategy.engine
    if trainer.is_global_zero:
        print(f"trained {engine.global_steps} steps as {type(trainer.model).__name__} (ZeRO {engine.stage}); "
              f"last loss {trainer.callback_metrics['loss'].item():.4f}")


if __name__ == "__main__":
    main()
