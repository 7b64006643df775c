"""Config errors: each names the key, what is allowed, and the fix."""

import dataclasses
import inspect
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from plfl.config import load_config
from plfl.errors import ConfigError
from plfl.fields import allowed
from plfl.methods import methods, source_config_class

ROOT = Path(__file__).resolve().parents[1]

QUICKSTART = ROOT / "configs" / "quickstart.yaml"


def error_of(*overrides, path=QUICKSTART) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    return str(info.value)


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "federation.roundz=3",
            "Unknown config key 'federation.roundz'. Did you mean 'federation.rounds'? "
            "Valid keys in section 'federation': batch_size, drop_last, eval_every, executor, join_ratio, "
            "local_epochs, local_steps, lr, max_failed_clients, momentum, rounds, seed, state_offload, system, "
            "threads, unseen_clients.",
        ),
        ("method.eta_=2", "Unknown config key 'method.eta_'. Did you mean 'method.eta'?"),
        (
            "bogus=1",
            "Unknown config key 'bogus'. Valid keys in the top level: aggregation, attack, checkpoint_every, data, "
            "eval, federation, keep_checkpoints, logger, method, model,",
        ),
        ("federation.rounds=abc", "Config key 'federation.rounds' has a value of the wrong type"),
        (
            "federation.executor=spark",
            "Config key 'federation.executor' must be one of ray, sequential, vectorized; got 'spark'.",
        ),
        (
            "vectorized.cuda_graphs=false",
            "vectorized.cuda_graphs=false is read only by federation.executor=vectorized, "
            "not by federation.executor=sequential. Remove vectorized.cuda_graphs or set "
            "federation.executor=vectorized.",
        ),
        (
            "vectorized.cohort_size=8",
            "vectorized.cohort_size=8 is read only by federation.executor=vectorized, not by "
            "federation.executor=sequential. Remove vectorized.cohort_size or set "
            "federation.executor=vectorized.",
        ),
        # The executors' keys moved to their own sections: the old key is refused naming the new one.
        (
            "federation.cohort_size=8",
            "federation.cohort_size is now vectorized.cohort_size: write vectorized.cohort_size=8.",
        ),
        (
            "federation.state_offload=maybe",
            "Config key 'federation.state_offload' has a value of the wrong type: Value "
            "'maybe' is not a valid bool (type str). Expected bool.",
        ),
        ("federation.rounds=-1", "Config key 'federation.rounds' must be an integer >= 0; got -1."),
        ("federation.join_ratio=0", "Config key 'federation.join_ratio' must be a number in (0, 1]; got 0.0."),
        ("federation.join_ratio=1.5", "Config key 'federation.join_ratio' must be a number in (0, 1]; got 1.5."),
        ("data.beta=0", "Config key 'data.beta' must be a number > 0; got 0.0."),
        ("data.beta=-0.5", "Config key 'data.beta' must be a number > 0; got -0.5."),
        ("federation.lr=0", "Config key 'federation.lr' must be a number > 0; got 0.0."),
        ("method.s=0", "Config key 'method.s' must be a percentage in (0, 100]; got 0.0."),
        (
            "data.source=imagenet",
            "Config key 'data.source' must be one of agnews, cifar10, cifar100, digits, fashionmnist, "
            "hf, imagefolder, leaf, mnist, pfllib, shakespeare; got 'imagenet'.",
        ),
        (
            "model.name=vgg",
            "Config key 'model.name' must be one of cnn, fasttext, lenet5, lstm, mclr, mlp, resnet18, transformer; "
            "got 'vgg'.",
        ),
        (
            "method.name=fedrox",
            f"Unknown method.name 'fedrox'. Did you mean 'fedprox'? Valid names: {', '.join(sorted(methods()))}.",
        ),
        ("federation.rounds", "Override 'federation.rounds' is not of the form key=value"),
        ("federation.local_steps=0", "Config key 'federation.local_steps' must be null or an integer >= 1; got 0."),
    ],
)
def test_config_errors_name_the_key_and_the_fix(override, message):
    assert message in error_of(override)


