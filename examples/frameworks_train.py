"""A few training steps under PyTorch Lightning, Hugging Face Accelerate
or the Hugging Face Trainer, on the aggnet backend by the recipe of
docs/torch.md, or on gloo to compare:

    torchrun --nproc-per-node 2 examples/frameworks_train.py lightning --backend aggnet
    torchrun --nproc-per-node 2 examples/frameworks_train.py accelerate --backend gloo --out gloo.json

Rank 0 prints (or writes, with --out) the final weights' first values and
the losses it saw: the aggnet run and the gloo run end the same, bit for
bit (tests/integration/test_frameworks.py holds them to it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

STEPS = 6


def _data(n: int = 96):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 8, generator=g)
    return x, (x[:, :3] * torch.tensor([1.0, -2.0, 0.5])).argmax(1)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def _median(values: list) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def _weights(model: nn.Module) -> list:
    return [p.detach().reshape(-1).tolist() for p in model.parameters()]


def lightning(backend: str) -> dict:
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    if backend == "aggnet":
        import aggnet.torch  # noqa: F401  registers the backend before Lightning initializes the group

    losses = []

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _net()

        def training_step(self, batch, _index):
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            # sync_dist averages the batch size, an int64, over the ranks
            self.log("train_loss", loss, sync_dist=True, batch_size=len(x))
            losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    steps = []

    class StepTimer(L.Callback):
        def on_train_batch_start(self, *args):
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, *args):
            steps.append(time.perf_counter() - self.t0)

    module = Module()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend=backend),
                        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[StepTimer()])
    trainer.fit(module, DataLoader(TensorDataset(*_data()), batch_size=8))
    return {"weights": _weights(module.net), "losses": losses, "step_s": _median(steps[1:]),
            "logged": float(trainer.callback_metrics["train_loss"]),
            "group_backend": str(dist.get_backend()) if dist.is_initialized() else None}


def accelerate(backend: str) -> dict:
    if backend == "aggnet":
        import aggnet.torch

        aggnet.torch.init_process_group()  # before the Accelerator, which keeps the group
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset

    acc = Accelerator(cpu=True)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = acc.prepare(model, opt, DataLoader(TensorDataset(*_data()), batch_size=8))
    losses, steps = [], []
    for step, (x, y) in enumerate(loader):
        if step == STEPS:
            break
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        acc.backward(loss)
        opt.step()
        steps.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    return {"weights": _weights(acc.unwrap_model(model)), "losses": losses, "step_s": _median(steps[1:]),
            "group_backend": str(dist.get_backend())}


def trainer(backend: str) -> dict:
    if backend == "aggnet":
        import aggnet.torch

        aggnet.torch.init_process_group()  # before TrainingArguments, which would ask for gloo
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    steps = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            steps.append(time.perf_counter() - self.t0)

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2))
    g = torch.Generator().manual_seed(9)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (64, 16), generator=g)]
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=STEPS, per_device_train_batch_size=4, use_cpu=True,
                                 report_to=[], save_strategy="no", logging_strategy="no", seed=0,
                                 dataloader_num_workers=0, learning_rate=1e-3,
                                 **({} if backend == "aggnet" else {"ddp_backend": "gloo"}))
        result = Trainer(model=model, args=args, train_dataset=rows, callbacks=[StepTimer()]).train()
    return {"weights": _weights(model)[:4], "losses": [result.training_loss], "step_s": _median(steps[1:]),
            "group_backend": str(dist.get_backend())}


def main() -> None:
    p = argparse.ArgumentParser(description="a few training steps of a framework on the aggnet backend or gloo")
    p.add_argument("framework", choices=["lightning", "accelerate", "trainer"])
    p.add_argument("--backend", choices=["aggnet", "gloo"], default="aggnet")
    p.add_argument("--out", default=None, help="write rank 0's result here as JSON (default: print it)")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.backend == "gloo" and args.framework != "lightning":
        dist.init_process_group("gloo")
    result = {"lightning": lightning, "accelerate": accelerate, "trainer": trainer}[args.framework](args.backend)
    if int(os.environ.get("RANK", "0")) == 0:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f)
        else:
            print(f"{args.framework} on {result['group_backend']}: losses {result['losses']}, first weights "
                  f"{result['weights']}, median step {result['step_s'] * 1e3:.1f} ms", flush=True)
    if dist.is_initialized():
        dist.barrier()
        if args.framework == "accelerate":
            # Accelerate's state ends the group itself; ending it here too
            # aborts the gloo run at exit
            from accelerate import PartialState

            PartialState().destroy_process_group()
        else:
            dist.destroy_process_group()
    if args.backend == "gloo":
        # the peer's run: gloo's threads can still hold tensors when the
        # interpreter finalizes, and then abort the process after its result
        # is written (pytorch/pytorch#179291); the aggnet run exits normally
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
