"""The repository's suites (suites/*.yaml, plfl reproduce): each loads, every cell's run config resolves as plfl
reproduce resolves it, and what a suite reports or claims is among the cells it runs. Only configs are read, never
data (hub data included)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from plfl.config import load_config
from plfl.errors import ConfigError
from plfl.reproduce import Suite, cell_config, load_suite

ROOT = Path(__file__).resolve().parents[1]
SUITES = sorted((ROOT / "suites").glob("*.yaml"))


@functools.cache
def suite(path: Path) -> Suite:
    return load_suite(path)


def cells() -> list:
    """A parameter per cell of every suite; a suite that does not load gives one, which fails in the test."""
    params = []
    for path in SUITES:
        try:
            params += [pytest.param(path, s, m, id=f"{path.stem}/{s}/{m}") for s, m in suite(path).cells]
        except ConfigError:
            params.append(pytest.param(path, None, None, id=path.stem))
    return params


def test_the_repository_has_suites():
    assert len(SUITES) >= 10


@pytest.mark.parametrize("path, setting, method", cells())
def test_every_cell_resolves_to_a_valid_config(path, setting, method, monkeypatch):
    monkeypatch.chdir(ROOT)  # config files and data roots are relative to the repository, where plfl reproduce runs
    s = suite(path) if setting is not None else load_suite(path)  # a suite that does not load fails here
    config, overrides = cell_config(s, setting, method, s.rounds, 0)
    cfg = load_config(config, overrides)
    assert (cfg.federation.rounds, cfg.federation.seed) == (s.rounds, 0)
    chosen = [o.removeprefix("method=") for o in overrides if o.startswith("method=")]
    assert not chosen or cfg.method.name == chosen[-1]


@pytest.mark.parametrize("path", SUITES, ids=lambda p: p.stem)
def test_a_suite_reports_and_claims_only_what_it_runs(path):
    s = load_suite(path)
    assert set(s.reported) <= set(s.cells), "a reported value for a cell the suite does not run"
    assert len(set(s.cells)) == len(s.cells), "a cell listed twice"
    settings = {m: {setting for setting, n in s.cells if n == m} for m in s.methods}
    assert all(settings.values()), "a method that runs in no setting"
    for higher, lower in s.claims:
        assert settings[higher] & settings[lower], f"claim {higher} > {lower}: no setting runs both"