@pytest.mark.parametrize(
    "config, override, message",
    [
        ("fedprox", "method.mu=-0.1", "Config key 'method.mu' must be a number >= 0; got -0.1."),
        ("ditto", "method.lam=-1", "Config key 'method.lam' must be a number >= 0; got -1.0."),
        ("ditto", "method.personal_epochs=0", "'method.personal_epochs' must be null or an integer >= 1; got 0."),
        ("perfedavg", "method.variant=so", "must be one of fo, hf"),
        ("perfedavg", "method.alpha=0", "must be null or a number > 0"),
        ("perfedavg", "method.ala.s=50", "method.ala"),
        ("fedamp", "method.sigma=0", "Config key 'method.sigma' must be a number > 0; got 0.0."),
        ("fedamp", "method.alpha_k=-1", "Config key 'method.alpha_k' must be a number > 0; got -1.0."),
        ("fedamp", "method.ala.s=50", "Unknown config key 'method.ala'"),
        ("fedfomo", "method.m=0", "Config key 'method.m' must be an integer >= 1; got 0."),
        ("fedfomo", "method.val_ratio=1", "Config key 'method.val_ratio' must be a number in (0, 1); got 1.0."),
        (
            "pfedhn",
            "method.embedding_dim=0",
            "Config key 'method.embedding_dim' must be null or an integer >= 1; got 0.",
        ),
        ("pfedhn", "method.hn_momentum=1", "Config key 'method.hn_momentum' must be a number in [0, 1); got 1.0."),
        (
            "pfedhn",
            "method.max_grad_norm=0",
            "Config key 'method.max_grad_norm' must be null or a number > 0; got 0.0.",
        ),
        ("apple", "method.dr_lr=-0.1", "Config key 'method.dr_lr' must be a number >= 0; got -0.1."),
        ("apple", "method.schedule_rounds=-1", "Config key 'method.schedule_rounds' must be null or an integer >= 0"),
        ("apple", "method.ala.s=50", "method.ala"),
        ("fedphp", "method.mu=1.5", "Config key 'method.mu' must be a number in [0, 1]; got 1.5."),
        ("fedphp", "method.lam=-0.1", "Config key 'method.lam' must be a number in [0, 1]; got -0.1."),
        (
            "fedphp",
            "method.inheritance_rounds=0",
            "Config key 'method.inheritance_rounds' must be null or an integer >= 1",
        ),
    ],
)
def test_a_methods_own_bad_keys_are_refused(config, override, message):
    assert message in error_of(override, path=ROOT / "configs" / f"{config}.yaml")


def test_a_round_trains_epochs_or_steps_never_both():
    assert (
        "federation.local_epochs=2 and federation.local_steps=20 are both set: a round trains either epochs or "
        "steps. Remove one of them (as an override: federation.local_epochs=null)."
        in error_of("federation.local_epochs=2", "federation.local_steps=20")
    )
    federation = OmegaConf.to_object(
        load_config(QUICKSTART, ["federation.local_epochs=null", "federation.local_steps=20"]).federation
    )
    assert federation.local_length() == {"steps": 20}
    assert OmegaConf.to_object(load_config(QUICKSTART).federation).local_length() == {"epochs": 1}


def test_cohort_size_is_checked_for_the_vectorized_executor():
    assert (
        error_of("federation.executor=vectorized", "vectorized.cohort_size=0")
        == "Config key 'vectorized.cohort_size' must be null or an integer >= 1; got 0."
    )


def test_malformed_yaml_gives_the_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("data:\n  source: digits\nfederation:\n  rounds: [1, 2\n  lr: 0.1\n")
    assert re.search(r"bad.yaml is not valid YAML at line \d+, column \d+", error_of(path=path))


def test_missing_config_file(tmp_path):
    assert "does not exist. Pass an existing YAML file to --config." in error_of(path=tmp_path / "nope.yaml")


def test_overrides_interpolation_and_defaults():
    cfg = load_config(QUICKSTART, ["federation.rounds=3", "name=run-${federation.rounds}", "method.p=1"])
    assert cfg.name == "run-3"
    assert cfg.method.p == 1 and cfg.method.threshold == 0.1  # method defaults filled in
    assert cfg.data.test_fraction == 0.25


def test_relative_data_root_resolves_against_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(QUICKSTART, ["data.source=pfllib", "data.root=some/dir"])
    assert cfg.data.root == str(tmp_path / "some" / "dir")


# The methods plfl is built on run in their own papers' settings; every other method is a baseline of FedALA's
# Table 2 and runs in its MNIST setting, a new one included.
OWN_SETTINGS = {"fedft", "fedftha", "pfedla", "heurpfedla", "selffl"}


