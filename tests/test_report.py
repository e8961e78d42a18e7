"""The run report (simpar.report): the main job's --report writes report.json, its pictures
and a page that holds them; python -m simpar.report builds them again; the page opens in a
real browser (headless Chromium, Debian's package, which dev.py installs where it may) and its
screenshot shows the pictures."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from simpar import report, train


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("report")
    assert train.main(["--model", "mlp", "--steps", "3", "--report", str(out)]) == 0
    return out


def _not_blank(png: Path) -> None:
    import matplotlib.image as mpimg
    img = np.asarray(mpimg.imread(png))
    assert img.shape[0] > 100 and img.shape[1] > 200 and img.std() > 0.05, png


def test_the_job_writes_the_report(run_dir: Path) -> None:
    data = json.loads((run_dir / "report.json").read_text())
    assert len(data["losses"]) == 3 and data["strategy_table"] and data["cost"]
    assert data["check"].endswith(": PASS")
    page = (run_dir / "report.html").read_text()
    for heading in ("Strategies", "Loss per step", "measured against the cost model",
                    "peak memory of each rank", "How _backbone.fc1.weight is cut",
                    "Against one device"):
        assert heading in page, heading
    assert page.count("data:image/png;base64,") == 4 + len(data["layouts"])   # + the graph
    for png in ("loss.png", "steps.png", "cost.png", "graph.png", "layout0.png"):
        _not_blank(run_dir / png)


def test_the_report_is_built_again_from_its_data(run_dir: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    again = tmp_path / "again"
    again.mkdir()
    shutil.copy(run_dir / "report.json", again)
    shutil.copy(run_dir / "graph.png", again)   # the job's drawing of its program
    assert report.main([str(again)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {again / 'report.html'}"
    assert (again / "report.html").read_text() == (run_dir / "report.html").read_text()
    assert report.main([str(tmp_path / "empty")]) == 2
    assert "holds no report.json" in capsys.readouterr().err


def test_the_page_shows_its_pictures_in_a_browser(run_dir: Path, tmp_path: Path) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no chromium here (dev.py installs Debian's package where it may): the "
                    "report's page was not opened in a browser")
    shot = tmp_path / "shot.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                    "--hide-scrollbars", f"--screenshot={shot}", "--window-size=1200,3000",
                    (run_dir / "report.html").as_uri()], check=True, timeout=120,
                   capture_output=True)
    import matplotlib.image as mpimg
    img = np.asarray(mpimg.imread(shot))[:, :, :3]
    # the pictures are in colour, the text grey: a page without them has no saturated pixel
    saturation = img.max(axis=2) - img.min(axis=2)
    assert (saturation > 0.3).mean() > 0.02, (saturation > 0.3).mean()
