// dashboard.js: the live page of kvtier serve. Subscribes to /events
// (server-sent events: a `snapshot` event a second, the /stats document
// without its request list, and a `request` event per finished request);
// when the stream cannot be opened it polls /stats every 2 s instead, and
// tries the stream again every 30 s. Every figure the tests compare carries
// its raw value in a data-value attribute.
'use strict';
(function () {
  const WINDOW_MS = 30000;     // the reuse chart's window
  const POINTS = 300;          // points kept per chart (5 minutes at one a second)
  const TABLE_ROWS = 50;
  const TTFT_WINDOW = 50;      // requests the TTFT percentiles are taken over

  const $ = (id) => document.getElementById(id);
  const state = { records: [], lastSeq: 0, samples: [], snapshots: 0, mode: 'connecting', es: null, pollTimer: null };
  document.body.dataset.snapshots = '0';
  document.body.dataset.lastSeq = '0';

  // ---- formatting for people ---------------------------------------------------------------
  const nf = new Intl.NumberFormat('en-US');
  function num(n) { return n == null ? '–' : nf.format(n); }
  // binary units, as the flags count them (--prompt-cache 1G is 2^30 bytes: "1.00 GiB")
  function bytes(n) {
    if (n == null) return '–';
    const u = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
    let i = 0, v = n;
    while (v >= 1024 && i < u.length - 1) { v /= 1024; i++; }
    return (i === 0 ? v.toFixed(0) : v.toFixed(v < 10 ? 2 : 1)) + ' ' + u[i];
  }
  function ms(v) {
    if (v == null || v < 0 || !isFinite(v)) return '–';
    if (v < 1) return v.toFixed(2) + ' ms';
    if (v < 100) return v.toFixed(1) + ' ms';
    if (v < 1000) return v.toFixed(0) + ' ms';
    return (v / 1000).toFixed(2) + ' s';
  }
  function pct(a, b) { return b > 0 ? (100 * a / b).toFixed(1) + ' %' : '–'; }
  function clock(t) { return new Date(t).toLocaleTimeString('en-GB', { hour12: false }); }
  function setFig(id, text, raw) {
    const el = $(id);
    el.textContent = text;
    el.dataset.value = raw == null ? '' : String(raw);
  }
  function banner(msg) {
    const b = $('banner');
    b.hidden = !msg;
    b.textContent = msg || '';
  }
  function percentile(sorted, p) {
    if (!sorted.length) return null;
    const i = Math.min(sorted.length - 1, Math.max(0, Math.ceil(p / 100 * sorted.length) - 1));
    return sorted[i];
  }

  // ---- charts ------------------------------------------------------------------------------
  const haveChart = typeof window.Chart === 'function' && !window.kvtChartMissing;
  let reuseChart = null, ttftChart = null;
  if (!haveChart) {
    banner('Chart.js could not be loaded from /dashboard/chart.js (kvtier reads it from the Debian package ' +
      'libjs-chart.js, /usr/share/javascript/chart.js/chart.min.js, or from $KVTIER_CHARTJS). ' +
      'Charts are off; every figure and the request table below are still live.');
    for (const id of ['chart-reuse', 'chart-ttft']) {
      const c = $(id).parentElement;
      c.style.height = 'auto';
      c.innerHTML = '<p class="note">Chart unavailable: Chart.js is missing on the server.</p>';
    }
  } else {
    Chart.defaults.font.family = getComputedStyle(document.body).fontFamily;
    Chart.defaults.color = '#6a7686';
    const common = (ytitle, ymax, stacked) => ({
      animation: false, responsive: true, maintainAspectRatio: false, normalized: true,
      interaction: { mode: 'index', intersect: false },
      plugins: { legend: { position: 'bottom', labels: { boxWidth: 12 } } },
      scales: {
        x: { title: { display: true, text: 'time (hh:mm:ss)' }, ticks: { maxTicksLimit: 7, maxRotation: 0 } },
        y: { stacked, beginAtZero: true, max: ymax, title: { display: true, text: ytitle } },
      },
    });
    const reuseOpts = common('% of prompt tokens', 100, true);
    reuseOpts.plugins.tooltip = { callbacks: { label: (c) => c.dataset.label + ': ' + (c.parsed.y == null ? '–' : c.parsed.y.toFixed(1) + ' %') } };
    reuseChart = new Chart($('chart-reuse'), {
      type: 'line',
      data: { labels: [], datasets: [
        { label: 'RAM tier', data: [], borderColor: '#2f7ed8', backgroundColor: 'rgba(47,126,216,.35)', fill: 'origin', pointRadius: 0, tension: .2 },
        { label: 'SSD tier', data: [], borderColor: '#f28f2c', backgroundColor: 'rgba(242,143,44,.35)', fill: '-1', pointRadius: 0, tension: .2 },
        { label: 'remote tier', data: [], borderColor: '#2ca58d', backgroundColor: 'rgba(44,165,141,.35)', fill: '-1', pointRadius: 0, tension: .2 },
        { label: 'published cache', data: [], borderColor: '#9b59b6', backgroundColor: 'rgba(155,89,182,.35)', fill: '-1', pointRadius: 0, tension: .2 },
      ] },
      options: reuseOpts,
    });
    const ttftOpts = common('TTFT (ms)', undefined, false);
    ttftOpts.plugins.legend.labels = { usePointStyle: true, pointStyle: 'line' };
    ttftOpts.plugins.tooltip = { callbacks: { label: (c) => c.dataset.label + ': ' + ms(c.parsed.y) } };
    ttftChart = new Chart($('chart-ttft'), {
      type: 'line',
      data: { labels: [], datasets: [
        { label: 'p50 with reuse', data: [], borderColor: '#2f7ed8', backgroundColor: '#2f7ed8', pointRadius: 0, tension: .2 },
        { label: 'p99 with reuse', data: [], borderColor: '#2f7ed8', backgroundColor: '#2f7ed8', borderDash: [5, 4], pointRadius: 0, tension: .2 },
        { label: 'p50 without', data: [], borderColor: '#d64545', backgroundColor: '#d64545', pointRadius: 0, tension: .2 },
        { label: 'p99 without', data: [], borderColor: '#d64545', backgroundColor: '#d64545', borderDash: [5, 4], pointRadius: 0, tension: .2 },
      ] },
      options: ttftOpts,
    });
  }
  function push(chart, label, values) {
    if (!chart) return;
    chart.data.labels.push(label);
    values.forEach((v, i) => chart.data.datasets[i].data.push(v));
    if (chart.data.labels.length > POINTS) {
      chart.data.labels.shift();
      chart.data.datasets.forEach((d) => d.data.shift());
    }
    chart.update('none');
  }

  // ---- requests ----------------------------------------------------------------------------
  // the tiers a reused prefix comes from, as usage and /metrics name them
  const TIERS = ['ram', 'ssd', 'remote', 'published'];
  const reusedOf = (r) => (r.reused_tokens ? TIERS.reduce((a, k) => a + (r.reused_tokens[k] || 0), 0) : 0);
  function addRecord(r) {
    if (r.seq <= state.lastSeq) return false;
    state.lastSeq = r.seq;
    state.records.push(r);
    if (state.records.length > 256) state.records.shift();
    document.body.dataset.lastSeq = String(r.seq);
    return true;
  }
  function td(text, cls) {
    const c = document.createElement('td');
    if (cls) c.className = cls;
    c.textContent = text;
    return c;
  }
  function renderTable() {
    const body = $('requests').tBodies[0];
    const rows = state.records.slice(-TABLE_ROWS).reverse();
    body.replaceChildren(...rows.map((r) => {
      const tr = document.createElement('tr');
      tr.dataset.seq = r.seq;
      tr.dataset.reused = reusedOf(r);
      tr.dataset.prompt = r.prompt_tokens;
      tr.append(td(clock(r.time_ms)), td(r.model), td(r.ns || 'base'),
        td(num(r.prompt_tokens), 'num prompt'), ...TIERS.map((k) => td(num(r.reused_tokens[k] || 0), 'num reused-' + k)),
        td(num(r.prefilled_tokens), 'num prefilled'),
        td(ms(r.ttft_ms), 'num ttft'));
      const st = td('', 'num status');
      const span = document.createElement('span');
      span.className = r.status === 200 ? 'st-ok' : 'st-bad';
      span.textContent = r.status;
      st.append(span);
      tr.append(st);
      return tr;
    }));
    $('requests-empty').hidden = rows.length > 0;
  }
  function ttftStats() {
    const recent = state.records.slice(-TTFT_WINDOW).filter((r) => r.status === 200 && r.ttft_ms >= 0);
    const w = recent.filter((r) => reusedOf(r) > 0).map((r) => r.ttft_ms).sort((a, b) => a - b);
    const wo = recent.filter((r) => reusedOf(r) === 0).map((r) => r.ttft_ms).sort((a, b) => a - b);
    const all = recent.map((r) => r.ttft_ms).sort((a, b) => a - b);
    return { w50: percentile(w, 50), w99: percentile(w, 99), o50: percentile(wo, 50), o99: percentile(wo, 99),
      p50: percentile(all, 50), n: all.length, nw: w.length };
  }

  // ---- per-layer residency ------------------------------------------------------------------
  // Columns of the per-layer tables: every field of a layer object, in the
  // report's order (the server's one list), RAM bytes drawn as a bar; bytes
  // fields shown in bytes. Each cell carries its raw value in data-value.
  const LAYER_TITLES = {
    ram_bytes: 'RAM bytes', ram_shared_blocks: 'Shared blocks', ssd_bytes: 'SSD bytes',
    remote_written_bytes: 'Sent to Redis', restores: 'Restores', restored_bytes: 'Restored',
    written: 'Written', written_bytes: 'Written bytes', promotions: 'Promotions', demotions: 'Demotions',
    evictions: 'Evictions',
  };
  const layerTitle = (k) => LAYER_TITLES[k] || k.replace(/_/g, ' ').replace(/^./, (c) => c.toUpperCase());
  // Every served model's id, context and report: the "models" list, else the one top-level model.
  function modelsOf(s) {
    if (Array.isArray(s.models) && s.models.length)
      return s.models.map((m) => ({ id: m.id, max_model_len: m.max_model_len, report: m.report || {}, running: m.running }));
    return s.model ? [{ id: s.model.id, max_model_len: s.model.max_model_len, report: s }] : [];
  }
  function layerTable(model, layers) {
    const wrap = document.createElement('div');
    wrap.className = 'layer-model';
    wrap.dataset.model = model.id;
    const h = document.createElement('h3');
    h.textContent = 'model ' + model.id + ' · ' + layers.length + (layers.length === 1 ? ' layer group' : ' layer groups');
    wrap.append(h);
    if (!layers.length) {
      const n = document.createElement('p');
      n.className = 'note';
      n.textContent = 'No layer is reported yet.';
      wrap.append(n);
      return wrap;
    }
    const keys = Object.keys(layers[0]).filter((k) => k !== 'layer');
    const tw = document.createElement('div');
    tw.className = 'tablewrap';
    const table = document.createElement('table');
    table.className = 'layer-table';
    table.dataset.model = model.id;
    const hr = document.createElement('tr');
    const th0 = document.createElement('th');
    th0.textContent = 'Layer';
    hr.append(th0);
    for (const k of keys) {
      const th = document.createElement('th');
      th.textContent = layerTitle(k);
      th.dataset.key = k;
      if (k !== 'ram_bytes') th.className = 'num';
      hr.append(th);
    }
    table.createTHead().append(hr);
    const maxRam = Math.max(1, ...layers.map((l) => l.ram_bytes || 0));
    const body = table.createTBody();
    for (const l of layers) {
      const tr = document.createElement('tr');
      tr.dataset.layer = l.layer;
      tr.append(td(l.layer, 'layer'));
      for (const k of keys) {
        const v = l[k] || 0;
        let cell;
        if (k === 'ram_bytes') {
          cell = td('', 'layer-ram');
          const fill = document.createElement('span');
          fill.className = 'layer-bar';
          fill.style.width = (100 * v / maxRam).toFixed(1) + '%';
          const lab = document.createElement('span');
          lab.textContent = bytes(v);
          cell.append(fill, lab);
        } else {
          cell = td(/bytes$/.test(k) ? bytes(v) : num(v), 'num');
        }
        cell.dataset.key = k;
        cell.dataset.value = String(v);
        tr.append(cell);
      }
      body.append(tr);
    }
    tw.append(table);
    wrap.append(tw);
    return wrap;
  }
  function renderLayers(s) {
    const models = modelsOf(s);
    const all = models.map((m) => ({ m, layers: Array.isArray(m.report.layers) ? m.report.layers : [] }));
    $('layer-tables').replaceChildren(...all.map((x) => layerTable(x.m, x.layers)));
    $('layers-note').textContent = all.some((x) => x.layers.length)
      ? 'Per layer of each model: RAM bytes (shared blocks counted once), what the cold tiers hold and what restores brought up and write-behind handed down.'
      : 'No layer is reported yet.';
  }

  // ---- snapshots ---------------------------------------------------------------------------
  function tierBlock(name, color, bytesNow, maxBytes, entries, idBase) {
    const div = document.createElement('div');
    div.className = 'tier';
    const share = maxBytes > 0 ? Math.min(100, 100 * bytesNow / maxBytes) : 0;
    div.innerHTML = '<div class="row"><span class="name"></span><span class="used"></span></div>' +
      '<div class="bar"><div></div></div><div class="row muted"><span class="entries"></span><span class="budget"></span></div>';
    div.querySelector('.name').textContent = name;
    const used = div.querySelector('.used');
    used.id = idBase + '-bytes';
    used.dataset.value = bytesNow;
    used.textContent = bytes(bytesNow) + (maxBytes > 0 ? ' of ' + bytes(maxBytes) + ' (' + share.toFixed(1) + ' %)' : '');
    const bar = div.querySelector('.bar > div');
    bar.style.width = (maxBytes > 0 ? share : (bytesNow > 0 ? 100 : 0)) + '%';
    bar.style.background = color;
    if (maxBytes <= 0) bar.style.opacity = '.35';
    const en = div.querySelector('.entries');
    en.id = idBase + '-entries';
    en.dataset.value = entries;
    en.textContent = num(entries) + (entries === 1 ? ' entry' : ' entries');
    div.querySelector('.budget').textContent = maxBytes > 0 ? 'budget ' + bytes(maxBytes) : 'no byte budget';
    return div;
  }
  function fig(k, v, id, raw, bad) {
    const d = document.createElement('div');
    d.className = 'fig';
    d.innerHTML = '<div class="k"></div><div class="v"></div>';
    d.querySelector('.k').textContent = k;
    const e = d.querySelector('.v');
    e.textContent = v;
    if (id) { e.id = id; e.dataset.value = raw == null ? '' : String(raw); }
    if (bad) e.classList.add('bad');
    return d;
  }
  function onSnapshot(s) {
    const srv = s.server || {}, c = srv.counters || {}, ssd = s.ssd;
    const t = s.time_ms || Date.now();
    state.snapshots++;
    document.body.dataset.snapshots = String(state.snapshots);
    const models = modelsOf(s);
    if (models.length > 1) $('model').textContent = 'models ' + models.map((m) => m.id).join(', ');
    else if (s.model) $('model').textContent = 'model ' + s.model.id + ' · context ' + num(s.model.max_model_len) + ' tokens';
    $('updated').textContent = 'updated ' + clock(t);

    setFig('kpi-requests', num(c.completions), c.completions);
    $('kpi-requests-sub').textContent = num(c.completions_ok) + ' ok · ' + num(c.cancelled) + ' cancelled · ' + num(c.rejected_queue_full) + ' refused';
    setFig('kpi-prompt', num(c.prompt_tokens), c.prompt_tokens);
    $('kpi-prompt-sub').textContent = num(c.prefilled_tokens) + ' prefilled · ' + num(c.generation_tokens) + ' generated';
    setFig('kpi-cached', num(c.prefix_cache_hits), c.prefix_cache_hits);
    $('kpi-cached-sub').textContent = pct(c.prefix_cache_hits, c.prefix_cache_queries) + ' of prompt tokens · RAM ' + num(c.cached_tokens_ram) + ' · SSD ' + num(c.cached_tokens_ssd) +
      ' · remote ' + num(c.cached_tokens_remote || 0) + ' · published ' + num(c.cached_tokens_published || 0);
    setFig('kpi-running', num(srv.running) + ' / ' + num(srv.queue_depth), srv.running);
    $('kpi-running-sub').textContent = num(srv.connections) + ' connections' + (c.decode_steps ? ' · mean batch ' + (c.decode_batch_sequences / c.decode_steps).toFixed(2) : '');
    const tt = ttftStats();
    setFig('kpi-ttft', ms(tt.p50), tt.p50);
    $('kpi-ttft-sub').textContent = tt.n ? 'with reuse ' + ms(tt.w50) + ' · without ' + ms(tt.o50) : 'no request yet';

    // tiers
    const tiers = $('tiers');
    // each model's RAM and SSD tiers (the first model's keep the plain ids)
    const blocks = [];
    (models.length ? models : [{ id: '', report: s }]).forEach((m, i) => {
      const mp = m.report.prefixes || {}, ms = m.report.ssd, sfx = i ? '-' + i : '';
      const of = models.length > 1 ? ' · model ' + m.id : '';
      blocks.push(tierBlock('RAM tier (prompt cache)' + of, 'var(--ram)', mp.bytes || 0, mp.max_bytes || 0, mp.entries || 0, 'tier-ram' + sfx));
      if (ms) blocks.push(tierBlock('SSD tier' + of, 'var(--ssd)', ms.bytes, ms.max_bytes, ms.entries, 'tier-ssd' + sfx));
    });
    // each model's KV admission (its own --kv-budget)
    (models.length ? models : [{ id: '', report: s }]).forEach((m, i) => {
      const kv = m.report.kv || {}, of = models.length > 1 ? ' · model ' + m.id : '';
      const running = m.running != null ? m.running : srv.running || 0;
      if (kv.budget_bytes) blocks.push(tierBlock('KV admission (projected)' + of, '#7b61c9', kv.projected_bytes || 0, kv.budget_bytes, running, 'tier-kv' + (i ? '-' + i : '')));
    });
    tiers.replaceChildren(...blocks);
    const anySsd = models.length ? models.some((m) => m.report.ssd) : !!ssd;
    if (!anySsd) {
      const n = document.createElement('p');
      n.className = 'note';
      n.textContent = 'No SSD tier: start the server with --ssd-cache DIR to keep prefixes across restarts.';
      tiers.append(n);
    }

    // write-behind and restores of each model (the first model's figures keep the plain ids)
    const groups = (models.length ? models : [{ id: '', report: s }]).map((m, i) => {
      const mp = m.report.prefixes || {}, sd = m.report.ssd, sfx = i ? '-' + i : '';
      const wrap = document.createElement('div');
      wrap.className = 'writes-model';
      wrap.dataset.model = m.id;
      if (models.length > 1) {
        const h = document.createElement('h3');
        h.textContent = 'model ' + m.id;
        wrap.append(h);
      }
      const g = document.createElement('div');
      g.className = 'figs';
      if (sd) {
        g.append(fig('pending writes', num(sd.pending), 'wb-pending' + sfx, sd.pending),
          fig('pending bytes', bytes(sd.pending_bytes), 'wb-pending-bytes' + sfx, sd.pending_bytes),
          fig('dropped', num(sd.dropped), 'wb-dropped' + sfx, sd.dropped, sd.dropped > 0),
          fig('failed', num(sd.failed), 'wb-failed' + sfx, sd.failed, sd.failed > 0),
          fig('written', num(sd.written), 'wb-written' + sfx, sd.written),
          fig('SSD restores', num(sd.restores), 'rs-count' + sfx, sd.restores),
          fig('restored bytes', bytes(sd.restore_bytes), 'rs-bytes' + sfx, sd.restore_bytes),
          fig('last restore', sd.restore_ns_last ? ms(sd.restore_ns_last / 1e6) : '–', 'rs-last' + sfx, sd.restore_ns_last));
      }
      g.append(fig('cold restores served', num(mp.cold_restores), 'rs-cold' + sfx, mp.cold_restores),
        fig('spills', num(mp.spills), 'pc-spills' + sfx, mp.spills),
        fig('demotions', num(mp.demotions), 'pc-demotions' + sfx, mp.demotions),
        fig('evictions', num(mp.evictions), 'pc-evictions' + sfx, mp.evictions));
      wrap.append(g);
      return wrap;
    });
    const w = $('writes');
    w.replaceChildren(...groups);
    if (!anySsd) {
      const n = document.createElement('p');
      n.className = 'note';
      n.textContent = 'Write-behind and SSD restores appear with an SSD tier.';
      w.append(n);
    }

    // per-layer residency of every model (each report's "layers": 64 layers named, the rest one group)
    renderLayers(s);

    // charts
    const sample = { t, prompt: c.prompt_tokens || 0 };
    for (const k of TIERS) sample[k] = c['cached_tokens_' + k] || 0;
    state.samples.push(sample);
    while (state.samples.length > 2 && t - state.samples[1].t >= WINDOW_MS) state.samples.shift();
    const a = state.samples[0], b = state.samples[state.samples.length - 1];
    const one = state.samples.length === 1;
    const dp = one ? b.prompt : b.prompt - a.prompt;
    const label = clock(t);
    push(reuseChart, label, TIERS.map((k) => (dp > 0 ? 100 * (one ? b[k] : b[k] - a[k]) / dp : null)));
    push(ttftChart, label, [tt.w50, tt.w99, tt.o50, tt.o99]);
  }

  // ---- transport ---------------------------------------------------------------------------
  function setMode(m) {
    state.mode = m;
    const el = $('conn');
    el.className = 'pill ' + ({ live: 'live', polling: 'poll', down: 'down' }[m] || '');
    el.textContent = { live: 'live', polling: 'polling /stats', down: 'server unreachable', connecting: 'connecting' }[m] || m;
    document.body.dataset.mode = m;
  }
  async function poll() {
    try {
      const r = await fetch('/stats', { cache: 'no-store' });
      if (r.status === 401) {
        banner('This server requires an API key (--api-key): /stats and /events answer 401 to a browser. ' +
          'Run the dashboard against a server without --api-key, or behind a proxy that adds the key.');
        setMode('down');
        return;
      }
      if (!r.ok) throw new Error('HTTP ' + r.status);
      const s = await r.json();
      let added = false;
      for (const rec of (s.server && s.server.recent) || []) added = addRecord(rec) || added;
      if (added) renderTable();
      onSnapshot(s);
      if (state.mode !== 'live') setMode('polling');
    } catch (e) {
      if (state.mode !== 'live') setMode('down');
    }
  }
  function startPolling() {
    if (state.pollTimer) return;
    poll();
    state.pollTimer = setInterval(poll, 2000);
    setTimeout(subscribe, 30000);
  }
  function subscribe() {
    if (!window.EventSource) { startPolling(); return; }
    const es = new EventSource('/events');
    state.es = es;
    es.addEventListener('open', () => {
      if (state.pollTimer) { clearInterval(state.pollTimer); state.pollTimer = null; }
      setMode('live');
    });
    es.addEventListener('snapshot', (ev) => onSnapshot(JSON.parse(ev.data)));
    es.addEventListener('request', (ev) => { if (addRecord(JSON.parse(ev.data))) renderTable(); });
    es.addEventListener('error', () => {
      if (es.readyState === EventSource.CLOSED) { // refused (503: too many streams, 401) or gone: poll instead
        state.es = null;
        setMode('polling');
        startPolling();
      } else {
        setMode('connecting');
      }
    });
  }
  setMode('connecting');
  renderTable();
  subscribe();
})();
