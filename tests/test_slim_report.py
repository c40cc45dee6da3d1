"""The slim report's files: the JSON is the dict exactly, every chart is drawn, and a headless Chromium shows
the page whole, every chart loaded and visibly drawn, with nothing fetched from the network.

The report rendered is ``tests/fixtures/slim_report.json``, written by hand from a digits run's numbers,
so these tests pin the renderer whatever the pipeline that fills the report does.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from slimtorch.errors import SlimtorchError

pytest.importorskip("matplotlib")

from slimtorch.slimming.report_files import write_report

FIXTURE = Path(__file__).parent / "fixtures" / "slim_report.json"
TITLES = (
    "Where the bytes go, by stage",
    "Per-layer sensitivity and what was done",
    "Latency before and after",
    "Load time",
    "Memory of one training step",
    "Metric at each stage",
    "Deployment footprint",
)
CHART_NAMES = ("bytes", "layers", "latency", "load", "memory", "metric", "footprint")
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
# Each image's natural size and its box on the page, written where --dump-dom shows them. Ours, local, and
# only in the copy the browser opens: the report itself carries no script.
PROBE = """<script>
window.addEventListener("load", () => {
  for (const img of document.images) {
    const box = img.getBoundingClientRect();
    img.dataset.loaded = img.complete ? img.naturalWidth + "x" + img.naturalHeight : "0x0";
    const edges = [box.left + scrollX, box.top + scrollY, box.width, box.height];
    img.dataset.box = edges.map(Math.round).join(",");
  }
  document.body.dataset.height = document.documentElement.scrollHeight;
});
</script>"""


def fixture_report() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_report(fixture_report(), tmp_path_factory.mktemp("report"))


@pytest.mark.slow
def test_report_json_is_the_report_dict_exactly(rendered: dict[str, Path]) -> None:
    assert json.loads(rendered["json"].read_text()) == fixture_report()


def test_every_chart_is_a_png_of_sane_size_with_something_drawn(rendered: dict[str, Path]) -> None:
    from matplotlib.image import imread

    drawn = [f"{key}.png" for key in rendered if key.startswith("charts/")]
    assert drawn == [f"charts/{name}.png" for name in CHART_NAMES] == fixture_report()["outputs"]["charts"]
    for name in CHART_NAMES:
        pixels = imread(rendered[f"charts/{name}"])
        height, width = pixels.shape[:2]
        assert 600 <= width <= 2000 and 300 <= height <= 1200, (name, width, height)
        assert pixels[..., :3].std() > 0.05, f"{name} is nearly one colour"


def test_the_page_holds_every_title_its_charts_inline_and_nothing_from_the_network(
    rendered: dict[str, Path],
) -> None:
    page = rendered["html"].read_text()
    for title in TITLES:
        assert f"<h2>{title}</h2>" in page
    assert page.count('<img src="data:image/png;base64,') == len(CHART_NAMES)
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", page, re.IGNORECASE)
    assert "<script" not in page.lower() and "@import" not in page and "url(" not in page
    assert "http" not in page  # the fixture names no URL, so none may appear
    report = fixture_report()
    for section in ("latency", "load", "memory", "footprint"):  # every number says what measured it
        assert f"how measured: <code>{report[section]['command']}</code>" in page
    assert "goal met" in page and "0.046x the file" in page
    assert ">0.046x<" in page and ">-0.45 points<" in page and ">2.21x faster<" in page


@pytest.mark.slow
def test_every_string_from_the_report_is_escaped(tmp_path: Path) -> None:
    report = fixture_report()
    report["model"] = '<img src="http://example.com/x.png" onerror="alert(1)">'
    report["stages"][1]["reason"] = "<script>alert(2)</script>"
    report["layers"][0]["name"] = "a&b"
    page = write_report(report, tmp_path)["html"].read_text()
    assert "<script" not in page and 'src="http' not in page and '<img src="http' not in page
    assert "&lt;img src=&quot;http://example.com/x.png&quot;" in page
    assert "&lt;script&gt;alert(2)&lt;/script&gt;" in page and "<td>a&amp;b</td>" in page


@pytest.mark.slow
def test_a_section_not_measured_is_not_drawn_and_says_the_stages_reason(tmp_path: Path) -> None:
    write_report(fixture_report(), tmp_path)  # an earlier run drew every chart
    report = fixture_report()
    report["footprint"] = None
    report["stages"][-1].update(status="skipped", reason="no --bundle asked for")
    report.update(latency=None, load=None, memory=None)
    report["stages"][0]["reason"] += "; latency, load and memory not measured: --no-timings"
    paths = write_report(report, tmp_path)
    page = paths["html"].read_text()
    assert "not measured: export skipped: no --bundle asked for" in page
    assert "charts/footprint" not in paths and not (tmp_path / "charts" / "footprint.png").exists()
    because = (
        "not measured: baseline: 99.56% accuracy on 450 held-out digits; 498.0 KiB, 126,538 parameters; "
    )
    assert page.count(because + "latency, load and memory not measured: --no-timings") == 3
    assert page.count('<p class="missing">not measured') == 4
    assert page.count("how measured:") == len(CHART_NAMES) - 4  # nothing measured, no command to show
    assert page.count("<img ") == len(CHART_NAMES) - 4


@pytest.mark.slow
def test_a_section_no_stage_explains_says_so(tmp_path: Path) -> None:
    report = fixture_report()
    report.update(memory=None, footprint=None, stages=report["stages"][:-1])  # no export stage at all
    page = write_report(report, tmp_path)["html"].read_text()
    assert "not measured: the run recorded no memory and no stage says why" in page
    assert "not measured: no bundle was exported (no export stage ran)" in page


@pytest.mark.slow
def test_a_footprint_without_torchs_size_draws_the_bundle_alone(tmp_path: Path) -> None:
    report = fixture_report()
    report["footprint"]["torch_bytes"] = None  # torch's own footprint was not cached
    paths = write_report(report, tmp_path)
    assert "charts/footprint" in paths


@pytest.mark.slow
def test_a_goal_not_met_and_values_not_measured_show_as_such(
    rendered: dict[str, Path], tmp_path: Path
) -> None:
    missing = '<span class="missing">not measured</span>'
    already = rendered["html"].read_text().count(missing)  # the export stage has no metric of its own
    report = fixture_report()
    report.update(met=False, reason="0.13x at best within 1 point: int8 of features.0 costs 2.1 points")
    report["layers"][1]["sensitivity"] = None
    report["stages"][-2]["metric"] = None  # the deliverable's stage not evaluated
    report["stages"][1]["metric"] = 10.0  # pruned, before recovery: far below the band, still drawn
    paths = write_report(report, tmp_path)
    page = paths["html"].read_text()
    assert "goal not met" in page and "int8 of features.0 costs 2.1 points" in page
    assert page.count(missing) == already + 3  # the summary's "after", the layer's row, the stage's row
    assert "charts/metric" in paths and "charts/layers" in paths and ">10.00%<" in page


@pytest.mark.parametrize("broken", [{"version": 2}, {"layers": "drop"}])
def test_a_report_this_renderer_cannot_read_is_one_error_line(tmp_path: Path, broken: dict) -> None:
    report = fixture_report()
    for key, value in broken.items():
        if value == "drop":
            del report[key]
        else:
            report[key] = value
    with pytest.raises(SlimtorchError, match=r"slim report (version 2|lacks layers)"):
        write_report(report, tmp_path)
    assert not (tmp_path / "report.json").exists()


def _browser() -> str:
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    pytest.skip(
        f"no headless Chromium on PATH ({', '.join(BROWSERS)}): scripts/ensure_chromium.sh installs one"
    )


def _chromium(browser: str, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """One headless Chromium call, bounded: a virtual time budget for the page, a timeout for the process."""
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        "--force-device-scale-factor=1",
    ]
    command = [browser, *flags, f"--user-data-dir={profile}", "--virtual-time-budget=5000", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


@pytest.mark.slow
def test_chromium_shows_every_chart_loaded_and_drawn(rendered: dict[str, Path], tmp_path: Path) -> None:
    import numpy as np
    from matplotlib.image import imread

    browser = _browser()
    probed = tmp_path / "probed.html"
    probed.write_text(rendered["html"].read_text().replace("</body>", PROBE + "\n</body>"))
    dom = _chromium(
        browser, tmp_path / "profile", "--window-size=1200,900", "--dump-dom", probed.as_uri()
    ).stdout
    for title in TITLES:
        assert f"<h2>{title}</h2>" in dom
    images = re.findall(
        r'<img [^>]*alt="([^"]+)"[^>]*data-loaded="(\d+)x(\d+)"[^>]*data-box="([\d,-]+)"', dom
    )
    assert [alt for alt, *_ in images] == list(TITLES)
    assert all(int(w) >= 600 and int(h) >= 300 for _, w, h, _ in images), images
    height = int(re.search(r'<body data-height="(\d+)"', dom).group(1))
    shot = tmp_path / "page.png"
    _chromium(
        browser, tmp_path / "profile", f"--window-size=1200,{height}", f"--screenshot={shot}", probed.as_uri()
    )
    pixels = imread(shot)[..., :3]
    assert pixels.shape[:2] == (height, 1200)
    for alt, _, _, box in images:
        x, y, w, h = (int(v) for v in box.split(","))
        assert w > 500 and h > 200, (alt, box)
        region = pixels[y : y + h, x : x + w]
        colours = np.unique((region[::3, ::3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)
        assert region.std() > 0.05 and len(colours) > 20, f"{alt}: nothing drawn where the chart is"


@pytest.mark.slow
def test_chromium_screenshot_differs_from_a_blank_page(rendered: dict[str, Path], tmp_path: Path) -> None:
    """The screenshot check above would pass on any busy page; the same check fails on an empty one."""
    from matplotlib.image import imread

    browser = _browser()
    blank = tmp_path / "blank.html"
    blank.write_text("<!DOCTYPE html><html><body></body></html>")
    shot = tmp_path / "blank.png"
    _chromium(browser, tmp_path / "profile", "--window-size=1200,600", f"--screenshot={shot}", blank.as_uri())
    assert imread(shot)[..., :3].std() < 0.01
