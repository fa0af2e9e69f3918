#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# tests/tools/plot_check.py — dml-plot's pictures checked: two small CSV logs are written, dml-plot draws them, and
#  svg:    the SVG is parsed (xml.etree): its size; one polyline per run per panel that has the run's column, a
#          point per value (empty cells left out, not drawn as zero); every point inside its panel's axes; one x
#          for one step in every panel (a shared axis); values placed on a line rising up the panel, the largest
#          loss at the top of the panel's points and the smallest at the bottom; the legend naming both runs, and
#          --label names escaped for XML;
#  render: rsvg-convert renders it to PNG (exit 77, a skip, without rsvg-convert): the PNG is the SVG's size, and
#          each run's colour is drawn inside the panels' axes and nowhere else but the legend.
# Usage: plot_check.py svg|render DML_PLOT WORK_DIR.   Standard library only.
import os
import shutil
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET
import zlib

NS = "{http://www.w3.org/2000/svg}"
WIDTH, PANEL = 900, 240  # the figure's width and each panel's height, as given to dml-plot
LEGEND = 34  # one row of legend entries: 20 px and 14 (tools/dml-plot.cpp)

# Run a: steps 1..20, val_loss every 5th step (the other cells empty), the smallest loss. Run b: steps 1..30, the
# columns in another order, an extra one (epoch), tokens_per_s (b's alone), the largest loss.
A_COLUMNS = ["step", "loss", "val_loss", "lr"]
A_ROWS = [[s, 3.0 - 0.1 * s + 0.05 * (s % 3), 3.1 - 0.1 * s if s % 5 == 0 else "", 1e-3 * min(1, s / 4)]
          for s in range(1, 21)]
