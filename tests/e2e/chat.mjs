// chat.mjs: kvtier serve end to end through the official `openai` npm
// package. Starts two servers on free loopback ports (the prompt cache on,
// and --prompt-cache 0), runs a 5-turn chat against both, non-streaming and
// streaming, and checks: cached_tokens > 0 from turn 2 with the cache, 0
// without, and every reply byte-identical; then 16 concurrent clients, each
// a 3-turn conversation of its own, with 0 errors and 0 replies differing
// from the cache-off server. Stops both with SIGTERM (exit status 0).
//
// Environment: KVT_BIN (the kvtier binary), KVT_MODEL, KVT_TOKENIZER.
import { spawn } from 'node:child_process';
import assert from 'node:assert/strict';
import OpenAI from 'openai';

const bin = process.env.KVT_BIN;
const model = process.env.KVT_MODEL;
const tokenizer = process.env.KVT_TOKENIZER;

function startServer(extra) {
  return new Promise((resolve, reject) => {
    const p = spawn(bin, ['serve', '--model', model, '--tokenizer', tokenizer, '--port', '0', ...extra],
      { stdio: ['ignore', 'ignore', 'pipe'] });
    let log = '';
    let port = 0;
    const timer = setTimeout(() => reject(new Error('server did not get ready: ' + log)), 30000);
    p.stderr.on('data', (d) => {
      log += d.toString();
      const m = log.match(/listening on http:\/\/127\.0\.0\.1:(\d+)/);
      if (m) port = Number(m[1]);
      if (port && log.includes('ready, model')) {
        clearTimeout(timer);
        resolve({ proc: p, port, log: () => log });
      }
    });
    p.on('exit', (code) => reject(new Error(`server exited (${code}): ${log}`)));
  });
}

function stopServer(s) {
  return new Promise((resolve) => {
    s.proc.removeAllListeners('exit');
    s.proc.on('exit', (code) => resolve(code));
    s.proc.kill('SIGTERM');
  });
}

const script = [
  'Hello! Can you tell me a short story about a cat?',
  'What was the name of the cat?',
  'Where did the cat live?',
  'What happened at the end?',
  'Thank you, that was lovely.',
];

// One turn over `history` (alternating user/assistant messages ending with user).
async function turn(client, messages, stream) {
  const req = { model: 'stories260K', messages, temperature: 0, max_tokens: 40 };
  if (!stream) {
    const r = await client.chat.completions.create(req);
    assert.equal(r.object, 'chat.completion');
    assert.equal(r.choices.length, 1);
    return { text: r.choices[0].message.content, usage: r.usage };
  }
  const s = await client.chat.completions.create({ ...req, stream: true, stream_options: { include_usage: true } });
  let text = '';
  let usage = null;
  let finish = null;
  for await (const chunk of s) {
    assert.equal(chunk.object, 'chat.completion.chunk');
    if (chunk.choices.length === 0) {
      usage = chunk.usage;
      continue;
    }
    assert.equal(usage, null, 'the usage chunk comes last');
    text += chunk.choices[0].delta.content ?? '';
    if (chunk.choices[0].finish_reason) finish = chunk.choices[0].finish_reason;
  }
  assert.ok(finish === 'stop' || finish === 'length', 'a finish_reason before the end');
  assert.ok(usage, 'include_usage gives a usage chunk');
  return { text, usage };
}

async function conversation(client, users, stream, label) {
  const messages = [];
  const out = [];
  for (let t = 0; t < users.length; t++) {
    messages.push({ role: 'user', content: users[t] });
    const r = await turn(client, messages, stream);
    messages.push({ role: 'assistant', content: r.text });
    out.push(r);
    if (label)
      console.log(`${label} turn ${t + 1}: prompt ${r.usage.prompt_tokens}, cached ` +
        `${r.usage.prompt_tokens_details.cached_tokens}, prefilled ${r.usage.kvtier.prefilled_tokens}, ` +
        `ttft ${r.usage.kvtier.ttft_ms} ms`);
  }
  return out;
}

const on = await startServer([]);
const off = await startServer(['--prompt-cache', '0']);
const cOn = new OpenAI({ baseURL: `http://127.0.0.1:${on.port}/v1`, apiKey: 'none', maxRetries: 0 });
const cOff = new OpenAI({ baseURL: `http://127.0.0.1:${off.port}/v1`, apiKey: 'none', maxRetries: 0 });
let failed = false;
try {
  const models = await cOn.models.list();
  assert.equal(models.data[0].id, 'stories260K');

  for (const stream of [false, true]) {
    const a = await conversation(cOn, script, stream, stream ? 'stream' : 'plain');
    const b = await conversation(cOff, script, stream, null);
    for (let t = 0; t < script.length; t++) {
      assert.equal(a[t].text, b[t].text, `turn ${t + 1}: the same reply with the cache on and off`);
      assert.equal(b[t].usage.prompt_tokens_details.cached_tokens, 0);
      assert.equal(a[t].usage.prompt_tokens, b[t].usage.prompt_tokens);
      if (t > 0) assert.ok(a[t].usage.prompt_tokens_details.cached_tokens > 0, `turn ${t + 1} reuses the cache`);
    }
  }

  // concurrent clients, each its own 3-turn conversation
  const N = 16;
  const topics = ['cat', 'dog', 'bird', 'frog'];
  const convs = Array.from({ length: N }, (_, i) => [
    `Client ${i}: tell me about a ${topics[i % 4]}.`, 'What happened next?', `How did it end for ${i}?`]);
  const t0 = Date.now();
  const results = await Promise.allSettled(convs.map((u, i) => conversation(cOn, u, i % 2 === 1, null)));
  const ms = Date.now() - t0;
  const errors = results.filter((r) => r.status === 'rejected');
  for (const e of errors) console.error(e.reason);
  let differ = 0;
  for (let i = 0; i < N; i++) {
    if (results[i].status !== 'fulfilled') continue;
    const ref = await conversation(cOff, convs[i], false, null);
    for (let t = 0; t < 3; t++) if (ref[t].text !== results[i].value[t].text) differ++;
  }
  console.log(`${N} concurrent clients x 3 turns in ${ms} ms: ${errors.length} errors, ${differ} replies differing from cache-off`);
  assert.equal(errors.length, 0);
  assert.equal(differ, 0);
} catch (e) {
  console.error(e);
  failed = true;
}
const codes = [await stopServer(on), await stopServer(off)];
assert.deepEqual(codes, [0, 0], 'both servers exit 0 after SIGTERM');
if (failed) process.exit(1);
console.log('e2e: ok');
