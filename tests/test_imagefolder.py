"""The image-folder reader (plfl/data/imagefolder.py), its cache, and data.augment."""

from __future__ import annotations

import csv
import os
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

import plfl.data.imagefolder as imagefolder
from plfl.config import DataConfig, load_config, validate
from plfl.data import load_federated_data
from plfl.data.augment import random_crop_flip
from plfl.data.imagefolder import load_image_folder
from plfl.errors import ConfigError, DataError, PlflWarning
from plfl.experiment import run_experiment

from conftest import SHARED_DATA, reads_shared_data

CIFAR10_JPEG = SHARED_DATA / "cifar10-jpeg"
# Per-file pixels of the folders write_image_folder makes: {relative path: uint8 (H, W, 3) or (H, W)}.
Pixels = dict[str, np.ndarray]


def write_image_folder(root: Path, counts=None, size=(5, 4), broken=None, seed=0) -> Path:
    """PNG images under ``root/{train,test}/<class>/``; ``counts``: {split: {class: n}} (default 3 train,
    2 test per class a, b); ``broken``: a relative path that gets bytes no image format has."""
    counts = counts or {"train": {"a": 3, "b": 3}, "test": {"a": 2, "b": 2}}
    rng = np.random.default_rng(seed)
    for split, classes in counts.items():
        for name, n in classes.items():
            (root / split / name).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / name / f"{i}.png")
    if broken:
        (root / broken).write_bytes(b"not an image")
    return root


def pixels_of(root: Path) -> Pixels:
    return {str(p.relative_to(root)): np.asarray(Image.open(p)) for p in sorted(root.rglob("*.png"))}


def expected(root: Path, pixels: Pixels) -> torch.Tensor:
    """The reader's output computed here from the files' pixels, train then test, classes and names sorted."""
    order = sorted(pixels, key=lambda rel: (rel.split("/")[0] != "train", rel))
    stacked = np.stack([pixels[rel] for rel in order]).astype(np.float64) / 255  # (n, H, W, C)
    mean, std = stacked.mean(axis=(0, 1, 2)), stacked.std(axis=(0, 1, 2))
    return torch.from_numpy(((stacked - mean) / std).astype(np.float32)).permute(0, 3, 1, 2)


def test_pooled_images_are_normalised_per_channel_with_sorted_class_labels(tmp_path):
    root = write_image_folder(tmp_path / "data")
    x, y, num_classes = load_image_folder(str(root), str(tmp_path / "cache"))
    assert x.dtype == torch.float32 and x.shape == (10, 3, 4, 5) and x.is_contiguous()
    assert num_classes == 2 and y.tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]  # train a, b; then test a, b
    torch.testing.assert_close(x, expected(root, pixels_of(root)))


def test_grey_images_give_one_channel_and_become_rgb_beside_colour_ones(tmp_path):
    root = write_image_folder(tmp_path / "data")
    for path in root.rglob("*.png"):
        Image.open(path).convert("L").save(path)
    x, _, _ = load_image_folder(str(root), str(tmp_path / "cache"))
    assert x.shape == (10, 1, 4, 5)
    torch.testing.assert_close(x, expected(root, {k: v[..., None] for k, v in pixels_of(root).items()}))

    colour = root / "test" / "b" / "1.png"
    Image.fromarray(np.full((4, 5, 3), [10, 200, 30], np.uint8)).save(colour)
    x, _, _ = load_image_folder(str(root), str(tmp_path / "cache"))
    pixels = {k: np.repeat(v[..., None], 3, axis=2) if v.ndim == 2 else v for k, v in pixels_of(root).items()}
    assert x.shape == (10, 3, 4, 5)
    torch.testing.assert_close(x, expected(root, pixels))


def test_second_load_reads_the_cache_without_decoding(tmp_path, monkeypatch):
    root = write_image_folder(tmp_path / "data")
    first = load_image_folder(str(root), str(tmp_path / "cache"))
    assert len(list((tmp_path / "cache").iterdir())) == 1  # the cache file, no temporary left over

    def no_decoding(*args, **kwargs):
        raise AssertionError("decoded an image although the cache holds it")

    monkeypatch.setattr(imagefolder.Image, "open", no_decoding)
    second = load_image_folder(str(root), str(tmp_path / "cache"))
    for a, b in zip(first, second):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))


