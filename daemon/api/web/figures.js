// The plots' panels and the totals table, from what the page has seen: samples of /metrics,
// the latest /props, and the answers it streamed.

import { total } from "./api.js";
import { plot } from "./plots.js";

const KEEP = 60; // points per time series

const panel = (id) => document.getElementById(id);
const fixed = (value, digits = 2) => (value == null ? "–" : Number(value).toFixed(digits));

function headline(id, text) {
  panel(id).querySelector(".headline").textContent = text;
}

function draw(id, series, options) {
  plot(panel(id).querySelector("canvas"), series, options);
}

// The figures one /metrics scrape gives, named as the totals table names them.
export function figuresOf(metrics) {
  const rounds = total(metrics, "hetspec_speculative_rounds_total");
  const accepted = total(metrics, "hetspec_draft_accepted_tokens_total");
  const rateSum = total(metrics, "hetspec_decode_tokens_per_second_sum");
  const rateCount = total(metrics, "hetspec_decode_tokens_per_second_count");
  return {
    hetspec_generated_tokens_total: total(metrics, "hetspec_generated_tokens_total"),
    hetspec_speculative_rounds_total: rounds,
    hetspec_draft_tokens_total: total(metrics, "hetspec_draft_tokens_total"),
    hetspec_draft_accepted_tokens_total: accepted,
    accepted_per_round: rounds ? accepted / rounds : null,
    decode_tokens_per_second_mean: rateCount ? rateSum / rateCount : null,
    hetspec_queue_waiting: total(metrics, "hetspec_queue_waiting"),
    worker_restarts: total(metrics, "hetspec_worker_restarts"),
    rateSum,
    rateCount,
  };
}

// Per-interval series: a point where generations ended since the previous scrape.
export class History {
  constructor() {
    this.previous = null;
    this.rates = [];
    this.accepted = [];
  }

  add(figures) {
    const before = this.previous;
    this.previous = figures;
    if (!before) return;
    const generations = figures.rateCount - before.rateCount;
    if (generations > 0) push(this.rates, (figures.rateSum - before.rateSum) / generations);
    const rounds = figures.hetspec_speculative_rounds_total - before.hetspec_speculative_rounds_total;
    const accepted =
      figures.hetspec_draft_accepted_tokens_total - before.hetspec_draft_accepted_tokens_total;
    if (rounds > 0) push(this.accepted, accepted / rounds);
  }
}

function push(list, value) {
  list.push(value);
  if (list.length > KEEP) list.shift();
}

export function showTotals(figures) {
  for (const cell of document.querySelectorAll("[data-metric]")) {
    const value = figures[cell.dataset.metric];
    cell.dataset.value = value == null ? "" : String(value);
    cell.textContent =
      value == null ? "–" : Number.isInteger(value) ? String(value) : value.toFixed(2);
  }
}

export function showMetricPlots(history, figures) {
  draw("plot-rate", [{ values: history.rates, kind: "line", color: "#2f6fde" }], {
    empty: "no answer since the page opened",
  });
  headline(
    "plot-rate",
    figures.rateCount
      ? `mean ${fixed(figures.decode_tokens_per_second_mean, 1)} tokens/s over ` +
          `${figures.rateCount} generation${figures.rateCount === 1 ? "" : "s"} since start`
      : "no generation yet",
  );
  draw("plot-accepted", [{ values: history.accepted, kind: "line", color: "#2f6fde" }], {
    empty: "no speculative round since the page opened",
  });
  headline(
    "plot-accepted",
    figures.accepted_per_round == null
      ? "no speculative round yet"
      : `${fixed(figures.accepted_per_round)} a round since start ` +
          `(${figures.hetspec_draft_accepted_tokens_total} of ` +
          `${figures.hetspec_draft_tokens_total} drafted)`,
  );
}

