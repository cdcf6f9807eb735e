"""Checks `loom report`'s page as headless Chromium leaves it after its script ran (--dump-dom):
a chart per scalar of metrics.jsonl with as many points on its curve as finite values, the plan's
row per device from run.json, and the outputs; and that the screenshot is a real picture.
Usage: check_page.py RUN_DIR DOM_FILE SCREENSHOT_PNG"""
import json
import re
import struct
import sys
from html.parser import HTMLParser

from metric_tags import read_rows, series


class Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.charts = {}   # tag -> {"points": int, "curve": d}
        self.devices = []  # the plan table's data-device rows
        self.body = {}
        self.open_chart = None
        self.text = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "body":
            self.body = a
        elif tag == "svg" and "data-tag" in a:
            self.open_chart = a["data-tag"]
            self.charts[self.open_chart] = {"points": int(a.get("data-points", -1)), "curve": None}
        elif tag == "path" and self.open_chart and a.get("class") == "curve":
            self.charts[self.open_chart]["curve"] = a.get("d", "")
        elif tag == "tr" and "data-device" in a:
            self.devices.append(a["data-device"])

    def handle_endtag(self, tag):
        if tag == "svg":
            self.open_chart = None

    def handle_data(self, data):
        self.text.append(data)


def main():
    run, dom_file, png_file = sys.argv[1:4]
    page = Page()
    with open(dom_file, encoding="utf-8") as f:
        page.feed(f.read())
    want = series(read_rows(f"{run}/metrics.jsonl"))
    problems = []
    if page.body.get("data-charts") != str(len(want)):
        problems.append(f"the page's script drew {page.body.get('data-charts')} charts; metrics.jsonl has {len(want)} scalars")
    for tag, points in want.items():
        chart = page.charts.get(tag)
        if chart is None:
            problems.append(f"no chart for {tag}")
            continue
        drawn = len(re.findall(r"[ML]", chart["curve"] or ""))
        if chart["points"] != len(points) or drawn != len(points):
            problems.append(f"{tag}: {len(points)} values, the chart says {chart['points']} and its curve has {drawn} points")
    with open(f"{run}/run.json", encoding="utf-8") as f:
        plan = json.load(f)["plan"]
    world = plan["mesh"]["world"]
    for d in plan["devices"]:
        key = d["device"] if world == 1 else f"rank {d['rank']} {d['device']}"
        if key not in page.devices:
            problems.append(f"the plan table has no row for {key} (rows: {page.devices})")
    text = " ".join(page.text)
    for needed in (f"{run}/adapter", "events.out.tfevents.loom", "metrics.jsonl"):
        if needed not in text:
            problems.append(f"the page does not name {needed}")
    with open(png_file, "rb") as f:
        png = f.read()
    if png[:8] != b"\x89PNG\r\n\x1a\n":
        problems.append("the screenshot is not a PNG")
    else:
        width, height = struct.unpack(">II", png[16:24])
        if width < 800 or height < 600 or len(png) < 20000:
            problems.append(f"the screenshot is {width}x{height}, {len(png)} bytes: too small to show the page")
    if problems:
        sys.exit("check_page.py:\n  " + "\n  ".join(problems))
    print(f"check_page.py: {len(want)} charts drawn with every point, {len(page.devices)} plan row(s), screenshot {png_file}")


main()
