"""A regression on arrays of your own: the steps a researcher takes with their own data.

This script stands in for "your arrays": it writes a synthetic regression problem with a
planted answer to regression.npz. 16 features, 3 float targets a row:

    y = x @ W + 0.5 * tanh(x @ V) + noise,   noise ~ Normal(0, NOISE^2)

so the best any model can do is a mean squared error of NOISE^2 = 0.01 (the noise floor).
Then, from examples/:

    python regression.py                                   # writes regression.npz
    distbelief prepare arrays regression.npz --out regression.h5 \\
        --x x --y y --test-fraction 0.1                    # float y: a "values" dataset
    mpiexec -n 3 python -m distbelief train regression.toml   # [model] loss = "mse"

The run reports test r2 and rmse instead of accuracy, and stops when the test loss (the
mean squared error) reaches run.target_loss, just above the floor.
"""

import sys

import numpy as np

FEATURES, TARGETS, ROWS, NOISE = 16, 3, 20_000, 0.1


def planted(rows: int = ROWS, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(x, y): float32 features and targets from the planted model above."""
    rng = np.random.default_rng(seed)
    w = rng.normal(0, 1 / np.sqrt(FEATURES), (FEATURES, TARGETS))
    v = rng.normal(0, 2 / np.sqrt(FEATURES), (FEATURES, TARGETS))
    x = rng.normal(0, 1, (rows, FEATURES))
    y = x @ w + 0.5 * np.tanh(x @ v) + rng.normal(0, NOISE, (rows, TARGETS))
    return x.astype(np.float32), y.astype(np.float32)


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "regression.npz"
    x, y = planted()
    np.savez(out, x=x, y=y)
    print(f"wrote {out}: x {x.shape}, y {y.shape} (noise floor: mse {NOISE ** 2:g})")
