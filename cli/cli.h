/*
 * cli.h: the subcommands of the `kvtier` command. Each lives in its own file
 * (cli/cmd_<name>.c, bench/bench_<name>.c) and returns the process exit status
 * (0 success, 1 failure, 2 usage error). Declared weak so a build that lacks
 * one still links; main() reports such a command as unavailable.
 */
#ifndef KVT_CLI_H
#define KVT_CLI_H

#define KVT_CLI_WEAK __attribute__((weak))

/* cli/cmd_*.c */
KVT_CLI_WEAK int kvt_cmd_generate(int argc, char **argv);
KVT_CLI_WEAK int kvt_cmd_model(int argc, char **argv);
KVT_CLI_WEAK int kvt_cmd_chat(int argc, char **argv);
KVT_CLI_WEAK int kvt_cmd_replay(int argc, char **argv);
KVT_CLI_WEAK int kvt_cmd_store(int argc, char **argv);
KVT_CLI_WEAK int kvt_cmd_serve(int argc, char **argv);
KVT_CLI_WEAK int kvt_cmd_cache(int argc, char **argv);

/* bench/bench_*.c: `kvtier bench NAME` */
KVT_CLI_WEAK int kvt_bench_engine(int argc, char **argv);
KVT_CLI_WEAK int kvt_bench_lookup(int argc, char **argv);
KVT_CLI_WEAK int kvt_bench_dedup(int argc, char **argv);
KVT_CLI_WEAK int kvt_bench_chat(int argc, char **argv);
KVT_CLI_WEAK int kvt_bench_ssd(int argc, char **argv);
KVT_CLI_WEAK int kvt_bench_serve(int argc, char **argv);
KVT_CLI_WEAK int kvt_bench_kv_dtype(int argc, char **argv);
KVT_CLI_WEAK int kvt_bench_checkpoint(int argc, char **argv);
KVT_CLI_WEAK int kvt_bench_residency(int argc, char **argv);
KVT_CLI_WEAK int kvt_bench_remote(int argc, char **argv);

#endif
