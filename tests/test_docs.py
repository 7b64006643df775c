"""The documentation: its generated reference covers every method and every config key, its results tables
are well-formed, the guides' code is the repository's code, and the README stays short.

The site itself is built by ``.ci/run`` (``sphinx-build -W``: a broken link or reference fails it); these
tests check what the generator (docs/_ext/plfl_docs.py) writes."""

import csv
import dataclasses
import re
import runpy
import subprocess
import sys
import typing
from dataclasses import is_dataclass
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from plfl.config import ExperimentConfig, dotted_items
from plfl.methods import method_class, methods, summary

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "_ext"))
import plfl_docs  # noqa: E402  (the docs' own extension, beside conf.py)

SOURCES = {"python": ["plfl/**/*.py", "tests/*.py"], "yaml": ["configs/*.yaml", "suites/*.yaml"]}
FENCE = re.compile(r"^```(?P<language>\w+)\n(?P<block>.*?)^```$", re.MULTILINE | re.DOTALL)
GENERATED = {"reference/configuration.md", "reference/cli.md"}


def guides() -> list[Path]:
    """The hand-written pages of docs/ (not the generated ones, not the build)."""
    docs = ROOT / "docs"
    return [
        p
        for p in sorted(docs.rglob("*.md"))
        if p.relative_to(docs).parts[0] not in ("_build", "results")
        and p.relative_to(docs).parts[:2] != ("reference", "methods")
        and p.relative_to(docs).as_posix() not in GENERATED
    ]


def code_blocks(guide: Path) -> list[tuple[str, str, str]]:
    """(language, block, name) of each checked block; the name is the guide, line and first line."""
    text = guide.read_text()
    blocks = []
    for m in FENCE.finditer(text):
        if m["language"] in SOURCES:
            line = text.count("\n", 0, m.start()) + 1
            name = f"{guide.relative_to(ROOT / 'docs')}:{line} {m['block'].splitlines()[0].strip()}"
            blocks.append((m["language"], m["block"], name))
    return blocks


BLOCKS = [block for guide in guides() for block in code_blocks(guide)]


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    """The generated pages, written into an empty docs folder."""
    docs = tmp_path_factory.mktemp("docs")
    plfl_docs.generate(docs)
    return docs


def test_every_registered_method_has_a_reference_page(generated):
    index = (generated / "reference" / "methods" / "index.md").read_text()
    for name, cls in methods().items():
        page = (generated / "reference" / "methods" / f"{name}.md").read_text()
        assert f"| `method.name` | `{name}` |" in page and f".. autoclass:: {cls.__module__}.{cls.__qualname__}" in page
        assert f"[`{name}`]({name}.md)" in index and f"\n{name}\n" in index  # listed and in the toctree
        for f in dataclasses.fields(cls.config_class):
            assert f.name == "name" or f"`method.{f.name}`" in page, (name, f.name)


def config_keys() -> list[str]:
    """Every key of the run schema (from OmegaConf's view of it) and every method's ``method.*`` key."""
    schema = OmegaConf.to_container(OmegaConf.structured(ExperimentConfig))
    keys = [key for key, _ in dotted_items(schema) if not key.startswith("method")]
    for cls in methods().values():
        for f in dataclasses.fields(cls.config_class):
            keys.append(f"method.{f.name}")
            nested = [a for a in typing.get_args(typing.get_type_hints(cls.config_class)[f.name]) if is_dataclass(a)]
            keys += [f"method.{f.name}.{g.name}" for section in nested for g in dataclasses.fields(section)]
    return sorted(set(keys), key=keys.index)


@pytest.mark.parametrize("key", config_keys())
def test_every_config_key_has_an_entry_with_its_meaning_in_the_configuration_reference(generated, key):
    page = (generated / "reference" / "configuration.md").read_text()
    rows = [line for line in page.splitlines() if line.startswith(f"| `{key}` |")]
    assert rows, f"{key} is not in the configuration reference"
    meanings = [row.rstrip(" |").rpartition(" | ")[2] for row in rows]
    assert all(meanings), f"{key} has no meaning: give its field a doc (plfl.fields.checked/documented/one_of)"


