"""data.source=hf (Hugging Face datasets, plfl/data/hf.py) and data.partition=flwr (Flower Datasets' partitioners),
on local data sets built here from the shared real data: CIFAR-10 JPEGs, FedALA's MNIST, AG News rows."""

from __future__ import annotations

import csv
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from plfl.config import validate
from plfl.data import load_federated_data
from plfl.data.imagefolder import load_image_folder
from plfl.data.partition import Flower
from plfl.data.pfllib import load_pfllib
from plfl.data.sources import HuggingFace
from plfl.errors import ConfigError, DataError
from plfl.experiment import run_experiment

from conftest import FEDALA_MNIST, SHARED_DATA, last_metrics

datasets = pytest.importorskip("datasets", reason="the hf extra is not installed (pip install -e '.[hf]')")
flwr_partitioner = pytest.importorskip("flwr_datasets.partitioner", reason="the hf extra is not installed")

CIFAR10_JPEG = SHARED_DATA / "cifar10-jpeg"
AG_NEWS = SHARED_DATA / "ag_news"
needs_ag_news = pytest.mark.skipif(not AG_NEWS.exists(), reason=f"shared data not found at {AG_NEWS}")
MNIST_TRAIN, MNIST_TEST = 300, 100  # samples of FedALA's MNIST pool written as the data set's two splits


@pytest.fixture(autouse=True)
def offline_cache(tmp_path, monkeypatch):
    """The datasets cache in tmp_path, and the hub unreachable at once (HF_HUB_OFFLINE), as on this machine."""
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def cifar_folder(tmp_path_factory) -> Path:
    """250 CIFAR-10 JPEGs in the image-folder layout: 20 train and 5 test images of each of the 10 classes."""
    if not CIFAR10_JPEG.is_dir():
        pytest.skip(f"shared data not found at {CIFAR10_JPEG}")
    root = tmp_path_factory.mktemp("cifar")
    for split, n in (("train", 20), ("test", 5)):
        for folder in sorted((CIFAR10_JPEG / split).iterdir()):
            (root / split / folder.name).mkdir(parents=True)
            for image in sorted(folder.glob("*.jpg"))[:n]:
                shutil.copy(image, root / split / folder.name / image.name)
    return root


@pytest.fixture(scope="module")
def mnist(tmp_path_factory) -> tuple[Path, Path, np.ndarray, np.ndarray]:
    """A sample of FedALA's MNIST (read by plfl's PFLlib loader) as a DatasetDict (train, test) of grey PNG images,
    ClassLabel labels and a writer_id column, written with save_to_disk and as parquet files: (the save_to_disk
    directory, the parquet directory, uint8 pixels (n, 28, 28) and labels (n,), train then test)."""
    if not FEDALA_MNIST.is_dir():
        pytest.skip(f"shared data not found at {FEDALA_MNIST}")
    data = load_pfllib(str(FEDALA_MNIST), None)
    rng = np.random.default_rng(0)
    pixels, labels = [], []
    for split, n in (("train", MNIST_TRAIN), ("test", MNIST_TEST)):
        x = torch.cat([getattr(c, f"x_{split}") for c in data.clients])
        y = torch.cat([getattr(c, f"y_{split}") for c in data.clients])
        pick = np.sort(rng.choice(len(y), n, replace=False))
        # PFLlib stores (v / 255 - 0.5) / 0.5: back to the digits' bytes, exactly
        pixels.append(((x[pick, 0].numpy() + 1) * 127.5).round().astype(np.uint8))
        labels.append(y[pick].numpy())
    features = datasets.Features(
        {
            "image": datasets.Image(),
            "label": datasets.ClassLabel(names=[str(d) for d in range(10)]),
            "writer_id": datasets.Value("string"),
        }
    )
    splits = {}
    start = 0
    for name, px, y in zip(("train", "test"), pixels, labels):
        writers = [f"w{(start + i) % 7}" for i in range(len(y))]  # 7 writers over both splits
        splits[name] = datasets.Dataset.from_dict(
            {"image": list(px), "label": y.tolist(), "writer_id": writers}, features=features
        )
        start += len(y)
    saved = tmp_path_factory.mktemp("mnist-saved")
    parquet = tmp_path_factory.mktemp("mnist-parquet")
    dataset = datasets.DatasetDict(splits)
    dataset.save_to_disk(str(saved))
    for name, split in dataset.items():
        split.to_parquet(str(parquet / f"{name}.parquet"))
    return saved, parquet, np.concatenate(pixels), np.concatenate(labels)


