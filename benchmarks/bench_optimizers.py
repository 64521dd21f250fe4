"""SGD with momentum and Adam: the fused kernels against torch.optim's in the same run.

One thread (torch.set_num_threads(1)), arrays far beyond the caches, the median of
--repeats steps. Each line is an update of P float32 parameters:

* distbelief: distbelief.model.optimizers.Momentum / Adam .step, one fused pass (momentum
  reads params, buf, grad and writes params, buf: 20 bytes per parameter; Adam reads
  params, m, v, grad and writes params, m, v: 28 bytes);
* torch: torch.optim.SGD(momentum=0.9) / torch.optim.Adam on one parameter tensor, with
  its default implementation on CPU (the single-tensor loop), and with foreach=True and,
  for Adam, fused=True, the faster variants a user may pick;
* copy: np.copyto moving the same bytes, the memory bound.

The ratio printed is torch's time over ours (above 1: ours is faster).

    python benchmarks/bench_optimizers.py [--size 10000000] [--repeats 9]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np
from bench_adagrad import median_seconds

from distbelief.model.optimizers import Adam, Momentum

BYTES = {"momentum": 20, "adam": 28}


def torch_step(torch, opt_class, params: np.ndarray, grad: np.ndarray,
               **kwargs) -> Callable[[], None]:
    p = torch.nn.Parameter(torch.from_numpy(params.copy()))
    p.grad = torch.from_numpy(grad)
    opt = opt_class([p], **kwargs)
    return opt.step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=10_000_000, help="parameters (P)")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    size, repeats = args.size, args.repeats
    rng = np.random.default_rng(0)
    params = rng.standard_normal(size, dtype=np.float32)
    grad = rng.standard_normal(size, dtype=np.float32)
    print(f"P = {size:,} float32 parameters, median of {repeats} steps, one thread, "
          f"torch {torch.__version__}")
    count = [0]

    def ours(opt) -> Callable[[], None]:
        def step() -> None:
            opt.step(params, grad, update=count[0])
            count[0] += 1
        return step

    rows = {
        "momentum": (Momentum(size, 0.01, 0.9), torch.optim.SGD,
                     {"lr": 0.01, "momentum": 0.9}, ("foreach",)),
        "adam": (Adam(size, 1e-3), torch.optim.Adam, {"lr": 1e-3}, ("foreach", "fused")),
    }
    for name, (mine, torch_class, kwargs, variants) in rows.items():
        copy_len = size * BYTES[name] // 2 // 4
        src = rng.standard_normal(copy_len, dtype=np.float32)
        dst = np.empty_like(src)
        bound = median_seconds(lambda d=dst, s=src: np.copyto(d, s), repeats)
        t_ours = median_seconds(ours(mine), repeats)
        gbs = size * BYTES[name] / t_ours / 1e9
        print(f"{name:<9} distbelief {t_ours * 1e3:8.2f} ms  {gbs:6.2f} GB/s  "
              f"({bound / t_ours:.2f} of the copy bound)")
        for variant in ("default", *variants):
            extra = {} if variant == "default" else {variant: True}
            t_torch = median_seconds(torch_step(torch, torch_class, params, grad,
                                                **kwargs, **extra), repeats)
            print(f"{name:<9} torch {variant:<8} {t_torch * 1e3:8.2f} ms  "
                  f"ratio torch/distbelief {t_torch / t_ours:.2f}")


if __name__ == "__main__":
    main()
