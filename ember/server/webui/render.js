// Pure helpers of the chat page (no DOM): markdown to HTML, server-sent event parsing, the
// chat request body. Kept apart so that they can be tested without a browser.

export function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}

function inline(text) {
  // code spans first, so that what is inside them stays literal
  return escapeHtml(text).split(/(`[^`]+`)/).map((part) => {
    if (part.startsWith("`") && part.endsWith("`") && part.length > 1) return `<code>${part.slice(1, -1)}</code>`;
    return part
      .replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>")
      .replace(/(^|[^*])\*([^*\s][^*]*)\*/g, "$1<em>$2</em>")
      .replace(/\[([^\]]+)\]\((https?:\/\/[^\s)]+)\)/g, '<a href="$2" target="_blank" rel="noopener">$1</a>');
  }).join("");
}

// Markdown subset: fenced code blocks (an unclosed fence runs to the end, as while streaming),
// headings, bullet and numbered lists, paragraphs, inline code, bold, italics, links.
export function markdown(source) {
  const out = [];
  const lines = source.split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(/^```\s*([\w+-]*)/);
    if (fence) {
      const body = [];
      i++;
      while (i < lines.length && !lines[i].startsWith("```")) body.push(lines[i++]);
      i++;
      const lang = fence[1] ? ` class="language-${escapeHtml(fence[1])}"` : "";
      out.push(`<pre><code${lang}>${escapeHtml(body.join("\n"))}</code></pre>`);
      continue;
    }
    const heading = line.match(/^(#{1,6})\s+(.*)/);
    if (heading) {
      out.push(`<h${heading[1].length}>${inline(heading[2])}</h${heading[1].length}>`);
      i++;
      continue;
    }
    const list = line.match(/^\s*([-*]|\d+\.)\s+/);
    if (list) {
      const ordered = /\d/.test(list[1]);
      const items = [];
      while (i < lines.length && /^\s*([-*]|\d+\.)\s+/.test(lines[i])) {
        items.push(`<li>${inline(lines[i].replace(/^\s*([-*]|\d+\.)\s+/, ""))}</li>`);
        i++;
      }
      out.push(ordered ? `<ol>${items.join("")}</ol>` : `<ul>${items.join("")}</ul>`);
      continue;
    }
    if (!line.trim()) { i++; continue; }
    const para = [];
    while (i < lines.length && lines[i].trim() && !/^(```|#{1,6}\s|\s*([-*]|\d+\.)\s)/.test(lines[i])) para.push(lines[i++]);
    out.push(`<p>${inline(para.join("\n")).replace(/\n/g, "<br>")}</p>`);
  }
  return out.join("\n");
}

// Feeds text received from an event stream; returns the JSON payloads of the complete events
// ("[DONE]" ends nothing here: the caller stops at the end of the stream).
export class EventParser {
  constructor() { this.buffer = ""; }
  push(text) {
    this.buffer += text;
    const events = [];
    let end;
    while ((end = this.buffer.indexOf("\n\n")) >= 0) {
      const block = this.buffer.slice(0, end);
      this.buffer = this.buffer.slice(end + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
      if (data && data !== "[DONE]") events.push(JSON.parse(data));
    }
    return events;
  }
}

// A streamed reply accumulated from chat.completion.chunk deltas.
export function applyDelta(reply, chunk) {
  if (chunk.error) { reply.error = chunk.error.message; return reply; }
  const choice = (chunk.choices || [])[0];
  if (!choice) return reply;
  const d = choice.delta || {};
  if (d.content) reply.content += d.content;
  if (d.reasoning_content) reply.reasoning += d.reasoning_content;
  for (const call of d.tool_calls || []) {
    const slot = reply.tool_calls[call.index] || (reply.tool_calls[call.index] = { name: "", arguments: "" });
    if (call.function && call.function.name) slot.name = call.function.name;
    if (call.function && call.function.arguments) slot.arguments += call.function.arguments;
  }
  if (choice.finish_reason) reply.finish_reason = choice.finish_reason;
  return reply;
}

export function requestBody(conversation, settings) {
  const messages = [];
  if (settings.system) messages.push({ role: "system", content: settings.system });
  for (const m of conversation.messages) messages.push({ role: m.role, content: m.content });
  return {
    model: settings.model || "default", messages, stream: true,
    temperature: Number(settings.temperature), top_p: Number(settings.top_p), max_tokens: Number(settings.max_tokens),
  };
}
