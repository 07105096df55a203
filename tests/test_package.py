"""Packaging promises: no generic top-level package, import survives a diffusers registration failure."""

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_converters_is_not_a_top_level_package():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = project["tool"]["setuptools"]["packages"]["find"]["include"]
    assert all(p.startswith("svdq_linear") for p in include), f"installed packages: {include}"
    assert project["project"]["scripts"]["svdq-convert"] == "svdq_linear.convert.cli:main"
    assert "svdq_linear" in project["tool"]["setuptools"]["package-data"]


def test_svdq_convert_entry_point_imports():
    from svdq_linear.convert import cli

    assert callable(cli.main)


def test_import_warns_but_works_when_diffusers_registration_fails():
    # A foreign quantizer already registered under our name makes register() raise.
    code = (
        "import warnings, torch\n"
        "from diffusers.quantizers import auto\n"
        "class Foreign: pass\n"
        "auto.AUTO_QUANTIZER_MAPPING['svdq_w4a4'] = Foreign\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    import svdq_linear\n"
        "assert any('could not register' in str(x.message) for x in w), [str(x.message) for x in w]\n"
        "m = svdq_linear.SVDQW4A4Linear.from_linear(torch.nn.Linear(32, 16), rank=2)\n"
        "print(tuple(m(torch.randn(3, 32)).shape))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "(3, 16)", r.stdout
