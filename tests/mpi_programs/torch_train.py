"""distbelief.train with a PyTorch module (examples/torch_cnn.py) on every rank:

    mpiexec -n N python tests/mpi_programs/torch_train.py CONFIG OUT_DIR H W C CLASSES
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from torch import nn
from torch_cnn import CNN

import distbelief
from distbelief.torch import TorchModel

if __name__ == "__main__":
    config, out, *shape = sys.argv[1:]
    height, width, channels, classes = map(int, shape)
    model = TorchModel(CNN(height, width, channels, classes), nn.CrossEntropyLoss())
    summary = distbelief.train(config, model=model, overrides=[f'run.out_dir="{out}"'])
    if summary is not None:
        print(f"summary: {summary['stop_reason']} {summary['final_test_accuracy']:.4f}",
              flush=True)
