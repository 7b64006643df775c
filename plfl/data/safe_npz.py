"""Reading PFLlib's ``.npz`` client files without running code from them.

PFLlib stores each client as ``np.savez_compressed(path, data={"x": ..., "y": ...})``:
the dict becomes a 0-d object array, i.e. a pickle inside ``data.npy``.
``np.load(allow_pickle=True)`` would execute whatever a crafted file's pickle
asks for, so the pickle is read here by an unpickler that can build only NumPy
arrays, dtypes and scalars, plus the plain containers pickle makes natively.
"""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
from numpy._core import multiarray
from numpy.lib import format as npy_format

from plfl.errors import DataError

# The only globals a pickled ndarray (object or not) refers to. Files written by
# NumPy < 2 name ``numpy.core``, NumPy 2 names ``numpy._core``; both map to the
# same functions, resolved here rather than imported by name from the file.
_ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    **{
        (module, name): getattr(multiarray, name)
        for module in ("numpy.core.multiarray", "numpy._core.multiarray")
        for name in ("_reconstruct", "scalar")
    },
}


class _ArrayUnpickler(pickle.Unpickler):
    """An unpickler that refuses every global outside :data:`_ALLOWED_GLOBALS`."""

    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            raise DataError(
                f"{self._path} contains a pickled {module}.{name}; plfl loads only NumPy arrays, "
                "dtypes and plain containers from .npz files. The file may be crafted or corrupt: "
                "regenerate it with PFLlib."
            ) from None


def load_npz_dict(path: str | Path) -> dict[str, np.ndarray]:
    """Read a PFLlib client file: the dict stored under the ``data`` entry of an ``.npz``.

    Args:
        path: an ``.npz`` written by ``np.savez_compressed(path, data={"x": x, "y": y})``.

    Returns:
        The stored dict; ``"x"`` and ``"y"`` are NumPy arrays (for PFLlib,
        ``x`` is float32 ``(n, C, H, W)`` and ``y`` int64 ``(n,)``; their dtypes
        and shapes are checked by the caller, not here).

    Raises:
        DataError: the file is missing, not a zip (corrupt or truncated), has no
            ``data`` entry, is not a valid ``.npy`` inside, pickles anything but
            NumPy arrays/dtypes/scalars and plain containers (nothing from the
            pickle is executed), or does not hold a dict with ``x`` and ``y`` arrays.
    """
    path = Path(path)
    regenerate = "Regenerate it with PFLlib's generate_*.py script or restore the original file."
    if not path.is_file():
        raise DataError(f"Client file {path} does not exist. {regenerate}")
    try:
        with zipfile.ZipFile(path) as zf:
            if "data.npy" not in zf.namelist():
                raise DataError(
                    f"{path} has no 'data' entry (it holds {sorted(zf.namelist())}); PFLlib client files "
                    f"store one pickled dict {{'x': ..., 'y': ...}} under 'data'. {regenerate}"
                )
            payload = _read_npy_member(zf, "data.npy", path)
    except DataError:
        raise
    # Anything else while parsing an untrusted file (bad zip, bad CRC, truncated
    # stream, malformed pickle or header) means the file is corrupt.
    except Exception as e:  # noqa: BLE001  see above: every failure means a corrupt file
        raise DataError(
            f"{path} is corrupt or truncated and cannot be read ({type(e).__name__}: {e}). {regenerate}"
        ) from None

    if isinstance(payload, np.ndarray) and payload.dtype == object and payload.shape == ():
        payload = payload.item()
    if not (isinstance(payload, dict) and all(isinstance(payload.get(k), np.ndarray) for k in ("x", "y"))):
        if isinstance(payload, dict):
            found = f"a dict with keys {sorted(map(str, payload))}"
        elif isinstance(payload, np.ndarray):
            found = f"a {payload.dtype} array of shape {payload.shape}"
        else:
            found = f"a {type(payload).__name__}"
        raise DataError(
            f"{path} holds {found} under 'data', not a dict with arrays 'x' and 'y' as PFLlib writes. {regenerate}"
        )
    return payload


def _read_npy_member(zf: zipfile.ZipFile, name: str, path: Path) -> Any:
    """Parse one ``.npy`` member: object arrays via the restricted unpickler, others plainly."""
    with zf.open(name) as f:
        version = npy_format.read_magic(f)
        if version == (1, 0):
            _, _, dtype = npy_format.read_array_header_1_0(f)
        elif version == (2, 0):
            _, _, dtype = npy_format.read_array_header_2_0(f)
        else:
            raise DataError(f"{path}: '{name}' uses .npy format version {version}, which plfl does not read.")
        if dtype.hasobject:
            return _ArrayUnpickler(f, path).load()
    with zf.open(name) as f:
        return npy_format.read_array(f, allow_pickle=False)
