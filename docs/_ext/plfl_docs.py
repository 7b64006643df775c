"""Pages of the documentation that are generated at build time, so that they cannot drift from the code:

- ``reference/configuration.md``: every config key from the schemas (:func:`plfl.fields.key_rows`, the source
  that ``plfl methods`` prints);
- ``reference/methods/<name>.md``: one page per registered method, from the registry, its config schema and
  its docstrings;
- ``reference/cli.md``: the help of every ``plfl`` command, from the argument parser;
- ``results/<slug>.md``: each measured table ``results/<slug>.csv`` with its ``<slug>.yaml`` (title,
  description, command, hardware, software, date, units, plot) as a table and a plotly figure.

A Sphinx extension: the pages are written when the builder starts, before Sphinx reads the sources.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import os
import shutil
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
EXECUTORS_TEXT = "sequential, vectorized and ray, with the same numbers ([executors](../../explanation/executors.md))"
SECTIONS = {
    "": "Run",
    "data.": "Data (`data.*`)",
    "model.": "Model (`model.*`)",
    "federation.": "Federation (`federation.*`)",
    "logger.": "Logging (`logger.*`)",
    "trainer.": "Lightning Trainer (`trainer.*`)",
    "ray.": "Ray executor (`ray.*`)",
}
RESULT_KEYS = {"title", "description", "command", "hardware", "software", "date", "units", "plot"}


def cell(text: Any) -> str:
    """``text`` safe inside a Markdown table cell."""
    return str(text).replace("|", "\\|").replace("<", "&lt;").replace("\n", " ")


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def key_table(rows: list) -> str:
    """Config keys as a table: key, type, default, allowed values, meaning."""
    return table(
        ["key", "type", "default", "allowed", "meaning"],
        [[f"`{r.key}`", r.type, f"`{r.default}`", r.allowed, r.doc] for r in rows],
    )


def configuration_page() -> str:
    from plfl.config import ExperimentConfig
    from plfl.fields import key_rows
    from plfl.methods import methods
    from plfl.methods.ala import ALAConfig
    from plfl.methods.base import MethodConfig

    rows = [r for r in key_rows(ExperimentConfig, "") if r.key != "method"]
    text = [
        "# Configuration\n",
        "Every key a config file or a `key=value` override may set, generated from plfl's config schema "
        "(the dataclasses of `plfl/config.py` and of each method's module). A config is checked against "
        "it before anything trains: an unknown key names the close matches, a wrong type or a value outside "
        "*allowed* names the key and what is allowed, and a key that the other keys make meaningless (a "
        "source's own key with another source, `data.beta` with `data.partition: classes`) is refused.\n",
    ]
    for prefix, title in SECTIONS.items():
        section = [r for r in rows if r.key.startswith(prefix) and (prefix or "." not in r.key)]
        text += [f"## {title}\n", key_table(section)]
    text.append(
        "## Methods (`method.*`)\n\n`method.name` picks the method; its own keys sit beside it. `plfl methods "
        "[NAME]` prints the same.\n"
    )
    (name_row,) = [r for r in key_rows(MethodConfig, "method.")]
    text.append(key_table([dataclasses.replace(name_row, allowed="one of " + ", ".join(methods()))]))
    text += [
        "### `method.ala`\n\n[ALA](methods/ala.md) as the local initialisation of a method whose keys list "
        "`method.ala` (FedALA's own keys are the same, directly under `method`).\n",
        key_table(key_rows(ALAConfig, "method.ala.")),
    ]
    for name, cls in methods().items():
        keys = [r for r in key_rows(cls.config_class, "method.") if r.key != "method.name"]
        text.append(f"### `{name}`\n\n[{summary(cls)}](methods/{name}.md)\n")
        text.append(key_table(keys) if keys else "No keys of its own.\n")
    return "\n".join(text)


def summary(cls: type) -> str:
    from plfl.methods import summary as method_summary

    return method_summary(cls)


def files_naming(name: str, folder: str, pattern: str) -> list[str]:
    """Repository files under ``folder`` whose text names ``method.name`` ``name`` (configs, sweeps)."""
    found = []
    for path in sorted((ROOT / folder).glob(pattern)):
        text = yaml.safe_load(path.read_text()) or {}
        method = (text.get("method") or {}).get("name") if isinstance(text.get("method"), dict) else None
        if method == name or (folder == "sweeps" and f"configs/{name}" in path.read_text()):
            found.append(f"`{folder}/{path.name}`")
    return found


def method_page(name: str, cls: type) -> str:
    from plfl.fields import key_rows
    from plfl.methods import takes_ala

    keys = [r for r in key_rows(cls.config_class, "method.") if r.key != "method.name"]
    if name == "fedala":
        ala = "built in: [ALA](ala.md) is FedALA's local initialisation"
    elif takes_ala(cls):
        ala = "yes: `method.ala: {s: 80, p: 2, ...}` adds [ALA](ala.md) to its local initialisation (FedALA, Table 4)"
    else:
        ala = "no: it has a local initialisation of its own, so `method.ala` is an unknown key"
    facts = [
        ["`method.name`", f"`{name}`"],
        ["class", f"{{py:class}}`{cls.__module__}.{cls.__qualname__}`"],
        ["ALA (`method.ala`)", ala],
        ["executors", EXECUTORS_TEXT],
        ["configs", ", ".join(files_naming(name, "configs", "*.yaml")) or "–"],
        ["sweeps", ", ".join(files_naming(name, "sweeps", "*.yaml")) or "–"],
    ]
    return "\n".join(
        [
            f"# {summary(cls).split(':')[0].split(' (')[0]} (`{name}`)\n",
            f"{summary(cls)}\n",
            table(["", ""], facts),
            "## Keys\n",
            key_table(keys) if keys else "No keys of its own; `federation.*` sets its local training.\n",
            "## The method\n",
            "The module's description: the paper, its equations and which hook implements each, and every "
            "departure from the paper or its reference code.\n",
            f"```{{eval-rst}}\n.. automodule:: {cls.__module__}\n   :no-index:\n```\n",
            f"```{{eval-rst}}\n.. autoclass:: {cls.__module__}.{cls.__qualname__}\n"
            "   :members:\n   :exclude-members: config_class, name, server_state\n```\n",
        ]
    )


def ala_page() -> str:
    from plfl.fields import key_rows
    from plfl.methods import methods, takes_ala
    from plfl.methods.ala import ALAConfig

    takers = ", ".join(f"[{n}]({n}.md)" for n, c in methods().items() if takes_ala(c))
    return "\n".join(
        [
            "# Adaptive Local Aggregation (ALA)\n",
            "FedALA's local initialisation as a component: [FedALA](fedala.md) is FedAvg with it (its keys sit "
            f"directly under `method`), and `method.ala: {{...}}` adds it to {takers}.\n",
            "## Keys\n",
            key_table(key_rows(ALAConfig, "method.ala.")),
            "```{eval-rst}\n.. automodule:: plfl.methods.ala\n   :no-index:\n```\n",
        ]
    )


def methods_index() -> str:
    from plfl.methods import methods, takes_ala

    rows = [
        [f"[`{n}`]({n}.md)", summary(c), "built in" if n == "fedala" else "yes" if takes_ala(c) else "no"]
        for n, c in methods().items()
    ]
    toctree = "\n".join([*methods(), "ala"])
    return (
        "# Methods\n\nEvery `method.name`, generated from plfl's method registry: the method's paper and idea, "
        "its keys with their defaults, whether ALA can be added (`method.ala`), and its description with the "
        "equations it implements and its departures from the paper.\n\n"
        + table(["method.name", "method", "[ALA](ala.md)"], rows)
        + f"\n```{{toctree}}\n:hidden:\n\n{toctree}\n```\n"
    )


def cli_page() -> str:
    from plfl.cli import build_parser

    os.environ["COLUMNS"] = "100"  # argparse wraps its help to the terminal's width
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    text = ["# Command line\n", "The `plfl` command and its subcommands, as `--help` prints them.\n"]
    for name, sub in [("plfl", parser), *((f"plfl {n}", p) for n, p in commands.items())]:
        text += [f"## `{name}`\n", f"```text\n{sub.format_help().rstrip()}\n```\n"]
    return "\n".join(text)


def read_result(meta_path: Path) -> tuple[dict, list[dict[str, str]]]:
    """A results table: its YAML (checked) and its CSV rows.

    Raises:
        ValueError: a key missing or unknown, the CSV missing, or a plotted column not in it.
    """
    meta = yaml.safe_load(meta_path.read_text())
    missing = {"title", "description", "command", "hardware", "date"} - set(meta)
    if missing or set(meta) - RESULT_KEYS:
        raise ValueError(f"{meta_path}: missing keys {sorted(missing)}, unknown {sorted(set(meta) - RESULT_KEYS)}")
    with open(meta_path.with_suffix(".csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    plot = meta.get("plot") or {}
    wanted = [plot.get("x"), plot.get("group"), *as_list(plot.get("y"))]
    absent = [c for c in wanted if c and c not in rows[0]]
    if absent:
        raise ValueError(f"{meta_path}: plot columns {absent} are not in {meta_path.with_suffix('.csv').name}")
    return meta, rows


def as_list(value: Any) -> list:
    return [] if value is None else value if isinstance(value, list) else [value]


def number(value: str) -> float | None:
    try:
        return float(value)
    except ValueError:
        return None


def figure_html(meta: dict, rows: list[dict[str, str]]) -> str:
    """The plot the YAML asks for, as a plotly ``div`` (plotly.js is loaded by the page)."""
    import plotly.graph_objects as go

    plot, units = meta["plot"], meta.get("units") or {}
    x, ys, group = plot["x"], as_list(plot["y"]), plot.get("group")
    series = (
        {g: [r for r in rows if r[group] == g] for g in dict.fromkeys(r[group] for r in rows)}
        if group
        else {y: rows for y in ys}
    )
    fig = go.Figure()
    for label, points in series.items():
        y = ys[0] if group else label
        values = [number(r[y]) for r in points]
        xs = [r[x] for r in points]
        if all(number(v) is not None for v in xs):  # a numeric axis (rounds), not categories
            xs = [number(v) for v in xs]
        trace = go.Bar if plot.get("kind") == "bar" else go.Scatter
        fig.add_trace(trace(x=xs, y=values, name=str(label), **({} if trace is go.Bar else {"mode": "lines+markers"})))
    unit = units.get(ys[0], "")
    fig.update_layout(
        template="plotly_white",
        height=420,
        margin=dict(l=60, r=20, t=30, b=50),
        xaxis_title=f"{x} ({units[x]})" if x in units else x,
        yaxis_title=plot.get("y_title") or (f"{ys[0]} ({unit})" if unit else ys[0]),
        yaxis_type="log" if plot.get("log_y") else None,
        barmode="group",
    )
    return fig.to_html(full_html=False, include_plotlyjs=False, config={"displaylogo": False})


def result_page(meta: dict, rows: list[dict[str, str]], csv_name: str) -> str:
    units = meta.get("units") or {}
    header = [f"{c} ({units[c]})" if c in units else c for c in rows[0]]
    text = [
        f"# {meta['title']}\n",
        meta["description"].strip() + "\n",
        table(["", ""], [[k, meta[k]] for k in ("hardware", "software", "date") if k in meta]),
        f"Command:\n\n```bash\n{meta['command'].strip()}\n```\n",
    ]
    if meta.get("plot"):
        text.append(
            f'```{{raw}} html\n<script src="../_static/plotly.min.js"></script>\n{figure_html(meta, rows)}\n```\n'
        )
    text += [table(header, [list(r.values()) for r in rows]), f"Data: {{download}}`{csv_name} <{csv_name}>`\n"]
    return "\n".join(text)


def results_pages(folder: Path) -> dict[str, str]:
    """slug → page text for every ``<slug>.yaml`` in ``folder``, plus ``index``."""
    pages, index = {}, []
    for meta_path in sorted(folder.glob("*.yaml")):
        meta, rows = read_result(meta_path)
        pages[meta_path.stem] = result_page(meta, rows, meta_path.with_suffix(".csv").name)
        index.append([f"[{meta['title']}]({meta_path.stem}.md)", meta["date"], meta["hardware"]])
    index.sort(key=lambda row: str(row[1]), reverse=True)
    pages["index"] = (
        "# Results\n\nMeasured figures, each with the command that produced it, the hardware and the date. "
        "Every page is generated from a CSV file and a YAML file in `docs/results/`; add a measurement by "
        "adding such a pair.\n\n"
        + table(["table", "date", "hardware"], index)
        + "\n```{toctree}\n:hidden:\n\n"
        + "\n".join(sorted(p for p in pages if p != "index"))
        + "\n```\n"
    )
    return pages


def write(path: Path, text: str) -> None:
    """Write ``text`` unless the file already holds it (so that Sphinx rebuilds only what changed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def generate(docs: Path = DOCS) -> None:
    """Write every generated page under ``docs``."""
    from plfl.methods import methods

    write(docs / "reference" / "configuration.md", configuration_page())
    with redirect_stdout(io.StringIO()):
        write(docs / "reference" / "cli.md", cli_page())
    write(docs / "reference" / "methods" / "index.md", methods_index())
    write(docs / "reference" / "methods" / "ala.md", ala_page())
    for name, cls in methods().items():
        write(docs / "reference" / "methods" / f"{name}.md", method_page(name, cls))
    for slug, text in results_pages(docs / "results").items():
        write(docs / "results" / f"{slug}.md", text)


def copy_plotly(app: Any) -> None:
    """plotly.js beside the pages, so that the results' figures work offline."""
    import plotly

    source = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    static = Path(app.outdir) / "_static"
    static.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, static / "plotly.min.js")


def setup(app: Any) -> dict[str, Any]:
    app.connect("builder-inited", lambda app: (generate(Path(app.srcdir)), copy_plotly(app)))
    return {"parallel_read_safe": True, "parallel_write_safe": True}
