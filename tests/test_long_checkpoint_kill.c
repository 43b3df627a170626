/*
 * test_long_checkpoint_kill.c: the SIGKILL trials of test_checkpoint_kill.c,
 * 50 of them (label long: `make test-long`): `kvtier generate
 * --checkpoint-every 8 --request-id ID --ssd-cache DIR` killed at a random
 * point of its output, then run again: byte-identical output, nothing
 * checkpointed prefilled or decoded again.
 */
#define KILL_TRIALS 50
#include "test_checkpoint_kill.c"
