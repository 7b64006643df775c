"""The client-state store in RAM and offloaded to files (federation.state_offload): same values, same runs."""

import csv
import io

import pytest
import torch

from plfl.checkpoint import list_checkpoints, read_checkpoint
from plfl.config import resume_config
from plfl.experiment import run_experiment
from plfl.state import ClientStateStore


@pytest.fixture(params=["ram", "offloaded"])
def store(request, tmp_path):
    store = ClientStateStore(4)
    if request.param == "offloaded":
        store.offload(tmp_path / "client-state")
    yield store
    store.close()


def test_store_gives_back_what_was_set(store):
    model = {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "n": torch.tensor(7)}
    store.set(1, "model", model)
    store.set(1, "count", 3)
    store.set(2, "weights", torch.tensor([0.25, 0.5], dtype=torch.float64))
    store.set(2, "mixed", {"x": torch.tensor([5]), "steps": 2})
    store.set(3, "sigma", None)

    got = store.get(1, "model")
    assert set(got) == {"w", "n"}
    assert got["w"].tolist() == [[1.0, 2.0], [3.0, 4.0]] and got["n"].item() == 7 and got["n"].dtype == torch.int64
    assert store.get(1, "count") == 3
    assert store.get(2, "weights").tolist() == [0.25, 0.5] and store.get(2, "weights").dtype == torch.float64
    assert store.get(2, "mixed")["x"].tolist() == [5] and store.get(2, "mixed")["steps"] == 2
    assert store.get(3, "sigma") is None and (3, "sigma") in store
    # A client never set, and a key a client does not have.
    assert store.get(0, "model") is None and store.get(0, "count", 0) == 0 and (0, "model") not in store
    assert store.get(2, "model") is None and (2, "model") not in store and (1, "model") in store

    store.set(1, "model", {"w": torch.tensor([[9.0, 8.0], [7.0, 6.0]]), "n": torch.tensor(1)})  # overwrite
    store.set(0, "model", {"w": torch.zeros(2, 2), "n": torch.tensor(0)})
    assert store.get(1, "model")["w"].tolist() == [[9.0, 8.0], [7.0, 6.0]] and store.get(1, "model")["n"].item() == 1
    assert store.get(0, "model")["w"].tolist() == [[0.0, 0.0], [0.0, 0.0]]
    store.set(1, "model", {"w": torch.ones(3)})  # another shape under the same key and name
    assert store.get(1, "model")["w"].tolist() == [1.0, 1.0, 1.0] and store.get(0, "model")["w"].shape == (2, 2)


def test_state_dict_loads_back_into_either_kind_of_store(store, tmp_path):
    store.set(0, "model", {"w": torch.tensor([1.0, 2.0])})
    store.set(3, "model", {"w": torch.tensor([3.0, 4.0])})
    store.set(3, "count", 2)
    buffer = io.BytesIO()
    torch.save(store.state_dict(), buffer)
    saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)

    ram, offloaded = ClientStateStore(4), ClientStateStore(4)
    offloaded.offload(tmp_path / "other")
    for restored in (ram, offloaded):
        restored.load_state_dict(saved)
        assert restored.get(0, "model")["w"].tolist() == [1.0, 2.0] and restored.get(3, "model")["w"].tolist() == [
            3.0,
            4.0,
        ]
        assert restored.get(3, "count") == 2 and (1, "model") not in restored
    with pytest.raises(ValueError, match="state for 4 clients given to a store of 3"):
        ClientStateStore(3).load_state_dict(saved)
    offloaded.close()