def run_config(tmp_path, **data):
    """A validated config with these ``data`` keys (an MLP, 1 round), output in tmp_path."""
    base = {
        "output_dir": str(tmp_path / "runs"),
        "progress_bar": False,
        "data": data,
        "model": {"name": "mlp", "hidden_sizes": [16]},
        "federation": {"rounds": 1, "lr": 0.05, "batch_size": 20},
    }
    return validate(OmegaConf.create(base))


def hf_config(tmp_path, **data):
    return run_config(tmp_path, source="hf", **data)


def normalised(pixels: np.ndarray) -> torch.Tensor:
    """(u / 255 - mean) / std per channel over all images, computed here in float64: ``(n, H, W[, C])`` uint8 →
    float32 ``(n, C, H, W)``."""
    u = pixels.astype(np.float64)[..., None] / 255 if pixels.ndim == 3 else pixels.astype(np.float64) / 255
    mean, std = u.mean(axis=(0, 1, 2)), u.std(axis=(0, 1, 2))
    return torch.from_numpy(((u - mean) / std).astype(np.float32)).permute(0, 3, 1, 2)


# ---------------------------------------------------------------- the source


def test_image_folder_read_by_hf_equals_the_imagefolder_source(cifar_folder, tmp_path):
    x, y, num_classes, _ = HuggingFace(source="hf", path=str(cifar_folder)).read()
    expected_x, expected_y, expected_classes = load_image_folder(str(cifar_folder), str(tmp_path / "cache"))
    assert x.shape == (250, 3, 32, 32) and x.dtype == torch.float32 and num_classes == expected_classes == 10
    assert torch.equal(y, expected_y) and y[:20].eq(0).all() and y[200:205].eq(0).all()  # train, then test
    assert torch.equal(x, expected_x)
    torch.testing.assert_close(x.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-5, rtol=0)
    torch.testing.assert_close(x.std(dim=(0, 2, 3), unbiased=False), torch.ones(3), atol=1e-5, rtol=0)


@pytest.mark.parametrize("form", ["save_to_disk", "parquet"])
def test_mnist_splits_pool_train_then_test_as_one_grey_channel(mnist, form):
    saved, parquet, pixels, labels = mnist
    x, y, num_classes, columns = HuggingFace(source="hf", path=str(saved if form == "save_to_disk" else parquet)).read()
    assert x.shape == (MNIST_TRAIN + MNIST_TEST, 1, 28, 28) and num_classes == 10
    assert y.dtype == torch.int64 and y.tolist() == labels.tolist()
    torch.testing.assert_close(x, normalised(pixels))
    assert list(columns) == ["writer_id"] and columns["writer_id"][:8].tolist() == [f"w{i % 7}" for i in range(8)]


def test_named_splits_are_pooled_in_their_order(mnist):
    saved, _, pixels, labels = mnist
    x, y, _, _ = HuggingFace(source="hf", path=str(saved), splits=["test", "train"]).read()
    assert y.tolist() == [*labels[MNIST_TRAIN:], *labels[:MNIST_TRAIN]]
    _, y_test, _, _ = HuggingFace(source="hf", path=str(saved), splits=["test"]).read()
    assert y_test.tolist() == labels[MNIST_TRAIN:].tolist()


def test_string_labels_are_numbered_in_sorted_order(tmp_path):
    path = tmp_path / "animals.csv"
    path.write_text("text,animal\na cat,cat\nthe dog,dog\nan ant,ant\nno cat,cat\n")
    x, y, num_classes, _ = HuggingFace(source="hf", path=str(path), text_column="text", label_column="animal").read()
    assert y.tolist() == [1, 2, 0, 1] and num_classes == 3 and x.tolist() == ["a cat", "the dog", "an ant", "no cat"]


def agnews_rows(n: int) -> list[list[str]]:
    with open(AG_NEWS / "test.csv", newline="", encoding="utf-8") as f:
        return [row for row, _ in zip(csv.reader(f), range(n))]


