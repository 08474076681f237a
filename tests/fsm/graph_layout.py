"""Read Graphviz's own layout (`dot -Tjson`) of a drawing and list what makes it hard to read.

A layout is readable when no two boxes (nodes, edge labels, the graph's title) overlap, no edge's drawn
curve passes through a box other than the two nodes it joins, and the whole picture fits a screen (aspect
between 1:2 and 2:1). Edge labels (`label`, `xlabel`, head/tail labels) are boxed from the text Graphviz
drew for them, so the check applies to any DOT, not only ours (whose labels are all nodes).
"""

from __future__ import annotations

import json

TOLERANCE = 1.0  # points: boxes may touch, curves may graze a box's margin


def _box(x, y, w, h):
    return (x - w / 2, y - h / 2, x + w / 2, y + h / 2)


def boxes(layout: dict) -> dict[str, tuple[float, float, float, float]]:
    """name -> (x0, y0, x1, y1) in points for every node and the graph title."""
    out = {}
    for obj in layout.get("objects", []):
        if "pos" not in obj:  # a subgraph
            continue
        x, y = map(float, obj["pos"].split(","))
        out[obj["name"]] = _box(x, y, float(obj["width"]) * 72, float(obj["height"]) * 72)
    for edge in layout.get("edges", []):
        texts = [op for key in ("_ldraw_", "_hldraw_", "_tldraw_") for op in edge.get(key, []) if op["op"] == "T"]
        sizes = [op["size"] for key in ("_ldraw_",) for op in edge.get(key, []) if op["op"] == "F"] or [14.0]
        for j, op in enumerate(texts):
            w, (x, y), size = op["width"], op["pt"], sizes[0]
            x0 = {"c": x - w / 2, "l": x, "r": x - w}[op["align"]]
            out[f"label of edge {edge['_gvid']} ({j})"] = (x0, y - 0.25 * size, x0 + w, y + 0.9 * size)
    if "lp" in layout:
        x, y = map(float, layout["lp"].split(","))
        out["<title>"] = _box(x, y, float(layout["lwidth"]) * 72, float(layout["lheight"]) * 72)
    return out


def _bezier(points, steps=24):
    """Points along a piecewise cubic Bezier given as Graphviz's control points."""
    for i in range(0, len(points) - 3, 3):
        p0, p1, p2, p3 = points[i:i + 4]
        for k in range(steps + 1):
            t = k / steps
            a, b, c, d = (1 - t) ** 3, 3 * t * (1 - t) ** 2, 3 * t * t * (1 - t), t ** 3
            yield (a * p0[0] + b * p1[0] + c * p2[0] + d * p3[0], a * p0[1] + b * p1[1] + c * p2[1] + d * p3[1])


def _inside(point, box, tol=TOLERANCE):
    x, y = point
    return box[0] + tol < x < box[2] - tol and box[1] + tol < y < box[3] - tol


def problems(layout: dict) -> list[str]:
    """Overlapping boxes, curves through boxes, and a bad aspect ratio, as readable lines (empty: fine)."""
    found = []
    bx = boxes(layout)
    names = sorted(bx)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            p, q = bx[a], bx[b]
            if min(p[2], q[2]) - max(p[0], q[0]) > TOLERANCE and min(p[3], q[3]) - max(p[1], q[1]) > TOLERANCE:
                found.append(f"boxes overlap: {a} and {b}")
    by_id = {obj["_gvid"]: obj["name"] for obj in layout.get("objects", [])}
    for edge in layout.get("edges", []):
        ends = {by_id[edge["tail"]], by_id[edge["head"]]}
        if edge.get("style") == "invis":
            continue
        curve = [pt for op in edge.get("_draw_", []) if op["op"] == "b" for pt in _bezier(op["points"])]
        for name, box in bx.items():
            if name not in ends and any(_inside(pt, box) for pt in curve):
                found.append(f"edge {' -> '.join(sorted(ends))} crosses {name}")
    x0, y0, x1, y1 = map(float, layout["bb"].split(","))
    aspect = (x1 - x0) / (y1 - y0)
    if not 0.5 <= aspect <= 2.0:
        found.append(f"aspect ratio {aspect:.2f} (width/height) is outside 0.5 .. 2.0")
    return found


def layout_of(dot_json: bytes) -> dict:
    """The parsed `dot -Tjson` output."""
    return json.loads(dot_json)