// What the last answer's rounds chose, and what each mode's controller chooses now.
export function showChoices(answers, props) {
  const last = answers[answers.length - 1]?.speculative;
  draw(
    "plot-gamma",
    last
      ? [
          { values: last.gamma_history, kind: "bar" },
          { values: last.branch_history, kind: "line" },
        ]
      : [],
    { empty: "after an answer with speculative rounds" },
  );
  const now = Object.entries(props?.gamma || {})
    .filter(([, choice]) => choice)
    .map(([mode, c]) =>
      c.gamma
        ? `${mode} γ${c.gamma} × ${c.branches} branch${c.branches === 1 ? "" : "es"}` +
          (c.overlap ? ", overlapped" : "")
        : `${mode} decodes alone (γ0)`,
    );
  headline("plot-gamma", now.length ? `now: ${now.join("; ")}` : "no round chosen yet");

  const recent = answers.slice(-30);
  draw(
    "plot-overlap",
    recent.length
      ? [
          { values: recent.map((a) => a.speculative?.rounds ?? 0), kind: "bar" },
          { values: recent.map((a) => a.speculative?.run_ahead ?? 0), kind: "line" },
        ]
      : [],
    { empty: "after an answer" },
  );
  headline(
    "plot-overlap",
    last
      ? `last answer: ${last.run_ahead} of ${last.rounds} rounds overlapped ` +
          `(drafted while the previous one verified), ${last.run_ahead_held} of them kept`
      : "",
  );
}

// The controller's measured costs by verified width (the last answer's) and the load profile.
export function showCosts(answers, props) {
  const last = answers[answers.length - 1]?.speculative;
  const controller = last?.controller;
  const series = [];
  let text = "after an answer with speculative rounds";
  if (controller) {
    const widths = Object.keys(controller.verify_ms?.plain || {}).map(Number);
    const at = (kind) => widths.map((w) => controller.verify_ms[kind]?.[w] ?? null);
    series.push({ values: at("plain"), xs: widths, kind: "line" });
    series.push({ values: at("overlapped"), xs: widths, kind: "line", color: "#b05fd0" });
    const step = controller.draft_step_ms?.plain;
    if (step != null && widths.length) {
      series.push({ values: widths.map(() => step), xs: widths, kind: "dashed" });
    }
    const drafted = last.t_draft_ms == null ? "no draft" : `drafter ${fixed(last.t_draft_ms, 3)} ms`;
    text =
      `last answer, a round: verifier ${fixed(last.t_verify_ms)} ms, ${drafted}; ` +
      `a drafted token ${fixed(step, 3)} ms`;
  }
  draw("plot-costs", series, { empty: "after an answer with speculative rounds" });
  headline("plot-costs", text);

  const decision = props?.gpu_runtime;
  const profiles = decision?.profiles || [];
  const palette = ["#2f6fde", "#e0782f", "#1f8a4c", "#b05fd0"];
  draw(
    "plot-profile",
    profiles.map((p, i) => ({
      values: p.median_ms,
      xs: p.widths,
      kind: "line",
      color: palette[i % palette.length],
    })),
    { empty: decision ? `verifier runtime ${decision.runtime}: ${decision.chosen_by}` : "" },
  );
  const drafter = props?.drafter;
  const drafterCost = drafter?.costs_ms?.[drafter.runtime];
  const perToken = drafterCost ? Object.values(drafterCost)[0] : null;
  const parts = profiles.map((p, i) => `${p.runtime} on ${p.device} (${["blue", "orange", "green", "purple"][i % 4]})`);
  if (decision) parts.push(`chosen: ${decision.runtime} (by ${decision.chosen_by})`);
  if (drafter) parts.push(`drafter ${drafter.runtime}, ${fixed(perToken, 3)} ms a token`);
  const queue = props?.queue;
  if (queue) {
    const seats = queue.parallel ?? 1;
    parts.push(`queue ${queue.running} of ${seats} decoding, ${queue.waiting} waiting`);
  }
  headline("plot-profile", parts.join(" · "));
}
