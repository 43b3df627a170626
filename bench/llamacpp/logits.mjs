// logits.mjs: greedy decoding of a GGUF model by llama.cpp, printing the raw
// logits of every step, for tests/test_long_gguf_llamacpp.c to compare with
// kvtier's engine on the same weights.
//   node logits.mjs --model F.gguf --tokens 1,20,30 --steps 64 [--threads 2] [--kv f32] [--flash auto|on|off]
// Prints one line "info ..." then, per step s (0 = after the prompt), a line
// "step s token t logits l0 l1 ... l(V-1)": t is the argmax of the raw logits
// (the lowest id on a tie), fed back as the next input. Exit 3: no llama.cpp.
import { loadLlama, parseArgs, kvType, fail } from "./llama.mjs";

const o = parseArgs(process.argv.slice(2), { model: "", tokens: "", steps: "64", threads: "2", kv: "f32", flash: "auto" });
const prompt = o.tokens.split(",").filter((s) => s.length).map(Number);
const steps = Number(o.steps), threads = Number(o.threads);
if (!o.model || !prompt.length || !(steps >= 1))
    fail("usage: node logits.mjs --model F.gguf --tokens ID,ID,... --steps N [--threads T] [--kv f32|f16|q8_0]");
const { llama, info } = await loadLlama(threads);
console.log(`info ${info}`);
const model = await llama.loadModel({ modelPath: o.model, gpuLayers: 0 });
const V = model.tokens.count ?? model.fileInsights?.vocabSize;
const ctx = await model.createContext({
    contextSize: Math.min(model.trainContextSize, prompt.length + steps + 16), threads, batchSize: 512,
    flashAttention: { auto: "auto", on: true, off: false }[o.flash] ?? fail(`--flash ${o.flash}: expected auto, on or off`),
    experimentalKvCacheKeyType: kvType(o.kv), experimentalKvCacheValueType: kvType(o.kv),
});
const seq = ctx.getSequence();
const ask = { generateNext: { logits: true } };
let input = prompt.map((t, i) => (i === prompt.length - 1 ? [t, ask] : t));
for (let s = 0; s < steps; s++) {
    const out = await seq.controlledEvaluate(input);
    const lg = out[input.length - 1]?.next?.logits;
    if (!lg)
        fail(`step ${s}: llama.cpp returned no logits`);
    const row = new Array(lg.size);
    for (const [id, v] of lg)
        row[id] = v;
    if (row.length !== lg.size || row.some((v) => v === undefined))
        fail(`step ${s}: logits of ${lg.size} tokens do not cover ids 0..${lg.size - 1}`);
    let best = 0;
    for (let i = 1; i < row.length; i++)
        if (row[i] > row[best])
            best = i;
    console.log(`step ${s} token ${best} logits ${row.join(" ")}`);
    input = [[best, ask]];
}
await ctx.dispose();
await model.dispose();
await llama.dispose();
