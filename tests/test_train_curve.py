"""The learning curve's table (``pydflash.train.curve.render``): one row per point, the fixed-text
tau only where a point has one."""

from __future__ import annotations

import json

from pydflash.train import curve


def test_table_has_one_row_per_point_and_the_fixed_text_tau_where_measured(tmp_path):
    points = [
        dict(run="a", step=100, blocks_trained=6400, train_tokens=50_000, val_tau=2.0, tau=1.5,
             verify_steps=200, accepted_per_position=[80, 20]),
        dict(run="b", step=200, blocks_trained=12800, train_tokens=50_000, val_tau=2.1, tau=1.6, walk_tau=1.625,
             verify_steps=100, accepted_per_position=[50, 10]),
    ]
    path = tmp_path / "curve.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in points))
    table, _ = curve.render(path, tmp_path / "out")
    rows = [line for line in table.read_text().splitlines() if line.startswith("| a ") or line.startswith("| b ")]
    assert rows == ["| a | 100 | 6,400 | 50,000 | 2.000 | **1.500** |  | 0.40, 0.10 |",
                    "| b | 200 | 12,800 | 50,000 | 2.100 | **1.600** | 1.625 | 0.50, 0.10 |"]