def test_offloaded_values_are_copies_in_files_of_one_row_per_client(tmp_path):
    directory = tmp_path / "client-state"
    directory.mkdir()
    (directory / "0.bin").write_bytes(b"left by a killed run")
    store = ClientStateStore(100)
    store.set(0, "model", {"w": torch.ones(250)})  # set before offloading: moved into a file
    store.offload(directory)
    for client_id in range(1, 10):
        store.set(client_id, "model", {"w": torch.full((250,), float(client_id))})
    (path,) = directory.iterdir()
    assert path.stat().st_size == 10 * 250 * 4  # the clients that hold it, not all 100

    got = store.get(3, "model")
    got["w"] += 1  # a copy: the store keeps its value
    assert store.get(3, "model")["w"][0].item() == 3.0 and store.get(0, "model")["w"][0].item() == 1.0

    store.set(9, "model", None)  # kept in RAM: client 9's row is free for the next value
    store.set(50, "model", {"w": torch.full((250,), 50.0)})
    assert path.stat().st_size == 10 * 250 * 4 and store.get(9, "model") is None
    assert store.get(50, "model")["w"][0].item() == 50.0 and store.get(8, "model")["w"][0].item() == 8.0

    # A checkpoint of the store is about its payload: each file written once, whatever the clients.
    buffer = io.BytesIO()
    torch.save(store.state_dict(), buffer)
    assert 10 * 250 * 4 < len(buffer.getvalue()) < 10 * 250 * 4 + 20_000
    with pytest.raises(ValueError, match="offloaded to .*client-state already"):
        store.offload(tmp_path / "elsewhere")
    store.close()
    assert not directory.exists() and store.get(3, "model") is None


def test_clients_given_the_same_tensor_share_its_row(tmp_path):
    """As in RAM, where a broadcast's global model set for every client is one tensor, not one per client."""
    store = ClientStateStore(10)
    store.offload(tmp_path / "a")
    received = {"w": torch.arange(100.0)}
    for client_id in range(10):
        store.set(client_id, "received", received)
    (path,) = (tmp_path / "a").iterdir()
    assert path.stat().st_size == 100 * 4
    store.set(3, "received", {"w": torch.zeros(100)})  # the others keep theirs
    store.set(4, "received", {"w": torch.ones(100)})
    assert path.stat().st_size == 3 * 100 * 4
    assert store.get(3, "received")["w"].sum().item() == 0 and store.get(4, "received")["w"].sum().item() == 100
    assert all(store.get(i, "received")["w"].sum().item() == 4950 for i in (0, 1, 2, 5, 6, 7, 8, 9))

    buffer = io.BytesIO()
    torch.save(store.state_dict(), buffer)
    assert len(buffer.getvalue()) < 3 * 100 * 4 + 20_000  # each row once
    restored = ClientStateStore(10)
    restored.offload(tmp_path / "b")
    restored.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    assert [restored.get(i, "received")["w"].sum().item() for i in range(10)] == [4950] * 3 + [0, 100] + [4950] * 5
    assert (tmp_path / "b" / "0.bin").stat().st_size <= 4 * 100 * 4  # still shared after the reload
    store.close()
    restored.close()


def rows(path):
    """A CSV's rows without the wall-clock column."""
    with open(path) as f:
        return [{k: v for k, v in row.items() if k != "seconds"} for row in csv.DictReader(f)]


def results(run_dir):
    return rows(run_dir / "metrics.csv"), rows(run_dir / "clients.csv")


def stored(run_dir):
    """The client-state store in the run's newest checkpoint."""
    return read_checkpoint(list_checkpoints(run_dir / "checkpoints")[0])["store"]


OPTIONS = {"fedavg": {}, "ditto": {}, "selffl": {"method.warmup_rounds": 1, "method.l_max": 5}}


@pytest.mark.parametrize("method", sorted(OPTIONS))
def test_offloaded_state_gives_the_same_run_and_checkpoint(digits_config, method):
    """FedAvg (a model per client), Ditto (personal models) and Self-FL (per-client moments), 3 rounds."""
    options = {"method.name": method, "federation.join_ratio": 0.6, **OPTIONS[method]}
    in_ram, _ = run_experiment(digits_config(**options))
    offloaded, _ = run_experiment(digits_config(**options, **{"federation.state_offload": True}))
    assert results(offloaded) == results(in_ram)
    assert not (offloaded / "client-state").exists()

    torch.testing.assert_close(stored(offloaded), stored(in_ram), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("method", ["fedala", pytest.param("selffl", marks=pytest.mark.slow)])
def test_offloaded_run_resumes_to_identical_metrics(digits_config, method):
    options = {
        "method.name": method,
        "federation.state_offload": True,
        **({"method.p": 2} if method == "fedala" else OPTIONS[method]),
    }
    straight, _ = run_experiment(digits_config(**options, **{"federation.rounds": 3}))
    stopped, _ = run_experiment(digits_config(**options, **{"federation.rounds": 2}))
    resumed, _ = run_experiment(resume_config(stopped, ["federation.rounds=3"]), stopped)
    assert results(resumed) == results(straight)
