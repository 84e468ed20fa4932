"""benchmarks/RESULTS.md stays a current table that README.md's figures come from: every number of the README's
Results section is in RESULTS.md (as written, or as its rounding), and the file stays short."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?")


def numbers(text: str) -> list[str]:
    return NUMBER.findall(text)


def found(figure: str, values: list[float]) -> bool:
    """``figure`` (as written, e.g. "18.4") is one of ``values`` rounded to its decimals."""
    decimals = len(figure.split(".")[1]) if "." in figure else 0
    half = 0.5 * 10 ** -decimals + 1e-9
    return any(abs(v - float(figure)) <= half for v in values)


def test_found_rounds_to_the_figures_decimals():
    assert found("18.4", [18.445]) and found("1339", [1338.7]) and found("3.10", [3.098])
    assert not found("18.4", [18.46]) and not found("0.365", [0.464])


def test_every_figure_of_the_readme_results_is_in_results_md():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Results"):]
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    values = [float(n) for n in numbers(results)]
    missing = sorted({n for n in numbers(section) if not found(n, values)}, key=float)
    assert not missing, f"README figures with no row in benchmarks/RESULTS.md: {missing}"


def test_results_md_is_short():
    assert len((ROOT / "benchmarks" / "RESULTS.md").read_text().splitlines()) <= 400