B_COLUMNS = ["step", "epoch", "lr", "loss", "tokens_per_s", "val_loss"]
B_ROWS = [[s, s // 10, 2e-3, 3.5 - 0.05 * s, 1000 + 10 * s, 3.4 - 0.05 * s if s % 10 == 0 else ""]
          for s in range(1, 31)]


def fail(message):
    print("plot_check: FAILED: " + message)
    sys.exit(1)


def write_csv(path, columns, rows):
    with open(path, "w") as f:
        f.write(",".join(columns) + "\n")
        for r in rows:
            f.write(",".join(str(v) for v in r) + "\n")


def values(columns, rows, name):
    """(step, value) of the non-empty cells of one column."""
    if name not in columns:
        return []
    i = columns.index(name)
    return [(float(r[0]), float(r[i])) for r in rows if r[i] != ""]


def run_plot(dml_plot, args):
    p = subprocess.run([dml_plot] + args, capture_output=True, text=True)
    if p.returncode != 0:
        fail("dml-plot %s exited %d: %s" % (" ".join(args), p.returncode, p.stderr.strip()))


def draw(dml_plot, work, extra=()):
    a, b, out = os.path.join(work, "a.csv"), os.path.join(work, "b.csv"), os.path.join(work, "plot.svg")
    write_csv(a, A_COLUMNS, A_ROWS)
    write_csv(b, B_COLUMNS, B_ROWS)
    run_plot(dml_plot, [a, b, "-o", out, "--width", str(WIDTH), "--height", str(PANEL)] + list(extra))
    return out


def panels(root):
    """Each panel's column, axes rectangle (x, y, w, h) and {run: [(x, y), ...]}."""
    out = []
    for g in root.iter(NS + "g"):
        if g.get("class") != "panel":
            continue
        rects = [r for r in g.iter(NS + "rect") if r.get("class") == "axes"]
        if len(rects) != 1:
            fail("panel %s: expected one axes rectangle, found %d" % (g.get("data-column"), len(rects)))
        box = tuple(float(rects[0].get(k)) for k in ("x", "y", "width", "height"))
        runs = {}
        for line in g.iter(NS + "polyline"):
            run = int(line.get("data-run"))
            if run in runs:
                fail("panel %s: expected one polyline for run %d, found more" % (g.get("data-column"), run))
            runs[run] = [tuple(map(float, p.split(","))) for p in line.get("points").split()]
        out.append((g.get("data-column"), box, runs, g))
    return out


def legend_texts(root):
    for g in root.iter(NS + "g"):
        if g.get("class") == "legend":
            return [t.text for t in g.iter(NS + "text")]
    fail("expected a legend group, found none")


def check_svg(dml_plot, work):
    root = ET.parse(draw(dml_plot, work)).getroot()
    width, height = int(root.get("width")), int(root.get("height"))
    expected_panels = ["loss", "val_loss", "tokens_per_s", "lr"]
    if (width, height) != (WIDTH, LEGEND + PANEL * len(expected_panels)):
        fail("expected an SVG of %dx%d, found %dx%d" % (WIDTH, LEGEND + PANEL * 4, width, height))
    if legend_texts(root) != ["a.csv", "b.csv"]:
        fail("expected a legend naming a.csv and b.csv, found %s" % legend_texts(root))
    found = panels(root)
    if [p[0] for p in found] != expected_panels:
        fail("expected the panels %s, found %s" % (expected_panels, [p[0] for p in found]))
    x_of_step = {}
    for column, (bx, by, bw, bh), runs, _ in found:
        data = [values(A_COLUMNS, A_ROWS, column), values(B_COLUMNS, B_ROWS, column)]
        want = {r for r in (0, 1) if data[r]}
        if set(runs) != want:
            fail("panel %s: expected polylines for runs %s, found %s" % (column, sorted(want), sorted(runs)))
        points = []  # (value, x, y, step)
        for r in want:
            if len(runs[r]) != len(data[r]):
                fail("panel %s, run %d: expected %d points (one per non-empty cell), found %d"
                     % (column, r, len(data[r]), len(runs[r])))
            for (step, v), (x, y) in zip(data[r], runs[r]):
                if not (bx - 0.01 <= x <= bx + bw + 0.01 and by - 0.01 <= y <= by + bh + 0.01):
                    fail("panel %s, run %d: step %g drawn at (%g, %g), outside the axes %s"
                         % (column, r, step, x, y, (bx, by, bw, bh)))
                if abs(x_of_step.setdefault(step, x) - x) > 0.011:
                    fail("step %g: expected one x in every panel (%g), found %g in %s"
                         % (step, x_of_step[step], x, column))
                points.append((v, x, y, step))
        top, bottom = max(points), min(points)  # the largest value and the smallest
        ys = [p[2] for p in points]
        if top[2] != min(ys) or bottom[2] != max(ys):
            fail("panel %s: expected the largest value (%g) at the top of its points (y %g) and the smallest (%g) at "
                 "the bottom (y %g), found y %g and %g" % (column, top[0], min(ys), bottom[0], max(ys), top[2],
                                                           bottom[2]))
        if top[0] > bottom[0]:  # every value on the line through those two
            for v, x, y, step in points:
                want_y = bottom[2] + (v - bottom[0]) / (top[0] - bottom[0]) * (top[2] - bottom[2])
                if abs(y - want_y) > 0.02:
                    fail("panel %s: step %g (%g) drawn at y %g, expected %g" % (column, step, v, y, want_y))
    steps = sorted(x_of_step)
    if any(x_of_step[s] >= x_of_step[t] for s, t in zip(steps, steps[1:])):
        fail("expected x to grow with the step, found %s" % x_of_step)

    # Names given with --label, escaped: the parser reads them back as given.
    names = ["lr <1e-3> & \"warm\"", "b's run"]
    root = ET.parse(draw(dml_plot, work, ["--label", names[0], "--label", names[1], "--columns", "loss"])).getroot()
    if legend_texts(root) != names:
        fail("expected the legend %s, found %s" % (names, legend_texts(root)))
    if [p[0] for p in panels(root)] != ["loss"]:
        fail("--columns loss: expected one panel, found %s" % [p[0] for p in panels(root)])
    print("plot_check: svg passed: %dx%d, %d panels" % (width, height, len(found)))


def read_png(path):
    """(width, height, bytes a pixel, rows of bytes) of an 8-bit RGB or RGBA non-interlaced PNG: rsvg-convert
    writes RGB for a picture with no transparent pixel (dml-plot's white background), RGBA otherwise."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        fail("%s: expected a PNG signature, found %r" % (path, data[:8]))
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, colour, _, _, interlace = header
    if depth != 8 or colour not in (2, 6) or interlace != 0:
        fail("%s: expected 8-bit RGB or RGBA (colour type 2 or 6), not interlaced, found depth %d, colour type %d, "
             "interlace %d" % (path, depth, colour, interlace))
    bpp = 3 if colour == 2 else 4
    raw, stride = zlib.decompress(idat), width * bpp
    rows, previous = [], bytearray(stride)
    for y in range(height):
        kind = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = previous[i]
            c = previous[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + a) & 255
            elif kind == 2:
                line[i] = (line[i] + b) & 255
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
            elif kind != 0:
                fail("%s: row %d: expected a filter type 0 to 4, found %d" % (path, y, kind))
        rows.append(line)
        previous = line
    return width, height, bpp, rows


def check_render(dml_plot, work):
    rsvg = shutil.which("rsvg-convert")
    if not rsvg:
        print("SKIPPED: rsvg-convert not found (librsvg2-bin)")
        sys.exit(77)
    svg = draw(dml_plot, work)
    png = os.path.join(work, "plot.png")
    p = subprocess.run([rsvg, "-o", png, svg], capture_output=True, text=True)
    if p.returncode != 0:
        fail("rsvg-convert exited %d: %s" % (p.returncode, p.stderr.strip()))
    root = ET.parse(svg).getroot()
    width, height, bpp, rows = read_png(png)
    if (width, height) != (int(root.get("width")), int(root.get("height"))):
        fail("expected a PNG of the SVG's %sx%s, found %dx%d" % (root.get("width"), root.get("height"), width, height))
    found = panels(root)
    boxes = [p[1] for p in found]
    legend_bottom = height - PANEL * len(boxes)  # the legend strip, above the first panel
    colours = {}
    for _, _, _, g in found:
        for line in g.iter(NS + "polyline"):
            colours[int(line.get("data-run"))] = line.get("stroke")
    for run, colour in sorted(colours.items()):
        rgb = tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))
        inside, outside = 0, []
        for y, row in enumerate(rows):
            for x in range(width):
                r, g, b = row[bpp * x:bpp * x + 3]
                if (bpp == 4 and row[4 * x + 3] < 250) or max(abs(r - rgb[0]), abs(g - rgb[1]), abs(b - rgb[2])) > 24:
                    continue
                if any(bx - 2 <= x <= bx + bw + 2 and by - 2 <= y <= by + bh + 2 for bx, by, bw, bh in boxes):
                    inside += 1
                elif y >= legend_bottom:
                    outside.append((x, y))
        if inside < 200:
            fail("run %d: expected its colour %s drawn inside the panels' axes, found %d pixels" % (run, colour, inside))
        if outside:
            fail("run %d: expected its colour %s only inside the axes and the legend, found %d pixels outside, "
                 "first at %s" % (run, colour, len(outside), outside[0]))
        print("plot_check: run %d: %d pixels of %s inside the axes" % (run, inside, colour))
    print("plot_check: render passed: %dx%d" % (width, height))


def main():
    if len(sys.argv) != 4 or sys.argv[1] not in ("svg", "render"):
        sys.exit("usage: plot_check.py svg|render DML_PLOT WORK_DIR")
    mode, dml_plot, work = sys.argv[1:]
    work = os.path.join(work, "plot_check_" + mode)
    os.makedirs(work, exist_ok=True)
    (check_svg if mode == "svg" else check_render)(dml_plot, work)


if __name__ == "__main__":
    main()
