"""A PyTorch module as a model of the user's own (model.protocol): `TorchModel(module,
loss)`; needs torch (`pip install "distbelief[torch]"`, never a core dependency).
docs/your-own-model.md.

The module's parameters become views into one flat float32 buffer, in named_parameters
order, and their gradients views into another: a step copies the replica's parameter
vector in (one copy), runs the module and autograd, and hands the gradient buffer back,
with no per-parameter gathering. The shards stay distbelief's (Adagrad, RMA,
checkpoints); only the replicas run torch, one thread each by default.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from distbelief.model.protocol import accuracy_of

__all__ = ["TorchModel"]


class TorchModel:
    """`module` trained by distbelief: `loss(module(x), y)` is the batch's mean loss
    (e.g. torch.nn.CrossEntropyLoss()). `name` and `version` identify the model in the
    config hash (default: "torch:" and the module's class name, "1"); `threads` is torch's
    intra-op thread count in this process (one per replica, as run.threads' default).
    Integer labels are passed to `loss` as int64, anything else as float32."""

    def __init__(self, module: torch.nn.Module, loss: Callable[..., torch.Tensor], *,
                 name: str | None = None, version: str = "1", threads: int | None = 1):
        self.module, self.loss = module, loss
        self.name = name or f"torch:{type(module).__name__}"
        self.version = version
        if threads:
            torch.set_num_threads(threads)
        buffers = [n for n, _ in module.named_buffers()]
        if buffers:  # e.g. BatchNorm's running statistics
            raise ValueError(f"{self.name} has buffers ({', '.join(buffers[:3])}): state "
                             f"outside its parameters, which each replica would keep on "
                             f"its own and no checkpoint would hold; use a module without "
                             f"(LayerNorm or GroupNorm instead of BatchNorm)")
        self._named = [(n, tuple(p.shape)) for n, p in module.named_parameters()]
        size = sum(p.numel() for p in module.parameters())
        if size == 0:
            raise ValueError(f"{self.name} has no parameters to train")
        self._flat = torch.zeros(size, dtype=torch.float32)
        self._grad = torch.zeros(size, dtype=torch.float32)
        offset = 0
        for p in module.parameters():
            n = p.numel()
            with torch.no_grad():
                self._flat[offset:offset + n].copy_(p.detach().reshape(-1).float())
            p.data = self._flat[offset:offset + n].view_as(p)
            p.grad = self._grad[offset:offset + n].view_as(p)
            offset += n
        self._constructed = self._flat.clone()  # what no reset_parameters redraws

    # -- the protocol --------------------------------------------------------------------

    def named_slices(self) -> list[tuple[str, tuple[int, ...]]]:
        return list(self._named)

    def init_params(self, rng: np.random.Generator) -> np.ndarray:
        """The module's own initialisation (each submodule's reset_parameters), under a
        torch seed drawn from `rng`: the same vector on every rank for one run.seed. A
        parameter no reset_parameters covers keeps the value it was constructed with."""
        torch.manual_seed(int(rng.integers(2**31)))
        with torch.no_grad():
            self._flat.copy_(self._constructed)
            for sub in self.module.modules():
                reset = getattr(sub, "reset_parameters", None)
                if callable(reset):
                    reset()
        return self._flat.numpy().copy()

    def loss_and_grad(self, params: np.ndarray, x: np.ndarray,
                      y: np.ndarray) -> tuple[float, np.ndarray]:
        self._load(params)
        self.module.train()
        self._grad.zero_()
        loss = self.loss(self.module(torch.from_numpy(x)), _targets(y))
        loss.backward()
        return float(loss.detach()), self._grad.numpy()

    def evaluate(self, params: np.ndarray, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        """The loss in eval mode (dropout off), without autograd; with class labels also
        the accuracy (else distbelief scores predict's outputs by the run's model.loss)."""
        self._load(params)
        self.module.eval()
        with torch.no_grad():
            outputs = self.module(torch.from_numpy(x))
            loss = float(self.loss(outputs, _targets(y)))
        labels = np.asarray(y)
        if not np.issubdtype(labels.dtype, np.integer):
            return {"loss": loss}
        return {"loss": loss, "accuracy": accuracy_of(outputs.numpy(), labels)}

    def predict(self, params: np.ndarray, x: np.ndarray) -> np.ndarray:
        self._load(params)
        self.module.eval()
        with torch.no_grad():
            return self.module(torch.from_numpy(x)).numpy()

    def _load(self, params: np.ndarray) -> None:
        with torch.no_grad():
            self._flat.copy_(torch.from_numpy(params))

    # -- after training ------------------------------------------------------------------

    @staticmethod
    def load_into(module: torch.nn.Module, run_dir: str | Path, which: str = "best") -> Any:
        """Copy a run's trained vector into `module`'s parameters, in place: its best model
        ("best", the default where one was kept) or its newest checkpoint ("last").
        Returns the checkpoint read. ValueError if the module's parameters are not the
        run's (names and shapes, in order)."""
        from distbelief.records.export import find_checkpoint

        found, _ = find_checkpoint(Path(run_dir), which)
        named = [(n, list(p.shape)) for n, p in module.named_parameters()]
        saved = [(e["name"], e["shape"]) for e in found.manifest["layout"]]
        if named != saved:
            raise ValueError(f"{type(module).__name__}'s parameters are not those of "
                             f"{found.path}: {named[:3]}... against {saved[:3]}...")
        params, _ = found.read_state()
        offset = 0
        with torch.no_grad():
            for p in module.parameters():
                n = p.numel()
                p.copy_(torch.from_numpy(params[offset:offset + n]).view_as(p))
                offset += n
        return found


def _targets(y: np.ndarray) -> torch.Tensor:
    y = np.asarray(y)
    if np.issubdtype(y.dtype, np.integer):
        return torch.from_numpy(y.astype(np.int64, copy=False))
    return torch.from_numpy(y.astype(np.float32, copy=False))
