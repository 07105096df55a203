"""Packaging and README promises: no generic top-level package, no import cycle, an import that survives a
diffusers registration failure, one place per fact, no dead code, README commands that run (twice)."""

import ast
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "svdq_linear"
README = (ROOT / "README.md").read_text()
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def _imports(path: Path, top_level_only: bool) -> set[str]:
    """Modules ``path`` imports (``from . import x`` resolved against the svdq_linear package)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            out.update([base] + [f"{base}.{a.name}" for a in node.names])
    return out


# ---- converters/: in the repository, not installed -----------------------------------------------------


def test_converters_is_not_a_top_level_package():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = project["tool"]["setuptools"]["packages"]["find"]["include"]
    assert all(p.startswith("svdq_linear") for p in include), f"installed packages: {include}"
    assert project["project"]["scripts"]["svdq-convert"] == "svdq_linear.convert.cli:main"
    assert "svdq_linear" in project["tool"]["setuptools"]["package-data"]


def test_setuptools_finds_no_converters_package_although_the_folder_is_there():
    from setuptools import find_namespace_packages

    assert (ROOT / "converters" / "flux.py").is_file() and (ROOT / "converters" / "sd3.py").is_file()
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    found = find_namespace_packages(where=str(ROOT), include=include)
    assert "svdq_linear.convert" in found
    assert not [p for p in found if p.split(".")[0] != "svdq_linear"], found


def test_the_installed_distribution_has_no_top_level_converters(tmp_path):
    # A fresh interpreter outside the repository, with only what is installed on its path. A source tree run
    # through PYTHONPATH (the GPU machine's) has no distribution to check.
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("svdq-linear")
    except PackageNotFoundError:
        pytest.skip("svdq-linear is not installed (the tests run from a source tree): nothing installed to check")
    env = {k: v for k, v in ENV.items() if k != "PYTHONPATH"}
    code = "import importlib.util as u; print(u.find_spec('converters'), u.find_spec('svdq_linear') is not None)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["None", "True"], r.stdout


# ---- imports ----------------------------------------------------------------------------------------------


def test_import_warns_but_works_when_diffusers_registration_fails():
    # A foreign quantizer already registered under our name makes register() raise.
    code = (
        "import sys, warnings, torch\n"
        "from diffusers.quantizers import auto\n"
        "class Foreign: pass\n"
        "auto.AUTO_QUANTIZER_MAPPING['svdq_w4a4'] = Foreign\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    import svdq_linear\n"
        "assert any('could not register' in str(x.message) for x in w), [str(x.message) for x in w]\n"
        "assert auto.AUTO_QUANTIZER_MAPPING['svdq_w4a4'] is Foreign\n"
        "assert 'svdq_linear.convert' not in sys.modules, 'import svdq_linear imports its converters'\n"
        "m = svdq_linear.SVDQW4A4Linear.from_linear(torch.nn.Linear(32, 16), rank=2)\n"
        "print(tuple(m(torch.randn(3, 32)).shape))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "(3, 16)", r.stdout


def test_no_import_cycle_between_the_library_and_its_converters():
    library = [p for p in PACKAGE.rglob("*.py") if "convert" not in p.relative_to(PACKAGE).parts]
    offenders = [str(p.relative_to(ROOT)) for p in library
                 if any(m.startswith("svdq_linear.convert") for m in _imports(p, top_level_only=True))]
    assert not offenders, f"library modules importing svdq_linear.convert at import time: {offenders}"


def test_file_io_and_quantization_live_in_separate_modules():
    io_modules = {"json", "safetensors", "safetensors.torch", "huggingface_hub"}
    files = _imports(PACKAGE / "files.py", top_level_only=False)
    assert not [m for m in files if m.startswith("svdq_linear")], f"files.py imports the library: {files}"
    pipeline = _imports(PACKAGE / "pipeline.py", top_level_only=False)
    assert not pipeline & io_modules, f"pipeline.py does file I/O itself: {pipeline & io_modules}"


# ---- one place per fact, no dead code ------------------------------------------------------------------


def test_fixed_dtypes_and_target_kinds_are_declared_once():
    from svdq_linear.linear import FIXED_DTYPES

    assert FIXED_DTYPES == {"qweight": torch.uint8, "wscales": torch.float8_e4m3fn, "wcscale": torch.float32,
                            "smooth": torch.float32}
    declared = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in getattr(node, "targets", [getattr(node, "target", None)]):
                    names = target.elts if isinstance(target, ast.Tuple) else [target]
                    for name in names:
                        if isinstance(name, ast.Name) and name.id in ("W4A4", "W4A16", "FIXED_DTYPES"):
                            declared.setdefault(name.id, []).append(str(path.relative_to(ROOT)))
    assert declared == {"W4A4": ["svdq_linear/linear.py"], "W4A16": ["svdq_linear/linear.py"],
                        "FIXED_DTYPES": ["svdq_linear/linear.py"]}, declared
    sources = {p: p.read_text() for p in PACKAGE.rglob("*.py") if p.name != "linear.py"}
    spelled = [str(p.relative_to(ROOT)) for p, text in sources.items()
               if re.search(r"endswith\(\(?\s*[\"']\.(smooth|wcscale)", text)]
    assert not spelled, f"fixed-dtype tensor names spelled out again in {spelled}"


def test_every_module_level_function_and_class_is_used():
    others = [p for folder in ("svdq_linear", "tests", "examples", "benchmarks", "converters")
              for p in (ROOT / folder).rglob("*.py")]
    text = {p: p.read_text() for p in others}
    unused = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.parse(text[path]).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("__"):
                uses = sum(len(re.findall(rf"\b{re.escape(node.name)}\b", t)) for t in text.values())
                if uses <= 1:  # only its own definition
                    unused.append(f"{path.relative_to(ROOT)}:{node.name}")
    assert not unused, f"defined but used nowhere (dead code): {unused}"


# ---- README ---------------------------------------------------------------------------------------------


def _setup_block() -> list[str]:
    section = README[README.index("## Set up and run"):README.index("## Test")]
    block = section[section.index("```bash") + len("```bash"):]
    return [line for line in block[:block.index("```")].strip().splitlines()], section


def test_readme_setup_says_which_torch_build_and_how_to_get_the_cuda_one():
    lines, section = _setup_block()
    assert "pip install torch==2.13.0" in lines[0]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pip install -q torch==2.13.0" in ci, "the README's set-up installs what CI installs"
    assert "CPU build" in section
    assert re.search(r"pip install torch==2\.13\.0 --index-url https://download\.pytorch\.org/whl/cu\d+", section)
    assert section.index("--index-url") < section.rindex('pip install -e ".[test,kernels]"'), "torch first"


def test_readme_memory_figure_is_what_a_flux_dev_size_transformer_holds():
    from accelerate import init_empty_weights
    from diffusers import FluxTransformer2DModel

    from svdq_linear import diffusers_quantizer as dq
    from svdq_linear.convert import recipes

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with init_empty_weights():  # FLUX.1-dev's shapes on meta: no memory, no hub
            model = FluxTransformer2DModel(num_layers=19, num_single_layers=38, guidance_embeds=True)
    finally:
        torch.set_default_dtype(default)
    nbytes = lambda m: sum(t.numel() * t.element_size() for t in m.state_dict().values())  # noqa: E731
    before = nbytes(model)
    recipe = recipes.recipe_for(model)
    config = dq.SVDQuantizationConfig(rank=32, w4a4_modules=recipe.w4a4, w4a16_modules=recipe.w4a16)
    dq.swap_in_quantized_modules(model, config, torch.bfloat16)
    after = nbytes(model)
    figure = f"{before / after:.2f}x"
    sizes = f"{before / 2**30:.2f} GiB -> {after / 2**30:.2f} GiB"
    assert (figure, sizes) == ("3.37x", "22.17 GiB -> 6.59 GiB")
    for doc in ("README.md", "docs/perf.md"):
        text = (ROOT / doc).read_text()
        assert figure in text and sizes in text, f"{doc} does not state {figure} ({sizes})"
    assert "3.5x" not in README
