"""The page of `interlock timeline`: a `Timeline` (`interlock.timeline`) as one self-contained
HTML page.

A lane per node shows its health and its model discovery over time; each transition is a mark
carrying its seq and message; gateway starts, stops and reloads are vertical lines, a reload
saying what it changed; a lane per model shows when no node would have served it; a decision
log adds the request rate and the failed share as a strip on top. Inline SVG with a little CSS
and JS: the page needs no network and opens anywhere.
"""

from __future__ import annotations

import datetime
import html
import math

from controlplane.rules.transitions import HEALTH, MODELS, OFFLINE, Transition
from events.state import Discovery, Health
from interlock.timeline import (
    BIN_STEPS,
    SERVED,
    UNSERVED,
    Band,
    GatewayEvent,
    Lane,
    ModelLane,
    Timeline,
    Traffic,
    nice_step,
    utc,
)

# --- time ------------------------------------------------------------------------------------

_TICK_STEPS = BIN_STEPS + (2 * 86400, 7 * 86400)


def _utc_ms(at: float) -> str:
    """`03:05:30.582Z`: a transition's time, to the millisecond the log records."""
    moment = datetime.datetime.fromtimestamp(at, datetime.UTC)
    return moment.strftime("%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def time_ticks(start: float, end: float) -> list[tuple[float, str]]:
    """About ten round UTC times across the window, labelled as precisely as their step needs."""
    step = nice_step((end - start) / 10, _TICK_STEPS)
    spans_days = utc(start, "%Y-%m-%d") != utc(end, "%Y-%m-%d")
    spec = "%H:%M:%S" if step < 60 else "%H:%M"
    if step >= 86400:
        spec = "%Y-%m-%d"
    elif spans_days:
        spec = "%m-%d " + spec
    first = math.ceil(start / step) * step
    return [(at, utc(at, spec)) for at in range(int(first), int(end) + 1, step)]


# --- rendering -------------------------------------------------------------------------------

WIDTH = 1320
"""The chart's width at full size: a 1,400 px window holds it with the page's margins and a
scroll bar; a narrower one scales it down (the SVG is at most 100% wide)."""
LABELS = 200
"""The lane label column."""
RIGHT = 40
STRIP_HEIGHT = 84
AXIS_HEIGHT = 26
GATEWAY_HEIGHT = 34
LANE_HEIGHT = 58
MODEL_LANE_HEIGHT = 30
MODEL_ROW = (9, 14)
"""(offset in a model's lane, height) of its served / no node bar."""
HEALTH_ROW = (14, 18)
MODELS_ROW = (34, 11)
"""(offset in the lane, height) of the health bar and the model discovery bar; the marks of each
sit just outside it (above the health bar, below the models bar), so they never hide a state."""
MARK_RADIUS = 4.5
MARK_SPACING = 9
"""Transitions of one event on one row sit side by side, this far apart."""

HEALTH_COLOURS = {Health.HEALTHY: "#2f9e5b", Health.DEGRADED: "#f0a22b", Health.DEAD: "#d33b3b"}
DISCOVERY_COLOURS = {
    Discovery.UNTRIED: "#c5cbd3",
    Discovery.KNOWN: "#3f7fd9",
    Discovery.KNOWN_EMPTY: "#9a67d8",
    Discovery.DEGRADED: "#f5c95c",
    Discovery.EXPIRED: "#8c3a2b",
}
MODEL_COLOURS = {SERVED: "#a9d8b8", UNSERVED: "#d33b3b"}
HEALTH_LABELS = {Health.DEGRADED: "degraded", Health.DEAD: "dead"}
DISCOVERY_LABELS = {
    Discovery.UNTRIED: "untried",
    Discovery.KNOWN_EMPTY: "no models",
    Discovery.DEGRADED: "listing failing",
    Discovery.EXPIRED: "expired",
}
"""The text written on a band wide enough for it; the normal states carry none."""
NORMAL = {Health.HEALTHY, Discovery.KNOWN}
"""States drawn at their true width however short; the others are kept visible (3 px at least)."""
LEVEL_COLOURS = {"info": "#1f2a3a", "warn": "#b25d00", "error": "#b31d1d"}
GATEWAY_LINES = {
    "start": ("#1f2a3a", ""),
    "stop": ("#1f2a3a", ""),
    "reload": ("#2f63b8", "6 4"),
    "reload rejected": ("#b31d1d", "6 4"),
}
"""(colour, dash pattern) of each kind of vertical line."""

_CSS = """
body { font: 14px/1.4 "DejaVu Sans", "Liberation Sans", system-ui, sans-serif; color: #1f2a3a; margin: 20px 24px;
       background: #fff; }
h1 { font-size: 20px; margin: 0 0 2px; }
.sub { color: #5b6573; margin: 0 0 12px; }
svg { display: block; max-width: 100%; height: auto; }
svg text { font: 12px "DejaVu Sans", "Liberation Sans", system-ui, sans-serif; fill: #1f2a3a; }
svg .name { font-weight: bold; font-size: 13px; }
svg .detail, svg .tick, svg .note { fill: #5b6573; font-size: 11px; }
svg .in-band { dominant-baseline: central; text-anchor: middle; pointer-events: none; font-weight: 600; }
.mark { cursor: pointer; }
.mark:hover circle { stroke: #1f2a3a; stroke-width: 2; }
.band:hover { opacity: 0.8; }
.legend { display: flex; flex-wrap: wrap; gap: 6px 22px; margin: 14px 0 0; color: #3a4452; font-size: 13px; }
.legend .group { display: flex; gap: 12px; align-items: center; }
.legend b { font-weight: 600; margin-right: 2px; }
.sw { display: inline-block; width: 22px; height: 12px; border-radius: 2px; vertical-align: -1px; margin-right: 4px; }
.dot { display: inline-block; width: 10px; height: 10px; border-radius: 50%; border: 1.5px solid #fff;
       box-shadow: 0 0 0 1px #c5cbd3; vertical-align: -1px; margin-right: 4px; }
.line { display: inline-block; width: 0; height: 14px; border-left: 2px solid; vertical-align: -2px;
        margin: 0 6px 0 4px; }
#tip { position: absolute; max-width: 520px; background: #1f2a3a; color: #fff; padding: 6px 9px;
       border-radius: 4px; font-size: 12px; white-space: pre-line; pointer-events: none; z-index: 2; }
"""

_HATCH_CSS = "repeating-linear-gradient(135deg, {0} 0 3px, transparent 3px 6px)"

_JS = """
(() => {
  const tip = document.getElementById("tip");
  for (const title of document.querySelectorAll("#chart title")) {  // instant tooltips instead of the native ones
    title.parentElement.dataset.tip = title.textContent;
    title.remove();
  }
  document.addEventListener("mousemove", (event) => {
    const item = event.target.closest("[data-tip]");
    if (!item) { tip.hidden = true; return; }
    tip.textContent = item.dataset.tip;
    tip.hidden = false;
    const right = window.scrollX + document.documentElement.clientWidth - 8;
    tip.style.left = Math.min(event.pageX + 14, right - tip.offsetWidth) + "px";
    tip.style.top = (event.pageY + 16) + "px";
  });
  const chart = document.getElementById("chart"), cursor = document.getElementById("cursor");
  const [start, end, x0, width] = ["start", "end", "x0", "width"].map((key) => Number(chart.dataset[key]));
  chart.addEventListener("mousemove", (event) => {
    const box = chart.getBoundingClientRect();  // the chart may be drawn smaller than its viewBox
    const x = (event.clientX - box.left) * chart.viewBox.baseVal.width / box.width;
    if (x < x0 || x > x0 + width) { cursor.setAttribute("visibility", "hidden"); return; }
    const at = start + (x - x0) / width * (end - start);
    cursor.setAttribute("transform", `translate(${x},0)`);
    cursor.querySelector("text").textContent = new Date(at * 1000).toISOString().slice(11, 19) + "Z";
    cursor.setAttribute("visibility", "visible");
  });
  chart.addEventListener("mouseleave", () => cursor.setAttribute("visibility", "hidden"));
})();
"""


class _Canvas:
    """Maps times to x and collects SVG elements."""

    def __init__(self, timeline: Timeline):
        self.start, self.end = timeline.start, timeline.end
        self.plot_width = WIDTH - LABELS - RIGHT
        self.parts: list[str] = []

    def x(self, at: float) -> float:
        return round(LABELS + (at - self.start) / (self.end - self.start) * self.plot_width, 1)

    def add(self, part: str) -> None:
        self.parts.append(part)


def _attr(text: object) -> str:
    return html.escape(str(text), quote=True)


def _transition_tip(transition: Transition) -> str:
    fields = "\n".join(f"{key}: {value}" for key, value in transition.fields if key != "node")
    where = f" · {transition.node}" if transition.node else ""
    text = f"seq {transition.seq} · {_utc_ms(transition.at)} · {transition.level}{where}\n{transition.msg}"
    return text + ("\n" + fields if fields else "")


def _mark(canvas: _Canvas, transition: Transition, x: float, y: float) -> None:
    canvas.add(
        f'<g class="mark" data-seq="{transition.seq}" data-kind="{transition.kind}" data-level="{transition.level}"'
        f' data-node="{_attr(transition.node)}"><title>{_attr(_transition_tip(transition))}</title>'
        f'<circle cx="{x}" cy="{y}" r="{MARK_RADIUS}" fill="{LEVEL_COLOURS.get(transition.level, "#1f2a3a")}"'
        ' stroke="#fff" stroke-width="1.5"/></g>'
    )


def _marks_in_row(canvas: _Canvas, transitions: list[Transition], y: float) -> None:
    """One mark per transition; those of the same event side by side, the first at its time."""
    previous_seq, offset = None, 0
    for transition in transitions:
        offset = offset + MARK_SPACING if transition.seq == previous_seq else 0
        previous_seq = transition.seq
        _mark(canvas, transition, canvas.x(transition.at) + offset, y)


def _band_rects(
    canvas: _Canvas,
    bands: list[Band],
    top: float,
    row: tuple[int, int],
    what: str,
    colours: dict[str, str],
    labels: dict[str, str],
) -> None:
    offset, height = row
    for band in bands:
        x0, x1 = canvas.x(band.start), canvas.x(band.end)
        tip = f"{what}: {band.state}\n{utc(band.start, '%H:%M:%SZ')} – {utc(band.end, '%H:%M:%SZ')}"
        tip += f" ({_duration(band.end - band.start)})"
        fill = colours.get(band.state, "url(#offline)")
        canvas.add(
            f'<rect class="band {what}" data-state="{_attr(band.state)}"'
            f' data-start="{band.start}" data-end="{band.end}"'
            f' x="{x0}" y="{top + offset}" width="{max(x1 - x0, 1 if band.state in NORMAL else 3):.1f}"'
            f' height="{height}" fill="{fill}">'
            f"<title>{_attr(tip)}</title></rect>"
        )
        label = labels.get(band.state, "")
        if label and x1 - x0 > _text_width(label) + 40:  # room for it between the marks at either end
            canvas.add(
                f'<text class="in-band" x="{(x0 + x1) / 2:.1f}" y="{top + offset + height / 2}"'
                f' style="fill:{_text_colour(fill)}; font-size:{min(height - 2, 12)}px">{_attr(label)}</text>'
            )


def _text_colour(fill: str) -> str:
    """Dark text on a light fill, white on a dark one."""
    red, green, blue = (int(fill[i : i + 2], 16) / 255 for i in (1, 3, 5))
    return "#1f2a3a" if 0.299 * red + 0.587 * green + 0.114 * blue > 0.6 else "#fff"


def _lane(canvas: _Canvas, lane: Lane, top: float) -> None:
    canvas.add(f'<g class="lane" data-node="{_attr(lane.ip)}">')
    canvas.add(
        f'<rect x="{LABELS}" y="{top + HEALTH_ROW[0]}" width="{canvas.plot_width}" height="{HEALTH_ROW[1]}"'
        ' fill="#f1f3f6"/>'
        f'<rect x="{LABELS}" y="{top + MODELS_ROW[0]}" width="{canvas.plot_width}" height="{MODELS_ROW[1]}"'
        ' fill="#f1f3f6"/>'
    )
    title = lane.name or lane.ip
    detail = " · ".join(part for part in (lane.ip if lane.name else "", lane.ring or "standalone") if part)
    canvas.add(f'<text class="name" x="12" y="{top + 27}">{_attr(title)}</text>')
    canvas.add(f'<text class="detail" x="12" y="{top + 44}">{_attr(detail)}</text>')
    _band_rects(canvas, lane.health, top, HEALTH_ROW, HEALTH, HEALTH_COLOURS, HEALTH_LABELS)
    _band_rects(canvas, lane.offline, top, HEALTH_ROW, OFFLINE, {}, {})
    _band_rects(canvas, lane.models, top, MODELS_ROW, MODELS, DISCOVERY_COLOURS, DISCOVERY_LABELS)
    health_marks = [mark for mark in lane.marks if mark.kind != MODELS]
    _marks_in_row(canvas, health_marks, top + HEALTH_ROW[0] - MARK_RADIUS - 1)
    models_marks = [mark for mark in lane.marks if mark.kind == MODELS]
    _marks_in_row(canvas, models_marks, top + MODELS_ROW[0] + MODELS_ROW[1] + MARK_RADIUS + 1)
    canvas.add("</g>")


def _axis(canvas: _Canvas, ticks: list[tuple[float, str]], top: float, lines_to: float) -> None:
    """Tick labels in a row at `top`, with grid lines down to `lines_to`."""
    for at, label in ticks:
        x = canvas.x(at)
        canvas.add(f'<line x1="{x}" y1="{top + AXIS_HEIGHT - 4}" x2="{x}" y2="{lines_to}" stroke="#e1e5ea"/>')
        canvas.add(f'<text class="tick" x="{x}" y="{top + 15}" text-anchor="middle">{label}</text>')


def _strip(canvas: _Canvas, traffic: Traffic, top: float) -> None:
    """Requests per second per bin, the 5xx share in red, with the peak rate as the scale."""
    rates = []
    for traffic_bin in traffic.bins:
        seconds = min(traffic.bin_seconds, canvas.end - traffic_bin.start)  # the last bin may be cut short
        rates.append((traffic_bin.requests / seconds, traffic_bin.failures / seconds))
    peak = max((requests for requests, _ in rates), default=0.0)
    height = STRIP_HEIGHT - 20
    bottom = top + height
    total = sum(traffic_bin.requests for traffic_bin in traffic.bins)
    failures = sum(traffic_bin.failures for traffic_bin in traffic.bins)
    share = f" ({100 * failures / total:.1f}%)" if total else ""
    canvas.add(f'<g class="strip" data-requests="{total}" data-failures="{failures}">')
    canvas.add(f'<text class="name" x="12" y="{top + 14}">requests</text>')
    canvas.add(f'<text class="detail" x="12" y="{top + 30}">{total} in window, {failures} failed{share}</text>')
    canvas.add(f'<text class="detail" x="12" y="{top + 46}">per {traffic.bin_seconds} s bin</text>')
    canvas.add(f'<rect x="{LABELS}" y="{top}" width="{canvas.plot_width}" height="{height}" fill="#f7f8fa"/>')
    canvas.add(f'<line x1="{LABELS}" y1="{bottom}" x2="{LABELS + canvas.plot_width}" y2="{bottom}" stroke="#c5cbd3"/>')
    if peak:
        canvas.add(f'<text class="tick" x="{LABELS + canvas.plot_width + 4}" y="{top + 10}">{peak:.1f}/s</text>')
        canvas.add(
            f'<line x1="{LABELS}" y1="{top}" x2="{LABELS + canvas.plot_width}" y2="{top}" stroke="#e1e5ea"'
            ' stroke-dasharray="2 3"/>'
        )
    for traffic_bin, (requests, failures) in zip(traffic.bins, rates):
        if not requests:
            continue
        x0, x1 = canvas.x(traffic_bin.start), canvas.x(min(traffic_bin.start + traffic.bin_seconds, canvas.end))
        bar = max(x1 - x0 - 1, 1)
        tip = (
            f"{utc(traffic_bin.start, '%H:%M:%SZ')} + {traffic.bin_seconds} s\n{traffic_bin.requests} requests"
            f", {requests:.1f}/s, {traffic_bin.failures} failed (5xx or cut short by the node)"
        )
        requests_height, errors_height = height * requests / peak, height * failures / peak
        canvas.add(
            f'<g class="bar"><title>{_attr(tip)}</title>'
            f'<rect x="{x0}" y="{bottom - requests_height:.1f}" width="{bar:.1f}"'
            f' height="{requests_height:.1f}" fill="#9aa8bb"/>'
        )
        if failures:
            canvas.add(
                f'<rect x="{x0}" y="{bottom - errors_height:.1f}" width="{bar:.1f}"'
                f' height="{errors_height:.1f}" fill="#d33b3b"/>'
            )
        canvas.add("</g>")
    canvas.add("</g>")


def _gateway_row(canvas: _Canvas, events: list[GatewayEvent], top: float, lines_to: float) -> None:
    """Starts, stops and reloads: a labelled line through every lane, a mark per transition."""
    canvas.add('<g class="gateway">')
    canvas.add(f'<text class="name" x="12" y="{top + 21}">gateway</text>')
    for index, event in enumerate(events):
        colour, dash = GATEWAY_LINES[event.label]
        x = canvas.x(event.at)
        dashes = f' stroke-dasharray="{dash}"' if dash else ""
        tip = f"{event.label} at {_utc_ms(event.at)}" + "".join(f"\n{change}" for change in event.changes)
        canvas.add(
            f'<g class="gateway-event" data-changes="{_attr(chr(10).join(event.changes))}"><title>{_attr(tip)}</title>'
            f'<line class="gateway-line" data-label="{event.label}" x1="{x}" y1="{top + 6}" x2="{x}"'
            f' y2="{lines_to}" stroke="{colour}" stroke-width="1.5"{dashes} opacity="0.75"/>'
            f'<line x1="{x}" y1="{top + 6}" x2="{x}" y2="{lines_to}" stroke="transparent" stroke-width="7"/></g>'
        )
        marks_end = x + MARK_SPACING * (len(event.transitions) - 1) + 8
        room = (canvas.x(events[index + 1].at) - 8 if index + 1 < len(events) else WIDTH) - marks_end
        label = next((text for text in _gateway_labels(event) if _text_width(text) <= room), "")
        if label:
            canvas.add(f'<text class="note" x="{marks_end}" y="{top + 21}">{_attr(label)}</text>')
        _marks_in_row(canvas, event.transitions, top + 17)
    canvas.add("</g>")


def _gateway_labels(event: GatewayEvent) -> list[str]:
    """A gateway line's label, longest first: a reload names what it changed
    (`reload: nodes +10.0.0.5`, `reload: nodes, policy`), else says it changed none of them."""
    labels = []
    if event.label == "reload":
        if event.changes:
            labels.append("reload: " + "; ".join(change.replace(":", "", 1) for change in event.changes))
            aspects = dict.fromkeys(change.split(":")[0].split()[0] for change in event.changes)
            labels.append("reload: " + ", ".join(aspects))
        else:
            labels.append("reload: nodes, models, policy unchanged")
    return labels + [event.label, event.label.split()[-1]]


def _model_lane(canvas: _Canvas, lane: ModelLane, top: float) -> None:
    canvas.add(f'<g class="model-lane" data-model="{_attr(lane.name)}">')
    offset, height = MODEL_ROW
    canvas.add(f'<rect x="{LABELS}" y="{top + offset}" width="{canvas.plot_width}" height="{height}" fill="#f1f3f6"/>')
    name = lane.name if _text_width(lane.name) <= LABELS - 24 else lane.name[: int((LABELS - 24) / 6.5) - 1] + "…"
    canvas.add(f'<text class="detail" x="12" y="{top + 20}"><title>{_attr(lane.name)}</title>{_attr(name)}</text>')
    _band_rects(canvas, lane.bands, top, MODEL_ROW, "model", MODEL_COLOURS, {UNSERVED: UNSERVED})
    canvas.add("</g>")


def _text_width(text: str) -> float:
    """Roughly, in the chart's 11 px notes."""
    return 6.5 * len(text)


def _stopped_bands(canvas: _Canvas, stopped: list[Band], top: float, bottom: float) -> None:
    for band in stopped:
        x0, x1 = canvas.x(band.start), canvas.x(band.end)
        tip = f"gateway not running\n{utc(band.start, '%H:%M:%SZ')} – {utc(band.end, '%H:%M:%SZ')}"
        canvas.add(
            f'<rect class="band stopped" x="{x0}" y="{top}" width="{max(x1 - x0, 0.5):.1f}"'
            f' height="{bottom - top}" fill="url(#stopped)"><title>{_attr(tip)}</title></rect>'
        )


def _svg(timeline: Timeline) -> str:
    canvas = _Canvas(timeline)
    ticks = time_ticks(timeline.start, timeline.end)
    top = 0.0
    strip_top = None
    if timeline.traffic is not None:
        strip_top, top = top, top + STRIP_HEIGHT
    axis_top = top
    gateway_top = axis_top + AXIS_HEIGHT
    lanes_top = gateway_top + GATEWAY_HEIGHT
    models_top = lanes_top + LANE_HEIGHT * len(timeline.lanes)
    lanes_bottom = models_top + MODEL_LANE_HEIGHT * len(timeline.model_lanes)
    height = lanes_bottom + AXIS_HEIGHT
    canvas.add(
        '<defs><pattern id="offline" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">'
        '<rect width="6" height="6" fill="#5a3d8a"/><rect width="3" height="6" fill="#b7a3d9"/></pattern>'
        '<pattern id="stopped" width="8" height="8" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">'
        '<rect width="8" height="8" fill="#ffffff" opacity="0.65"/><rect width="2" height="8" fill="#8d96a3"'
        ' opacity="0.5"/></pattern></defs>'
    )
    _axis(canvas, ticks, axis_top, lanes_bottom)
    if strip_top is not None:
        _strip(canvas, timeline.traffic, strip_top)
    for index, lane in enumerate(timeline.lanes):
        lane_top = lanes_top + index * LANE_HEIGHT
        if index:
            canvas.add(f'<line x1="0" y1="{lane_top}" x2="{WIDTH}" y2="{lane_top}" stroke="#e9ecf0"/>')
        _lane(canvas, lane, lane_top)
    if timeline.model_lanes:
        canvas.add(f'<line x1="0" y1="{models_top}" x2="{WIDTH}" y2="{models_top}" stroke="#c5cbd3"/>')
    for index, model_lane in enumerate(timeline.model_lanes):
        _model_lane(canvas, model_lane, models_top + index * MODEL_LANE_HEIGHT)
    _stopped_bands(canvas, timeline.stopped, lanes_top, lanes_bottom)
    _gateway_row(canvas, timeline.gateway_events, gateway_top, lanes_bottom)
    for at, label in ticks:
        canvas.add(f'<text class="tick" x="{canvas.x(at)}" y="{lanes_bottom + 16}" text-anchor="middle">{label}</text>')
    canvas.add(
        f'<g id="cursor" visibility="hidden" pointer-events="none"><line x1="0" y1="{axis_top + AXIS_HEIGHT - 4}"'
        f' x2="0" y2="{lanes_bottom}" stroke="#1f2a3a" stroke-opacity="0.35"/>'
        f'<rect x="-35" y="{axis_top + 2}" width="70" height="18" rx="3" fill="#1f2a3a"/>'
        f'<text x="0" y="{axis_top + 15}" text-anchor="middle" style="fill:#fff; font-size:11px">.</text></g>'
    )
    return (
        f'<svg id="chart" width="{WIDTH}" height="{height:.0f}"'
        f' viewBox="0 0 {WIDTH} {height:.0f}" data-start="{timeline.start}" data-end="{timeline.end}"'
        f' data-x0="{LABELS}" data-width="{canvas.plot_width}">' + "".join(canvas.parts) + "</svg>"
    )


def _legend(timeline: Timeline) -> str:
    def swatch(colour: str, label: str) -> str:
        return f'<span><span class="sw" style="background:{colour}"></span>{_attr(label)}</span>'

    def dot(colour: str, label: str) -> str:
        return f'<span><span class="dot" style="background:{colour}"></span>{label}</span>'

    def line(colour: str, dash: str, label: str) -> str:
        style = f"border-left: 2px {'dashed' if dash else 'solid'} {colour}"
        return f'<span><span class="line" style="{style}"></span>{label}</span>'

    health = [swatch(colour, state) for state, colour in HEALTH_COLOURS.items()]
    health.append(swatch(_HATCH_CSS.format("#5a3d8a") + ", #b7a3d9", "offline (skipped by the data plane)"))
    models = [swatch(colour, state) for state, colour in DISCOVERY_COLOURS.items()]
    marks = [dot(colour, level) for level, colour in LEVEL_COLOURS.items()]
    lines = [
        line(*GATEWAY_LINES["start"], "start / stop"),
        line(*GATEWAY_LINES["reload"], "reload"),
        line(*GATEWAY_LINES["reload rejected"], "reload rejected"),
        swatch(_HATCH_CSS.format("#8d96a3"), "gateway not running"),
    ]
    groups = [("health (thick bar)", health), ("models (thin bar)", models), ("transitions", marks), ("gateway", lines)]
    if timeline.model_lanes:
        served = swatch(MODEL_COLOURS[SERVED], "a node would serve it")
        groups.append(("model lanes", [served, swatch(MODEL_COLOURS[UNSERVED], "no node (503)")]))
    if timeline.traffic is not None:
        failures = swatch("#d33b3b", "failed: 5xx, or cut short by the node")
        groups.append(("requests", [swatch("#9aa8bb", "all"), failures]))
    return (
        '<div class="legend">'
        + "".join(f'<div class="group"><b>{title}</b>{"".join(items)}</div>' for title, items in groups)
        + "</div>"
    )


def render_html(timeline: Timeline) -> str:
    """The whole page: heading, chart, legend, and the hover script."""
    marks = sum(len(lane.marks) for lane in timeline.lanes) + sum(
        len(event.transitions) for event in timeline.gateway_events
    )
    title = f"Interlock timeline: {timeline.cluster}" if timeline.cluster else "Interlock timeline"
    window = f"{utc(timeline.start, '%Y-%m-%d %H:%M:%S')} – {utc(timeline.end, '%Y-%m-%d %H:%M:%S')} UTC"
    summary = (
        f"{window} ({_duration(timeline.end - timeline.start)}) · {len(timeline.lanes)} nodes · {marks}"
        f" transitions · {timeline.event_count} events from {', '.join(timeline.sources)}"
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{_attr(title)}</title><style>{_CSS}</style></head><body>"
        f'<h1>{_attr(title)}</h1><p class="sub">{_attr(summary)} · hover a mark for its seq and message</p>'
        f'{_svg(timeline)}{_legend(timeline)}<div id="tip" hidden></div><script>{_JS}</script></body></html>\n'
    )
