// The Playground: a sentence similarity matrix for an encoder (from /v1/embeddings) and a chat
// box for a decoder that streams tokens from /v1/chat/completions (OpenAI server-sent events).
"use strict";

FS.chat = {messages: [], abort: null};

FS.pages.playground = {
  async refresh() {
    await loadModels();
    const live = FS.models.filter(m => m.active !== null);
    fillSelect($("play-model"), modelOptions(), "nothing is deployed");
    const chosen = live.find(m => m.model_id === $("play-model").value);
    const decoders = live.filter(m => m.kind === "decoder");
    $("play-encoder").hidden = Boolean(chosen && chosen.kind === "decoder");
    $("no-decoder").hidden = decoders.length > 0;
    $("chat-form").hidden = !(chosen && chosen.kind === "decoder");
    $("play-decoder").hidden = Boolean(chosen && chosen.kind === "encoder") && decoders.length > 0;
    if (chosen && chosen.kind === "decoder" && !FS.chat.abort) {
      status("chat-status", await speculationLine(chosen.model_id));  // on or off, and why
    }
  },
  hide() { if (FS.chat.abort) FS.chat.abort.abort(); },
  wire() {
    $("play-model").addEventListener("change", () => {
      FS.chat.messages = [];
      $("chat-log").innerHTML = "";
      FS.pages.playground.refresh().catch(e => showError(e.message));
    });
    $("similarity-form").addEventListener("submit", event => { event.preventDefault(); similarity(); });
    $("chat-form").addEventListener("submit", event => { event.preventDefault(); chat(); });
    $("chat-input").addEventListener("keydown", event => {
      if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); chat(); }
    });
    $("chat-stop").addEventListener("click", () => FS.chat.abort && FS.chat.abort.abort());
  },
};

function cosineMatrix(vectors) {
  const norm = v => Math.sqrt(v.reduce((a, x) => a + x * x, 0)) || 1;
  const unit = vectors.map(v => { const n = norm(v); return v.map(x => x / n); });
  return unit.map(a => unit.map(b => a.reduce((s, x, k) => s + x * b[k], 0)));
}

async function similarity() {
  const sentences = $("sentences").value.split("\n").map(s => s.trim()).filter(Boolean);
  const model = $("play-model").value;
  if (!model) { status("similarity-status", "Deploy an encoder model first.", true); return; }
  if (sentences.length < 2) { status("similarity-status", "Type at least two sentences.", true); return; }
  await guarded("similarity-status", "Embedding…", async () => {
    const started = performance.now();
    const body = await api("POST", "/v1/embeddings", {model, input: sentences});
    const vectors = body.data.sort((a, b) => a.index - b.index).map(d => d.embedding);
    Charts.heatmap($("similarity"), cosineMatrix(vectors));
    const legend = sentences.map((s, k) => `${k + 1}. ${s}`).join("\n");
    $("similarity-title").textContent = "Cosine similarity between the sentences:\n" + legend;
    renderSentenceKey(sentences);
    return `${sentences.length} sentences, ${vectors[0].length} dimensions, ` +
      `${((performance.now() - started) / 1000).toFixed(2)} s.`;
  });
}

function renderSentenceKey(sentences) {
  let list = $("sentence-key");
  if (!list) {
    list = document.createElement("ol");
    list.id = "sentence-key";
    list.className = "sentence-key";
    $("similarity").after(list);
  }
  list.innerHTML = sentences.map(s => `<li>${esc(s)}</li>`).join("");
}

// "Speculative decoding on: prompt lookup drafts (setting: auto), 62% of drafted tokens
// accepted, 23.1 tokens/s" or "Speculative decoding off: rows not independent: ... (setting:
// auto)" for a decoder: what runs, next to the stored setting.
async function speculationLine(modelId) {
  const m = (await loadModels()).find(x => x.model_id === modelId);
  if (!m) return "Speculative decoding: off.";
  // what runs ("on: ..." or "off: why"), not only the stored setting ("auto" may be off)
  if (m.speculative === "off" || m.speculation_off) {
    return `Speculative decoding ${m.speculation_in_effect || "off"} (setting: ${m.speculative}).`;
  }
  const rate = m.acceptance_rate === null ? "no drafts yet" :
    `${Math.round(m.acceptance_rate * 100)}% of drafted tokens accepted`;
  const speed = m.tokens_per_s === null ? "" : `, ${m.tokens_per_s.toFixed(1)} tokens/s`;
  const draft = m.draft_model && m.speculative !== "lookup" ?
    `, draft model ${m.draft_model.split("/").filter(Boolean).pop()}` : "";
  return `Speculative decoding ${m.speculation_in_effect || "on"} (setting: ${m.speculative}${draft}), ${rate}${speed}.`;
}

function chatBubble(role, text) {
  const div = document.createElement("div");
  div.className = `bubble ${role}`;
  div.textContent = text;
  $("chat-log").appendChild(div);
  return div;
}

async function chat() {
  const text = $("chat-input").value.trim();
  const model = $("play-model").value;
  const chosen = FS.models.find(m => m.model_id === model);
  if (!text || FS.chat.abort) return;
  if (!chosen || chosen.kind !== "decoder") {
    status("chat-status", "Choose a decoder model to chat with.", true);
    return;
  }
  $("chat-input").value = "";
  FS.chat.messages.push({role: "user", content: text});
  chatBubble("user", text);
  const answer = chatBubble("assistant", "");
  const abort = new AbortController();
  FS.chat.abort = abort;
  $("chat-stop").disabled = false;
  status("chat-status", "Generating…");
  try {
    const response = await request("POST", "/v1/chat/completions", {model,
      messages: FS.chat.messages, stream: true, max_tokens: Number($("chat-max").value) || 64},
      {signal: abort.signal});
    if (!response.ok) {
      let data = null;
      try { data = await response.json(); } catch (e) { data = null; }
      throw new ApiError(plainError(response.status, data), response.status);
    }
    let finish = "";
    await readEvents(response, ev => {
      if (ev.data === "[DONE]") return;
      const chunk = JSON.parse(ev.data);
      if (chunk.error) throw new ApiError(chunk.error.message || "generation failed", 500);
      for (const choice of chunk.choices || []) {
        if (choice.delta && choice.delta.content) answer.textContent += choice.delta.content;
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    });
    FS.chat.messages.push({role: "assistant", content: answer.textContent});
    status("chat-status", [finish === "length" ? "Stopped at the token limit." : "",
      await speculationLine(model)].filter(Boolean).join(" "));
  } catch (e) {
    if (e.name === "AbortError") status("chat-status", "Stopped.");
    else { answer.classList.add("failed"); status("chat-status", e.message, true); }
    if (answer.textContent) FS.chat.messages.push({role: "assistant", content: answer.textContent});
  } finally {
    FS.chat.abort = null;
    $("chat-stop").disabled = true;
  }
}
