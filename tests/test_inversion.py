"""Gradient inversion (plfl invert): the observed gradient against the true batch's, iDLG's label rule, DLG and
iDLG on the digits MLP with and without noise, PSNR/SSIM against torchmetrics, the assignment, and the refusals."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

from plfl.batches import batch_loader
from plfl.checkpoint import checkpoint_path, read_checkpoint
from plfl.cli import main
from plfl.data import FederatedData, load_federated_data
from plfl.data.federated import ClientData
from plfl.data.vision import read_digits
from plfl.errors import ConfigError, FederationError, PlflWarning
from plfl.experiment import run_experiment
from plfl.inversion import (
    UploadRecorder,
    batch_gradient,
    check_inversion,
    dlg,
    finite_or_null,
    idlg,
    idlg_label,
    invert,
    last_layer_weight,
    matched,
    observed_gradient,
    psnr,
    ssim,
    unit_range,
)
from plfl.models import build_model
from plfl.report import write_report
from plfl.seeding import derive_seed


@pytest.fixture(scope="module")
def digits():
    x, y, _ = read_digits()
    return x.double(), y


def mlp(seed=0):
    torch.manual_seed(seed)
    model = build_model("mlp", (1, 8, 8), 10, hidden_sizes=[32]).train()
    return model, {k: v.detach().double() for k, v in model.state_dict().items()}


def one_step(digits_config, **overrides):
    return digits_config(**{"federation.local_steps": 1, "federation.rounds": 2, **overrides})


def test_one_sgd_step_gives_back_the_gradient_of_its_batch(digits):
    model, _ = mlp()
    sent = {k: v.detach().clone() for k, v in model.state_dict().items()}
    x, y = digits[0][:4].float(), digits[1][:4]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    F.cross_entropy(model(x), y).backward()
    expected = {k: p.grad.clone() for k, p in model.named_parameters()}
    optimizer.step()
    gradient = observed_gradient(sent, model.state_dict(), 0.3, list(expected))
    for k, g in expected.items():
        torch.testing.assert_close(gradient[k], g.double(), rtol=0, atol=1e-5)


def test_the_observed_upload_is_the_gradient_of_the_batch_the_client_trained_on(digits_config, tmp_path):
    cfg = one_step(digits_config, **{"federation.batch_size": 4, "checkpoint_every": 1, "keep_checkpoints": 2})
    client, round_ = 3, 2
    recorder = UploadRecorder(client, round_)
    run_dir, _ = run_experiment(cfg, callbacks=[recorder])
    sent = read_checkpoint(checkpoint_path(run_dir / "checkpoints", round_ - 1))["received"][client]
    data = load_federated_data(cfg.data, cfg.federation.seed).clients[client]
    # the batch from Lightning's loader, seeded as a client's local training is
    loader = batch_loader(
        data.x_train, data.y_train, 4, derive_seed(cfg.federation.seed, round_, client, "local_training")
    )
    x, y = next(iter(loader))
    model = build_model("mlp", (1, 8, 8), 10, hidden_sizes=[32])
    model.load_state_dict(sent)
    F.cross_entropy(model(x), y).backward()
    names = [k for k, _ in model.named_parameters()]
    gradient = observed_gradient(sent, recorder.upload, cfg.federation.lr, names)
    for k, p in model.named_parameters():
        torch.testing.assert_close(gradient[k], p.grad.double(), rtol=1e-4, atol=1e-5)
    assert max(gradient[k].abs().max().item() for k in names) > 1e-3  # the step moved the model


@pytest.mark.parametrize("label", [0, 3, 7, 9])
def test_idlg_reads_the_label_of_a_batch_of_one_from_the_last_layer(digits, label):
    model, state = mlp(seed=label)
    x = digits[0][digits[1] == label][:1]
    gradient = batch_gradient(model, state, x, torch.tensor([label]))
    assert idlg_label(gradient[last_layer_weight(model, 10)]) == label


def test_dlg_and_idlg_reconstruct_a_digit_and_a_noised_gradient_hides_it(digits):
    model, state = mlp()
    x, y = digits[0][5:6], digits[1][5:6]
    gradient = batch_gradient(model, state, x, y)
    recovered = dlg(model, state, gradient, (1, 8, 8), 10, 1, 100, seed=0)
    assert psnr(x, unit_range(recovered.x, 0, 1)).item() > 30 and recovered.labels.tolist() == y.tolist()
    recovered = idlg(model, state, gradient, (1, 8, 8), 10, 100, seed=0)
    assert psnr(x, unit_range(recovered.x, 0, 1)).item() > 30 and recovered.labels.tolist() == y.tolist()
    # Gaussian noise of 10 times the gradient's root mean square, as DP's noise would add
    scale = torch.cat([g.flatten() for g in gradient.values()]).square().mean().sqrt()
    generator = torch.Generator().manual_seed(1)
    noised = {k: g + 10 * scale * torch.randn(g.shape, generator=generator, dtype=g.dtype) for k, g in gradient.items()}
    for attack in (
        dlg(model, state, noised, (1, 8, 8), 10, 1, 100, seed=0),
        idlg(model, state, noised, (1, 8, 8), 10, 100, 0),
    ):
        assert psnr(x, unit_range(attack.x, 0, 1)).item() < 12


def test_psnr_and_ssim_are_torchmetrics_per_image():
    generator = torch.Generator().manual_seed(0)
    for side, options in ((8, {"gaussian_kernel": False, "kernel_size": 7}), (16, {})):
        true = torch.rand(3, 1, side, side, generator=generator)
        recon = (true + 0.1 * torch.randn(true.shape, generator=generator)).clamp(0, 1)
        expected_psnr = [peak_signal_noise_ratio(r[None], t[None], data_range=1.0) for t, r in zip(true, recon)]
        expected_ssim = [
            structural_similarity_index_measure(r[None], t[None], data_range=1.0, **options)
            for t, r in zip(true, recon)
        ]
        torch.testing.assert_close(psnr(true, recon), torch.stack(expected_psnr))
        torch.testing.assert_close(ssim(true, recon), torch.stack(expected_ssim))
    # by hand: an MSE of 0.01 is 20 dB
    assert psnr(torch.zeros(1, 1, 8, 8), torch.full((1, 1, 8, 8), 0.1)).item() == pytest.approx(20.0, abs=1e-4)
    assert psnr(torch.zeros(1, 1, 8, 8), torch.full((1, 1, 8, 8), 0.1)).shape == (1,)
    assert unit_range(torch.tensor([-1.0, 0.0, 1.0, 3.0]), -1, 1).tolist() == [0.0, 0.5, 1.0, 1.0]


def test_the_assignment_pairs_each_true_image_with_its_own_reconstruction(digits):
    true = digits[0][:4]
    recon = true[[2, 0, 3, 1]] + 0.05 * torch.randn(true.shape, generator=torch.Generator().manual_seed(0))
    # true image 0 is reconstruction 1, 1 is 3, 2 is 0, 3 is 2; a greedy pick by row could not be trusted
    assert matched(true, recon.clamp(0, 1)).tolist() == [1, 3, 0, 2]


def test_plfl_invert_writes_its_json_and_image_and_prints_the_table(digits_config, tmp_path, capsys):
    config = tmp_path / "digits.yaml"
    config.write_text(
        f"output_dir: {tmp_path / 'runs'}\nprogress_bar: false\ndata: {{source: digits, num_clients: 5}}\n"
        "model: {name: mlp, hidden_sizes: [32]}\nfederation: {rounds: 3, lr: 0.05, local_steps: 1}\n"
    )
    argv = ["invert", "--config", str(config), "--client", "2", "--round", "1", "--batch-size", "1"]
    assert main([*argv, "--attack", "idlg", "--iterations", "60", "--restarts", "4"]) == 0
    out = capsys.readouterr().out
    assert "IDLG on client 2's upload of round 1 (B = 1" in out and "label accuracy 100 %" in out
    (run_dir,) = (tmp_path / "runs").glob("*/*")
    report = json.loads((run_dir / "inversion.json").read_text())
    assert report["mean_psnr"] > 30 and report["label_accuracy"] == 1.0 and report["gradient_error"] < 1e-4
    assert (report["attack"], report["client"], report["round"], report["batch_size"]) == ("idlg", 2, 1, 1)
    assert len(report["psnr"]) == len(report["ssim"]) == 1 and not math.isnan(report["mean_ssim"])
    assert (run_dir / "inversion.png").read_bytes()[:4] == b"\x89PNG"
    page = write_report([run_dir], tmp_path / "report.html").read_text()
    assert f"mean PSNR {report['mean_psnr']:.2f} dB" in page and 'src="data:image/png;base64,' in page

    # An exact reconstruction (MSE 0): its infinite PSNR is null in the file, which stays JSON, and ∞ on the page.
    image = torch.rand(1, 1, 8, 8)
    exact = psnr(image, image)
    report.update(psnr=exact.tolist(), mean_psnr=exact.mean().item(), gradient_distance=math.nan)
    (run_dir / "inversion.json").write_text(json.dumps(finite_or_null(report), allow_nan=False))
    written = json.loads((run_dir / "inversion.json").read_text())
    assert (written["psnr"], written["mean_psnr"], written["gradient_distance"]) == ([None], None, None)
    assert "mean PSNR ∞ dB" in write_report([run_dir], tmp_path / "report.html").read_text()


def test_dlg_on_a_batch_of_eight_reports_every_image(digits_config, tmp_path):
    cfg = one_step(digits_config, **{"federation.batch_size": 8})
    run_dir, report = invert(cfg, 0, 1, "dlg", 20)
    assert len(report["psnr"]) == len(report["recovered_labels"]) == 8 and report["batch_size"] == 8
    assert report["mean_psnr"] == pytest.approx(sum(report["psnr"]) / 8)
    assert report["gradient_error"] < 1e-4


@pytest.mark.parametrize(
    ("overrides", "client", "round_", "attack", "message"),
    [
        ({"method.name": "fedproto"}, 0, 1, "dlg", "method.name=fedproto does not upload a model"),
        (
            {"federation.local_steps": "null", "federation.local_epochs": 2},
            0,
            1,
            "dlg",
            "Pass federation.local_steps=1 (and federation.local_epochs=null",
        ),
        ({"federation.momentum": 0.5}, 0, 1, "dlg", "Pass federation.momentum=0"),
        ({"data.augment": True}, 0, 1, "dlg", "Set data.augment=false and attack.kind=none"),
        ({}, 0, 3, "dlg", "--round 3 is not a training round of the run, whose rounds are 1..2"),
        ({}, 0, 0, "dlg", "--round 0 is not a training round"),
        ({}, 5, 1, "dlg", "--client 5 is not a client of the run, whose clients are 0..4"),
        ({"federation.join_ratio": 0.4}, 0, 1, "dlg", "client 0 does not train in round 1: the clients sampled then"),
        ({"federation.batch_size": 4}, 0, 1, "idlg", "--attack idlg reads the label of a batch of one"),
    ],
)
def test_what_is_not_one_observed_gradient_is_refused_before_a_run(
    digits_config, tmp_path, overrides, client, round_, attack, message
):
    cfg = one_step(digits_config, **{"federation.batch_size": 1, **overrides})
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        invert(cfg, client, round_, attack, 5)
    assert not any(tmp_path.rglob("config.yaml"))  # no run directory


def test_an_upload_that_is_not_the_batchs_gradient_is_named(digits_config, tmp_path, monkeypatch):
    cfg = one_step(digits_config, **{"federation.batch_size": 1})
    monkeypatch.setattr("plfl.inversion.true_batch", lambda *args: torch.tensor([0]))  # not the trained sample
    with pytest.warns(PlflWarning, match="differs from the gradient of the batch plfl's batch order gives"):
        _, report = invert(cfg, 1, 1, "idlg", 5)
    assert report["gradient_error"] > 1e-3


def test_a_client_that_uploaded_nothing_is_named(digits_config, tmp_path, monkeypatch):
    monkeypatch.setattr(UploadRecorder, "on_client_end", lambda *args: None)  # as if its training had failed
    with pytest.raises(FederationError, match="client 1's local training in round 1 failed, so it uploaded nothing"):
        invert(one_step(digits_config, **{"federation.batch_size": 1}), 1, 1, "idlg", 5)


def test_plfl_invert_refuses_no_iterations(tmp_path, capsys):
    assert main(["invert", "--config", str(tmp_path / "x.yaml"), "--iterations", "0"]) == 2
    assert "the attack needs at least one draw and one L-BFGS iteration" in capsys.readouterr().err


def test_text_data_are_refused(digits_config, tmp_path):
    tokens, labels = torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, dtype=torch.long)
    client = ClientData(tokens, labels, tokens, labels)
    data = FederatedData("agnews", [client], 4, (5,), vocab_size=100)
    with pytest.raises(ConfigError, match=r"plfl invert reconstructs images \(C, H, W\), but agnews's inputs"):
        check_inversion(one_step(digits_config), data, 0, 1, "dlg")


def test_a_client_that_does_not_train_the_received_model_is_refused(digits_config, tmp_path):
    cfg = one_step(digits_config, **{"method.name": "fedala", "federation.rounds": 2})
    with pytest.raises(ConfigError, match="method.name=fedala's client does not start its training from the whole"):
        invert(cfg, 0, 2, "dlg", 5)