def test_the_command_line_reference_holds_every_command(generated):
    page = (generated / "reference" / "cli.md").read_text()
    for command in ("fit", "sweep", "reproduce", "compare", "report", "methods"):
        assert f"## `plfl {command}`" in page and f"usage: plfl {command}" in page


RESULTS = ROOT / "docs" / "results"
RESULT_YAMLS = sorted(RESULTS.glob("*.yaml"))
META = (
    "title: t\ndescription: d\ncommand: c\nhardware: h\nsoftware: s\ncode: 1234abc\nversion: 0.2.0\ndate: 2026-01-01\n"
)


@pytest.fixture(scope="module")
def results() -> dict[str, str]:
    """The results pages that the generator writes from docs/results/."""
    return plfl_docs.results_pages(RESULTS)


def test_every_results_table_names_its_command_hardware_and_date_and_plots_its_own_columns(results):
    assert RESULT_YAMLS and all(path.with_suffix(".csv").exists() for path in RESULT_YAMLS)
    overviews = {f"dataset-{d}" for d in plfl_docs.DATASETS}
    assert set(results) - overviews == {p.stem for p in RESULT_YAMLS} | {"index"}
    assert {"dataset-mnist", "dataset-cifar10", "dataset-femnist", "dataset-agnews"} <= set(results)


@pytest.mark.parametrize("path", RESULT_YAMLS, ids=[p.stem for p in RESULT_YAMLS])
def test_every_results_yaml_has_the_fields_the_generator_needs(path):
    meta = yaml.safe_load(path.read_text())
    required = [key for key, (needed, _) in plfl_docs.RESULT_FIELDS.items() if needed]
    assert not [key for key in required if key not in meta], f"{path.name} lacks fields"
    assert re.fullmatch(r"[0-9a-f]{7}( \(.+\))?", meta["code"]), meta["code"]  # a commit as `git log --format=%h`
    assert re.fullmatch(r"\d+\.\d+\.\d+", meta["version"]), meta["version"]
    assert all(d in plfl_docs.DATASETS for d in plfl_docs.datasets_of(meta)), meta["dataset"]
    assert re.match(r"\d{4}-\d{2}-\d{2}", str(meta["date"])), meta["date"]


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def test_every_results_commit_exists_and_has_the_version_its_yaml_names():
    try:
        if git("rev-parse", "--is-shallow-repository") == "true":
            pytest.skip("a shallow clone lacks the results' commits")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    for path in RESULT_YAMLS:
        meta = yaml.safe_load(path.read_text())
        for commit in re.findall(r"\b[0-9a-f]{7}\b", meta["code"]):
            source = git("show", f"{commit}:plfl/__init__.py") if git("ls-tree", commit, "plfl/__init__.py") else ""
            found = re.search(r'__version__ = "([^"]+)"', source) or re.search(
                r'^version = "([^"]+)"', git("show", f"{commit}:pyproject.toml"), re.MULTILINE
            )
            assert found and found[1] == meta["version"], (path.name, commit, found and found[1])
            assert git("log", "-1", "--format=%ad", "--date=short", commit) >= "2026-11-22", (path.name, commit)


def test_a_results_table_that_plots_a_missing_column_is_refused(tmp_path):
    (tmp_path / "t.csv").write_text("round,accuracy\n1,50\n")
    (tmp_path / "t.yaml").write_text(META + "dataset: digits\nplot: {x: round, y: acc}\n")
    with pytest.raises(ValueError, match=r"plot columns \['acc'\] are not in t.csv"):
        plfl_docs.results_pages(tmp_path)


