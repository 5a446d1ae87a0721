"""The tutorial's MNIST, without torchvision and without ever downloading anything.

``load_mnist(root)`` reads the four classic IDX files (``train-images-idx3-ubyte`` and friends,
optionally gzipped) from a local directory and applies the tutorial's transform:
``ToTensor()`` (bytes to [0, 1]) then ``Normalize((0.1307,), (0.3081,))``.

``synthetic_mnist(samples)`` is the offline default: MNIST-shaped (1x28x28 float images, ten
classes), deterministic for a seed, and *learnable* by construction: each class has a fixed
sparse "ink" template, and every sample is its class template at a random intensity plus
Gaussian noise, normalized like MNIST. With the tutorial's SGD the loss
falls clearly within three epochs of 4096 samples (after a short plateau, as on MNIST).
"""

from __future__ import annotations

import gzip
import os
import struct
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
NUM_CLASSES = 10
IMAGE_SHAPE = (1, 28, 28)
# IDX type byte -> big-endian numpy dtype (http://yann.lecun.com/exdb/mnist/, "IDX format").
IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
MNIST_FILES = {
    True: ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    False: ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
_TEMPLATE_SEED = 20240101  # the class templates never change; ``seed`` only draws samples


class IDXFormatError(ValueError):
    """A file that is not a well-formed IDX file; the message says what is wrong."""


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Read an IDX file (gzipped when the name ends in ``.gz``) into a native-endian array.

    Layout: two zero bytes, one type byte, one byte ``ndim``, then ``ndim`` big-endian
    uint32 dimensions, then the data, big-endian, row-major.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4:
        raise IDXFormatError(f"{path}: {len(raw)} bytes is too short for an IDX header")
    magic = struct.unpack(">I", raw[:4])[0]
    if raw[0] != 0 or raw[1] != 0:
        raise IDXFormatError(
            f"{path}: bad magic number 0x{magic:08x}; an IDX file starts with two zero bytes"
        )
    type_code, ndim = raw[2], raw[3]
    if type_code not in IDX_DTYPES:
        raise IDXFormatError(f"{path}: unknown IDX data type 0x{type_code:02x}")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise IDXFormatError(f"{path}: header announces {ndim} dimensions but the file ends")
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    dtype = np.dtype(IDX_DTYPES[type_code])
    count = int(np.prod(dims, dtype=np.int64))
    expected = count * dtype.itemsize
    if len(raw) - header != expected:
        raise IDXFormatError(
            f"{path}: dimensions {dims} of {dtype.name} need {expected} data bytes, "
            f"the file holds {len(raw) - header}"
        )
    data = np.frombuffer(raw, dtype=dtype, count=count, offset=header).reshape(dims)
    return data.astype(dtype.newbyteorder("="))


def _find(root: Path, name: str) -> Path:
    for candidate in (root / name, root / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"no {name} (or {name}.gz) in {root}; nothing is downloaded")


def normalize(images: torch.Tensor) -> torch.Tensor:
    """The tutorial's transform for values already in [0, 1]: Normalize((0.1307,), (0.3081,))."""
    return (images - MNIST_MEAN) / MNIST_STD


def load_mnist(root: str | os.PathLike[str], train: bool = True) -> TensorDataset:
    """MNIST from the IDX files in ``root``: (image 1x28x28 float32, label int64) pairs."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"MNIST directory {root} does not exist")
    images_path, labels_path = (_find(root, name) for name in MNIST_FILES[train])
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.dtype != np.uint8 or images.ndim != 3 or images.shape[1:] != (28, 28):
        raise IDXFormatError(
            f"{images_path}: expected uint8 images of shape (N, 28, 28), "
            f"got {images.dtype} {images.shape}"
        )
    if labels.dtype != np.uint8 or labels.ndim != 1 or len(labels) != len(images):
        raise IDXFormatError(
            f"{labels_path}: expected {len(images)} uint8 labels, got {labels.dtype} {labels.shape}"
        )
    if len(labels) and labels.max() >= NUM_CLASSES:
        raise IDXFormatError(f"{labels_path}: label {labels.max()} is not a digit 0-9")
    x = torch.from_numpy(images).float().div_(255.0).unsqueeze(1)  # ToTensor()
    return TensorDataset(normalize(x), torch.from_numpy(labels).long())


def class_templates() -> torch.Tensor:
    """Ten fixed sparse 28x28 "ink" patterns in {0, 1}, one a class (about 20% ink, like MNIST)."""
    g = torch.Generator().manual_seed(_TEMPLATE_SEED)
    # Blocky 7x7 patterns scaled up 4x: strokes a few pixels wide, which convolutions can see.
    coarse = (torch.rand(NUM_CLASSES, 1, 7, 7, generator=g) < 0.2).float()
    return torch.nn.functional.interpolate(coarse, scale_factor=4, mode="nearest")


def synthetic_mnist(samples: int = 4096, seed: int = 0, noise: float = 0.3) -> TensorDataset:
    """A deterministic, learnable MNIST stand-in of ``samples`` examples (balanced classes)."""
    if samples < 1:
        raise ValueError(f"samples must be at least 1, got {samples}")
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(samples) % NUM_CLASSES
    labels = labels[torch.randperm(samples, generator=g)]
    intensity = 0.6 + 0.4 * torch.rand(samples, 1, 1, 1, generator=g)
    x = class_templates()[labels] * intensity
    x = (x + noise * torch.randn(samples, *IMAGE_SHAPE, generator=g)).clamp_(0.0, 1.0)
    return TensorDataset(normalize(x), labels)


def get_dataset(
    data_path: str | os.PathLike[str] | None = None, samples: int | None = None, seed: int = 0
) -> TensorDataset:
    """MNIST from ``data_path`` (its first ``samples`` images) or synthetic data if no path."""
    if data_path is None:
        return synthetic_mnist(4096 if samples is None else samples, seed)
    dataset = load_mnist(data_path)
    if samples is not None:
        dataset = TensorDataset(*(t[:samples] for t in dataset.tensors))
    return dataset