@pytest.mark.parametrize("method", sorted(set(methods()) - OWN_SETTINGS))
def test_baseline_configs_run_on_fedalas_mnist_federation(method):
    cfg, fedavg = (
        load_config(ROOT / "configs" / f"{method}.yaml", []),
        load_config(ROOT / "configs" / "fedavg.yaml", []),
    )
    assert cfg.data == fedavg.data and cfg.federation == fedavg.federation and cfg.method.name == method


def test_ala_switches_on_for_fedavg():
    fedavg = ROOT / "configs" / "fedavg.yaml"
    cfg = load_config(fedavg, ["method.ala.s=50"])
    assert cfg.method.ala.s == 50 and cfg.method.ala.p == 2
    assert "Unknown config key 'method.ala.q'" in error_of("method.ala.q=1", path=fedavg)


@pytest.mark.parametrize("name", sorted(methods()))
def test_a_methods_config_rebuilt_from_its_source_has_its_fields_defaults_and_checks(name):
    # What refuses a method's keys before torch is imported must know every key, inherited ones included.
    rebuilt, real = source_config_class(name), methods()[name].config_class
    assert rebuilt is not None and rebuilt.__name__ == real.__name__
    got, want = dataclasses.fields(rebuilt), dataclasses.fields(real)
    assert [f.name for f in got] == [f.name for f in want]
    unqualified = lambda text: re.sub(r"\b[\w.]+\.(?=\w)", "", text)  # noqa: E731
    for g, w in zip(got, want):
        assert unqualified(inspect.formatannotation(g.type)) == w.type
        assert (g.default, allowed(g), g.metadata.get("doc")) == (w.default, allowed(w), w.metadata.get("doc"))


@pytest.mark.parametrize(
    "override, message",
    [
        ("method.sx=40", "Unknown config key 'method.sx'. Did you mean 'method.s'?"),
        ("method.s=0", "Config key 'method.s' must be a percentage in (0, 100]; got 0.0."),
        ("method.p=two", "Config key 'method.p' has a value of the wrong type"),
    ],
)
def test_a_method_keys_error_is_the_same_from_the_source_and_from_the_module(monkeypatch, override, message):
    assert message in error_of(override)
    monkeypatch.setattr("plfl.config.source_config_class", lambda name: None)  # as when the source cannot tell
    assert message in error_of(override)


def test_keys_of_another_method_are_refused_naming_the_switch():
    # quickstart.yaml sets FedALA's s, p, eta: FedAvg has no such keys.
    message = error_of("method.name=fedavg")
    assert message.startswith("Unknown config key 'method.s'. Valid keys in section 'method': ala, name.")
    assert "its method section holds the keys of fedala: write method=fedavg instead of method.name=fedavg" in message


def test_method_switch_takes_the_new_methods_defaults_and_later_keys():
    cfg = load_config(QUICKSTART, ["method=fedprox", "method.mu=0.5"])
    assert dict(cfg.method) == {"name": "fedprox", "ala": None, "mu": 0.5}
    assert load_config(QUICKSTART, ["method.p=1", "method=fedavg"]).method == {"name": "fedavg", "ala": None}
    assert cfg.name == "quickstart" and cfg.data.num_clients == 20  # the rest of the file stays


def test_model_switch_takes_the_new_models_defaults():
    # quickstart.yaml sets the MLP's hidden_sizes, which the CNN does not read.
    message = error_of("model.name=cnn")
    assert message == (
        "model.hidden_sizes=[64] is read only by model.name=mlp, not by model.name=cnn. Remove model.hidden_sizes "
        "(or set its default, model.hidden_sizes=[200]), or set model.name=mlp; model=cnn takes cnn's defaults in "
        "place of the section."
    )
    cfg = load_config(QUICKSTART, ["model=cnn", "model.batch_norm=true"])
    assert cfg.model.name == "cnn" and cfg.model.batch_norm and cfg.model.hidden_sizes == [200]


def test_a_key_in_the_wrong_section_suggests_its_full_dotted_key():
    assert error_of("roundz=3").startswith("Unknown config key 'roundz'. Did you mean 'federation.rounds'?")
    assert error_of("data.rounds=3").startswith("Unknown config key 'data.rounds'. Did you mean 'federation.rounds'?")
    assert error_of("s=40").startswith("Unknown config key 's'. Did you mean 'method.s'?")  # quickstart is FedALA
