"""The README and docs/ stay true: examples run, figures match, the docs build.

- every python example in README.md and docs/ runs;
- every figure quoted from a benchmark or training run agrees with its
  committed results file (docs/figures.py);
- every public name is in the API reference (docs/api/);
- every link to a page or a file of the repository resolves;
- the docs build with Sphinx without a warning (skipped, saying so, where
  the ``docs`` extra is not installed);
- the README stays a front door (at most 12 KB).
"""

import importlib.util
import io
import pathlib
import re
import warnings

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
API_FILE = ROOT / "tests" / "public_api.txt"
REPO_URL = "https://github.com/qbits-dev/qbits/"


def _figures():
    spec = importlib.util.spec_from_file_location("figures", DOCS / "figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _markdown_files() -> list[pathlib.Path]:
    return _figures().markdown_files()


def test_readme_is_a_front_door():
    size = len(README.read_bytes())
    assert size <= 12 * 1024, f"README.md is {size} bytes: move detail to docs/"


def _examples() -> dict[pathlib.Path, list[tuple[int, str]]]:
    """Each file's ```python blocks and their lines; a block seen before is left out.

    (E.g. a README example repeated in its guide runs once.)
    """
    seen, out = set(), {}
    for path in _markdown_files():
        text = path.read_text()
        for m in re.finditer(r"```python\n(.*?)```", text, re.S):
            block = m.group(1)
            if block not in seen:
                seen.add(block)
                line = text.count("\n", 0, m.start(1))
                out.setdefault(path, []).append((line, block))
    return out


# One test per file: the workers share the examples' compile time.
EXAMPLES = _examples()


@pytest.mark.parametrize("path", list(EXAMPLES), ids=lambda p: p.name)
def test_python_examples_run(path):
    """Each ```python block runs on its own."""
    for line, block in EXAMPLES[path]:
        # Tracebacks name the markdown file's line.
        exec(compile("\n" * line + block, str(path), "exec"), {})


def test_docs_have_python_examples():
    assert EXAMPLES


def test_serving_example_step_captures_no_batch():
    """examples/serving_mlp.py: a batch closed over by the jitted step is an
    XLA constant, whose quantization XLA folded for seconds at compile time
    (14 lines of "Constant folding ... taking > 1s" alarms)."""
    import jax
    import optax

    import qbits
    from examples.serving_mlp import Mlp, make_step

    qat = qbits.flax.quantize(Mlp(), "w4a8")
    x, y = jax.numpy.ones((4, 256)), jax.numpy.zeros((4,), "int32")
    params = Mlp().init(jax.random.key(0), x)
    tx = optax.sgd(0.1)
    traced = make_step(qat, tx).trace(params, tx.init(params), x, y)
    assert max((c.size for c in traced.jaxpr.consts), default=0) < 1000


def test_figures_agree_with_their_results_files():
    problems = _figures().check()
    assert not problems, (
        "figures differ from benchmarks/results/ (python docs/figures.py "
        "rewrites them):\n\n" + "\n\n".join(problems)
    )


def test_a_changed_figure_is_caught(tmp_path):
    figures = _figures()
    text = README.read_text()
    assert "<!-- figure: lm_headline -->" in text
    page = tmp_path / "page.md"
    page.write_text(figures.render(text))
    assert figures.check([page]) == []
    start = page.read_text().index("<!-- figure: lm_headline -->")
    changed = re.sub(r"1\.00\d\d", "1.0999", page.read_text()[start:], count=1)
    page.write_text(page.read_text()[:start] + changed)
    (problem,) = figures.check([page])
    assert "lm_headline" in problem and "1.0999" in problem


def _documented_names() -> set[str]:
    """Names given to an autodoc or python-domain directive in docs/api/."""
    pattern = re.compile(
        r"^\.\. (?:auto\w+|py:\w+):: ([\w.]+)\n(?:   :module: ([\w.]+)\n)?", re.M
    )
    names = set()
    for page in (DOCS / "api").glob("*.md"):
        for name, module in pattern.findall(page.read_text()):
            names.add(f"{module}.{name}" if module else name)
    return names


def _public_names() -> set[str]:
    lines = [ln for ln in API_FILE.read_text().splitlines() if ln and ln[0] != "#"]
    return {ln.replace(": ", ".") for ln in lines}


def test_every_public_name_is_in_the_api_reference():
    missing = sorted(_public_names() - _documented_names())
    assert not missing, (
        "add these to their module's page in docs/api/ (e.g. "
        "'.. autofunction:: qbits.NAME' in an eval-rst block):\n" + "\n".join(missing)
    )


def test_links_resolve():
    """Links point at files of the repository that exist, and at their headings."""
    link = re.compile(r"\]\(([^)\s]+)\)")
    problems = []
    for path in _markdown_files():
        for target in link.findall(path.read_text()):
            if target.startswith(REPO_URL):
                parts = target[len(REPO_URL) :].split("#")[0].split("/")
                if parts[0] in ("blob", "tree") and len(parts) > 2:
                    file = ROOT.joinpath(*parts[2:])
                elif parts == ["issues"] or parts == [""]:
                    continue
                else:
                    problems.append(f"{path.name}: {target}")
                    continue
            elif re.match(r"\w+:", target):
                continue  # another site
            else:  # relative, or "#heading" on the same page
                file = path.parent / target.split("#")[0] if target[0] != "#" else path
            anchor = target.partition("#")[2]
            if not file.exists():
                problems.append(f"{path.relative_to(ROOT)}: {target}")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                problems.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert not problems, "links to nothing:\n" + "\n".join(problems)


def _anchors(page: pathlib.Path) -> set[str]:
    """GitHub's (and MyST's) anchors of a page's headings."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    headings = re.findall(r"^#+ (.*)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_docs_build_without_warnings(tmp_path):
    for module in ("sphinx", "myst_parser"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed: pip install -e '.[docs]'")
    from sphinx.application import Sphinx

    out = io.StringIO()
    with warnings.catch_warnings():
        # Deprecations inside Sphinx and docutils are theirs, not the docs'.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", PendingDeprecationWarning)
        app = Sphinx(
            str(DOCS),
            str(DOCS),
            str(tmp_path / "out"),
            str(tmp_path / "doctrees"),
            "dummy",  # reads, resolves and checks everything; writes nothing
            status=None,
            warning=out,
            freshenv=True,
        )
        app.build()
    assert not out.getvalue(), "the docs build warns:\n" + out.getvalue()
    objects = set(app.env.domains.python_domain.objects)
    missing = sorted(_public_names() - objects)
    assert not missing, f"not in the built API reference: {missing}"
