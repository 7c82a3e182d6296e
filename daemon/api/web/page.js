// The page: the chat, the status line, and the plots refreshed from /metrics and /props.

import { call, parseMetrics, Problem, problemOf, setToken, token } from "./api.js";
import { streamChat } from "./chat.js";
import {
  figuresOf,
  History,
  showChoices,
  showCosts,
  showMetricPlots,
  showTotals,
} from "./figures.js";

const POLL_MS = 1000;
const $ = (id) => document.getElementById(id);

const page = {
  messages: [], // the conversation so far, as OpenAI's messages
  answers: [], // each streamed answer's usage chunk (timings, speculative)
  history: new History(),
  props: null,
  restarts: null, // {worker: restarts} at the previous poll
  note: "", // a passing remark for the status line (a worker restarted)
  running: null, // the AbortController of the answer streaming now
  failures: 0,
};

function showStatus(text, state) {
  const status = $("status");
  status.textContent = text;
  status.dataset.state = state;
}

function addTurn(kind, text) {
  const turn = document.createElement("pre");
  turn.className = `turn ${kind}`;
  turn.textContent = text;
  $("conversation").append(turn);
  turn.scrollIntoView({ block: "end" });
  return turn;
}

// ------------------------------------------------------------------ status and plots

function statusOf(props) {
  const workers = Object.entries(props.workers || {});
  const down = workers.filter(([, w]) => !w.alive).map(([name]) => name);
  if (props.status === "draining") return ["hetspecd is shutting down: reconnecting…", "down"];
  if (props.status === "loading" && down.length) {
    return [`hetspecd is restarting its ${down.join(" and ")} worker…`, "loading"];
  }
  if (props.status === "loading") return ["hetspecd is loading its models…", "loading"];
  const devices = Object.entries(props.devices || {})
    .map(([role, device]) => `${role} on ${device}`)
    .join(", ");
  const queue = props.queue || {};
  if (queue.running) {
    const together = queue.running > 1 ? ` ${queue.running} at once` : "";
    return [`answering${together} (${queue.waiting} waiting) · ${devices}`, "busy"];
  }
  return [`ready · ${devices}${page.note ? ` · ${page.note}` : ""}`, "ready"];
}

function noticeRestarts(props) {
  const now = Object.fromEntries(
    Object.entries(props.workers || {}).map(([name, w]) => [name, w.restarts]),
  );
  for (const [name, count] of Object.entries(now)) {
    if (page.restarts && count > (page.restarts[name] ?? 0)) {
      page.note = `the ${name} worker restarted (${count} since start)`;
    }
  }
  page.restarts = now;
}

function fillModes(props) {
  const select = $("mode");
  if (select.options.length) return;
  const modes = props.models?.draft
    ? ["adaptive", "sequential", "parallel", "autoregressive"]
    : ["adaptive", "autoregressive"];
  for (const mode of modes) select.add(new Option(mode, mode, false, mode === props.mode));
}

async function pollOnce() {
  const [metricsResponse, propsResponse] = await Promise.all([call("/metrics"), call("/props")]);
  for (const response of [metricsResponse, propsResponse]) {
    if (!response.ok) throw await problemOf(response);
  }
  const [text, props] = await Promise.all([metricsResponse.text(), propsResponse.json()]);
  const figures = figuresOf(parseMetrics(text));
  page.props = props;
  page.history.add(figures);
  noticeRestarts(props);
  fillModes(props);
  $("model").textContent = props.model;
  showStatus(...statusOf(props));
  showTotals(figures);
  showMetricPlots(page.history, figures);
  showChoices(page.answers, props);
  showCosts(page.answers, props);
}

async function poll() {
  try {
    await pollOnce();
    page.failures = 0;
  } catch (error) {
    page.failures += 1;
    const problem = error instanceof Problem ? error : new Problem("hetspecd answered oddly: retrying…");
    showStatus(problem.message, problem.state);
  }
  // back off while the daemon is away, up to 5 s
  setTimeout(poll, Math.min(5000, POLL_MS * 2 ** Math.min(page.failures, 3)));
}

// ------------------------------------------------------------------ chat

function requestBody() {
  const body = {
    model: page.props?.model || "hetspec",
    messages: [...page.messages],
    temperature: Number($("temperature").value || 0),
    max_tokens: Number($("max-tokens").value || 256),
  };
  const system = $("system").value.trim();
  if (system) body.messages.unshift({ role: "system", content: system });
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  if ($("mode").value) body.mode = $("mode").value;
  return body;
}

function describe(final, finish) {
  const t = final.timings || {};
  const s = final.speculative;
  const parts = [
    `${final.usage.completion_tokens} tokens`,
    `${(t.predicted_per_second ?? 0).toFixed(1)} tokens/s`,
    `first token after ${(t.ttft_ms ?? 0).toFixed(0)} ms`,
  ];
  if (s) parts.push(`${s.rounds} rounds, ${s.mean_accepted_length.toFixed(2)} accepted a round`);
  parts.push(`${final.mode}, ${finish}`);
  return parts.join(" · ");
}

async function send(event) {
  event.preventDefault();
  const prompt = $("prompt").value.trim();
  if (!prompt || page.running) return;
  page.messages.push({ role: "user", content: prompt });
  addTurn("user", prompt);
  $("prompt").value = "";
  const answer = addTurn("assistant", "");
  const stats = $("answer-stats");
  const controller = (page.running = new AbortController());
  $("send").disabled = true;
  $("stop").disabled = false;
  const started = performance.now();
  let pieces = 0;
  try {
    const { usage, finish } = await streamChat(requestBody(), {
      signal: controller.signal,
      onText(piece) {
        answer.textContent += piece;
        pieces += 1;
        const seconds = (performance.now() - started) / 1000;
        stats.textContent = `streaming: ${pieces} pieces in ${seconds.toFixed(1)} s`;
        answer.scrollIntoView({ block: "end" });
      },
    });
    page.messages.push({ role: "assistant", content: answer.textContent });
    if (usage) {
      page.answers.push(usage);
      stats.textContent = describe(usage, finish);
      stats.dataset.tokens = String(usage.usage.completion_tokens);
    }
    answer.dataset.done = "true";
    showChoices(page.answers, page.props);
    showCosts(page.answers, page.props);
  } catch (error) {
    page.messages.pop(); // the question stays on screen, not in the next request's history
    if (!answer.textContent) answer.remove();
    if (error.name === "AbortError") {
      addTurn("note", "stopped");
      stats.textContent = "stopped";
    } else {
      const message = error instanceof Problem ? error.message : "the answer failed";
      addTurn("error", message);
      stats.textContent = "";
    }
  } finally {
    page.running = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

function start() {
  $("token").value = token();
  $("token-form").addEventListener("submit", (event) => {
    event.preventDefault();
    setToken($("token").value.trim());
    showStatus("connecting…", "connecting");
  });
  $("chat-form").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => page.running?.abort());
  $("clear").addEventListener("click", () => {
    page.running?.abort();
    page.messages = [];
    $("conversation").replaceChildren();
    $("answer-stats").textContent = "";
  });
  window.addEventListener("resize", () => page.props && pollOnce().catch(() => {}));
  poll();
}

start();
