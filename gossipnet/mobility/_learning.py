"""A small real model, trained by every vehicle at once: data, MLP, gradients (numpy).

Why numpy and not torch here: the simulator steps 16-100 models in lock-step, and one
batched ``einsum`` over a stacked (vehicles, parameters) array is both faster on two
CPU cores and bit-for-bit reproducible.  The model is a one-hidden-layer tanh MLP
with a softmax output, trained by plain SGD on cross-entropy.

The data is synthetic and seeded (no downloads): Gaussian class clusters passed
through a fixed random rotation and a ``tanh`` warp so a linear model is not
enough.  Each vehicle sees only a few classes (non-IID, like cameras that only see
their own part of town): alone it cannot learn the task, which is what makes the
gossip topology matter.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ("Dataset", "Mlp", "make_dataset")

FloatArray = np.ndarray
IntArray = np.ndarray


@dataclass(frozen=True, slots=True, eq=False)
class Dataset:
    """Per-vehicle training shards and a shared test set."""

    train_x: list[FloatArray]
    train_y: list[IntArray]
    test_x: FloatArray
    test_y: IntArray
    classes: int

    @property
    def dim(self) -> int:
        return int(self.test_x.shape[1])


def _sample(
    rng: np.random.Generator, means: FloatArray, rot: FloatArray, labels: IntArray, noise: float
) -> FloatArray:
    raw = means[labels] + noise * rng.standard_normal((labels.size, means.shape[1]))
    return np.tanh(raw @ rot)


def make_dataset(
    vehicles: int,
    *,
    classes: int = 10,
    dim: int = 16,
    per_vehicle: int = 256,
    classes_per_vehicle: int = 2,
    test_size: int = 500,
    noise: float = 1.0,
    seed: int = 0,
) -> Dataset:
    """A seeded synthetic classification task split non-IID over ``vehicles``.

    Vehicle v draws its samples from ``classes_per_vehicle`` consecutive classes
    starting at ``v mod classes``, so together the fleet covers every class.
    """
    rng = np.random.default_rng([seed, 7919])
    means = 1.5 * rng.standard_normal((classes, dim))
    rot = np.linalg.qr(rng.standard_normal((dim, dim)))[0]
    xs, ys = [], []
    for v in range(vehicles):
        own = (v + np.arange(classes_per_vehicle)) % classes
        y = own[rng.integers(classes_per_vehicle, size=per_vehicle)]
        xs.append(_sample(rng, means, rot, y, noise))
        ys.append(y)
    ty = rng.integers(classes, size=test_size)
    return Dataset(xs, ys, _sample(rng, means, rot, ty, noise), ty, classes)


@dataclass(frozen=True, slots=True)
class Mlp:
    """Shapes of a ``dim -> hidden (tanh) -> classes`` MLP stored as flat parameter rows."""

    dim: int
    hidden: int
    classes: int

    @property
    def size(self) -> int:
        return self.dim * self.hidden + self.hidden + self.hidden * self.classes + self.classes

    def init(self, rng: np.random.Generator) -> FloatArray:
        """One initial parameter vector (Glorot-like scale)."""
        w1 = rng.standard_normal((self.dim, self.hidden)) / np.sqrt(self.dim)
        w2 = rng.standard_normal((self.hidden, self.classes)) / np.sqrt(self.hidden)
        return np.concatenate(
            [w1.ravel(), np.zeros(self.hidden), w2.ravel(), np.zeros(self.classes)]
        )

    def _unpack(self, theta: FloatArray) -> tuple[FloatArray, ...]:
        n, d, h, c = theta.shape[0], self.dim, self.hidden, self.classes
        a = d * h
        w1 = theta[:, :a].reshape(n, d, h)
        b1 = theta[:, a : a + h]
        w2 = theta[:, a + h : a + h + h * c].reshape(n, h, c)
        b2 = theta[:, a + h + h * c :]
        return w1, b1, w2, b2

    def logits(self, theta: FloatArray, x: FloatArray) -> FloatArray:
        """(n, B, classes) logits; ``x`` is (B, dim) shared or (n, B, dim) per model."""
        w1, b1, w2, b2 = self._unpack(theta)
        hid = np.tanh(np.matmul(x, w1) + b1[:, None, :])
        return np.matmul(hid, w2) + b2[:, None, :]

    def loss_grad(
        self, theta: FloatArray, x: FloatArray, y: IntArray
    ) -> tuple[FloatArray, FloatArray]:
        """Mean cross-entropy (n,) and its gradient (n, size) for per-model batches.

        Args:
            theta: (n, size) parameters, one row per model.
            x: (n, B, dim) inputs; y: (n, B) labels.
        """
        w1, b1, w2, b2 = self._unpack(theta)
        n, batch = y.shape
        hid = np.tanh(np.matmul(x, w1) + b1[:, None, :])
        z = np.matmul(hid, w2) + b2[:, None, :]
        z = z - z.max(axis=-1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=-1, keepdims=True)
        rows = np.arange(n)[:, None], np.arange(batch)[None, :], y
        loss = -np.log(np.maximum(p[rows], 1e-12)).mean(axis=1)
        dz = p
        dz[rows] -= 1.0
        dz /= batch
        g_w2 = np.matmul(hid.transpose(0, 2, 1), dz)
        g_b2 = dz.sum(axis=1)
        dh = np.matmul(dz, w2.transpose(0, 2, 1)) * (1.0 - hid**2)
        g_w1 = np.matmul(x.transpose(0, 2, 1), dh)
        g_b1 = dh.sum(axis=1)
        grad = np.concatenate([g_w1.reshape(n, -1), g_b1, g_w2.reshape(n, -1), g_b2], axis=1)
        return loss, grad

    def evaluate(
        self, theta: FloatArray, x: FloatArray, y: IntArray
    ) -> tuple[FloatArray, FloatArray]:
        """Per-model test (accuracy, mean cross-entropy), each (n,)."""
        z = self.logits(theta, x)
        acc = (z.argmax(axis=-1) == y[None, :]).mean(axis=1)
        z = z - z.max(axis=-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
        loss = -np.take_along_axis(
            logp, np.broadcast_to(y[None, :, None], (z.shape[0], y.size, 1)), -1
        )
        return acc, loss[..., 0].mean(axis=1)
