// decode.mjs: llama.cpp's decode speed at context, the baseline of
// `kvtier bench engine --context-only` (bench/bench_llamacpp.c runs it on
// the default model exported as GGUF). It mirrors the engine's measurement:
// one sequence per configuration (KV cache type, flash attention on/off),
// prefilled to each context length C in turn with the bench's tokens, then
// `steps` greedy tokens, the configurations taking turns token by token, so
// all see the same load.
//   node decode.mjs --model F.gguf --tokens-file T --contexts 1024,2048,4064 --steps 32
//        [--threads 2] [--runs 1] [--configs f32:off,f16:off,f16:on,bf16:off,q8_0:on]
// T holds the prompt token ids as little-endian int32. Prints "info ..." and
// then, per configuration and context, the median over runs of two figures:
//   result kv f32 flash off ctx 1024 tps 12.34 own 12.50
// tps: steps / the wall time of the steps' controlledEvaluate calls (llama.cpp
// plus node-llama-cpp's JS, sampling and scheduling); own: steps / the decode
// time llama.cpp's own counters measured (llama_perf_context: llama_decode
// alone), the figure llama.cpp itself would print.
// Each context holds the last C plus the steps plus one token (node-llama-cpp
// keeps one cell free): with a context of exactly C + steps tokens it would
// "shift" the context inside a timed step, and as the bench's tokens do not
// start with BOS that shift drops the whole KV cache and evaluates the
// sequence again (the 1-2 tok/s once seen at C = 4064). A shift is refused here.
// Exit 3: llama.cpp did not load or bad arguments; 1: a run went wrong.
import { readFileSync } from "node:fs";
import { loadLlama, parseArgs, kvType, fail } from "./llama.mjs";

const o = parseArgs(process.argv.slice(2), {
    model: "", "tokens-file": "", contexts: "1024,2048,4064", steps: "32", threads: "2", runs: "1",
    configs: "f32:off,f16:off,f16:on,bf16:off,q8_0:on",
});
const contexts = o.contexts.split(",").map(Number), steps = Number(o.steps), threads = Number(o.threads);
const runs = Number(o.runs);
const configs = o.configs.split(",").map((c) => {
    const [kv, flash] = c.split(":");
    kvType(kv);
    if (flash !== "on" && flash !== "off")
        fail(`--configs ${c}: expected KV:on or KV:off`);
    return { kv, flash };
});
if (!o.model || !o["tokens-file"] || contexts.some((c) => !(c >= 1)) || !(steps >= 1) || !(runs >= 1))
    fail("usage: node decode.mjs --model F.gguf --tokens-file T --contexts C,C,... --steps N [--threads T] [--runs R] [--configs KV:on|off,...]");
for (let k = 1; k < contexts.length; k++)
    if (contexts[k] < contexts[k - 1] + steps)
        fail(`contexts must grow by at least ${steps} tokens each: ${o.contexts}`);
const buf = readFileSync(o["tokens-file"]);
const tokens = Array.from(new Int32Array(buf.buffer, buf.byteOffset, buf.length >> 2));
const last = contexts[contexts.length - 1];
if (last > tokens.length)
    fail(`context ${last} exceeds the ${tokens.length} tokens given`);
const { llama, logs, info } = await loadLlama(threads);
console.log(`info ${info}`);
const model = await llama.loadModel({ modelPath: o.model, gpuLayers: 0 })
    .catch((e) => fail(`llama.cpp cannot load ${o.model}: ${e.message}`, 1));
// one more cell than the sequence reaches; above the model's training
// context only when the last context ends at it (llama.cpp allows that)
const size = last + steps + 1;

// llama.cpp's own decode time since the last call (it resets its counters):
// the "eval time = X ms / N runs" line llama_perf_context_print logs
async function ownEval(ctx) {
    const from = logs.length;
    await ctx.printTimings();
    for (let wait = 0; wait < 200; wait++) {
        const line = logs.slice(from).find((l) => /(?<!prompt )eval time =/.test(l));
        const m = line && line.match(/(?<!prompt )eval time =\s*([\d.]+) ms \/\s*(\d+) runs/);
        if (m)
            return { secs: Number(m[1]) * 1e-3, n: Number(m[2]) };
        await new Promise((resolve) => setTimeout(resolve, 10));
    }
    return fail("llama.cpp printed no decode timings (llama_perf_context_print)", 1);
}

const greedy = { generateNext: { token: true, options: { temperature: 0 } } };
const noShift = {
    strategy: ({ sequence }) => fail(`context shift at token ${sequence.nextTokenIndex} of a ${size}-token context`, 1),
};
const wall = configs.map(() => contexts.map(() => []));
const own = configs.map(() => contexts.map(() => []));
for (let run = 0; run < runs; run++) {
    const seqs = [];
    for (const c of configs) {
        const ctx = await model.createContext({
            contextSize: size, threads, batchSize: 512, flashAttention: c.flash === "on", performanceTracking: true,
            experimentalKvCacheKeyType: kvType(c.kv), experimentalKvCacheValueType: kvType(c.kv),
        }).catch((e) => fail(`llama.cpp cannot create a ${size}-token context with KV ${c.kv}, flash attention ${c.flash}: ${e.message}`));
        seqs.push({ ctx, seq: ctx.getSequence({ contextShift: noShift }), next: 0 });
    }
    let at = 0;
    for (let k = 0; k < contexts.length; k++) {
        const C = contexts[k];
        for (const s of seqs) {
            const part = tokens.slice(at, C);
            const out = await s.seq.controlledEvaluate(part.map((t, i) => (i === part.length - 1 ? [t, greedy] : t)));
            s.next = out[part.length - 1].next.token;
            await ownEval(s.ctx); /* resets the counters: the prefill is not a decode step */
        }
        at = C;
        const t = configs.map(() => 0);
        for (let step = 0; step < steps; step++)
            for (let i = 0; i < seqs.length; i++) {
                const s = seqs[i];
                const t0 = process.hrtime.bigint();
                const out = await s.seq.controlledEvaluate([[s.next, greedy]]);
                t[i] += Number(process.hrtime.bigint() - t0) * 1e-9;
                s.next = out[0].next.token;
            }
        for (let i = 0; i < seqs.length; i++) {
            const e = await ownEval(seqs[i].ctx);
            if (e.n !== steps || seqs[i].seq.nextTokenIndex !== C + steps)
                fail(`${configs[i].kv} flash ${configs[i].flash} at C = ${C}: llama.cpp counted ${e.n} decodes for ${steps} steps and the sequence is at ${seqs[i].seq.nextTokenIndex}, not ${C + steps}`, 1);
            wall[i][k].push(t[i]);
            own[i][k].push(e.secs);
        }
        at += steps;
    }
    for (const s of seqs)
        await s.ctx.dispose();
}
const median = (a) => {
    const b = [...a].sort((x, y) => x - y), m = b.length >> 1;
    return b.length % 2 ? b[m] : (b[m - 1] + b[m]) / 2;
};
for (let i = 0; i < configs.length; i++)
    for (let k = 0; k < contexts.length; k++)
        console.log(`result kv ${configs[i].kv} flash ${configs[i].flash} ctx ${contexts[k]} tps ` +
                    `${(steps / median(wall[i][k])).toFixed(3)} own ${(steps / median(own[i][k])).toFixed(3)}`);
await model.dispose();
await llama.dispose();