@needs_ag_news
def test_csv_texts_give_the_agnews_sources_clients(tmp_path):
    """The same AG News rows as agnews CSV files and as hf csv files (text, label): the same clients, token ids and
    vocabulary, learnt on the clients' training texts only."""
    rows = agnews_rows(240)
    for name, part in (("train", rows[:180]), ("test", rows[180:])):
        (tmp_path / "ag").mkdir(exist_ok=True)
        with open(tmp_path / "ag" / f"{name}.csv", "w", newline="", encoding="utf-8") as f:
            csv.writer(f, quoting=csv.QUOTE_ALL).writerows(part)
        (tmp_path / "hf").mkdir(exist_ok=True)
        with open(tmp_path / "hf" / f"{name}.csv", "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(["text", "label"])
            writer.writerows([[f"{title} {description}", int(label) - 1] for label, title, description in part])
    keys = {"num_clients": 3, "partition": "iid", "max_length": 12, "vocab_size": 300}
    agnews = load_federated_data(run_config(tmp_path, source="agnews", root=str(tmp_path / "ag"), **keys).data, 3)
    hf = load_federated_data(hf_config(tmp_path, path=str(tmp_path / "hf"), text_column="text", **keys).data, 3)
    assert hf.vocab_size == agnews.vocab_size and hf.num_classes == agnews.num_classes == 4
    for ours, theirs in zip(hf.clients, agnews.clients, strict=True):
        for key in ("x_train", "y_train", "x_test", "y_test"):
            assert torch.equal(getattr(ours, key), getattr(theirs, key))


# ---------------------------------------------------------------- Flower partitioners


@pytest.mark.parametrize(
    "name, args",
    [
        ("DirichletPartitioner", {"alpha": 0.5, "min_partition_size": 5, "seed": 5}),
        ("PathologicalPartitioner", {"num_classes_per_partition": 2, "seed": 5}),
        ("ShardPartitioner", {"num_shards_per_partition": 2, "seed": 5}),
        ("IidPartitioner", {}),
    ],
)
def test_flower_partitioners_give_flower_datasets_own_partitions(mnist, name, args):
    """plfl's partition = Flower Datasets run directly on the same rows: label and a position column, shuffled with
    the seed plfl draws first from its generator; the partitioner's own seed given."""
    labels, num_clients, seed = mnist[3], 6, 11
    ours = Flower(partition="flwr", partitioner=name, partitioner_args=args).split(
        labels, num_clients, np.random.default_rng(seed)
    )
    rows = datasets.Dataset.from_dict({"label": labels, "position": np.arange(len(labels))})
    shuffle_seed = int(np.random.default_rng(seed).integers(2**32))
    by = {} if name == "IidPartitioner" else {"partition_by": "label"}
    partitioner = getattr(flwr_partitioner, name)(num_partitions=num_clients, **by, **args)
    partitioner.dataset = rows.shuffle(seed=shuffle_seed)
    theirs = [sorted(partitioner.load_partition(i)["position"]) for i in range(num_clients)]
    assert [sorted(part.tolist()) for part in ours] == theirs
    assert all(part.dtype == np.int64 for part in ours)
    every = np.concatenate(ours)
    assert len(np.unique(every)) == len(every)  # disjoint
    if name in ("DirichletPartitioner", "IidPartitioner"):
        assert sorted(every.tolist()) == list(range(len(labels)))


def test_pathological_clients_hold_two_classes_and_iid_clients_mix_the_splits(mnist):
    labels = mnist[3]
    args = {"num_classes_per_partition": 2, "class_assignment_mode": "first-deterministic"}
    pathological = Flower(partition="flwr", partitioner="PathologicalPartitioner", partitioner_args=args)
    parts = pathological.split(labels, 5, np.random.default_rng(0))
    assert [len(np.unique(labels[p])) for p in parts] == [2] * 5
    # The pool is in split order; unshuffled, IidPartitioner's contiguous shards would split train from test.
    iid = Flower(partition="flwr", partitioner="IidPartitioner").split(labels, 4, np.random.default_rng(0))
    assert all(len(np.unique(labels[p])) == 10 for p in iid)
    assert all((p >= MNIST_TRAIN).any() and (p < MNIST_TRAIN).any() for p in iid)


def test_the_partitioners_seed_comes_from_the_run_unless_given(mnist):
    labels = mnist[3]

    def split(run_seed, **args):
        flower = Flower(partition="flwr", partitioner="DirichletPartitioner", partitioner_args={"alpha": 0.3, **args})
        return [p.tolist() for p in flower.split(labels, 4, np.random.default_rng(run_seed))]

    assert split(1) == split(1) and split(1) != split(2)
    assert sorted(map(sorted, split(1, seed=9))) != sorted(map(sorted, split(1)))


def test_natural_ids_give_one_client_per_writer(mnist, tmp_path):
    saved, _, _, labels = mnist
    writers = np.array([f"w{i % 7}" for i in range(len(labels))])
    cfg = hf_config(
        tmp_path,
        path=str(saved),
        partition="flwr",
        partitioner="NaturalIdPartitioner",
        partitioner_args={"partition_by": "writer_id"},
    )
    data = load_federated_data(cfg.data, 0)
    assert len(data.clients) == 7  # data.num_clients unset: the writers' count
    for client, writer in zip(data.clients, sorted(set(writers))):  # NaturalIdPartitioner numbers ids sorted
        mine = labels[writers == writer]
        assert client.num_train + client.num_test == len(mine)
        assert sorted(torch.cat([client.y_train, client.y_test]).tolist()) == sorted(mine.tolist())
    with pytest.raises(DataError, match=r"NaturalIdPartitioner makes 7 partitions but data.num_clients=5"):
        keys = ("path", "partition", "partitioner", "partitioner_args")
        load_federated_data(hf_config(tmp_path, num_clients=5, **{k: cfg.data[k] for k in keys}).data, 0)


def test_flower_partition_through_the_run_keeps_flowers_clients(mnist, tmp_path):
    saved, _, _, labels = mnist
    args = {"alpha": 0.5, "min_partition_size": 5, "seed": 3}
    cfg = hf_config(
        tmp_path,
        path=str(saved),
        num_clients=4,
        partition="flwr",
        partitioner="DirichletPartitioner",
        partitioner_args=args,
    )
    data = load_federated_data(cfg.data, 8)
    parts = Flower(partition="flwr", partitioner="DirichletPartitioner", partitioner_args=args).split(
        labels, 4, np.random.default_rng(8)
    )
    for client, part in zip(data.clients, parts, strict=True):
        assert sorted(torch.cat([client.y_train, client.y_test]).tolist()) == sorted(labels[part].tolist())
        assert client.num_test == int(np.ceil(0.25 * len(part)))  # plfl's own train/test split


def test_a_run_trains_on_an_hf_source_with_a_flower_partition(mnist, tmp_path):
    cfg = hf_config(
        tmp_path,
        path=str(mnist[1]),
        num_clients=3,
        partition="flwr",
        partitioner="PathologicalPartitioner",
        partitioner_args={"num_classes_per_partition": 4},
    )
    run_dir = run_experiment(cfg)[0]
    assert last_metrics(run_dir)["round"] == "1"
    with open(run_dir / "clients.csv") as f:
        evaluated = {row["client"]: int(row["num_test"]) for row in csv.DictReader(f) if row["round"] == "1"}
    data = load_federated_data(cfg.data, cfg.federation.seed)
    assert evaluated == {str(i): client.num_test for i, client in enumerate(data.clients)}
    assert all(len(torch.cat([c.y_train, c.y_test]).unique()) <= 4 for c in data.clients)


# ---------------------------------------------------------------- errors and config


def test_missing_column_lists_the_columns(mnist):
    columns = r"its columns: image \(Image\), label \(ClassLabel, 10 classes\), writer_id \(string\)"
    with pytest.raises(DataError, match=r"no column 'character' \(data.label_column\); " + columns):
        HuggingFace(source="hf", path=str(mnist[0]), label_column="character").read()
    with pytest.raises(DataError, match=r"Column 'writer_id' .* holds writer_id \(string\), not images"):
        HuggingFace(source="hf", path=str(mnist[0]), image_column="writer_id").read()
    with pytest.raises(DataError, match=r"has no split 'valid'; its splits: train, test"):
        HuggingFace(source="hf", path=str(mnist[0]), splits=["valid"]).read()


def test_missing_local_path_and_unreachable_hub_say_what_to_do(tmp_path):
    with pytest.raises(DataError, match=r"no such file or directory .* Point data.path at a local copy"):
        HuggingFace(source="hf", path=str(tmp_path / "nowhere")).read()
    hub = r"neither a local data set .* nor loadable from the Hugging Face Hub .* Offline use needs a local path"
    with pytest.raises(DataError, match=hub):
        HuggingFace(source="hf", path="flwrlabs/femnist").read()


def test_unreadable_files_are_named(tmp_path, cifar_folder):
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 not parquet")
    with pytest.raises(DataError, match=r"Could not read the data set at .*broken.parquet"):
        HuggingFace(source="hf", path=str(broken)).read()
    with pytest.raises(DataError, match=r"a file plfl cannot read as a data set"):
        HuggingFace(source="hf", path=str(cifar_folder / "train" / "cat" / "0000.jpg")).read()
    folder = tmp_path / "images"
    shutil.copytree(cifar_folder, folder)
    (folder / "test" / "dog" / "0000.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    with pytest.raises(DataError, match=r"Image 25 of split test .*test/dog/0000.jpg\) cannot be read"):
        HuggingFace(source="hf", path=str(folder)).read()


def test_without_the_hf_extra_both_say_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets raises ImportError
    monkeypatch.setitem(sys.modules, "flwr_datasets", None)
    with pytest.raises(DataError, match=r"datasets, which is not installed.* pip install -e '\.\[hf\]'"):
        HuggingFace(source="hf", path=str(tmp_path)).read()
    with pytest.raises(ConfigError, match=r"flwr-datasets is not installed.* pip install -e '\.\[hf\]'"):
        Flower(partition="flwr", partitioner="IidPartitioner").split(np.zeros(8, np.int64), 2, np.random.default_rng(0))


def test_unknown_partitioner_and_bad_keywords_list_what_there_is(mnist):
    labels, rng = mnist[3], np.random.default_rng(0)

    def split(name, **args):
        return Flower(partition="flwr", partitioner=name, partitioner_args=args).split(labels, 4, rng)

    listed = r"one of: ContinuousPartitioner, DirichletPartitioner, .*NaturalIdPartitioner, PathologicalPartitioner"
    with pytest.raises(ConfigError, match=r"data.partitioner=Dirichlet is not .* " + listed):
        split("Dirichlet")
    keywords = r"Its keyword arguments: num_partitions \(data.num_clients\), partition_by, alpha"
    with pytest.raises(
        ConfigError, match=r"do not fit DirichletPartitioner \(it takes no keyword 'beta'\)\. " + keywords
    ):
        split("DirichletPartitioner", beta=0.1)
    with pytest.raises(ConfigError, match=r"partition_by=writer_id names no column of the pool: it has label"):
        split("NaturalIdPartitioner", partition_by="writer_id")
    with pytest.raises(DataError, match=r"PathologicalPartitioner could not partition the 400 samples"):
        split("PathologicalPartitioner", num_classes_per_partition=11)


def test_config_refuses_what_the_run_would_not_read(tmp_path):
    with pytest.raises(ConfigError, match=r"data.partitioner=IidPartitioner is read only by data.partition=flwr"):
        hf_config(tmp_path, path="x", partitioner="IidPartitioner")
    with pytest.raises(ConfigError, match=r"data.partitioner_args=\{alpha: 1\} is read only by data.partition=flwr"):
        hf_config(tmp_path, path="x", partitioner_args={"alpha": 1})
    with pytest.raises(ConfigError, match=r"data.partition=flwr needs data.partitioner"):
        hf_config(tmp_path, path="x", partition="flwr")
    with pytest.raises(ConfigError, match=r"without num_partitions \(data.num_clients gives it\)"):
        hf_config(
            tmp_path, path="x", partition="flwr", partitioner="IidPartitioner", partitioner_args={"num_partitions": 3}
        )
    with pytest.raises(ConfigError, match=r"data.image_column=img and data.text_column=text are both set"):
        hf_config(tmp_path, path="x", image_column="img", text_column="text")
    with pytest.raises(ConfigError, match=r"data.vocab_size=100 has no effect on images"):
        hf_config(tmp_path, path="x", vocab_size=100)
    with pytest.raises(ConfigError, match=r"data.source=hf needs data.path"):
        hf_config(tmp_path)
    with pytest.raises(ConfigError, match=r"data.image_column=img is read only by data.source=hf"):
        validate(OmegaConf.create({"data": {"source": "digits", "image_column": "img"}}))


def test_a_local_path_is_made_absolute_and_a_hub_id_is_kept(tmp_path, monkeypatch):
    (tmp_path / "copy").mkdir()
    monkeypatch.chdir(tmp_path)
    assert hf_config(tmp_path, path="copy").data.path == str(tmp_path / "copy")  # a resumed run reads the same files
    assert hf_config(tmp_path, path="uoft-cs/cifar100").data.path == "uoft-cs/cifar100"