@pytest.mark.parametrize(
    "fields, error",
    [
        ("dataset: digits\naccuracy: {method: method, round: round, value: acc}\n", r"accuracy columns \['acc'\]"),
        ("dataset: digits\naccuracy: {methods: {accuracy: FedAvg}, round: round}\n", r"unit % in units"),
        ("dataset: digits\naccuracy: {method: method, round: round}\n", r"value is needed"),
        ("dataset: mnist-dir\n", r"dataset \['mnist-dir'\] is none of"),
        ("dataset: null\n", None),
    ],
)
def test_a_results_yaml_that_misnames_its_accuracy_or_data_set_is_refused(tmp_path, fields, error):
    (tmp_path / "t.csv").write_text("method,round,accuracy\nFedAvg,1,50\n")
    (tmp_path / "t.yaml").write_text(META + fields)
    if error is None:
        assert set(plfl_docs.results_pages(tmp_path)) == {"t", "index"}  # no data set: no overview page
    else:
        with pytest.raises(ValueError, match=error):
            plfl_docs.results_pages(tmp_path)
    (tmp_path / "t.yaml").write_text(META.replace("code: 1234abc", "code: HEAD") + "dataset: digits\n")
    with pytest.raises(ValueError, match="is not a commit"):
        plfl_docs.results_pages(tmp_path)


def leaderboard(page: str, heading: str) -> list[tuple[str, str, str, str]]:
    """(method, number, linked table, also measured) of each row of the leaderboard under ``### heading``."""
    section = page.split(f"\n### {heading}\n", 1)[1].split("\n#", 1)[0]
    rows = []
    for line in section.splitlines()[3:]:
        if line.startswith("| "):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            number, table = re.fullmatch(r"\[([-\d.]+)\]\(([\w-]+)\.md\).*", cells[2]).groups()
            rows.append((re.sub(r"\[(.*?)\]\(.*?\)", r"\1", cells[1]), number, table, cells[5]))
    return rows


