// dashboard.mjs: kvtier serve's dashboard end to end in headless Chromium.
// Starts `kvtier serve` with two models (stories260K, and a small synthetic
// model made here with `kvtier model synth`, id "tiny"; the RAM and SSD
// tiers) on a free loopback port, opens /dashboard in Debian's chromium
// driven by playwright-core (never a downloaded browser), runs a multi-turn
// chat on the first model and completions on the second, and checks that
// the page's figures equal /stats (requests, cached tokens, tier bytes and
// entries), that it shows one per-layer table per model whose rows equal
// that model's "layers" in /stats (every field of every layer), that each
// model's write-behind and restore figures equal its report, that its
// request table lists every turn with its reused tokens, that the event streams are bounded (one over the
// limit gets 503, a second page then polls /stats and shows the same
// figures) and released when a client goes away, that without Chart.js the
// page says so and stays live, and that the browser saw
// no console error and no page error. Saves a screenshot.
//
// Environment: KVT_BIN, KVT_MODEL, KVT_TOKENIZER; KVT_CHROMIUM (default
// /usr/bin/chromium); KVT_DASH_TURNS (default 4); KVT_DASH_PAUSE_MS between
// turns (default 0; a comma-separated list is used in turn); KVT_DASH_SCREENSHOT (default dashboard.png here);
// KVT_DASH_SERVE_ARGS, more `kvtier serve` flags (space-separated).
// Exits 77 (skipped) when Chromium is missing.
import { spawn, execFileSync } from 'node:child_process';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';

const bin = process.env.KVT_BIN;
const model = process.env.KVT_MODEL;
const tokenizer = process.env.KVT_TOKENIZER;
const chromiumPath = process.env.KVT_CHROMIUM || '/usr/bin/chromium';
const turns = Number(process.env.KVT_DASH_TURNS || 4);
const pauses = (process.env.KVT_DASH_PAUSE_MS || '0').split(',').map(Number);
const shotPath = path.resolve(process.env.KVT_DASH_SCREENSHOT || 'dashboard.png');
const serveArgs = (process.env.KVT_DASH_SERVE_ARGS || '').split(' ').filter(Boolean);
const MAX_STREAMS = 16; // the server's default bound on /events streams

if (!fs.existsSync(chromiumPath)) {
  console.log(`test_serve_dashboard: skipped: no Chromium at ${chromiumPath} (Debian: chromium; or set KVT_CHROMIUM)`);
  process.exit(77);
}
const { chromium } = await import('playwright-core');

const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'kvt-dash-'));
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

