// Small canvas plots: bars and lines over one shared y axis from 0.

const COLORS = { bar: "#9dbaf0", line: "#e0782f", dashed: "#1f8a4c", other: "#2f6fde" };

function niceCeiling(value) {
  if (!(value > 0)) return 1;
  const power = 10 ** Math.floor(Math.log10(value));
  for (const step of [1, 2, 2.5, 5, 10]) if (step * power >= value) return step * power;
  return 10 * power;
}

function format(value) {
  if (value >= 100) return value.toFixed(0);
  if (value >= 10) return value.toFixed(1).replace(/\.0$/, "");
  return value.toFixed(2).replace(/\.?0+$/, "") || "0";
}

// Draw `series` ([{values, xs?, kind: "bar" | "line" | "dashed", color?}]) on `canvas`.
// Without xs a series is indexed 0..n-1 (bars need that); with xs, lines are drawn at those x.
// The canvas records what it shows: data-points (values drawn) and data-last (the first
// series' last value), which the page's test reads.
export function plot(canvas, series, { empty = "no data yet" } = {}) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth;
  const height = canvas.clientHeight;
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  const g = canvas.getContext("2d");
  g.scale(ratio, ratio);
  g.clearRect(0, 0, width, height);
  g.font = "10px system-ui, sans-serif";
  const drawn = series.filter((s) => s.values.some((v) => v != null));
  const points = drawn.reduce((n, s) => n + s.values.filter((v) => v != null).length, 0);
  canvas.dataset.points = String(points);
  const first = drawn[0]?.values.filter((v) => v != null) || [];
  canvas.dataset.last = first.length ? String(first[first.length - 1]) : "";
  if (!points) {
    g.fillStyle = "#6b7385";
    g.textAlign = "center";
    g.fillText(empty, width / 2, height / 2);
    return;
  }
  const left = 34, right = 6, top = 6, bottom = 16;
  const plotWidth = width - left - right, plotHeight = height - top - bottom;
  const all = drawn.flatMap((s) => s.values.filter((v) => v != null));
  const yMax = niceCeiling(Math.max(...all) * 1.05);
  const xsOf = (s) => s.xs || s.values.map((_, i) => i);
  const xValues = drawn.flatMap(xsOf);
  const indexed = drawn.some((s) => !s.xs);
  const xMin = indexed ? -0.5 : Math.min(...xValues);
  const xMax = indexed ? Math.max(...xValues) + 0.5 : Math.max(...xValues);
  const xSpan = xMax - xMin || 1;
  const x = (v) => left + ((v - xMin) / xSpan) * plotWidth;
  const y = (v) => top + plotHeight - (v / yMax) * plotHeight;

  g.strokeStyle = "#e6e9f0";
  g.fillStyle = "#6b7385";
  g.textAlign = "right";
  g.textBaseline = "middle";
  for (let i = 0; i <= 2; i++) {
    const v = (yMax * i) / 2;
    g.beginPath();
    g.moveTo(left, y(v));
    g.lineTo(width - right, y(v));
    g.stroke();
    g.fillText(format(v), left - 4, y(v));
  }
  g.textBaseline = "top";
  const xFirst = indexed ? 0 : xMin;
  const xLast = indexed ? Math.max(...xValues) : xMax;
  g.textAlign = "left";
  g.fillText(format(xFirst + (indexed ? 1 : 0)), x(xFirst), height - bottom + 3);
  g.textAlign = "right";
  g.fillText(format(xLast + (indexed ? 1 : 0)), x(xLast), height - bottom + 3);

  for (const s of drawn) {
    const xs = xsOf(s);
    const kind = s.kind || "line";
    if (kind === "bar") {
      const barWidth = Math.min(28, Math.max(1, (plotWidth / xSpan) * 0.7));
      g.fillStyle = s.color || COLORS.bar;
      s.values.forEach((v, i) => {
        if (v != null) g.fillRect(x(xs[i]) - barWidth / 2, y(v), barWidth, y(0) - y(v));
      });
      continue;
    }
    g.strokeStyle = g.fillStyle = s.color || COLORS[kind] || COLORS.line;
    g.lineWidth = 1.6;
    g.setLineDash(kind === "dashed" ? [5, 4] : []);
    g.beginPath();
    let started = false;
    s.values.forEach((v, i) => {
      if (v == null) return;
      if (started) g.lineTo(x(xs[i]), y(v));
      else g.moveTo(x(xs[i]), y(v));
      started = true;
    });
    g.stroke();
    g.setLineDash([]);
    if (s.values.length <= 40) {
      s.values.forEach((v, i) => {
        if (v == null) return;
        g.beginPath();
        g.arc(x(xs[i]), y(v), 2, 0, 2 * Math.PI);
        g.fill();
      });
    }
  }
}
