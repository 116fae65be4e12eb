"""experiments/_gpumemnet_models.py rebuilds the GPUMemNet generators' models: the parameter count of
each rebuilt model equals the row's recorded ``Total Parameters`` (tests/data/gpumemnet_rows.csv:
rows measured by the GPUMemNet authors, CC-BY 4.0), and the file-name parser reads every key."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROWS = ROOT / "tests" / "data" / "gpumemnet_rows.csv"


def _models():
    sys.path.insert(0, str(ROOT / "experiments"))
    try:
        import _gpumemnet_models
    finally:
        sys.path.remove(str(ROOT / "experiments"))
    return _gpumemnet_models


def _rows() -> list[dict[str, str]]:
    with open(ROWS, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("row", _rows(), ids=lambda r: r["Filename"][:60])
def test_rebuilt_parameter_count_equals_the_row(row):
    got, want = _models().check_params(row)
    assert got == want


def test_the_rows_cover_every_architecture_and_prelu():
    """The seven CNN architectures the CNN rows use (reverse_pyramid never drawn there), the four MLP
    ones in both MLP files, and PReLU, whose weight the rows do not count."""
    rows, parse = _rows(), _models().parse_filename
    archs = {f: {parse(r["Filename"])["arch"] for r in rows if r["file"] == f} for f in {r["file"] for r in rows}}
    assert archs["cnn_dev.csv"] == {"pyramid", "uniform", "bottleneck", "gradual", "hourglass", "residual", "dense"}
    assert archs["mlp_step1_dev.csv"] == archs["mlp_step2_dev.csv"] == {"pyramid", "uniform", "bottleneck", "gradual"}
    assert any("act:prelu" in r["Filename"] for r in rows)


def test_filename_parser_reads_every_key():
    parse = _models().parse_filename
    cnn = parse("input_channels:3_num_classes:453_depth:22_arch:uniform_base_filters:98_batch:62_input_size:174_"
                "act:leaky_relu_dropout:0.3442169060458645_dropout:True_batchnorm:False.out")
    assert cnn == {"input_channels": "3", "num_classes": "453", "depth": "22", "arch": "uniform",
                   "base_filters": "98", "batch": "62", "input_size": "174", "act": "leaky_relu",
                   "dropout_rate": "0.3442169060458645", "dropout": "True", "batchnorm": "False"}
    assert parse("input:1259_output:79_depth:8_arch:pyramid_batch:717.out") == {
        "input": "1259", "output": "79", "depth": "8", "arch": "pyramid", "batch": "717"}


def test_pyramid_mlp_by_hand():
    """input 1259, output 79, depth 8, pyramid (mlp.py): widths 629, 314, 157, then max(78, 79) = 79
    five times, and the output layer 79 -> 79: (1259+1)*629 + (629+1)*314 + (314+1)*157 + (157+1)*79
    + 4 * (79+1)*79 + (79+1)*79 = 1,083,897, the row's Total Parameters."""
    m = _models()
    import torch

    with torch.device("meta"):
        model = m.build_mlp(m.parse_filename("input:1259_output:79_depth:8_arch:pyramid_batch:717.out"))
    by_hand = 1260 * 629 + 630 * 314 + 315 * 157 + 158 * 79 + 4 * 80 * 79 + 80 * 79
    assert by_hand == 1_083_897
    assert m.count_params(model) == by_hand
