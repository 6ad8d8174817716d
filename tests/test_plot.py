"""scripts/plot.sh: learning curves of several runs on one chart."""

from __future__ import annotations

import json
import subprocess

import numpy as np

from tests.fleet import ROOT


def write_run(directory, slope: float, torn: bool = False):
    directory.mkdir(parents=True)
    lines = [
        json.dumps(
            {
                "elapsed_s": 10.0 * i,
                "env_frames": 1000 * i,
                "fps": 100.0 + i,
                "episode_return_mean": None if i == 0 else slope * i,
            }
        )
        for i in range(30)
    ]
    text = "\n".join(lines) + "\n" + ('{"elapsed_s": 3' if torn else "")
    (directory / "metrics.jsonl").write_text(text)


def test_two_runs_on_one_png(tmp_path):
    from PIL import Image

    write_run(tmp_path / "a", 1.0)
    write_run(tmp_path / "b", -1.0, torn=True)  # a live run's half-written last line
    out = tmp_path / "curves.png"
    result = subprocess.run(
        [
            str(ROOT / "scripts" / "plot.sh"),
            str(tmp_path / "a"),
            str(tmp_path / "b"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    pixels = np.asarray(Image.open(out).convert("RGB")).astype(int)
    # matplotlib's first two colours: one line per run.
    for rgb in ((0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)):
        assert (np.abs(pixels - rgb).max(axis=-1) < 30).sum() > 200, rgb


def test_a_missing_run_is_named(tmp_path):
    result = subprocess.run(
        [str(ROOT / "scripts" / "plot.sh"), str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    assert "metrics.jsonl not found" in result.stderr
