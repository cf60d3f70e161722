"""The architecture is enforced: imports go down the layers, the API is pinned.

The layers are read from the table in qbits/LAYERS.md (which the design guide,
docs/guides/design.md, includes), so the documentation and the code cannot
drift apart.
"""

import ast
import importlib
import inspect
import pathlib
import re

import qbits

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "qbits"
API_FILE = ROOT / "tests" / "public_api.txt"
LAYERS_FILE = PACKAGE / "LAYERS.md"


def _layers() -> dict[str, int]:
    """``{top-level module or package of qbits: layer}`` from qbits/LAYERS.md."""
    text = LAYERS_FILE.read_text()
    table = text[text.index("```") + 3 : text.index("```", text.index("```") + 3)]
    layers: dict[str, int] = {}
    for line in table.splitlines():
        m = re.match(r"\s+([\w/.,_ ]+?)\s+(\d+)\. ", line)
        if not m:
            continue
        for name in m.group(1).split(","):
            name = name.strip().removesuffix("/").removesuffix(".py")
            layers[name] = int(m.group(2))
    return layers


def _top(module: str) -> str:
    """``qbits.ops._core`` -> ``ops``; ``qbits._errors`` -> ``_errors``."""
    return module.split(".")[1]


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """Every ``qbits.*`` module imported by a file (any nesting)."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("qbits."):
                found.append((node.lineno, node.module))
            elif node.module == "qbits":
                found += [(node.lineno, f"qbits.{a.name}") for a in node.names]
        elif isinstance(node, ast.Import):
            found += [
                (node.lineno, a.name) for a in node.names if a.name.startswith("qbits.")
            ]
    return found


def _module_of(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_every_module_of_qbits_has_a_layer():
    layers = _layers()
    tops = {
        p.stem if p.is_file() else p.name
        for p in PACKAGE.iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()
    }
    assert tops - set(layers) == set(), "add them to the table in qbits/LAYERS.md"
    assert set(layers) - tops == set(), "qbits/LAYERS.md names these"


def test_imports_go_only_down_and_through_public_faces():
    layers = _layers()
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_of(path)
        if module == "qbits":  # the top-level API re-exports every layer
            continue
        own = _top(module)
        for line, imported in _imports(path):
            if imported == "qbits":
                continue
            other = _top(imported)
            where = f"{path.relative_to(ROOT)}:{line} imports {imported}"
            if layers[other] > layers[own]:
                problems.append(f"{where} (layer {layers[other]} > {layers[own]})")
            private = [p for p in imported.split(".")[2:] if p.startswith("_")]
            if private and other != own:
                problems.append(f"{where} (a private module of another package)")
    assert not problems, "\n".join(problems)


def _public_modules() -> dict[str, object]:
    """The public modules: qbits, those it exports, the subpackages, the CLI..."""
    modules = {"qbits": qbits}
    for n in qbits.__all__:
        if inspect.ismodule(getattr(qbits, n)):
            modules[f"qbits.{n}"] = getattr(qbits, n)
    # Subpackages imported on their own (not in qbits.__all__) and the command
    # (its example models, sweeps and reports, qbits._experiments, are not API).
    subpackages = (
        "qbits.transform", "qbits.ptq", "qbits.lora", "qbits.kvcache",
        "qbits.diagnostics", "qbits.hlo", "qbits.interop", "qbits.optim",
    )  # fmt: skip
    for name in (*subpackages, "qbits.cli"):
        modules[name] = importlib.import_module(name)
    return modules


def _public_api() -> list[str]:
    """``module: name`` for every public name of every public module."""
    return sorted(
        f"{name}: {attr}"
        for name, module in _public_modules().items()
        for attr in module.__all__
    )


def test_public_api_is_exactly_the_checked_in_list():
    want = [ln for ln in API_FILE.read_text().splitlines() if ln and ln[0] != "#"]
    got = _public_api()
    assert got == want, (
        "the public API changed; if deliberate, regenerate tests/public_api.txt "
        "(python tests/test_layering.py)\n"
        f"added: {sorted(set(got) - set(want))}\n"
        f"removed: {sorted(set(want) - set(got))}"
    )


def test_public_modules_list_each_name_once_on_its_own_line():
    for name, module in _public_modules().items():
        assert len(set(module.__all__)) == len(module.__all__), name
        source = inspect.getsource(module)
        block = source[source.index("__all__ = [") :]
        block = block[: block.index("]")]
        for entry in module.__all__:
            assert f'\n    "{entry}",' in block, f"{name}: {entry} on a line of its own"


if __name__ == "__main__":  # regenerate the list after a deliberate change
    API_FILE.write_text(
        "# The public API of qbits: one `module: name` per line "
        "(tests/test_layering.py).\n" + "\n".join(_public_api()) + "\n"
    )
