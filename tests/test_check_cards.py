"""``oomtune check best.yaml --mode predict --gpu CARDS``: best.yaml's answer predicted on each card of
the device catalogue, one line and one verdict per card.

The workload is chosen so that the verdicts follow from the catalogue's memory alone, by a wide margin
(hand calculation): an MLP with one 32768 x 32768 linear layer trained with SGD (momentum 0.9, the
built-in optimizer) keeps the weight (32768^2 x 4 bytes = 4 GiB), its gradient (4 GiB) and the
momentum buffer (4 GiB) live after the first step: at least 12 GiB reserved. An H100 80GB
(81,082 MiB = 79.18 GiB) holds that six times over; an A100-40GB MIG 1g.5gb slice (4.75 GiB) cannot
even hold the weight and its gradient.
"""

from __future__ import annotations

import pytest
import yaml

from oomtune.best import load_best
from oomtune.cli import main
from oomtune.gpu.catalogue import catalogue
from oomtune.units import GiB

BIG_MLP = {"name": "mlp", "in_features": 32768, "hidden": 32768, "layers": 1, "num_classes": 10,
           "optimizer": "sgd", "lr": 0.1, "precision": "fp32", "data": {"source": "synthetic"}}
THREE_COPIES = 3 * 32768 * 32768 * 4   # weight + gradient + momentum, bytes = 12 GiB


def write_best(path, *, alloc_conf="", memory_fraction=None, headroom=None):
    data = {
        "schema_version": 1,
        "workload": {"model": BIG_MLP, "target": {"name": "builtin"}},
        "device": {"kind": "cpu", "name": "virtual GPU (CPU)", "total_memory_bytes": 80 * GiB,
                   "budget_bytes": 80 * GiB, "memory_source": "simulated"},
        "best": {"batch_size": 8, "alloc_conf": alloc_conf, "settings": {},
                 "metrics": {"throughput": 1.0, "peak_reserved_bytes": THREE_COPIES, "memory_source": "simulated"},
                 "predicted_peak_reserved_bytes": THREE_COPIES, "memory_fraction": memory_fraction},
    }
    if headroom is not None:
        data["device"]["headroom"] = headroom
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(autouse=True)
def _no_stream_cache(monkeypatch):
    monkeypatch.setenv("OOMTUNE_CACHE_DIR", "off")


