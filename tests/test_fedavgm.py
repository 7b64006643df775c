"""FedAvgM: the server's momentum step, FedAvg as its special case, its checkpointed velocity and its keys' ranges."""

from pathlib import Path

import pytest
import torch

from plfl.checkpoint import load_latest_checkpoint
from plfl.cli import main
from plfl.config import load_config
from plfl.errors import ConfigError
from plfl.experiment import run_experiment
from plfl.methods.fedavgm import FedAvgM, FedAvgMConfig, server_momentum_step

from conftest import make_context

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "fedavgm.yaml"


def test_momentum_accumulates_over_two_rounds():
    # β = 0.5, η_s = 0.5. Round 1: Δ = (0.5, -1), v = Δ, Θ = Θ^0 - 0.5 v = (0.75, 2.5).
    # Round 2: Δ = (0.5, 0), v = 0.5 (0.5, -1) + (0.5, 0) = (0.75, -0.5), Θ = (0.375, 2.75).
    theta = {"w": torch.tensor([1.0, 2.0]), "count": torch.tensor(3)}
    theta, v = server_momentum_step(theta, {"w": torch.tensor([0.5, 3.0]), "count": torch.tensor(7)}, None, 0.5, 0.5)
    torch.testing.assert_close(theta["w"], torch.tensor([0.75, 2.5]))
    theta, v = server_momentum_step(theta, {"w": torch.tensor([0.25, 2.5]), "count": torch.tensor(9)}, v, 0.5, 0.5)
    torch.testing.assert_close(v["w"], torch.tensor([0.75, -0.5]))
    torch.testing.assert_close(theta["w"], torch.tensor([0.375, 2.75]))
    assert theta["count"].item() == 9 and "count" not in v  # integer buffers: FedAvg's, no velocity


def final_global_model(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_latest_checkpoint(run_dir / "checkpoints")[1]["method"]["global_params"]


def test_zero_momentum_and_unit_lr_is_fedavg_bit_for_bit(digits_config):
    fedavg, _ = run_experiment(digits_config(**{"method.name": "fedavg"}))
    plain, _ = run_experiment(digits_config(**{"method.name": "fedavgm", "method.server_momentum": 0}))
    momentum, _ = run_experiment(digits_config(**{"method.name": "fedavgm", "method.server_momentum": 0.9}))
    expected = final_global_model(fedavg)
    assert all(torch.equal(final_global_model(plain)[k], v) for k, v in expected.items())
    assert not torch.equal(final_global_model(momentum)["head.weight"], expected["head.weight"])


def test_velocity_is_server_state_and_resumes(tiny_federation):
    def make():
        context, model = make_context(tiny_federation)
        return FedAvgM(FedAvgMConfig(), context, {k: v.clone() for k, v in model.state_dict().items()})

    method, fresh = make(), make()
    first, second = [
        {i: {k: v + shift * i for k, v in method.global_params.items()} for i in (0, 2)} for shift in (0.1, 0.3)
    ]
    method.aggregate(first, round_=1)
    state = method.state_dict()
    assert set(state) == {"global_params", "velocity"} and set(state["velocity"]) == set(method.global_params)
    fresh.load_state_dict(state)
    method.aggregate(second, round_=2)
    fresh.aggregate(second, round_=2)
    assert all(torch.equal(fresh.global_params[k], v) for k, v in method.global_params.items())


@pytest.mark.parametrize(
    "override, message",
    [
        ("method.server_momentum=1", "Config key 'method.server_momentum' must be a number in [0, 1); got 1.0."),
        ("method.server_momentum=-0.1", "Config key 'method.server_momentum' must be a number in [0, 1); got -0.1."),
        ("method.server_lr=0", "Config key 'method.server_lr' must be a number > 0; got 0.0."),
    ],
)
def test_out_of_range_keys_are_refused_with_the_key_named(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(CONFIG, [override])
    assert message in str(info.value)


def test_fedavgm_config_runs_end_to_end_with_the_cli(tmp_path, capsys):
    def plfl(*args):
        status = main(list(args))
        return status, capsys.readouterr()

    status, listed = plfl("methods", "fedavgm")
    assert status == 0 and "method.server_momentum = 0.9" in listed.out
    # configs/fedavgm.yaml with the bundled digits instead of MNIST, and ALA on top (FedAvgM takes FedAvg's keys).
    status, out = plfl(
        "fit",
        "--config",
        str(CONFIG),
        "data.source=digits",
        "data.root=null",
        "data.num_clients=5",
        "data.beta=0.5",
        "model.name=mlp",
        "federation.rounds=2",
        "federation.batch_size=20",
        "federation.lr=0.05",
        "method.ala.s=50",
        "progress_bar=false",
        f"output_dir={tmp_path}",
    )
    assert status == 0, out.err
    run_dir = Path(out.out.strip().splitlines()[-1].removeprefix("Run directory: "))
    header, *rows = [line.split(",") for line in (run_dir / "metrics.csv").read_text().splitlines()]
    assert [row[header.index("round")] for row in rows] == ["0", "1", "2"]
    assert float(rows[-1][header.index("accuracy")]) > 0.2  # 10 classes: chance is 0.1 (measured 0.60)
    assert 0 <= float(rows[-1][header.index("ala_weight_mean")]) <= 1
