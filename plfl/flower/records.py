"""plfl's client requests and replies as Flower records: models as ``ArrayRecord``s, the rest in one ``ConfigRecord``.

A request to a SuperNode names its clients (``config["clients"]``) and carries the models they need once each: a
model that several clients receive (the global model) travels once, and ``config["model_of"]`` gives each client's
model's index (-1: none). A reply lists per client what it did, failures as ``failed`` clients with their
``reasons``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from plfl.state import Params

CONFIG = "config"


def with_models(config: dict, models: Sequence[Optional[Params]]) -> RecordDict:
    """A request of ``config`` carrying ``models`` (one per client of ``config["clients"]``, None: none), each
    distinct model object once."""
    distinct: dict[int, int] = {}
    records = RecordDict()
    model_of = []
    for model in models:
        if model is None:
            model_of.append(-1)
            continue
        if id(model) not in distinct:
            distinct[id(model)] = len(distinct)
            records[f"model.{distinct[id(model)]}"] = ArrayRecord(torch_state_dict=model)
        model_of.append(distinct[id(model)])
    records[CONFIG] = ConfigRecord({**config, "model_of": model_of})
    return records


def models_of(records: RecordDict) -> list[Optional[Params]]:
    """The models of a :func:`with_models` request, one per client (None: none); clients that received the same
    model share one object."""
    loaded: dict[int, Params] = {}
    models = []
    for k in records[CONFIG]["model_of"]:
        if k < 0:
            models.append(None)
            continue
        if k not in loaded:
            loaded[k] = records[f"model.{k}"].to_torch_state_dict()
        models.append(loaded[k])
    return models


def config_of(records: RecordDict) -> ConfigRecord:
    """The request's or reply's ``ConfigRecord``."""
    return records[CONFIG]
