"""The client-state store: every client's persistent state, as tensors.

Per-client state (the personalized model, ALA weights, variance statistics
...) lives here as data, never as attributes of a reused module, so that one
module can serve every client and other executors can run the same methods.

By default the store keeps its values in RAM. With ``federation.state_offload``
(:meth:`ClientStateStore.offload`) its tensors live in files and only the
clients being worked on are in memory: with 1000 clients, RAM holds a round's
models instead of 1000 of them.
"""

from __future__ import annotations

import math
import os
import shutil
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

Params = dict[str, torch.Tensor]
"""A model's state: ``state_dict`` names → tensors (parameters and buffers)."""


class ClientStateStore:
    """Maps (client id, key) → a tensor, a dict of tensors, or another value (a number, None, ...).

    In RAM (the default) a value is kept as it was set and ``get`` returns that
    very object. Offloaded (:meth:`offload`), CPU tensors, alone or as the
    values of a non-empty dict of CPU tensors, are copied into files when set,
    and ``get`` reads a fresh copy; other values stay in RAM. Either way a
    caller must not modify a value in place after setting it or getting it
    (in RAM that would change the store, offloaded it would not): set a new
    value instead. The key ``"model"`` holds the client's personalized model
    (:data:`Params`).
    """

    def __init__(self, num_clients: int):
        self._states: list[dict[str, Any]] = [{} for _ in range(num_clients)]
        self._directory: Optional[Path] = None
        self._columns: dict[tuple, _Column] = {}  # (key, tensor name, dtype, shape) → its file

    def __len__(self) -> int:
        return len(self._states)

    def get(self, client_id: int, key: str, default: Any = None) -> Any:
        """Client ``client_id``'s value of ``key`` (``default`` if it has none); offloaded tensors are read
        into new tensors."""
        value = self._states[client_id].get(key, default)
        if not isinstance(value, _Offloaded):
            return value
        tensors = {name: column.read(client_id) for name, column in value.columns.items()}
        return tensors[None] if value.bare else tensors

    def set(self, client_id: int, key: str, value: Any) -> None:
        """Give client ``client_id`` ``value`` for ``key``, replacing any earlier one.

        Raises:
            OSError: offloaded, and the file cannot be written (e.g. the disk is full).
        """
        columns = {}
        if self._directory is not None and _offloadable(value):
            bare = isinstance(value, torch.Tensor)
            tensors = {None: value} if bare else value
            columns = {name: self._column(key, name, tensor) for name, tensor in tensors.items()}
            for name, column in columns.items():
                column.write(client_id, tensors[name])
            value = _Offloaded(columns, bare)
        old = self._states[client_id].get(key)
        if isinstance(old, _Offloaded):  # free the rows that the new value does not take over
            for column in set(old.columns.values()) - set(columns.values()):
                column.release(client_id)
        self._states[client_id][key] = value

    def __contains__(self, item: tuple[int, str]) -> bool:
        client_id, key = item
        return key in self._states[client_id]

    def state_dict(self) -> list[dict[str, Any]]:
        """The whole store (for checkpoints): one dict per client, key → value.

        Offloaded tensors come as views of their files mapped into memory
        (privately: the files never change through them), not as copies:
        ``torch.save`` writes each file once, whole (a row per stored
        value), paging it in from the page cache as it goes.
        """
        if self._directory is None:
            return self._states
        rows = {column: list(column.mapped()) for column in self._columns.values()}  # one view per row

        def restored(client_id: int, value: Any) -> Any:
            if not isinstance(value, _Offloaded):
                return value
            tensors = {name: rows[column][column.rows[client_id]] for name, column in value.columns.items()}
            return tensors[None] if value.bare else tensors

        return [{key: restored(i, value) for key, value in state.items()} for i, state in enumerate(self._states)]

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        """Replace the store's content with ``states`` (what :meth:`state_dict` returned, offloaded or not).

        Raises:
            ValueError: ``states`` is for another number of clients.
        """
        if len(states) != len(self._states):
            raise ValueError(f"state for {len(states)} clients given to a store of {len(self._states)}")
        if self._directory is None:
            self._states = states
            return
        self._remove_files()
        self._directory.mkdir()
        self._states = [{} for _ in states]
        for client_id, state in enumerate(states):
            for key, value in state.items():
                self.set(client_id, key, value)

    def offload(self, directory: Path) -> None:
        """Keep the store's tensors in files under ``directory`` from now on, those already set included.

        A ``directory`` that exists is emptied first: files that a killed run
        left there are stale (its state comes back from a checkpoint).
        :meth:`close` removes it.

        Raises:
            ValueError: the store is offloaded already.
        """
        if self._directory is not None:
            raise ValueError(f"the client-state store is offloaded to {self._directory} already")
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        self._directory = directory
        for client_id, state in enumerate(self._states):
            for key, value in list(state.items()):
                self.set(client_id, key, value)

    def close(self) -> None:
        """Delete the offload files, if any; an offloaded store is empty and in RAM afterwards."""
        if self._directory is not None:
            self._remove_files()
            self._directory = None
            self._states = [{} for _ in self._states]

    def _remove_files(self) -> None:
        for column in self._columns.values():
            column.close()
        self._columns = {}
        shutil.rmtree(self._directory, ignore_errors=True)

    def _column(self, key: str, name: Optional[str], tensor: torch.Tensor) -> _Column:
        index = (key, name, tensor.dtype, tuple(tensor.shape))
        if index not in self._columns:
            self._columns[index] = _Column(self._directory / f"{len(self._columns)}.bin", tensor.dtype, tensor.shape)
        return self._columns[index]


