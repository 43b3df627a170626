// check.mjs: loads the prebuilt llama.cpp binary the way the benchmarks do
// and prints which build and CPU backend it runs (exit 3 when it does not load).
import { loadLlama } from "./llama.mjs";

const { llama, info } = await loadLlama(2);
console.log(info);
await llama.dispose();
