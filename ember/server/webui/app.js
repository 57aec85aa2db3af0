// The chat page: conversations kept in the browser's storage, replies streamed from
// /v1/chat/completions (stop cancels the request), a model picker from /v1/models, sampling
// settings, export and import as JSON, and an API key asked for when the server wants one.
import { EventParser, applyDelta, markdown, requestBody } from "./render.js";

const $ = (id) => document.getElementById(id);
const STORE = "ember.conversations", KEY = "ember.apiKey", SETTINGS = "ember.settings";
let conversations = JSON.parse(localStorage.getItem(STORE) || "[]");
let current = conversations[0] || null;
let controller = null;

function save() { localStorage.setItem(STORE, JSON.stringify(conversations)); }

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = localStorage.getItem(KEY);
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function api(path, options = {}) {
  let r = await fetch(path, { ...options, headers: headers() });
  if (r.status === 401) {
    const key = prompt("This server needs an API key:");
    if (!key) throw new Error("an API key is required");
    localStorage.setItem(KEY, key);
    r = await fetch(path, { ...options, headers: headers() });
  }
  return r;
}

function settings() {
  const s = {};
  for (const id of ["model", "system", "temperature", "top_p", "max_tokens"]) s[id] = $(id).value;
  return s;
}

function loadSettings() {
  const s = JSON.parse(localStorage.getItem(SETTINGS) || "{}");
  for (const [id, v] of Object.entries(s)) if ($(id) && id !== "model") $(id).value = v;
  for (const id of ["system", "temperature", "top_p", "max_tokens", "model"]) {
    $(id).addEventListener("change", () => localStorage.setItem(SETTINGS, JSON.stringify(settings())));
  }
  return s;
}

async function loadModels(saved) {
  try {
    const r = await api("/v1/models");
    const data = (await r.json()).data || [];
    $("model").innerHTML = data.map((m) => `<option>${m.id}</option>`).join("");
    if (saved.model && data.some((m) => m.id === saved.model)) $("model").value = saved.model;
  } catch (e) { console.error(e); }
}

function renderList() {
  const ul = $("conversations");
  ul.innerHTML = "";
  for (const c of conversations) {
    const li = document.createElement("li");
    li.className = c === current ? "current" : "";
    const title = document.createElement("span");
    title.textContent = c.title || "New chat";
    const del = document.createElement("button");
    del.textContent = "×";
    del.title = "Delete";
    del.onclick = (ev) => { ev.stopPropagation(); conversations = conversations.filter((x) => x !== c); if (current === c) current = conversations[0] || null; save(); render(); };
    li.append(title, del);
    li.onclick = () => { current = c; render(); };
    ul.append(li);
  }
}

function messageHtml(m) {
  let html = `<div class="role">${m.role}</div>`;
  if (m.reasoning) html += `<details><summary>Reasoning</summary>${markdown(m.reasoning)}</details>`;
  html += markdown(m.content || "");
  for (const call of m.tool_calls || []) {
    html += `<div class="tool">tool call: ${markdown("`" + call.name + "`")} ${markdown("```\n" + call.arguments + "\n```")}</div>`;
  }
  if (m.error) html += `<div class="error">${m.error}</div>`;
  return html;
}

function renderMessages() {
  const box = $("messages");
  box.innerHTML = "";
  for (const m of current ? current.messages : []) {
    const div = document.createElement("div");
    div.className = `message ${m.role}`;
    div.innerHTML = messageHtml(m);
    box.append(div);
  }
  box.scrollTop = box.scrollHeight;
}

function render() { renderList(); renderMessages(); }

function busy(on) { $("send").hidden = on; $("stop").hidden = !on; }

async function send(text) {
  if (!current) { current = { id: Date.now(), title: "", messages: [] }; conversations.unshift(current); }
  if (!current.title) current.title = text.slice(0, 40);
  current.messages.push({ role: "user", content: text });
  const reply = { role: "assistant", content: "", reasoning: "", tool_calls: [] };
  const body = requestBody(current, settings());
  current.messages.push(reply);
  save(); render();
  controller = new AbortController();
  busy(true);
  try {
    const r = await api("/v1/chat/completions", { method: "POST", body: JSON.stringify(body), signal: controller.signal });
    if (!r.ok) throw new Error(((await r.json()).error || {}).message || `HTTP ${r.status}`);
    const reader = r.body.getReader(), decoder = new TextDecoder(), parser = new EventParser();
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      for (const chunk of parser.push(decoder.decode(value, { stream: true }))) applyDelta(reply, chunk);
      renderMessages();
    }
  } catch (e) {
    if (e.name !== "AbortError") reply.error = String(e.message || e);
  } finally {
    controller = null;
    busy(false);
    save(); render();
  }
}

$("composer").onsubmit = (ev) => {
  ev.preventDefault();
  const text = $("input").value.trim();
  if (!text || controller) return;
  $("input").value = "";
  send(text);
};
$("input").onkeydown = (ev) => { if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("composer").requestSubmit(); } };
$("stop").onclick = () => { if (controller) controller.abort(); };
$("new").onclick = () => { current = null; render(); $("input").focus(); };
$("forget-key").onclick = () => localStorage.removeItem(KEY);
$("export").onclick = () => {
  const url = URL.createObjectURL(new Blob([JSON.stringify(conversations, null, 1)], { type: "application/json" }));
  const a = document.createElement("a");
  a.href = url; a.download = "ember-conversations.json"; a.click();
  URL.revokeObjectURL(url);
};
$("import").onchange = async (ev) => {
  const file = ev.target.files[0];
  if (!file) return;
  const loaded = JSON.parse(await file.text());
  if (Array.isArray(loaded)) { conversations = [...loaded, ...conversations]; current = conversations[0] || null; save(); render(); }
};

loadModels(loadSettings());
render();
