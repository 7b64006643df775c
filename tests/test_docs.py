"""The documentation: its generated reference covers every method and every config key, its results tables
are well-formed, the guides' code is the repository's code, and the README stays short.

The site itself is built by ``.ci/run`` (``sphinx-build -W``: a broken link or reference fails it); these
tests check what the generator (docs/_ext/plfl_docs.py) writes."""

import dataclasses
import re
import runpy
import subprocess
import sys
import typing
from dataclasses import is_dataclass
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from plfl.config import ExperimentConfig, dotted_items
from plfl.methods import methods

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "_ext"))
import plfl_docs  # noqa: E402  (the docs' own extension, beside conf.py)

SOURCES = {"python": ["plfl/**/*.py", "tests/*.py"], "yaml": ["configs/*.yaml"]}
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
    for command in ("fit", "sweep", "compare", "report", "methods"):
        assert f"## `plfl {command}`" in page and f"usage: plfl {command}" in page


def test_every_results_table_names_its_command_hardware_and_date_and_plots_its_own_columns():
    folder = ROOT / "docs" / "results"
    tables = sorted(folder.glob("*.yaml"))
    assert tables and all(path.with_suffix(".csv").exists() for path in tables)
    pages = plfl_docs.results_pages(folder)  # raises on a missing key or a plotted column not in the CSV
    assert set(pages) == {p.stem for p in tables} | {"index"}


def test_a_results_table_that_plots_a_missing_column_is_refused(tmp_path):
    (tmp_path / "t.csv").write_text("round,accuracy\n1,50\n")
    meta = "title: t\ndescription: d\ncommand: c\nhardware: h\ndate: 2026-01-01\nplot: {x: round, y: acc}\n"
    (tmp_path / "t.yaml").write_text(meta)
    with pytest.raises(ValueError, match=r"plot columns \['acc'\] are not in t.csv"):
        plfl_docs.results_pages(tmp_path)


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
