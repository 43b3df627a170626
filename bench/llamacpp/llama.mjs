// llama.mjs: loads llama.cpp through node-llama-cpp for kvtier's benchmarks
// and tests, from the prebuilt CPU binary that `npm ci` installed
// (@node-llama-cpp/linux-x64) only: never a download, never a build from
// source, never a GPU backend. Exits 3 with the reason when that binary does
// not load, so a caller can tell "no baseline" from a wrong answer.
process.env.NODE_LLAMA_CPP_SKIP_DOWNLOAD = "true";
process.env.NODE_LLAMA_CPP_GPU = "false";

export async function loadLlama(threads) {
    let nlc;
    try {
        nlc = await import("node-llama-cpp");
    } catch (e) {
        fail(`node-llama-cpp is not installed (run scripts/install-bench-deps.sh): ${e.message}`);
    }
    const logs = [];
    let llama;
    try {
        llama = await nlc.getLlama({
            gpu: false, build: "never", usePrebuiltBinaries: true, skipDownload: true, progressLogs: false,
            existingPrebuiltBinaryMustMatchBuildOptions: false, maxThreads: threads,
            logLevel: nlc.LlamaLogLevel.debug, logger: (level, message) => logs.push(message),
        });
    } catch (e) {
        fail(`the prebuilt llama.cpp binary (@node-llama-cpp/linux-x64) did not load (${e.name}: ${e.message}); is bench/llamacpp/node_modules/@node-llama-cpp/linux-x64/bins there?`);
    }
    if (llama.buildType !== "prebuilt" || llama.gpu !== false)
        fail(`node-llama-cpp picked a ${llama.buildType} build with gpu=${llama.gpu}; only the prebuilt CPU binary is used`);
    // the backend's log line arrives through the logger a moment later
    await new Promise((resolve) => setTimeout(resolve, 50));
    const backend = (logs.join("\n").match(/loaded CPU backend from \S*?(libggml-cpu-[\w-]+\.so)/) || [])[1] || "?";
    return { nlc, llama, logs, info: `llama.cpp ${llama.llamaCppRelease.release} prebuilt, CPU backend ${backend}; ${llama.systemInfo.trim()}` };
}

// Prints the reason and exits: 3 (the default) means llama.cpp did not load
// or the arguments are wrong, so callers run without the baseline; other
// codes mean a run went wrong.
export function fail(msg, code = 3) {
    console.error(`llamacpp: ${msg}`);
    process.exit(code);
}

// --name value pairs of argv after the script into an object.
export function parseArgs(argv, defaults) {
    const o = { ...defaults };
    for (let i = 0; i < argv.length; i += 2) {
        const k = argv[i].replace(/^--/, "");
        if (!(k in o) || i + 1 >= argv.length)
            fail(`unknown option or missing value: ${argv[i]}`);
        o[k] = argv[i + 1];
    }
    return o;
}

// The GGML KV cache type of a kvtier scheme name.
export function kvType(name) {
    const t = { f32: "F32", f16: "F16", bf16: "BF16", q8_0: "Q8_0" }[name];
    if (!t)
        fail(`KV type ${name}: expected f32, f16, bf16 or q8_0`);
    return t;
}
