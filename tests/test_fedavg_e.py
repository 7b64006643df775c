"""FedAvg-e: the plain mean of the uploads, unlike FedAvg's sample-size weighted mean."""

import torch

from plfl.experiment import run_experiment
from plfl.methods.fedavg import FedAvg, FedAvgConfig
from plfl.methods.fedavg_e import FedAvgE

from conftest import make_context


def test_aggregate_is_the_plain_mean_of_the_uploads(tiny_federation):
    context, model = make_context(tiny_federation)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    equal, weighted = FedAvgE(FedAvgE.config_class(), context, initial), FedAvg(FedAvgConfig(), context, initial)
    # Clients 0 and 3 hold 10 and 40 training samples.
    messages = {
        0: {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(7)},
        3: {"w": torch.tensor([4.0, 8.0]), "n": torch.tensor(9)},
    }
    equal.aggregate(messages, round_=1)
    weighted.aggregate(messages, round_=1)
    torch.testing.assert_close(equal.global_params["w"], torch.tensor([2.5, 5.0]))  # (1 + 4) / 2, (2 + 8) / 2
    torch.testing.assert_close(weighted.global_params["w"], torch.tensor([3.4, 6.8]))  # (10·1 + 40·4) / 50, ...
    assert equal.global_params["n"].item() == 7  # integer buffers: the first upload's, as in FedAvg


def test_fedavg_e_runs_and_differs_from_fedavg_on_unequal_clients(digits_config):
    finals = {}
    for name in ("fedavg", "fedavg_e"):
        run_dir, summary = run_experiment(digits_config(**{"method.name": name}))
        header, *rows = [line.split(",") for line in (run_dir / "metrics.csv").read_text().splitlines()]
        finals[name] = [row[header.index("accuracy")] for row in rows]
    accuracy = [float(a) for a in finals["fedavg_e"]]
    assert accuracy[-1] > accuracy[0] + 0.1  # it learns (measured 0.05 → 0.25 in 3 rounds; FedAvg 0.26)
    assert finals["fedavg_e"][0] == finals["fedavg"][0]  # the same initial model
    assert finals["fedavg_e"][1:] != finals["fedavg"][1:]  # Dir(0.5) clients differ in size
