"""A PyTorch Lightning run on CPU whose DDP strategy names a backend (argv[1]).

Started by ``test_torch_backend.py`` under ``torch.distributed.run``; rank 0 prints one
JSON line: the final training loss, the held-out loss and the gossipnet backend's
counters (0 under gloo), which show that the gradients went through gossipnet.
"""

from __future__ import annotations

import json
import sys
import warnings
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gossipnet.distributed as gdist

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "examples"))
from ddp_backend import model, teacher_data

#: Steps (cosine-annealed): the test compares gossipnet with gloo lossless, bit for bit
#: to 1e-4, which needs no long run; 60 rounds also show the gradients went through it.
STEPS = 60


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = model(32)

    def training_step(self, batch: list[torch.Tensor], _idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)  # an exact small all-reduce
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, STEPS)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main() -> None:
    backend = sys.argv[1]
    warnings.filterwarnings("ignore")
    pl.seed_everything(0, verbose=False)
    x, y = teacher_data(2048, seed=5)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(process_group_backend=backend),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = Regressor()
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True))
    x_test, y_test = teacher_data(1024, seed=99_999)
    with torch.no_grad():
        test_loss = nn.functional.mse_loss(module.net(x_test), y_test).item()
    out = {
        "backend": backend,
        "pg": dist.get_backend(),
        "train_loss": float(trainer.callback_metrics["train_loss"]),
        "test_loss": test_loss,
        "totals": gdist.totals() if backend == "gossipnet" else {},
    }
    if trainer.global_rank == 0:
        print(json.dumps(out), flush=True)
    dist.barrier()  # Lightning leaves the group to the script: end it on every rank together
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