function startServer(extra, env) {
  return new Promise((resolve, reject) => {
    const p = spawn(bin, ['serve', '--model', model, '--tokenizer', tokenizer, '--port', '0', ...extra],
      { stdio: ['ignore', 'ignore', 'pipe'], env: { ...process.env, ...env } });
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
  'Did the cat have a friend?',
  'What did they play?',
  'Was the weather nice?',
  'What did they eat?',
  'Who came to visit?',
  'Thank you, that was lovely.',
];

async function chat(base, n) {
  const messages = [];
  const out = [];
  for (let t = 0; t < n; t++) {
    messages.push({ role: 'user', content: script[t % script.length] });
    const r = await fetch(`${base}/v1/chat/completions`, {
      method: 'POST', headers: { 'Content-Type': 'application/json' },
      body: JSON.stringify({ model: 'stories260K', messages, temperature: 0, max_tokens: 16, user: 'dashboard-test' }),
    });
    if (r.status !== 200) throw new Error(`turn ${t + 1}: HTTP ${r.status}: ${await r.text()}`);
    const j = await r.json();
    messages.push({ role: 'assistant', content: j.choices[0].message.content });
    out.push(j.usage);
    console.log(`turn ${t + 1}: prompt ${j.usage.prompt_tokens}, cached ${j.usage.prompt_tokens_details.cached_tokens} ` +
      `(ram ${j.usage.kvtier.reused_tokens.ram}, ssd ${j.usage.kvtier.reused_tokens.ssd}), ttft ${j.usage.kvtier.ttft_ms} ms`);
    if (pauses[t % pauses.length]) await sleep(pauses[t % pauses.length]);
  }
  return out;
}

// The figures the page shows (data-value attributes), as numbers.
async function pageFigures(page) {
  return page.evaluate(() => {
    const v = (id) => { const e = document.getElementById(id); return e && e.dataset.value !== '' ? Number(e.dataset.value) : null; };
    return {
      requests: v('kpi-requests'), cached: v('kpi-cached'), prompt: v('kpi-prompt'),
      ram_bytes: v('tier-ram-bytes'), ram_entries: v('tier-ram-entries'),
      ssd_bytes: v('tier-ssd-bytes'), ssd_entries: v('tier-ssd-entries'),
      mode: document.body.dataset.mode, snapshots: Number(document.body.dataset.snapshots),
    };
  });
}

function statsFigures(s) {
  const c = s.server.counters;
  return {
    requests: c.completions, cached: c.prefix_cache_hits, prompt: c.prompt_tokens,
    ram_bytes: s.prefixes.bytes, ram_entries: s.prefixes.entries,
    ssd_bytes: s.ssd ? s.ssd.bytes : null, ssd_entries: s.ssd ? s.ssd.entries : null,
  };
}

// Waits until the page shows what /stats says (the page updates once a second or every 2 s when polling).
async function waitEqual(page, base, what) {
  let last = null;
  for (let i = 0; i < 60; i++) {
    const want = statsFigures(await (await fetch(`${base}/stats`)).json());
    const got = await pageFigures(page);
    const { mode, snapshots, ...shown } = got;
    last = { want, shown, mode, snapshots };
    if (JSON.stringify(shown) === JSON.stringify(want)) return last;
    await sleep(250);
  }
  assert.fail(`${what}: the page's figures never equalled /stats: ${JSON.stringify(last)}`);
}

// Each model's per-layer table as the page shows it: {id: [{layer, field: raw value, ...}]}.
async function pageLayers(page) {
  return page.evaluate(() => {
    const out = {};
    for (const t of document.querySelectorAll('table.layer-table')) {
      out[t.dataset.model] = [...t.tBodies[0].rows].map((tr) => {
        const row = { layer: tr.dataset.layer };
        for (const c of tr.querySelectorAll('td[data-key]')) row[c.dataset.key] = Number(c.dataset.value);
        return row;
      });
    }
    return out;
  });
}

function statsLayers(s) {
  const out = {};
  for (const m of s.models) out[m.id] = (m.report.layers || []).map((l) => ({ ...l }));
  return out;
}

// Waits until every model's per-layer table equals its "layers" in /stats.
async function waitLayers(page, base, what) {
  let last = null;
  for (let i = 0; i < 60; i++) {
    const want = statsLayers(await (await fetch(`${base}/stats`)).json());
    const got = await pageLayers(page);
    last = { want, got };
    if (JSON.stringify(got) === JSON.stringify(want)) return last;
    await sleep(250);
  }
  assert.fail(`${what}: the per-layer tables never equalled /stats: ${JSON.stringify(last)}`);
}

// Each model's write-behind and restore figures as the page shows them: {id: {field: raw value}}.
const WRITE_FIGS = { 'wb-pending': 'pending', 'wb-pending-bytes': 'pending_bytes', 'wb-dropped': 'dropped',
  'wb-failed': 'failed', 'wb-written': 'written', 'rs-count': 'restores', 'rs-bytes': 'restore_bytes',
  'rs-cold': 'cold_restores', 'pc-spills': 'spills', 'pc-demotions': 'demotions', 'pc-evictions': 'evictions' };
async function pageWrites(page) {
  return page.evaluate((figs) => {
    const out = {};
    [...document.querySelectorAll('#writes .writes-model')].forEach((g, i) => {
      const row = {};
      for (const [id, key] of Object.entries(figs)) {
        const e = document.getElementById(id + (i ? '-' + i : ''));
        row[key] = e && g.contains(e) && e.dataset.value !== '' ? Number(e.dataset.value) : null;
      }
      out[g.dataset.model] = row;
    });
    return out;
  }, WRITE_FIGS);
}

function statsWrites(s) {
  const out = {};
  for (const m of s.models) {
    const sd = m.report.ssd || {}, p = m.report.prefixes || {};
    out[m.id] = { pending: sd.pending, pending_bytes: sd.pending_bytes, dropped: sd.dropped, failed: sd.failed,
      written: sd.written, restores: sd.restores, restore_bytes: sd.restore_bytes, cold_restores: p.cold_restores,
      spills: p.spills, demotions: p.demotions, evictions: p.evictions };
  }
  return out;
}

// Waits until every model's write-behind figures equal its report in /stats.
async function waitWrites(page, base, what) {
  let last = null;
  for (let i = 0; i < 60; i++) {
    const want = statsWrites(await (await fetch(`${base}/stats`)).json());
    const got = await pageWrites(page);
    last = { want, got };
    if (JSON.stringify(got) === JSON.stringify(want)) return last;
    await sleep(250);
  }
  assert.fail(`${what}: the write-behind figures never equalled /stats: ${JSON.stringify(last)}`);
}

async function complete(base, modelId, prompt) {
  const r = await fetch(`${base}/v1/completions`, {
    method: 'POST', headers: { 'Content-Type': 'application/json' },
    body: JSON.stringify({ model: modelId, prompt, temperature: 0, max_tokens: 8 }),
  });
  if (r.status !== 200) throw new Error(`${modelId}: HTTP ${r.status}: ${await r.text()}`);
  return r.json();
}

function watch(page, errors) {
  page.on('console', (m) => { if (m.type() === 'error') errors.push(`console: ${m.text()}`); });
  page.on('pageerror', (e) => errors.push(`page error: ${e.message}`));
}

// the second model: 3 layers (stories260K has 5), the same 512-token vocabulary
const synth = path.join(tmp, 'tiny.bin');
execFileSync(bin, ['model', 'synth', '--out', synth, '--dim', '32', '--hidden', '64', '--layers', '3', '--heads', '2',
  '--kv-heads', '2', '--vocab', '512', '--seq-len', '256', '--seed', '7'], { stdio: 'ignore' });
const server = await startServer(['--model', synth, '--tokenizer', tokenizer, '--model-name', 'tiny',
  '--prompt-cache', '64M', '--ssd-cache', path.join(tmp, 'ssd'), ...serveArgs]);
const base = `http://127.0.0.1:${server.port}`;
const profile = fs.mkdtempSync(path.join(tmp, 'profile-'));
let ctx = null;
let failed = false;
try {
  ctx = await chromium.launchPersistentContext(profile, {
    executablePath: chromiumPath, headless: true,
    viewport: { width: 1280, height: 1000 }, deviceScaleFactor: 1,
    args: ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking',
      '--disable-component-update', '--disable-sync', '--disable-dev-shm-usage'],
  });
  const errors = [];
  const page = ctx.pages()[0] || await ctx.newPage();
  watch(page, errors);
  // nothing but the servers on loopback: any other address is refused and counted
  const outside = [];
  await ctx.route(/.*/, (route) => {
    const u = new URL(route.request().url());
    if (u.protocol === 'http:' && u.hostname === '127.0.0.1') return route.continue();
    outside.push(u.href);
    return route.abort();
  });
  const resp = await page.goto(`${base}/dashboard`);
  assert.equal(resp.status(), 200);
  await page.waitForFunction(() => document.body.dataset.mode === 'live' && Number(document.body.dataset.snapshots) >= 1,
    null, { timeout: 15000 });
  assert.equal(await page.evaluate(() => typeof window.Chart), 'function', 'Chart.js was served by kvtier');

  const usage = await chat(base, turns);
  assert.ok(usage.slice(1).every((u) => u.prompt_tokens_details.cached_tokens > 0), 'turns 2.. reuse the cache');
  for (const prompt of ['Once upon a time', 'Once upon a time there was']) await complete(base, 'tiny', prompt);
  await page.waitForFunction((n) => Number(document.body.dataset.lastSeq) >= n, turns + 2, { timeout: 15000 });
  const eq = await waitEqual(page, base, 'live page');
  // one per-layer table per model, each row equal to that model's report
  const lay = await waitLayers(page, base, 'live page');
  assert.deepEqual(Object.keys(lay.got), ['stories260K', 'tiny']);
  assert.equal(lay.got.stories260K.length, 5);
  assert.equal(lay.got.tiny.length, 3);
  for (const id of ['stories260K', 'tiny'])
    assert.ok(lay.got[id].every((l) => l.ram_bytes > 0), `${id}: every layer holds RAM bytes`);
  assert.ok(Object.keys(lay.got.tiny[0]).length >= 8, 'every field of the layer list is a column');
  console.log(`per-layer tables = /stats: ${JSON.stringify(lay.got.tiny[0])} ...`);
  // each model's write-behind and restores, once its writes have landed
  let wr = null;
  for (let i = 0; i < 60; i++) {
    wr = await waitWrites(page, base, 'live page');
    if (Object.values(wr.got).every((x) => x.written > 0 && x.pending === 0)) break;
    await sleep(250);
  }
  assert.deepEqual(Object.keys(wr.got), ['stories260K', 'tiny']);
  for (const id of ['stories260K', 'tiny'])
    assert.ok(wr.got[id].written > 0 && wr.got[id].pending === 0, `${id}: its write-behind landed and is shown`);
  console.log(`write-behind figures = /stats: ${JSON.stringify(wr.got)}`);
  console.log(`page = /stats: ${JSON.stringify(eq.shown)} (mode ${eq.mode}, ${eq.snapshots} snapshots)`);
  assert.ok(eq.shown.cached > 0 && eq.shown.ssd_bytes > 0 && eq.shown.ram_bytes + eq.shown.ssd_bytes > 0);

  // bytes in the flags' binary units (KiB, MiB, GiB: --prompt-cache 1G read "1.07 GB"): the RAM
  // tier's budget (under the pool, what it has grown to) as /stats prefixes.max_bytes gives it
  const ramBudget = await page.$eval('#tier-ram-bytes', (e) => e.closest('.tier').querySelector('.budget').textContent);
  const maxBytes = (await (await fetch(`${base}/stats`)).json()).prefixes.max_bytes;
  const bm = ramBudget.match(/^budget ([0-9.]+) (B|KiB|MiB|GiB|TiB)$/);
  assert.ok(bm, `the RAM tier budget in binary units: '${ramBudget}'`);
  const unit = 1024 ** ['B', 'KiB', 'MiB', 'GiB', 'TiB'].indexOf(bm[2]);
  assert.ok(Math.abs(Number(bm[1]) * unit - maxBytes) <= 0.051 * unit, `'${ramBudget}' is ${maxBytes} bytes`);
  console.log(`RAM tier: ${ramBudget} (${maxBytes} bytes)`);

  // the request table: one row per turn, with the reused tokens its usage reported
  const rows = await page.$$eval('#requests tbody tr', (trs) => trs.map((tr) => ({
    seq: Number(tr.dataset.seq), reused: Number(tr.dataset.reused), prompt: Number(tr.dataset.prompt),
    ram: tr.querySelector('.reused-ram').textContent, ssd: tr.querySelector('.reused-ssd').textContent,
    remote: tr.querySelector('.reused-remote').textContent, published: tr.querySelector('.reused-published').textContent,
    status: tr.querySelector('.status').textContent })));
  assert.equal(rows.length, turns + 2);
  for (let t = 0; t < turns; t++) {
    const row = rows.find((r) => r.seq === t + 1);
    assert.ok(row, `the table lists turn ${t + 1}`);
    const u = usage[t];
    assert.equal(row.reused, u.prompt_tokens_details.cached_tokens, `turn ${t + 1}: reused tokens`);
    assert.equal(row.prompt, u.prompt_tokens, `turn ${t + 1}: prompt tokens`);
    assert.equal(row.ram, u.kvtier.reused_tokens.ram.toLocaleString('en-US'));
    assert.equal(row.ssd, u.kvtier.reused_tokens.ssd.toLocaleString('en-US'));
    assert.equal(row.remote, u.kvtier.reused_tokens.remote.toLocaleString('en-US'));
    assert.equal(row.published, u.kvtier.reused_tokens.published.toLocaleString('en-US'));
    assert.equal(row.status, '200');
  }
  await sleep(1200); // one more snapshot drawn into the charts
  await page.screenshot({ path: shotPath, fullPage: true });
  console.log(`screenshot: ${shotPath}`);
  // a phone's width: one column, nothing wider than the screen (the table scrolls in its card)
  await page.setViewportSize({ width: 390, height: 844 });
  await sleep(300);
  const phone = await page.evaluate(() => ({ width: document.documentElement.scrollWidth,
    columns: getComputedStyle(document.querySelector('main')).gridTemplateColumns.split(' ').length }));
  assert.ok(phone.width <= 390, `the page fits a 390 px screen (it is ${phone.width} px wide)`);
  assert.equal(phone.columns, 1, 'one column on a phone');
  await page.setViewportSize({ width: 1280, height: 1000 });

  // bounded streams: the page holds one; fill the rest, one more is refused
  const holders = [];
  for (let i = 0; i < MAX_STREAMS - 1; i++) {
    const ac = new AbortController();
    const r = await fetch(`${base}/events`, { signal: ac.signal });
    assert.equal(r.status, 200, `stream ${i + 2} of ${MAX_STREAMS} is served`);
    r.body.getReader().read().catch(() => {});
    holders.push(ac);
  }
  const over = await fetch(`${base}/events`);
  assert.equal(over.status, 503, 'a stream over the bound gets 503');
  assert.equal((await over.json()).error.code, 'too_many_streams');
  // a second page cannot stream now: it polls /stats and shows the same figures
  const page2 = await ctx.newPage();
  const errors2 = [];
  watch(page2, errors2);
  await page2.goto(`${base}/dashboard`);
  await page2.waitForFunction(() => document.body.dataset.mode === 'polling' && Number(document.body.dataset.snapshots) >= 1,
    null, { timeout: 15000 });
  const eq2 = await waitEqual(page2, base, 'polling page');
  console.log(`polling page = /stats (mode ${eq2.mode})`);
  const rows2 = await page2.$$eval('#requests tbody tr', (trs) => trs.length);
  assert.equal(rows2, turns + 2);
  await waitLayers(page2, base, 'polling page');
  await waitWrites(page2, base, 'polling page');
  // the refused EventSource is the one console error we caused on purpose
  assert.ok(errors2.every((e) => /events|503|EventSource/i.test(e)), `page 2 errors: ${errors2.join('\n')}`);
  await page2.close();
  // a client that goes away releases its stream within a second
  holders.pop().abort();
  let again = null;
  for (let i = 0; i < 20; i++) {
    await sleep(100);
    again = await fetch(`${base}/events`);
    if (again.status === 200) break;
    await again.text();
  }
  assert.equal(again.status, 200, 'a closed stream frees its place');
  const reader = again.body.getReader();
  const first = new TextDecoder().decode((await reader.read()).value);
  assert.match(first, /^retry: 2000/);
  await reader.cancel();
  for (const ac of holders) ac.abort();

  // without Chart.js on the server the page says so and stays live
  const bare = await startServer([], { KVTIER_CHARTJS: path.join(tmp, 'no-chart.js') });
  try {
    const page3 = await ctx.newPage();
    await page3.goto(`http://127.0.0.1:${bare.port}/dashboard`);
    await page3.waitForFunction(() => document.body.dataset.mode === 'live' && Number(document.body.dataset.snapshots) >= 1,
      null, { timeout: 15000 });
    const b = await page3.evaluate(() => ({ hidden: document.getElementById('banner').hidden,
      text: document.getElementById('banner').textContent, requests: document.getElementById('kpi-requests').dataset.value }));
    assert.equal(b.hidden, false);
    assert.match(b.text, /Chart\.js could not be loaded/);
    assert.equal(b.requests, '0');
    const r = await fetch(`http://127.0.0.1:${bare.port}/dashboard/chart.js`);
    assert.equal(r.status, 404);
    assert.match(await r.text(), /no-chart\.js/);
    await page3.close();
  } finally {
    assert.equal(await stopServer(bare), 0);
  }

  assert.deepEqual(outside, [], 'the page fetched nothing from outside the server');
  assert.deepEqual(errors, [], 'no console or page error on the dashboard');
} catch (e) {
  console.error(e);
  console.error(server.log());
  failed = true;
}
if (ctx) await ctx.close();
const code = await stopServer(server);
fs.rmSync(tmp, { recursive: true, force: true });
assert.equal(code, 0, 'the server exits 0 after SIGTERM');
if (failed) process.exit(1);
console.log('dashboard e2e: ok');