def test_changed_image_builds_a_new_cache(tmp_path):
    root = write_image_folder(tmp_path / "data")
    cache = tmp_path / "cache"
    load_image_folder(str(root), str(cache))
    path = root / "train" / "b" / "0.png"
    Image.fromarray(np.zeros((4, 5, 3), np.uint8)).save(path)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a coarse clock must not hide the change
    x, _, _ = load_image_folder(str(root), str(cache))
    torch.testing.assert_close(x, expected(root, pixels_of(root)))
    assert len(list(cache.iterdir())) == 2


def test_a_failed_cache_write_leaves_no_file_and_warns(tmp_path, monkeypatch):
    root = write_image_folder(tmp_path / "data")

    def disk_full(obj, f):
        f.write(b"half a cache")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(imagefolder.torch, "save", disk_full)
    with pytest.warns(PlflWarning, match="Could not write the image cache .* No space left on device"):
        x, _, _ = load_image_folder(str(root), str(tmp_path / "cache"))
    assert len(x) == 10 and list((tmp_path / "cache").iterdir()) == []


def test_a_damaged_cache_file_is_rebuilt(tmp_path):
    root = write_image_folder(tmp_path / "data")
    load_image_folder(str(root), str(tmp_path / "cache"))
    [cache_file] = (tmp_path / "cache").iterdir()
    cache_file.write_bytes(cache_file.read_bytes()[:100])
    with pytest.warns(PlflWarning, match="cannot be read .* decoding the images again"):
        x, _, _ = load_image_folder(str(root), str(tmp_path / "cache"))
    torch.testing.assert_close(x, expected(root, pixels_of(root)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlflWarning)  # rewritten: read without a warning
        load_image_folder(str(root), str(tmp_path / "cache"))


def test_default_cache_dir_follows_xdg_cache_home(tmp_path, monkeypatch):
    root = write_image_folder(tmp_path / "data")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    load_image_folder(str(root))
    assert len(list((tmp_path / "xdg" / "plfl").glob("imagefolder-*.pt"))) == 1


def _mixed_sizes(root: Path) -> None:
    Image.fromarray(np.zeros((6, 5, 3), np.uint8)).save(root / "test" / "a" / "1.png")


MALFORMED = {
    "missing folder": (
        lambda r: shutil.rmtree(r / "test"),
        "{r}/test does not exist. An image folder data set holds train/<class>/<image> and test/<class>/<image>",
    ),
    "empty class folder": (
        lambda r: [p.unlink() for p in (r / "train" / "b").iterdir()],
        "Class folder {r}/train/b holds no image. Add its images or remove the class",
    ),
    "unreadable image": (
        lambda r: (r / "train" / "a" / "1.png").write_bytes(b"GIF89a garbage"),
        "Image {r}/train/a/1.png cannot be read (UnidentifiedImageError",
    ),
    "mismatched class folders": (
        lambda r: (r / "test" / "b").rename(r / "test" / "c"),
        "{r}/train and {r}/test hold different class folders (only in train: ['b']; "
        "only in test: ['c']). Both splits need the same class folders",
    ),
    "mixed image sizes": (
        _mixed_sizes,
        "Image {r}/test/a/1.png is 5×6 pixels but image {r}/train/a/0.png is 5×4. "
        "All images of a data set must have one size",
    ),
    "no class folder": (
        lambda r: [shutil.rmtree(r / s / c) for s in ("train", "test") for c in "ab"],
        "{r}/train holds no class folder.",
    ),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_folders_are_refused_with_the_file_named(case, tmp_path):
    root = write_image_folder(tmp_path / "data")
    damage, message = MALFORMED[case]
    damage(root)
    with pytest.raises(DataError) as e:
        load_image_folder(str(root), str(tmp_path / "cache"))
    assert message.replace("{r}", str(root)) in str(e.value)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_missing_root_and_cache_inside_the_data_are_refused(tmp_path):
    with pytest.raises(DataError, match="data.source=imagefolder needs data.root"):
        load_image_folder(None)
    with pytest.raises(DataError, match=f"Image folder {tmp_path / 'none'} does not exist"):
        load_image_folder(str(tmp_path / "none"))
    root = write_image_folder(tmp_path / "data")
    with pytest.raises(DataError, match="lies inside data.root=.* the cache must not be written into the data"):
        load_image_folder(str(root), str(root / "cache"))


def test_cache_dir_with_another_source_is_refused():
    with pytest.raises(ConfigError, match="data.cache_dir=.* is read only by data.source=imagefolder"):
        validate(OmegaConf.create({"data": {"source": "digits", "cache_dir": "/tmp/x"}}))


def test_partitioned_over_clients_with_75_25_splits(tmp_path):
    counts = {split: {c: n for c in "abcd"} for split, n in (("train", 12), ("test", 4))}
    root = write_image_folder(tmp_path / "data", counts)
    cfg = DataConfig(
        source="imagefolder", root=str(root), cache_dir=str(tmp_path / "cache"), num_clients=4, partition="iid"
    )
    data = load_federated_data(cfg, seed=0)
    assert data.num_classes == 4 and data.input_shape == (3, 4, 5) and len(data.clients) == 4
    assert [(c.num_train, c.num_test) for c in data.clients] == [(12, 4)] * 4
    assert torch.equal(load_federated_data(cfg, seed=0).clients[1].x_train, data.clients[1].x_train)


def test_random_crop_flip_moves_each_image_by_its_own_offset_and_flip():
    x = torch.arange(6 * 2 * 5 * 7, dtype=torch.float32).view(6, 2, 5, 7) + 1  # no zero: padding is visible
    out = random_crop_flip(x, torch.Generator().manual_seed(3), padding=2)
    assert out.shape == x.shape
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    found = set()
    for i in range(6):
        crops = {
            (dy, dx, flip): padded[i, :, dy : dy + 5, dx : dx + 7].flip(-1)
            if flip
            else padded[i, :, dy : dy + 5, dx : dx + 7]
            for dy in range(5)
            for dx in range(5)
            for flip in (False, True)
        }
        [match] = [key for key, crop in crops.items() if torch.equal(crop, out[i])]
        found.add(match)
    assert len(found) > 1  # per sample, not one draw for the whole batch
    assert torch.equal(out, random_crop_flip(x, torch.Generator().manual_seed(3), padding=2))
    assert not torch.equal(out, random_crop_flip(x, torch.Generator().manual_seed(4), padding=2))


def test_augment_is_reproducible_per_seed_and_changes_training(digits_config):
    def accuracies(**overrides):
        run_dir, _ = run_experiment(digits_config(**{"federation.rounds": 2, **overrides}))
        with open(run_dir / "metrics.csv") as f:
            return [row["accuracy"] for row in csv.DictReader(f)]

    augmented = accuracies(**{"data.augment": True})
    assert augmented == accuracies(**{"data.augment": True})
    plain = accuracies()
    assert augmented[0] == plain[0]  # round 0 evaluates the initial model: evaluation never augments
    assert augmented[1:] != plain[1:]


def test_augment_on_inputs_that_are_not_images_is_refused(digits_config, monkeypatch):
    cfg = digits_config(**{"data.augment": True})
    real = load_federated_data

    def flattened(cfg, seed):
        data = real(cfg, seed)
        data.input_shape = (64,)
        return data

    monkeypatch.setattr("plfl.experiment.load_federated_data", flattened)
    with pytest.raises(
        ConfigError,
        match=r"data.augment=true crops and flips images \(C, H, W\), but data.source="
        r"digits gives inputs of shape \(64,\)",
    ):
        run_experiment(cfg)


@reads_shared_data(CIFAR10_JPEG)
def test_real_cifar10_jpegs(tmp_path):
    """60 train and 10 test JPEGs per class of ../shared/data/cifar10-jpeg, linked into tmp_path."""
    root = tmp_path / "cifar"
    for split, n in (("train", 60), ("test", 10)):
        for folder in sorted((CIFAR10_JPEG / split).iterdir()):
            (root / split / folder.name).mkdir(parents=True)
            for path in sorted(folder.iterdir())[:n]:
                (root / split / folder.name / path.name).symlink_to(path)
    x, y, num_classes = load_image_folder(str(root), str(tmp_path / "cache"))
    assert num_classes == 10 and x.shape == (700, 3, 32, 32)
    assert torch.equal(y[:600], torch.arange(10).repeat_interleave(60))  # airplane 0, ..., truck 9
    [cache_file] = (tmp_path / "cache").iterdir()
    cached = torch.load(cache_file, weights_only=True)
    assert cached["classes"][:3] == ["airplane", "automobile", "bird"]
    # CIFAR-10's per-channel means over its 50,000 training images: 0.491, 0.482, 0.447.
    mean = cached["images"].double().mean(dim=(0, 2, 3)) / 255
    torch.testing.assert_close(mean, torch.tensor([0.491, 0.482, 0.447], dtype=torch.float64), atol=0.03, rtol=0)
    cfg = load_config(
        Path(__file__).resolve().parents[1] / "configs" / "fedala-cifar10.yaml",
        [f"data.root={root}", f"data.cache_dir={tmp_path / 'cache'}", "data.num_clients=5"],
    )
    data = load_federated_data(OmegaConf.to_object(cfg.data), seed=0)
    assert sum(c.num_train + c.num_test for c in data.clients) == 700
