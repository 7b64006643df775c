"""Bad input through `plfl fit`: exit 2, one paragraph naming the problem and the fix, and no run directory.

One case per kind of bad input; the loaders' own tests (test_config.py,
test_data.py) cover their messages in more detail.
"""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from plfl.cli import main
from plfl.methods import methods

from test_data import write_pfllib
from test_imagefolder import write_image_folder

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")
SIZES = "Size of samples for labels in clients"


class RunsCommand:
    """Pickles as a call to os.system: what a crafted PFLlib file would hold."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def pfllib(tmp_path: Path, change=None) -> list[str]:
    """Args for a 2-client PFLlib directory, after ``change(root)`` damaged it."""
    root = write_pfllib(tmp_path / "data", [([0, 1, 2, 1], [1, 0]), ([2, 2, 0, 1], [0, 2])])
    if change:
        change(root)
    return ["--config", QUICKSTART, "data.source=pfllib", f"data.root={root}", "data.num_clients=null"]


def agnews(tmp_path: Path, train_csv: str) -> list[str]:
    """Args for AG News files whose train.csv holds ``train_csv``."""
    root = tmp_path / "ag_news"
    root.mkdir()
    (root / "train.csv").write_text(train_csv)
    (root / "test.csv").write_text('"1","Title","Text"\n')
    return ["--config", QUICKSTART, "data.source=agnews", f"data.root={root}", "model=fasttext"]


def malformed_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("data:\n  source: digits\nfederation:\n  rounds: [1, 2\n  lr: 0.1\n")
    return ["--config", str(path)]


def relabel(root, y):
    x = np.zeros((len(y), 1, 4, 4), np.float32)
    np.savez_compressed(root / "train" / "1.npz", data={"x": x, "y": np.array(y, dtype=np.int64)})


def config_json(root, **changes):
    path = root / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def prose(tmp_path):
    path = tmp_path / "prose.txt"
    path.write_text("It was the best of times,\nit was the worst of times.\n")
    return path


CASES = {
    "malformed YAML": (
        malformed_yaml,
        "bad.yaml is not valid YAML at line 5, column 5: expected ',' or ']', but got ':'. Fix the file",
    ),
    "unknown key": (
        lambda t: ["--config", QUICKSTART, "federation.roundz=3"],
        "Unknown config key 'federation.roundz'. Did you mean 'federation.rounds'?",
    ),
    "wrong type": (
        lambda t: ["--config", QUICKSTART, "federation.rounds=many"],
        "Config key 'federation.rounds' has a value of the wrong type",
    ),
    "out of range": (
        lambda t: ["--config", QUICKSTART, "data.beta=-1"],
        "Config key 'data.beta' must be a number > 0; got -1.0.",
    ),
    "unknown method": (
        lambda t: ["--config", QUICKSTART, "method.name=fedrox"],
        f"Unknown method.name 'fedrox'. Did you mean 'fedprox'? Valid names: {', '.join(sorted(methods()))}.",
    ),
    "unknown model": (
        lambda t: ["--config", QUICKSTART, "model.name=vgg16"],
        "Config key 'model.name' must be one of cnn, fasttext, lenet5, lstm, mclr, mlp, resnet18, transformer; "
        "got 'vgg16'.",
    ),
    "unknown data set": (
        lambda t: ["--config", QUICKSTART, "data.source=imagenet"],
        "Config key 'data.source' must be one of agnews, cifar10, cifar100, digits, fashionmnist, hf, "
        "imagefolder, leaf, mnist, pfllib, shakespeare; got 'imagenet'.",
    ),
    "data root missing offline": (
        lambda t: ["--config", QUICKSTART, "data.source=mnist", f"data.root={t / 'none'}"],
        "The MNIST data set is not in {t}/none and data.download is false.",
    ),
    "config.json disagrees": (
        lambda t: pfllib(t, lambda r: config_json(r, **{SIZES: [[[0, 9]], [[0, 2]]]})),
        "Client 0 holds 2 samples of label 0 (train + test), but {t}/data/config.json says 9",
    ),
    "corrupt .npz": (
        lambda t: pfllib(t, lambda r: (r / "test" / "0.npz").write_bytes(b"PK\x03\x04 garbage")),
        "{t}/data/test/0.npz is corrupt or truncated",
    ),
    "pickle that runs code": (
        lambda t: pfllib(t, lambda r: np.savez(r / "train" / "0.npz", data={"x": RunsCommand(t / "pwned"), "y": 0})),
        "{t}/data/train/0.npz contains a pickled posix.system; plfl loads only NumPy arrays",
    ),
    "label outside num_classes": (
        lambda t: pfllib(t, lambda r: relabel(r, [0, 1, 7, 2])),
        "{t}/data/train/1.npz holds label 7, outside 0..2",
    ),
    "client without training samples": (
        lambda t: pfllib(t, lambda r: relabel(r, [])),
        "Client 1 has no training samples",
    ),
    "impossible Dirichlet minimum": (
        lambda t: ["--config", QUICKSTART, "data.num_clients=100", "data.min_samples=20"],
        "Cannot give each of 100 clients at least 20 samples: the data set has only 1797 samples",
    ),
    "image folder with a broken image": (
        lambda t: [
            "--config",
            QUICKSTART,
            "data.source=imagefolder",
            "data.num_clients=2",
            "model.name=mlp",
            f"data.root={write_image_folder(t / 'images', broken='test/b/0.png')}",
            f"data.cache_dir={t / 'cache'}",
        ],
        "Image {t}/images/test/b/0.png cannot be read",
    ),
    "AG News row with an unknown class": (
        lambda t: agnews(t, '"2","a","b"\n"7","a","b"\n'),
        "{t}/ag_news/train.csv, line 2: class '7' is not one of 1, 2, 3, 4",
    ),
    "play text without speaker headings": (
        lambda t: ["--config", QUICKSTART, "data.source=shakespeare", f"data.root={prose(t)}", "model=lstm"],
        "{t}/prose.txt has no speaker headings. data.source=shakespeare needs a play text",
    ),
    "resume a directory that is not a run": (
        lambda t: ["--resume", str(t)],
        "{t} is not a plfl run directory (it has no config.yaml)",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_refused_before_anything_is_written(case, tmp_path, capsys):
    make_args, message = CASES[case]
    out = tmp_path / "runs"
    status = main(["fit", *make_args(tmp_path), f"output_dir={out}", "progress_bar=false"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert message.replace("{t}", str(tmp_path)) in err
    assert err.startswith("plfl fit: ") and "Traceback" not in err
    assert not out.exists()  # no run directory, not even an empty one
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("method", ["pfedme", "perfedavg", "apple", "fedphp"])
@pytest.mark.parametrize(
    "option, fix",
    [
        ("federation.momentum=0.5", "set federation.momentum=0."),
        ("data.augment=true", "data.augment=true would be ignored. Set data.augment=false."),
    ],
)
def test_options_a_methods_own_training_loop_would_ignore_are_refused(method, option, fix, tmp_path, capsys):
    out = tmp_path / "runs"
    status = main(
        [
            "fit",
            "--config",
            str(ROOT / "configs" / f"{method}.yaml"),
            "data.source=digits",
            "data.root=null",
            "model.name=mlp",
            option,
            f"output_dir={out}",
            "progress_bar=false",
        ]
    )
    err = capsys.readouterr().err
    assert status == 2 and err.startswith(f"plfl fit: {method} ") and fix in err, err
    assert not out.exists()
