// One streamed answer from the OpenAI-compatible endpoint (server-sent events).

import { call, Problem, problemOf } from "./api.js";

// POST `body` to /v1/chat/completions streamed; onText(piece) for each verified piece of text.
// Resolves to the usage chunk (usage, timings, speculative: hetspec's statistics) and the
// finish reason; rejects with a Problem (the daemon's message) or an AbortError (stopped).
export async function streamChat(body, { signal, onText }) {
  const request = {
    ...body,
    stream: true,
    stream_options: { include_usage: true },
  };
  const response = await call("/v1/chat/completions", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(request),
    signal,
  });
  if (!response.ok) throw await problemOf(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let usage = null;
  let finish = null;
  for (;;) {
    let read;
    try {
      read = await reader.read();
    } catch (error) {
      if (error.name === "AbortError") throw error;
      throw new Problem("the answer was cut off: hetspecd stopped or restarted a worker");
    }
    if (read.done) break;
    buffer += read.value;
    for (let cut = buffer.indexOf("\n\n"); cut >= 0; cut = buffer.indexOf("\n\n")) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return { usage, finish };
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Problem(chunk.error.message || "the answer failed");
        for (const choice of chunk.choices || []) {
          if (choice.delta?.content) onText(choice.delta.content);
          if (choice.finish_reason) finish = choice.finish_reason;
        }
        if (chunk.usage) usage = chunk;
      }
    }
  }
  throw new Problem("the answer was cut off: hetspecd stopped or restarted a worker");
}
