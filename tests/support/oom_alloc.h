/*
 * oom_alloc.h: an allocator for out-of-memory tests that fails exactly one
 * allocation (the k-th malloc or realloc after it is armed), so a test can
 * fail each allocation of a call sequence in turn and stop once the sequence
 * made fewer than k allocations. A program that armed it prints at exit how
 * many allocations were failed over how many armed runs (TESTING.md's walk
 * figures).
 */
#ifndef KVT_TEST_OOM_ALLOC_H
#define KVT_TEST_OOM_ALLOC_H

/** Resets the count and installs (kvt_set_allocator) the failing allocator:
 * the fail_at-th malloc or realloc from now (counted from 1) returns NULL,
 * every other one succeeds. Undo with kvt_set_allocator(NULL). The count is
 * atomic: allocations may come from any thread. */
void oom_arm(long fail_at);
/** malloc and realloc calls made through the allocator since oom_arm. */
long oom_calls(void);

#endif