def test_fits_the_80gb_card_not_the_mig_slice_one_line_each(tmp_path, capsys):
    path = write_best(tmp_path / "best.yaml")
    assert main(["check", str(path), "--mode", "predict", "--gpu", "h100-80gb,a100-40gb-1g.5gb"]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("h100-80gb: PASS batch 8, the default allocator fits: peak reserved ")
    assert lines[0].endswith("of 79.18 GiB (h100 kernels, simulated)")   # 81,082 MiB, torch's total_memory
    assert lines[1].startswith("a100-40gb-1g.5gb: FAIL batch 8, the default allocator does not fit: needs ")
    assert lines[1].endswith("the card allows 4.75 GiB (sm80:14 kernels, simulated)")
    assert lines[2] == "oomtune check: FAIL batch 8 does not fit a100-40gb-1g.5gb (1 of 2 cards; simulated)"
    assert len(lines) == 3


def test_each_card_is_predicted_with_its_own_memory_and_kernels(tmp_path):
    from oomtune.regression_cards import check_cards

    cards = catalogue()
    report = check_cards(load_best(write_best(tmp_path / "best.yaml")), [cards["h100-80gb"], cards["a100-40gb-1g.5gb"]])
    h100, mig = report.figures["cards"]
    # at least the three 4 GiB copies; far below the 80 GB card
    assert THREE_COPIES <= h100["peak_reserved_bytes"] < 16 * GiB and h100["fits"] is True
    assert h100["limit_bytes"] == 85_020_639_232 and mig["limit_bytes"] == 5_100_273_664   # no headroom recorded
    assert mig["fits"] is False and mig["peak_reserved_bytes"] >= THREE_COPIES > mig["total_memory_bytes"]
    # the cuBLAS workspaces are the card's: 32 MiB on sm90, 8 MiB + 128 KiB below (CublasHandlePool.cpp),
    # so the sm90 card reserves more for the same workload
    assert h100["peak_reserved_bytes"] > mig["peak_reserved_bytes"]
    assert report.exit_code == 1 and [c.name for c in report.cases][:2] == ["card h100-80gb", "card a100-40gb-1g.5gb"]


def test_the_recorded_headroom_is_taken_from_each_card(tmp_path):
    """headroom 0.9: the limit is 10% of the card, int(85,020,639,232 x 0.1) = 8,502,063,923 bytes on
    the H100 80GB (7.92 GiB), below the 12 GiB the answer needs: FAIL, though the replay completes."""
    from oomtune.regression_cards import check_cards

    report = check_cards(load_best(write_best(tmp_path / "best.yaml", headroom=0.9)), [catalogue()["h100-80gb"]])
    (fig,) = report.figures["cards"]
    assert fig["limit_bytes"] == 8_502_063_923 and fig["fits"] is False


@pytest.mark.parametrize("fraction, code", [(0.1, 1), (0.5, 0)])
def test_the_answers_memory_fraction_is_of_each_cards_memory(fraction, code, tmp_path, capsys):
    """apply_best sets per_process_memory_fraction F on whatever card it runs: round(F x 85,020,639,232)
    bytes allowed, 7.92 GiB at 0.1 (below the 12 GiB needed) and 39.59 GiB at 0.5 (above)."""
    path = write_best(tmp_path / "best.yaml", alloc_conf="garbage_collection_threshold:0.8",
                      memory_fraction=fraction)
    assert main(["check", str(path), "--gpu", "h100-80gb"]) == code   # --gpu implies --mode predict
    out = capsys.readouterr().out
    assert f"best.yaml's memory fraction {fraction:g} allows {'7.92' if fraction == 0.1 else '39.59'} GiB" in out
    assert ("PASS" if code == 0 else "FAIL") in out.strip().splitlines()[-1]


@pytest.mark.parametrize("args, words", [
    (["--gpu", "l4,h100"], "--gpu 'h100': unknown card; choose from "),
    (["--gpu", "l4", "--mode", "run"], "--gpu predicts the answer on catalogue cards"),
])
def test_bad_gpu_is_one_line_exit_2_before_best_yaml_is_read(args, words, tmp_path, capsys):
    missing = tmp_path / "no-such-best.yaml"   # not read: the card names are checked first
    assert main(["check", str(missing), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


@pytest.mark.parametrize("typed, meant", [
    ("h100", "h100-80gb"),     # the whole card, not one of its MIG slices (the shortest name with that start)
    ("h100x", "h100-80gb"),    # a stray character: the longest shared start is "h100"
    ("A1000", "a100-40gb"),    # case is ignored; a100-40gb comes before a100-80gb in the catalogue
    ("rtx40", "rtx4090"),
])
def test_a_mistyped_card_gets_the_card_it_most_likely_meant(typed, meant, tmp_path, capsys):
    assert main(["check", str(tmp_path / "no-such-best.yaml"), "--gpu", typed]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith(f"(copy one of oomtune's conf/devices/*.yaml); did you mean {meant!r}?")


def test_a_card_file_without_memory_is_refused(tmp_path, capsys):
    data = yaml.safe_load((catalogue()["l4"].path and open(catalogue()["l4"].path).read()))
    data.update(name="my-l4", total_memory_bytes=None)
    card = tmp_path / "mycard.yaml"
    card.write_text(yaml.safe_dump(data))
    assert main(["check", str(write_best(tmp_path / "best.yaml")), "--gpu", str(card)]) == 2
    assert "--gpu my-l4: the catalogue has no sourced total_memory_bytes" in capsys.readouterr().err


def test_a_command_target_is_refused_with_the_run_mode_as_the_way(tmp_path, capsys):
    path = write_best(tmp_path / "best.yaml")
    data = yaml.safe_load(path.read_text())
    data["workload"] = {"target": {"name": "cmd", "command": "python train.py"}}
    path.write_text(yaml.safe_dump(data))
    assert main(["check", str(path), "--gpu", "l4"]) == 2
    err = capsys.readouterr().err
    assert "target 'cmd' cannot be" in err and "--mode run" in err
