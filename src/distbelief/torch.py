"""A PyTorch module trained by distbelief: `distbelief.torch.TorchModel(module, loss)`
(distbelief.model.torch_model; docs/your-own-model.md). Needs torch: pip install
"distbelief[torch]"."""

from distbelief.model.torch_model import TorchModel

__all__ = ["TorchModel"]