def csv_rows(table: str) -> list[dict[str, str]]:
    with open(RESULTS / f"{table}.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_a_leaderboard_number_is_the_value_in_the_csv_it_links_to(results):
    mnist = leaderboard(results["dataset-mnist"], "Round 10")
    (fedala,) = [row for row in mnist if row[0] == "FedALA"]
    spec = plfl_docs.read_result(RESULTS / f"{fedala[2]}.yaml")[0]["accuracy"]
    (source,) = [
        r
        for r in csv_rows(fedala[2])
        if r[spec["method"]] == "FedALA" and (spec["round"] == 10 or r[spec["round"]] == "10")
    ]
    assert fedala[1] == source[spec["value"]]
    agnews = leaderboard(results["dataset-agnews"], "Round 100")
    expected = {r["method"]: r["accuracy"] for r in csv_rows("fedala-agnews-100-rounds") if r["round"] == "100"}
    assert {method: number for method, number, _, _ in agnews} == expected
    assert [method for method, *_ in agnews] == sorted(expected, key=lambda m: -float(expected[m]))
    shakespeare = leaderboard(results["dataset-shakespeare"], "Round 6")
    assert shakespeare[0][:2] == ("FedAvg", csv_rows("fedavg-shakespeare-6-rounds")[-1]["accuracy"])


def test_every_leaderboard_number_is_in_its_table_and_every_board_ranks_highest_first(results):
    boards = 0
    for name, page in results.items():
        for heading in re.findall(r"^### (.+)$", page, re.MULTILINE) if name.startswith("dataset-") else []:
            rows, boards = leaderboard(page, heading), boards + 1
            numbers = [float(number) for _, number, _, _ in rows]
            assert numbers == sorted(numbers, reverse=True), (name, heading)
            for method, number, table, _ in rows:
                assert any(number in r.values() for r in csv_rows(table)), (name, heading, method, number, table)
    assert boards >= 8


def test_an_overview_lists_its_tables_and_each_table_shows_its_code_above_its_description(results):
    for path in RESULT_YAMLS:
        meta = yaml.safe_load(path.read_text())
        for dataset in plfl_docs.datasets_of(meta):
            tables = results[f"dataset-{dataset}"].split("\n## Tables\n", 1)[1]
            assert f"[{meta['title']}]({path.stem}.md)" in tables, (dataset, path.stem)
        top = results[path.stem].split(meta["description"].strip().splitlines()[0])[0]  # above the description
        assert f"plfl {meta['version']}, commit `{meta['code'][:7]}`" in top and f"on {meta['date']}" in top


def test_a_method_measured_in_several_tables_shows_the_newest_and_lists_the_others(tmp_path):
    older = "dataset: digits\nunits: {accuracy: '%'}\naccuracy: {method: method, round: round, value: accuracy}\n"
    (tmp_path / "a.csv").write_text("method,round,accuracy\nFedAvg,1,40.0\nFedAvg,2,60.0\n")
    (tmp_path / "a.yaml").write_text(META + older)
    (tmp_path / "b.csv").write_text("method,round,accuracy\nFedAvg,2,61.5\nLocal (own data),2,70.25\n")
    (tmp_path / "b.yaml").write_text(META.replace("2026-01-01", "2026-02-01") + older)
    page = plfl_docs.results_pages(tmp_path)["dataset-digits"]
    assert leaderboard(page, "Round 2") == [
        ("Local (own data)", "70.25", "b", ""),
        ("FedAvg", "61.5", "b", "[60.0](a.md) (2026-01-01)"),
    ]
    assert "### Round 1" not in page  # no table's run ends there
    assert (
        "[Local (own data)](../reference/methods/local.md)" in page
        and "[FedAvg](../reference/methods/fedavg.md)" in page
    )


MATH_MODULE = r'''
def step(theta):
    r"""ALA's update of the weights :math:`W_i`.

    .. math::

        \hat\Theta_i = \Theta_i + (\Theta - \Theta_i) \odot W_i

    Args:
        theta: the local model :math:`\Theta_i`.
    """
'''
MATH_PAGE = r"""# Math

The weight $\alpha_i^{l,j}$ of client $j$'s layer $l$, and a price of $5 to $10.

$$
\bar\theta_i^l = \sum_j \alpha_i^{l,j} \theta_j^l
$$

```{eval-rst}
.. autofunction:: mathdoc.step
```
"""


@pytest.mark.slow
def test_math_in_markdown_and_docstrings_is_rendered_by_a_mathjax_shipped_with_the_site(tmp_path):
    """A page built with the site's extensions and MyST settings (docs/conf.py, less the generated pages) renders
    ``$...$``, ``$$...$$``, a docstring's ``:math:`` and ``.. math::`` as MathJax markup, and loads MathJax from
    the site's own ``_static``, not from a CDN."""
    conf = runpy.run_path(str(ROOT / "docs" / "conf.py"))
    settings = {k: v for k, v in conf.items() if k.startswith(("myst_", "napoleon_", "autodoc_", "html_theme"))}
    settings["extensions"] = [e for e in conf["extensions"] if e not in ("plfl_docs", "sphinx.ext.viewcode")]
    (tmp_path / "conf.py").write_text(
        f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\n" + "".join(f"{k} = {v!r}\n" for k, v in settings.items())
    )
    (tmp_path / "mathdoc.py").write_text(MATH_MODULE)
    (tmp_path / "index.md").write_text(MATH_PAGE)
    out = tmp_path / "html"
    build = [sys.executable, "-m", "sphinx", "-W", "-q", "-b", "html", str(tmp_path), str(out)]
    result = subprocess.run(build, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    html = (out / "index.html").read_text()
    inline = re.findall(r'<span class="math notranslate nohighlight">\\\((.*?)\\\)</span>', html)
    assert r"\alpha_i^{l,j}" in inline and "j" in inline and r"\Theta_i" in inline  # Markdown and docstring
    assert "a price of $5 to $10" in html  # dollars that do not hug a formula stay text
    display = re.findall(r'<div class="math notranslate nohighlight">\s*\\\[(.*?)\\\]</div>', html, re.DOTALL)
    assert [d.strip() for d in display] == [
        r"\bar\theta_i^l = \sum_j \alpha_i^{l,j} \theta_j^l",
        r"\hat\Theta_i = \Theta_i + (\Theta - \Theta_i) \odot W_i",
    ]
    scripts = re.findall(r"<script[^>]*\bsrc=\"([^\"]+)\"", html)
    assert "_static/mathjax/tex-chtml.js" in [s.partition("?")[0] for s in scripts]  # ?v=<checksum> on a rebuild
    assert not [s for s in scripts if "//" in s], scripts  # no http(s):// nor protocol-relative CDN address
    assert (out / "_static" / "mathjax" / "tex-chtml.js").stat().st_size > 100_000
    assert (out / "_static" / "mathjax" / "output" / "chtml" / "fonts" / "woff-v2").is_dir()


INSTALL = re.compile(r"pip install (?P<options>[^\n`]*?)-e\s+(?P<target>'[^']*'|[^\s`]+)")


def test_every_page_installs_plfl_with_the_extras_the_readme_and_ci_name():
    """No page installs plfl bare (`pip install -e .`: without the test tools the README's next command fails),
    and every install with the CI pins installs what .ci/run installs."""
    ((options, ci),) = INSTALL.findall((ROOT / ".ci" / "run").read_text())
    readme = {target for _, target in INSTALL.findall((ROOT / "README.md").read_text())}
    assert "'.[dev]'" in readme and ci in readme and "-c constraints.txt" in options
    for page in [ROOT / "README.md", *guides()]:
        for options, target in INSTALL.findall(page.read_text()):
            where = page.relative_to(ROOT)
            assert target.startswith("'.["), f"{where} installs plfl as {target}, the README as '.[dev]'"
            assert "-c constraints.txt" not in options or target == ci, f"{where}: CI installs {ci}, not {target}"


def test_ci_runs_the_readmes_test_tiers_which_split_the_suite():
    """The README's pytest commands are .ci/run's, in order, and they are the two tiers: fast, then slow."""
    commands = re.compile(r"^(pytest [^\n#]*?)\s*(?:#.*)?$", re.MULTILINE)
    readme = commands.findall((ROOT / "README.md").read_text())
    assert readme == commands.findall((ROOT / ".ci" / "run").read_text())
    assert readme == ['pytest -q -n auto -m "not slow"', "pytest -q -n auto -m slow"]


def test_the_readme_methods_table_is_the_registrys():
    """Each row of the README's method table names a registered method with its own summary (the first line of
    its class docstring, as ``plfl methods`` prints it) and a config of that method."""
    rows = re.findall(r"^\| `(\w+)` \| (.+?) \| `(\S+\.yaml)` \|$", (ROOT / "README.md").read_text(), re.MULTILINE)
    assert len(rows) >= 4
    for name, text, config in rows:
        assert text == summary(method_class(name)).rstrip("."), name
        assert OmegaConf.load(ROOT / "configs" / config).method.name == name


def test_the_readme_stays_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= 250, f"README.md has {lines} lines; move reference and results into docs/"


def test_the_method_guide_has_checked_blocks():
    names = [name for _, _, name in BLOCKS if name.startswith("how-to/write-a-method.md")]
    assert len(names) >= 5, names  # schema, registry, update, class, test (and the config)


@pytest.mark.parametrize("language, block, name", BLOCKS, ids=[name for _, _, name in BLOCKS])
def test_block_appears_verbatim_in_the_repository(language, block, name):
    files = [path for pattern in SOURCES[language] for path in sorted(ROOT.glob(pattern))]
    assert any(block in path.read_text() for path in files), (
        f"The {language} block at {name!r} is not in any of {', '.join(SOURCES[language])}: copy it again "
        "from the file it shows, or fix the file."
    )
