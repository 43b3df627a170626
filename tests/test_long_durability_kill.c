/*
 * test_long_durability_kill.c: the kill -9 trials of test_durability_kill.c,
 * 50 of them (label long: `make test-long`): each a 6-turn `kvtier chat`
 * killed at a random moment, then a new process continuing the conversation
 * from --ssd-cache and --transcript, reusing at least the history older than
 * 1 s, with replies equal to a cache-off run.
 */
#define KILL_TRIALS 50
#include "test_durability_kill.c"
