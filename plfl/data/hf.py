"""A Hugging Face ``datasets`` data set (``data.source: hf``): by hub id, or offline from a local copy.

``data.path`` is either a local path or a hub id. A local path is read without the network: a directory
written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``; a parquet, csv, json or arrow file; or
a directory of such files or of images in class folders (``<split>/<class>/<image>``), which
``datasets.load_dataset`` reads with its packaged builders (``parquet``, ``csv``, ``imagefolder``, ...), taking
the splits from the file and folder names and caching them as arrow files under ``HF_HOME``. Anything else is a
hub id (``uoft-cs/cifar10``, ``data.subset`` its config name): ``load_dataset`` downloads it, or with
``HF_HUB_OFFLINE=1`` reads what an earlier download left in the hub cache.

The splits ``data.splits`` names (default all, in the data set's order) are pooled, as the torchvision sources
pool train and test; plfl partitions the pool and splits each client into train and test itself. The samples
are the images of ``data.image_column`` (a ``datasets.Image`` column), decoded and normalised per channel over
the pool exactly as :func:`plfl.data.imagefolder.load_image_folder` does, or the texts of ``data.text_column``,
which become token ids after the split (:meth:`plfl.data.sources.HuggingFace.encode`). The other per-sample columns
(FEMNIST's ``writer_id``, ...) come back beside them, read only if a partition splits by one.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from plfl.data.imagefolder import decode_images, normalise_channels
from plfl.errors import DataError

# A single file's builder, by suffix; a directory's files choose theirs (datasets' own inference).
_FILE_BUILDERS = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".jsonl": "json", ".arrow": "arrow"}
_LOCAL_FORMS = (
    "a directory written by save_to_disk, a parquet, csv or json file, or a directory of such files or of "
    "images in <split>/<class>/ folders"
)
_INTEGER_DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
_STRING_DTYPES = ("string", "large_string")


def read_hf(
    path: Optional[str],
    subset: Optional[str],
    splits: Optional[Sequence[str]],
    image_column: Optional[str],
    text_column: Optional[str],
    label_column: str,
) -> tuple[Any, torch.Tensor, int, Mapping[str, np.ndarray]]:
    """The samples of ``splits`` of the data set at ``path``, pooled in split order.

    Args:
        path: a local path (see the module) or a hub id.
        subset: the hub config name (``load_dataset``'s ``name``); None: the default.
        splits: the split names to pool; None: all, in the data set's order.
        image_column: the ``datasets.Image`` column; with ``text_column`` None too, the data set's only image
            column.
        text_column: the column of strings; None: images.
        label_column: the class labels: a ``ClassLabel`` column, integer class ids, or strings (numbered in
            sorted order).

    Returns:
        ``x``: images float32 ``(n, C, H, W)`` normalised per channel over the n pooled images (C: 3 if any
        image has colour, else 1), or texts, a NumPy object array of ``str`` ``(n,)``; ``y`` int64 ``(n,)``;
        the class count (the ``ClassLabel``'s names, else the largest id + 1, else the distinct strings); and
        the pool's other per-sample columns (ints, strings, class labels; ``label`` excluded, as it names
        ``y``), name → array ``(n,)``, each read when first asked for.

    Raises:
        DataError: ``datasets`` is not installed; ``path`` is neither a local data set nor loadable from the
            hub; a file cannot be read; a named split or column is missing (the message lists those there
            are); a column holds the wrong kind of values; a label is missing or negative; an image cannot be
            decoded or differs in size from the first.
    """
    if path is None:
        raise DataError(
            "data.source=hf needs data.path: a hub id (e.g. uoft-cs/cifar10) or a local copy "
            f"({_LOCAL_FORMS}). Set data.path."
        )
    lib = _datasets()
    parts = _pick_splits(lib, _load(lib, path, subset), splits, path)
    sample, is_image = _sample_column(lib, parts, image_column, text_column, path)
    for name, part in parts:
        _require(lib, part, label_column, "label_column", name, path)
    y, num_classes = _labels(lib, parts, label_column, path)
    x = _images(parts, sample, path) if is_image else _texts(parts, sample, path)
    shared = set.intersection(*(set(part.column_names) for _, part in parts))
    names = [
        c
        for c in parts[0][1].column_names
        if c in shared and c not in (sample, "label") and all(_is_scalar(lib, p.features[c]) for _, p in parts)
    ]
    return x, torch.from_numpy(y), num_classes, _Columns(parts, names)


def _datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise DataError(
            "data.source=hf reads data sets with Hugging Face datasets, which is not installed. Install plfl's "
            "hf extra: pip install -e '.[hf]' (in plfl's directory)."
        ) from None
    return datasets


def _load(lib: Any, path: str, subset: Optional[str]) -> Any:
    """The ``Dataset`` or ``DatasetDict`` at ``path``: local when the path exists, else from the hub."""
    local = Path(path).expanduser()
    if local.exists():
        return _load_local(lib, local, subset)
    where = local.resolve()
    if local.is_absolute() or path.startswith((".", "~")) or path.count("/") > 1:  # cannot be a hub id
        raise DataError(
            f"data.path={path}: no such file or directory ({where}). Point data.path at a local copy "
            f"({_LOCAL_FORMS}) or give a hub id such as uoft-cs/cifar10."
        )
    try:
        return lib.load_dataset(path, name=subset)
    except Exception as e:  # noqa: BLE001  the hub client raises many types (offline, unknown id, bad subset)
        raise DataError(
            f"data.path={path} is neither a local data set (no file or directory {where}) nor loadable from the "
            f"Hugging Face Hub ({type(e).__name__}: {e}). Offline use needs a local path: {_LOCAL_FORMS}; a hub "
            "data set downloaded before is read from the hub cache with HF_HUB_OFFLINE=1. Otherwise check the "
            "hub id and data.subset."
        ) from None


def _load_local(lib: Any, local: Path, subset: Optional[str]) -> Any:
    saved = local.is_dir() and ((local / "dataset_dict.json").is_file() or (local / "state.json").is_file())
    if saved and subset is not None:
        raise DataError(
            f"data.subset={subset} has no effect on {local}, a directory written by save_to_disk (it holds one "
            "configuration). Remove data.subset."
        )
    if local.is_file() and local.suffix.lower() not in _FILE_BUILDERS:
        raise DataError(
            f"data.path={local} is a file plfl cannot read as a data set: a single file must be "
            f"{', '.join(sorted(set(_FILE_BUILDERS)))}. Point data.path at {_LOCAL_FORMS}."
        )
    try:
        if saved:
            return lib.load_from_disk(str(local))
        if local.is_file():
            return lib.load_dataset(_FILE_BUILDERS[local.suffix.lower()], data_files=str(local))
        return lib.load_dataset(str(local), name=subset)
    except Exception as e:  # noqa: BLE001  pyarrow, pandas and datasets raise many types; each means unreadable
        raise DataError(
            f"Could not read the data set at {local} ({type(e).__name__}: {e}). data.path must be "
            f"{_LOCAL_FORMS}; replace a damaged file, or point data.path at the right one."
        ) from None


def _pick_splits(lib: Any, loaded: Any, splits: Optional[Sequence[str]], path: str) -> list[tuple[str, Any]]:
    """(name, Dataset) of the splits to pool, in order; a lone ``Dataset`` is the split it was loaded as
    (``train`` when it does not say)."""
    if isinstance(loaded, lib.Dataset):
        available = {str(loaded.split) if loaded.split is not None else "train": loaded}
    else:
        available = dict(loaded)
    if splits is None:
        chosen = list(available.items())
    else:
        missing = [s for s in splits if s not in available]
        if missing:
            raise DataError(
                f"{path} has no split {missing[0]!r}; its splits: {', '.join(available)}. Set data.splits to "
                "some of them (null: all)."
            )
        chosen = [(s, available[s]) for s in splits]
    if sum(len(part) for _, part in chosen) == 0:
        raise DataError(f"The splits {', '.join(s for s, _ in chosen)} of {path} hold no samples.")
    return chosen


def _describe(lib: Any, features: Any) -> str:
    """``img (Image), label (ClassLabel, 10 classes), ...``: a data set's columns for an error message."""

    def kind(feature: Any) -> str:
        if isinstance(feature, lib.ClassLabel):
            return f"ClassLabel, {feature.num_classes} classes"
        if isinstance(feature, lib.Value):
            return feature.dtype
        return type(feature).__name__

    return ", ".join(f"{name} ({kind(f)})" for name, f in features.items())


def _require(lib: Any, part: Any, column: str, key: str, split: str, path: str) -> None:
    if column not in part.column_names:
        raise DataError(
            f"{path} (split {split}) has no column {column!r} (data.{key}); its columns: "
            f"{_describe(lib, part.features)}. Set data.{key} to one of them."
        )


def _sample_column(
    lib: Any, parts: list[tuple[str, Any]], image_column: Optional[str], text_column: Optional[str], path: str
) -> tuple[str, bool]:
    """The column of samples and whether it holds images (else texts)."""
    first = parts[0][1]
    if text_column is None and image_column is None:
        found = [name for name, f in first.features.items() if isinstance(f, lib.Image)]
        if len(found) != 1:
            raise DataError(
                f"{path} has {len(found) or 'no'} image columns: set data.image_column, or data.text_column for "
                f"texts. Its columns: {_describe(lib, first.features)}."
            )
        image_column = found[0]
    column, key = (image_column, "image_column") if text_column is None else (text_column, "text_column")
    for name, part in parts:
        _require(lib, part, column, key, name, path)
        feature = part.features[column]
        if text_column is None and not isinstance(feature, lib.Image):
            raise DataError(
                f"Column {column!r} of {path} (split {name}) holds {_describe(lib, {column: feature})}, not "
                "images (datasets.Image). Set data.image_column to an image column, or data.text_column for texts."
            )
        if text_column is not None and not (isinstance(feature, lib.Value) and feature.dtype in _STRING_DTYPES):
            raise DataError(
                f"Column {column!r} of {path} (split {name}) holds {_describe(lib, {column: feature})}, not texts. "
                "Set data.text_column to a column of strings, or data.image_column for images."
            )
    return column, text_column is None


def _is_scalar(lib: Any, feature: Any) -> bool:
    """A column a partition can split by: class labels, integers or strings."""
    return isinstance(feature, lib.ClassLabel) or (
        isinstance(feature, lib.Value) and feature.dtype in (*_INTEGER_DTYPES, *_STRING_DTYPES)
    )


def _column(part: Any, name: str) -> np.ndarray:
    """One column of ``part`` as a NumPy array (ints, or objects for strings), through arrow: fast."""
    return part.with_format("arrow")[name].to_numpy()


def _labels(lib: Any, parts: list[tuple[str, Any]], column: str, path: str) -> tuple[np.ndarray, int]:
    """int64 ``(n,)`` labels of the pooled splits and the class count."""
    values, names, strings = [], None, None
    for split, part in parts:
        feature = part.features[column]
        where = f"Column {column!r} (data.label_column) of {path}, split {split},"
        is_class = isinstance(feature, lib.ClassLabel)
        is_int = is_class or (isinstance(feature, lib.Value) and feature.dtype in _INTEGER_DTYPES)
        is_str = isinstance(feature, lib.Value) and feature.dtype in _STRING_DTYPES
        if not (is_int or is_str):
            raise DataError(
                f"{where} holds {_describe(lib, {column: feature})}, not class labels (a ClassLabel, integer ids or "
                "strings). Set data.label_column to the column of classes."
            )
        if strings is not None and strings != is_str:
            raise DataError(
                f"{where} holds {'strings' if is_str else 'integers'} but an earlier split holds "
                f"{'integers' if is_str else 'strings'}: the pooled splits must label classes alike. Set "
                "data.splits to splits that agree."
            )
        strings = is_str
        if is_class:
            if names is not None and feature.names != names:
                raise DataError(
                    f"{where} names other classes than an earlier split ({feature.names[:5]}... vs "
                    f"{names[:5]}...). Set data.splits to splits with the same ClassLabel."
                )
            names = feature.names
        missing = part.with_format("arrow")[column].null_count
        if missing:
            raise DataError(
                f"{where} has {missing} samples without a label. Remove them, or set data.splits to labelled splits."
            )
        column_values = _column(part, column)
        if is_int and len(column_values) and column_values.min() < 0:
            raise DataError(
                f"{where} holds the label {column_values.min()}: class ids must be >= 0 (-1 marks an unlabelled "
                "sample, as in some hub test splits). Set data.splits to the labelled splits."
            )
        values.append(column_values)
    pooled = np.concatenate(values)
    if strings:
        classes, y = np.unique(pooled.astype(str), return_inverse=True)
        return y.astype(np.int64), len(classes)
    y = pooled.astype(np.int64)
    largest = int(y.max()) + 1 if len(y) else 0
    return y, max(largest, len(names) if names is not None else 0)


def _texts(parts: list[tuple[str, Any]], column: str, path: str) -> np.ndarray:
    texts = []
    for split, part in parts:
        missing = part.with_format("arrow")[column].null_count
        if missing:
            raise DataError(
                f"Column {column!r} (data.text_column) of {path}, split {split}, has {missing} samples without a "
                "text. Remove them, or fill them in."
            )
        texts += part.with_format("arrow")[column].to_pylist()
    return np.array(texts, dtype=object)


def _images(parts: list[tuple[str, Any]], column: str, path: str) -> torch.Tensor:
    """The images, decoded without ``datasets``' own decoding (so that a bad one is named) and normalised."""
    sources = []
    for split, part in parts:
        stored = part.with_format("arrow")[column].combine_chunks()  # struct<bytes, path> per image
        raw, files = stored.field("bytes").to_pylist(), stored.field("path").to_pylist()
        sources += [(f"{i} of split {split}", b, f) for i, (b, f) in enumerate(zip(raw, files))]
    return normalise_channels(_decode(sources, column, path))


def _decode(sources: list[tuple[str, Optional[bytes], Optional[str]]], column: str, path: str) -> torch.Tensor:
    """uint8 ``(n, C, H, W)`` of the images (``bytes``, else the file ``path``), channels as the image folder
    reader makes them (:func:`plfl.data.imagefolder.decode_images`)."""
    images = []
    for where, raw, file in sources:
        name = f"{where} in column {column!r} of {path}" + (f" ({file})" if file else "")
        if raw is None and file is None:
            raise DataError(f"Image {name} is missing (neither bytes nor a file). Remove the sample.")
        images.append((name, io.BytesIO(raw) if raw is not None else file))
    return decode_images(images)


class _Columns(Mapping):
    """The pool's per-sample columns other than its samples, name → array ``(n,)`` over the pooled splits,
    each read from the arrow tables when asked for (a partition reads at most the one it splits by)."""

    def __init__(self, parts: list[tuple[str, Any]], names: list[str]) -> None:
        self._parts, self._names = parts, names

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._names:
            raise KeyError(name)
        return np.concatenate([_column(part, name) for _, part in self._parts])

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)
