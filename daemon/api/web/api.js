// Talking to hetspecd: the bearer token, errors as sentences, Prometheus text as numbers.

const TOKEN_KEY = "hetspec-token";

export function token() {
  return sessionStorage.getItem(TOKEN_KEY) || "";
}

export function setToken(value) {
  if (value) sessionStorage.setItem(TOKEN_KEY, value);
  else sessionStorage.removeItem(TOKEN_KEY);
}

// A failure said in words for the page; `state` is what the status line shows
// ("token", "down", "busy"...). Never a stack trace.
export class Problem extends Error {
  constructor(message, state = "down") {
    super(message);
    this.state = state;
  }
}

// fetch() on the daemon with the token (TCP needs it; the Unix socket ignores it). A network
// failure becomes a Problem saying the daemon cannot be reached.
export async function call(path, options = {}) {
  const headers = new Headers(options.headers || {});
  if (token()) headers.set("Authorization", `Bearer ${token()}`);
  try {
    return await fetch(path, { ...options, headers, cache: "no-store" });
  } catch (error) {
    if (error.name === "AbortError") throw error;
    throw new Problem("hetspecd cannot be reached (stopped or restarting): reconnecting…");
  }
}

// The daemon's own message for a refused request (OpenAI's or Ollama's error shape).
export async function problemOf(response) {
  if (response.status === 401) {
    return new Problem("hetspecd wants its bearer token here (TCP): paste it above", "token");
  }
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    const error = body.error;
    message = typeof error === "string" ? error : error?.message || message;
  } catch {
    // not JSON: the status line says enough
  }
  return new Problem(message, response.status === 503 ? "loading" : "down");
}

// Prometheus text exposition -> Map(name -> [{labels, value}]).
export function parseMetrics(text) {
  const metrics = new Map();
  const sample = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/;
  const label = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g;
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const match = sample.exec(line);
    if (!match) continue;
    const labels = {};
    for (const [, name, value] of (match[2] || "").matchAll(label)) labels[name] = value;
    const entries = metrics.get(match[1]) || [];
    entries.push({ labels, value: parseFloat(match[3]) });
    metrics.set(match[1], entries);
  }
  return metrics;
}

// A metric summed over its label sets (0 where the daemon has not exported it yet).
export function total(metrics, name) {
  return (metrics.get(name) || []).reduce((sum, entry) => sum + entry.value, 0);
}