def _offloadable(value: Any) -> bool:
    """A CPU tensor, or a non-empty dict of CPU tensors."""
    tensors = [value] if isinstance(value, torch.Tensor) else list(value.values()) if isinstance(value, dict) else []
    return bool(tensors) and all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in tensors)


@dataclass(frozen=True, eq=False)
class _Offloaded:
    """Where an offloaded value's tensors are: its names → columns (the name None: a bare tensor)."""

    columns: dict[Optional[str], _Column]
    bare: bool


@dataclass(eq=False)
class _Column:
    """One file of tensors of one dtype and shape, a row per value. Clients set the very same tensor one
    after another (a broadcast's global model, kept per client) share one row, as they share it in RAM."""

    path: Path
    dtype: torch.dtype
    shape: torch.Size
    rows: dict[int, int] = field(default_factory=dict)  # client id → row
    users: list[int] = field(default_factory=list)  # row → clients on it
    free: list[int] = field(default_factory=list)  # rows no client is on
    last: Optional[tuple[weakref.ref, int]] = None  # the tensor written last, and its row

    def __post_init__(self) -> None:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.numel = math.prod(self.shape)
        self.row_bytes = self.numel * self.dtype.itemsize

    def write(self, client_id: int, tensor: torch.Tensor) -> None:
        old = self.rows.get(client_id)
        if old is not None:
            self.users[old] -= 1
        if self.last is not None and self.last[0]() is tensor:
            row = self.last[1]
            if old is not None and old != row and self.users[old] == 0:
                self.free.append(old)
        else:
            row = old if old is not None and self.users[old] == 0 else self._new_row()
            if os.pwrite(self.fd, _bytes(tensor.detach().contiguous()), row * self.row_bytes) != self.row_bytes:
                raise OSError(f"short write to {self.path} (disk full?)")
            self.last = weakref.ref(tensor), row
        self.users[row] += 1
        self.rows[client_id] = row

    def release(self, client_id: int) -> None:
        """The client no longer has a value here."""
        row = self.rows.pop(client_id)
        self.users[row] -= 1
        if self.users[row] == 0:
            self.free.append(row)
            if self.last is not None and self.last[1] == row:
                self.last = None  # its row will hold another value

    def _new_row(self) -> int:
        if self.free:
            return self.free.pop()
        self.users.append(0)
        return len(self.users) - 1

    def read(self, client_id: int) -> torch.Tensor:
        tensor = torch.empty(self.shape, dtype=self.dtype)
        if os.preadv(self.fd, [_bytes(tensor)], self.rows[client_id] * self.row_bytes) != self.row_bytes:
            raise OSError(f"short read from {self.path}: the file was changed outside plfl")
        return tensor

    def mapped(self) -> torch.Tensor:
        """The whole file as a (rows, *shape) tensor mapped into memory (changes to it stay out of the file)."""
        size = len(self.users) * self.numel
        return torch.from_file(str(self.path), shared=False, size=size, dtype=self.dtype).view(-1, *self.shape)

    def close(self) -> None:
        os.close(self.fd)


def _bytes(tensor: torch.Tensor) -> memoryview:
    """The memory of a contiguous CPU tensor as bytes (shared, not copied)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
