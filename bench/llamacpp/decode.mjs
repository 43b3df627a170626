// decode.mjs: llama.cpp's decode speed at context, the baseline of
// `kvtier bench engine --context-only` (bench/bench_llamacpp.c runs it on
// the default model exported as GGUF). It mirrors the engine's measurement:
// one sequence per configuration (KV cache type, flash attention on/off),
// prefilled to each context length C in turn with the bench's tokens, then
// `steps` greedy tokens, the configurations taking turns token by token
// (each token timed alone, sampling included), so all see the same load.
//   node decode.mjs --model F.gguf --tokens-file T --contexts 1024,2048,4064 --steps 32
//        [--threads 2] [--runs 1] [--configs f32:off,f16:off,f32:on,f16:on,q8_0:on]
// T holds the prompt token ids as little-endian int32. Prints "info ..." and
// then, per configuration and context, the median over runs:
//   result kv f32 flash off ctx 1024 tps 12.34
// Exit 3: llama.cpp did not load; 2: bad arguments.
import { readFileSync } from "node:fs";
import { loadLlama, parseArgs, kvType, fail } from "./llama.mjs";

const o = parseArgs(process.argv.slice(2), {
    model: "", "tokens-file": "", contexts: "1024,2048,4064", steps: "32", threads: "2", runs: "1",
    configs: "f32:off,f16:off,f32:on,f16:on,q8_0:on",
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
const buf = readFileSync(o["tokens-file"]);
const tokens = Array.from(new Int32Array(buf.buffer, buf.byteOffset, buf.length >> 2));
const { llama, info } = await loadLlama(threads);
console.log(`info ${info}`);
const model = await llama.loadModel({ modelPath: o.model, gpuLayers: 0 });
const size = model.trainContextSize;
if (contexts.some((c) => c + steps > size || c > tokens.length))
    fail(`a context plus ${steps} steps exceeds the model's ${size} tokens or the ${tokens.length} tokens given`);

const greedy = { generateNext: { token: true, options: { temperature: 0 } } };
const secs = configs.map(() => contexts.map(() => []));
for (let run = 0; run < runs; run++) {
    const seqs = [];
    for (const c of configs) {
        const ctx = await model.createContext({
            contextSize: size, threads, batchSize: 512, flashAttention: c.flash === "on",
            experimentalKvCacheKeyType: kvType(c.kv), experimentalKvCacheValueType: kvType(c.kv),
        }).catch((e) => fail(`llama.cpp cannot create a ${size}-token context with KV ${c.kv}, flash attention ${c.flash}: ${e.message}`));
        seqs.push({ ctx, seq: ctx.getSequence(), next: 0 });
    }
    let at = 0;
    for (let k = 0; k < contexts.length; k++) {
        const C = contexts[k];
        if (C < at)
            fail(`contexts must grow by at least ${steps} tokens each: ${o.contexts}`);
        for (const s of seqs) {
            const part = tokens.slice(at, C);
            const out = await s.seq.controlledEvaluate(part.map((t, i) => (i === part.length - 1 ? [t, greedy] : t)));
            s.next = out[part.length - 1].next.token;
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
        for (let i = 0; i < seqs.length; i++)
            secs[i][k].push(t[i]);
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
        console.log(`result kv ${configs[i].kv} flash ${configs[i].flash} ctx ${contexts[k]} tps ${(steps / median(secs[i][k])).toFixed(3)}`);
await model.dispose();
await llama.dispose();
